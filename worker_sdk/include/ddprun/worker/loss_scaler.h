// LossScaler: the loss scale of fp16 mixed precision, as torch.amp.GradScaler keeps it, without
// tensors. The loss is multiplied by scale() before backward; the gradients are unscaled and
// checked for inf/NaN before the optimizer steps; update() says whether to step and moves the
// scale: a non-finite gradient skips the step and backs the scale off, growth_interval clean steps
// in a row grow it. Every rank must feed update() the same verdict: the Trainer checks DDP's
// all-reduced gradients, which are bit-identical on every rank. The scale is a float32, as
// GradScaler's tensor. Thread-compatible (one per rank); pure, no LibTorch.
#pragma once

#include <cstdint>

namespace ddprun::worker {

struct LossScalerOptions {
  float init_scale = 65536.0f;  // 2^16
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  std::int64_t growth_interval = 2000;
};

class LossScaler {
 public:
  struct State {
    float scale = 0;
    std::int64_t growth_tracker = 0;  // clean steps in a row since the last growth or backoff
  };

  // Throws ConfigError naming the option that is out of range.
  explicit LossScaler(const LossScalerOptions& options = {});

  float scale() const { return state_.scale; }
  // 1/scale as GradScaler computes it (in double, then float32).
  float inverseScale() const;

  // Whether the optimizer steps after a step whose gradients had an inf or NaN (`found_inf`).
  bool update(bool found_inf);

  State state() const { return state_; }
  // Resumes from a snapshot's state; throws ConfigError for a scale that is not finite and > 0.
  void restore(const State& state);

 private:
  LossScalerOptions options_;
  State state_;
};

}  // namespace ddprun::worker
