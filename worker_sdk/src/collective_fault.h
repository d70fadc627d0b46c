// What kind of failure a collective's error names, for the control channel's `fault` message
// (docs/in-place-recovery.md §1): peer_closed, timeout, cuda or other. Read from the error's text,
// which is all a CommError carries (Gloo's, NCCL's and the SDK's own messages); only the agent's
// log and phase timings use it, so a message that matches nothing is merely `other`.
// Pure: no LibTorch, no I/O.
#pragma once

#include <string_view>

namespace ddprun::worker {

const char* collectiveFaultKind(std::string_view what);

}  // namespace ddprun::worker
