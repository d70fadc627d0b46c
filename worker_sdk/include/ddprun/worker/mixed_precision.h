// Mixed precision for the training loop, as PyTorch users write it: autocast around forward and
// loss (bf16 or fp16, LibTorch's own autocast: the same op lists as torch.autocast), and for fp16
// the loss scaling of torch.amp.GradScaler (LossScaler, loss_scaler.h). Trainer uses these
// (TrainerOptions::amp); a hand-written loop can too:
//
//   LossScaler scaler;                                   // fp16 only
//   { AutocastGuard autocast(at::kCUDA, Amp::kFp16); loss = criterion(model->forward(x), y); }
//   (loss * scaler.scale()).backward();                  // DDP all-reduces the scaled gradients
//   const bool inf = unscaleGradients(model->parameters(), scaler.inverseScale());
//   if (scaler.update(inf)) optimizer.step();            // same verdict on every rank
//
// Single-threaded per rank, like autocast itself (its state is per thread).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <string>
#include <vector>

#include "ddprun/worker/loss_scaler.h"

namespace ddprun::worker {

enum class Amp { kNone, kBf16, kFp16 };
// "none", "bf16" or "fp16"; ConfigError naming the choices otherwise.
Amp parseAmp(const std::string& name);
std::string ampName(Amp amp);

// Autocast on `device` (kCPU or kCUDA) to `amp`'s dtype for the guard's lifetime; kNone does
// nothing. The previous autocast state comes back after; the outermost guard clears the cast cache.
class AutocastGuard {
 public:
  AutocastGuard(at::DeviceType device, Amp amp);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  at::DeviceType device_;
  bool active_ = false;
  bool was_enabled_ = false;
  at::ScalarType was_dtype_ = at::kFloat;
};

// Throws ConfigError when this LibTorch cannot compute in `amp`'s dtype on `device` (fp16 matrix
// products on the CPU: LibTorch 1.13 has none).
void checkAmpSupported(at::DeviceType device, Amp amp);

// Multiplies every defined gradient of `params` by `inv_scale`, in place; returns whether any was
// inf or NaN. One host-device synchronisation per device the gradients are on. Dense gradients
// take LibTorch's fused kernel where it has one for their device (fusedUnscaleAvailable), as
// torch.amp.GradScaler does; the others one operation at a time, with the same result.
bool unscaleGradients(const std::vector<at::Tensor>& params, float inv_scale);

// Whether this LibTorch has the fused unscale kernel (_amp_foreach_non_finite_check_and_unscale_)
// for `device`: CUDA always, the CPU from LibTorch 2.3.
bool fusedUnscaleAvailable(at::DeviceType device);

}  // namespace ddprun::worker
