// NCCL-specific controls of a Communicator whose backend() is Backend::kNccl. Declared only in
// builds with the NCCL communicator (DDPRUN_WITH_NCCL, which the ddprun::worker target defines
// for its users); guard calls with #ifdef DDPRUN_WITH_NCCL.
#pragma once

#ifdef DDPRUN_WITH_NCCL

#include <cuda_runtime_api.h>

#include "ddprun/worker/communicator.h"

namespace ddprun::worker {

// The stream whose work an NCCL collective follows: a collective reads its tensor only after
// everything queued on this stream before the *Async call. Default (and after nullptr): the
// device's legacy default stream, which is LibTorch's current stream unless a CUDAStreamGuard
// says otherwise; a program that computes on its own stream sets that stream here. Thread-safe;
// applies to collectives submitted afterwards. Throws ConfigError if `comm` is not NCCL.
void setNcclProducerStream(Communicator& comm, cudaStream_t stream);

}  // namespace ddprun::worker

#endif  // DDPRUN_WITH_NCCL
