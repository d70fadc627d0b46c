// Whether this process waits for its peers: the worker SDK says so in its heartbeat file
// (DDPRUN_HEARTBEAT_FILE), for the agent's hang check (docs/in-place-recovery.md §2.2). When one
// rank hangs, every rank's heartbeat goes stale: the others wait in their collectives for it. The
// file's first byte says which (ddprun/common/heartbeat_file.h): kNotWaiting at each of the
// Trainer's touches, kWaitingForPeers while a collective or a store wait has waited for
// kMarkAfter, so the agent can tell the rank that hangs (its file says it does not wait) from
// those that wait for it, and replace it alone. The caller marks only waits that lasted
// kMarkAfter: a step's short waits write nothing.
//
// Thread-safe (one mutex); the file is opened once.
#pragma once

#include <chrono>
#include <string>

namespace ddprun::worker {

// How long a wait lasts before it is marked.
inline constexpr std::chrono::milliseconds kMarkAfter{50};

// The heartbeat file is `path` from now on ("": none; waits and touches write nothing). Waits are
// marked only once touchHeartbeat created it: until the first step, the agent does not watch it,
// and a mark would start its clock early. Returns a token for stopMarkingWaits.
int markWaitsIn(const std::string& path);
// Stops marking, unless markWaitsIn was called again since the call that returned `token` (a newer
// Trainer's file is kept when an older Trainer is destroyed after it was built).
void stopMarkingWaits(int token);

// The Trainer's touch after each step: writes the mark (kNotWaiting, or kWaitingForPeers while a
// wait is marked), which also sets the file's modification time; creates the file, again if it
// was removed. Returns errno when it cannot be opened or written, else 0 (and 0 without a file).
int touchHeartbeat();

// While an object lives, this thread waits for its peers (nested and concurrent ones count once).
class WaitingForPeers {
 public:
  WaitingForPeers();
  ~WaitingForPeers();
  WaitingForPeers(const WaitingForPeers&) = delete;
  WaitingForPeers& operator=(const WaitingForPeers&) = delete;
};

}  // namespace ddprun::worker
