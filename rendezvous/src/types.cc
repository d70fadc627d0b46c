#include "ddprun/rendezvous/types.h"

namespace ddprun::rendezvous {

const char* changeKindName(ChangeKind kind) {
  switch (kind) {
    case ChangeKind::kSnapshot:
      return "SNAPSHOT";
    case ChangeKind::kRoundPending:
      return "ROUND_PENDING";
    case ChangeKind::kRoundComplete:
      return "ROUND_COMPLETE";
    case ChangeKind::kClosed:
      return "CLOSED";
  }
  return "UNKNOWN";
}

const char* changeReasonName(ChangeReason reason) {
  switch (reason) {
    case ChangeReason::kNone:
      return "NONE";
    case ChangeReason::kNodeJoined:
      return "NODE_JOINED";
    case ChangeReason::kNodeLeft:
      return "NODE_LEFT";
    case ChangeReason::kNodeDead:
      return "NODE_DEAD";
    case ChangeReason::kFailureReported:
      return "FAILURE_REPORTED";
    case ChangeReason::kRecoveryFailed:
      return "RECOVERY_FAILED";
  }
  return "UNKNOWN";
}

}  // namespace ddprun::rendezvous
