// The agreed stop (Trainer): after each step every rank adds up who was asked to stop (a
// checkpoint signal) and who of those was asked to go away (SIGTERM). Every rank sees the same
// sums, so every rank takes the same branch at the same step boundary. Pure: no LibTorch.
#pragma once

#include <cstdint>

namespace ddprun::worker {

enum class StopAgreement {
  kGoOn,         // nobody asked
  kAllStop,      // every rank saves (rank 0 writes the snapshot) and returns kStoppedBySignal
  kLeave,        // this rank leaves the job; the others re-form in place without it
  kOthersLeave,  // ranks that were sent SIGTERM leave; this one re-forms in place without them
};

// `requests`: ranks asked to stop; `terminations`: those of them asked by SIGTERM; `asked_here`:
// whether this rank counted itself in `requests`. A part of the world leaves only under in-place
// recovery, and only when every request was a SIGTERM (a spot notice to one node, a signal to one
// worker): SIGUSR1 or requestCheckpoint() anywhere, or SIGTERM to every rank, stops everyone.
inline StopAgreement agreeOnStop(std::int64_t requests, std::int64_t terminations, int world,
                                 bool asked_here, bool in_place) {
  if (requests <= 0) return StopAgreement::kGoOn;
  if (!in_place || terminations != requests || requests >= world) return StopAgreement::kAllStop;
  return asked_here ? StopAgreement::kLeave : StopAgreement::kOthersLeave;
}

}  // namespace ddprun::worker
