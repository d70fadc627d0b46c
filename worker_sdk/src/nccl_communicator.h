// The parts of the NCCL communicator that need no GPU: device choice and tensor validation. They
// sit apart from nccl_communicator.cc so tests reach them on machines without a CUDA device (the
// communicator itself cannot be constructed there). Pure functions; throw on bad input.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace ddprun::worker::nccl_detail {

// The CUDA device this rank's communicator uses. `visible` and `count_error` are what
// cudaGetDeviceCount reported (`count_error` empty when it succeeded). Throws ConfigError when no
// device is visible or `requested` is not one of them.
int pickDevice(int requested, int visible, const std::string& count_error);

// Throws WorkerError unless `t` is a defined, strided, contiguous CUDA tensor on cuda:`device`
// with a dtype NCCL handles. `op` names the collective in the message.
void checkTensor(const at::Tensor& t, int device, const char* op);

}  // namespace ddprun::worker::nccl_detail
