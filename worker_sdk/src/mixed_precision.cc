#include "ddprun/worker/mixed_precision.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/version.h>

#include <algorithm>

#include "ddprun/worker/errors.h"

// LibTorch 2.4 replaced the per-device autocast functions (set_enabled, set_cpu_enabled, ...) by
// ones taking the device type, and deprecated the old ones.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define DDPRUN_AUTOCAST_BY_DEVICE 1
#endif

namespace ddprun::worker {

namespace {

bool autocastEnabled(at::DeviceType d) {
#ifdef DDPRUN_AUTOCAST_BY_DEVICE
  return at::autocast::is_autocast_enabled(d);
#else
  return d == at::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

void setAutocastEnabled(at::DeviceType d, bool on) {
#ifdef DDPRUN_AUTOCAST_BY_DEVICE
  at::autocast::set_autocast_enabled(d, on);
#else
  d == at::kCUDA ? at::autocast::set_enabled(on) : at::autocast::set_cpu_enabled(on);
#endif
}

at::ScalarType autocastDtype(at::DeviceType d) {
#ifdef DDPRUN_AUTOCAST_BY_DEVICE
  return at::autocast::get_autocast_dtype(d);
#else
  return d == at::kCUDA ? at::autocast::get_autocast_gpu_dtype()
                        : at::autocast::get_autocast_cpu_dtype();
#endif
}

void setAutocastDtype(at::DeviceType d, at::ScalarType t) {
#ifdef DDPRUN_AUTOCAST_BY_DEVICE
  at::autocast::set_autocast_dtype(d, t);
#else
  d == at::kCUDA ? at::autocast::set_autocast_gpu_dtype(t)
                 : at::autocast::set_autocast_cpu_dtype(t);
#endif
}

at::ScalarType dtypeOf(Amp amp) { return amp == Amp::kFp16 ? at::kHalf : at::kBFloat16; }

}  // namespace

Amp parseAmp(const std::string& name) {
  if (name == "none") return Amp::kNone;
  if (name == "bf16") return Amp::kBf16;
  if (name == "fp16") return Amp::kFp16;
  throw ConfigError("mixed precision must be none, bf16 or fp16, got '" + name + "'");
}

std::string ampName(Amp amp) {
  switch (amp) {
    case Amp::kBf16:
      return "bf16";
    case Amp::kFp16:
      return "fp16";
    case Amp::kNone:
      break;
  }
  return "none";
}

AutocastGuard::AutocastGuard(at::DeviceType device, Amp amp) : device_(device) {
  if (amp == Amp::kNone) return;
  if (device != at::kCPU && device != at::kCUDA) {
    throw ConfigError("mixed precision: autocast on " + c10::DeviceTypeName(device) +
                      " is not supported (cpu or cuda)");
  }
  active_ = true;
  was_enabled_ = autocastEnabled(device);
  was_dtype_ = autocastDtype(device);
  setAutocastDtype(device, dtypeOf(amp));
  setAutocastEnabled(device, true);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  setAutocastEnabled(device_, was_enabled_);
  setAutocastDtype(device_, was_dtype_);
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
}

void checkAmpSupported(at::DeviceType device, Amp amp) {
  if (amp != Amp::kFp16 || device != at::kCPU) return;
  try {
    const auto a = at::ones({2, 2}, at::TensorOptions().dtype(at::kHalf));
    (void)at::mm(a, a);
  } catch (const std::exception&) {
    throw ConfigError(
        "mixed precision fp16 on the CPU needs a LibTorch with fp16 matrix products on the CPU "
        "(2.x; this one has none): use bf16 on the CPU, or fp16 on a GPU");
  }
}

bool fusedUnscaleAvailable(at::DeviceType device) {
  // LibTorch has the kernel for CUDA since 1.6, for the CPU since 2.3 (Debian's 1.13 has none).
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(
      "aten::_amp_foreach_non_finite_check_and_unscale_", "");
  if (device == at::kCUDA) return op.hasKernelForDispatchKey(c10::DispatchKey::CUDA);
  if (device == at::kCPU) return op.hasKernelForDispatchKey(c10::DispatchKey::CPU);
  return false;
}

bool unscaleGradients(const std::vector<at::Tensor>& params, float inv_scale) {
  at::NoGradGuard no_grad;
  // As torch.amp.GradScaler: one fused kernel per device and dtype multiplies and checks every
  // gradient of its list (over CUDA, 5 small kernels per parameter otherwise). Its product is
  // mul_'s (the scale as a float, the half types computed in float): both paths give the same bits.
  struct Group {
    at::Device device;
    at::ScalarType dtype;
    std::vector<at::Tensor> grads;
  };
  std::vector<Group> fused;
  std::vector<at::Tensor> verdicts;
  for (const auto& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (g.layout() == at::kStrided && fusedUnscaleAvailable(g.device().type())) {
      auto it = std::find_if(fused.begin(), fused.end(), [&](const Group& group) {
        return group.device == g.device() && group.dtype == g.scalar_type();
      });
      if (it == fused.end()) it = fused.insert(fused.end(), Group{g.device(), g.scalar_type(), {}});
      it->grads.push_back(g);
      continue;
    }
    g.mul_(inv_scale);
    verdicts.push_back(g.isfinite().logical_not().any());
  }
  for (auto& group : fused) {
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(group.device);
    at::Tensor found_inf = at::zeros({1}, opts);
    at::_amp_foreach_non_finite_check_and_unscale_(group.grads, found_inf,
                                                   at::full({1}, inv_scale, opts));
    verdicts.push_back(found_inf.gt(0).squeeze(0));
  }
  // Combined on each device first, so one device costs one host-device synchronisation.
  std::vector<at::Tensor> per_device;
  for (const auto& v : verdicts) {
    auto it = std::find_if(per_device.begin(), per_device.end(),
                           [&](const at::Tensor& d) { return d.device() == v.device(); });
    if (it == per_device.end()) {
      per_device.push_back(v);
    } else {
      *it = it->logical_or(v);
    }
  }
  bool any = false;
  for (const auto& d : per_device) any = d.item<bool>() || any;
  return any;
}

}  // namespace ddprun::worker
