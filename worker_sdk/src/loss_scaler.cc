#include "ddprun/worker/loss_scaler.h"

#include <cmath>
#include <string>

#include "ddprun/worker/errors.h"

namespace ddprun::worker {

namespace {
bool positiveFinite(float v) { return std::isfinite(v) && v > 0; }
}  // namespace

LossScaler::LossScaler(const LossScalerOptions& options) : options_(options) {
  if (!positiveFinite(options.init_scale)) {
    throw ConfigError("LossScaler: init_scale must be a positive finite number, got " +
                      std::to_string(options.init_scale));
  }
  if (!std::isfinite(options.growth_factor) || options.growth_factor <= 1.0f) {
    throw ConfigError("LossScaler: growth_factor must be > 1, got " +
                      std::to_string(options.growth_factor));
  }
  if (!std::isfinite(options.backoff_factor) || options.backoff_factor <= 0.0f ||
      options.backoff_factor >= 1.0f) {
    throw ConfigError("LossScaler: backoff_factor must be in (0, 1), got " +
                      std::to_string(options.backoff_factor));
  }
  if (options.growth_interval < 1) {
    throw ConfigError("LossScaler: growth_interval must be >= 1, got " +
                      std::to_string(options.growth_interval));
  }
  state_.scale = options.init_scale;
}

float LossScaler::inverseScale() const {
  return static_cast<float>(1.0 / static_cast<double>(state_.scale));
}

bool LossScaler::update(bool found_inf) {
  if (found_inf) {
    state_.scale *= options_.backoff_factor;
    state_.growth_tracker = 0;
    return false;
  }
  if (++state_.growth_tracker == options_.growth_interval) {
    const float grown = state_.scale * options_.growth_factor;
    if (std::isfinite(grown)) state_.scale = grown;  // as GradScaler: never to inf
    state_.growth_tracker = 0;
  }
  return true;
}

void LossScaler::restore(const State& state) {
  if (!positiveFinite(state.scale) || state.growth_tracker < 0) {
    throw ConfigError("LossScaler: cannot resume from scale " + std::to_string(state.scale) +
                      " and growth tracker " + std::to_string(state.growth_tracker));
  }
  state_ = state;
}

}  // namespace ddprun::worker
