// The fp16 loss scale as torch.amp.GradScaler keeps it (loss_scaler.h), without a model: growth
// after growth_interval clean steps, backoff and a skipped step on inf/NaN, and state round trips.
// The ranks' identical decisions over real all-reduced gradients are in mixed_precision_test.cc.
#include "ddprun/worker/loss_scaler.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

#include "ddprun/worker/errors.h"

using ddprun::worker::ConfigError;
using ddprun::worker::LossScaler;
using ddprun::worker::LossScalerOptions;

TEST_CASE("the loss scale starts at 2^16 and grows after growth_interval clean steps",
          "[worker][amp]") {
  LossScaler s(LossScalerOptions{65536.0f, 2.0f, 0.5f, 3});
  CHECK(s.scale() == 65536.0f);
  CHECK(s.inverseScale() == 1.0f / 65536.0f);
  CHECK(s.update(false));
  CHECK(s.update(false));
  CHECK(s.scale() == 65536.0f);
  CHECK(s.state().growth_tracker == 2);
  CHECK(s.update(false));  // the third clean step in a row
  CHECK(s.scale() == 131072.0f);
  CHECK(s.state().growth_tracker == 0);
}

TEST_CASE("an inf or NaN gradient skips the step, backs the scale off and restarts the count",
          "[worker][amp]") {
  LossScaler s(LossScalerOptions{1024.0f, 2.0f, 0.5f, 2});
  CHECK(s.update(false));
  CHECK_FALSE(s.update(true));  // skip
  CHECK(s.scale() == 512.0f);
  CHECK(s.state().growth_tracker == 0);
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 256.0f);
  CHECK(s.update(false));
  CHECK(s.update(false));
  CHECK(s.scale() == 512.0f);
}

TEST_CASE("the loss scale never grows to infinity", "[worker][amp]") {
  LossScaler s(LossScalerOptions{std::numeric_limits<float>::max(), 2.0f, 0.5f, 1});
  CHECK(s.update(false));
  CHECK(std::isfinite(s.scale()));
  CHECK(s.scale() == std::numeric_limits<float>::max());
}

TEST_CASE("the loss scale's state survives a snapshot round trip", "[worker][amp]") {
  LossScaler a(LossScalerOptions{8.0f, 2.0f, 0.5f, 4});
  a.update(false);
  a.update(true);
  a.update(false);
  const LossScaler::State saved = a.state();
  LossScaler b(LossScalerOptions{8.0f, 2.0f, 0.5f, 4});
  b.restore(saved);
  CHECK(b.scale() == a.scale());
  for (bool inf : {false, false, false, true, false}) CHECK(a.update(inf) == b.update(inf));
  CHECK(b.scale() == a.scale());
  CHECK(b.state().growth_tracker == a.state().growth_tracker);
}

TEST_CASE("loss scaler options and resumed states out of range are named", "[worker][amp]") {
  CHECK_THROWS_WITH(LossScaler(LossScalerOptions{0.0f, 2.0f, 0.5f, 10}),
                    Catch::Contains("init_scale must be a positive finite number"));
  CHECK_THROWS_WITH(
      LossScaler(LossScalerOptions{std::numeric_limits<float>::infinity(), 2.0f, 0.5f, 10}),
      Catch::Contains("init_scale"));
  CHECK_THROWS_WITH(LossScaler(LossScalerOptions{1.0f, 1.0f, 0.5f, 10}),
                    Catch::Contains("growth_factor must be > 1"));
  CHECK_THROWS_WITH(LossScaler(LossScalerOptions{1.0f, 2.0f, 1.0f, 10}),
                    Catch::Contains("backoff_factor must be in (0, 1)"));
  CHECK_THROWS_WITH(LossScaler(LossScalerOptions{1.0f, 2.0f, 0.5f, 0}),
                    Catch::Contains("growth_interval must be >= 1"));
  LossScaler s;
  CHECK_THROWS_AS(s.restore(LossScaler::State{std::nanf(""), 0}), ConfigError);
  CHECK_THROWS_AS(s.restore(LossScaler::State{-1.0f, 0}), ConfigError);
  CHECK_THROWS_AS(s.restore(LossScaler::State{1.0f, -3}), ConfigError);
  CHECK(s.scale() == 65536.0f);  // unchanged by the refused states
}
