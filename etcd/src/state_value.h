// The value the etcd-v3 rendezvous stores under <prefix>/state, and a reader that gets from it
// what an agent needs on each pushed change without parsing the whole run.
//
// One transaction writes one value:
//   "v3;" <next deadline or "-"> ";" <n>":" <round changes> <m>":" <join answers> <snapshot>
// - the round changes of the transaction (what watchers are pushed);
// - the join answers: what the transaction answered to each join it completed or failed (the
//   JoinDone entries of its outbox, the gRPC server's replies), so a waiting joiner finds its
//   rank by its call id in a record of a few bytes per joiner instead of importing the snapshot;
// - the next deadline of the run, so an agent arms its tick timer without parsing the snapshot;
// - the run's snapshot (RendezvousState::exportRun), parsed only when an agent needs the state:
//   "p" and the snapshot as it is, or (from 1 KiB) "z" <size> ":" and the snapshot deflated.
//   Every watcher is pushed every value, so its size is what etcd fans out: a 512-node run's
//   61 KB snapshot deflates to 12 KB, which halved the change-delivery p99 at 512 agents.
// Older values still read: "v2;" (the snapshot as it is, no "p"), and a value without a tag
// (written before join answers existed: no answers). An agent of a release before "v3;" cannot
// read "v3;" values: every agent of a job runs the same ddprun.
// Every read is bounds checked: a damaged value is INVALID_ARGUMENT, never a crash. A deflated
// snapshot states its inflated size; a size over kMaxStateSnapshotBytes is refused before anything
// is allocated, and the inflation grows its buffer with what the stream delivers (from 64 KiB),
// never past the size stated: a 46-byte value that claims 1 GiB costs an agent nothing.
//
// Threading: pure functions and an immutable value type; StateValue shares the stored bytes
// (copying one is cheap) and may be read from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/rendezvous/state.h"
#include "ddprun/rendezvous/types.h"

namespace ddprun::etcd {

// The largest snapshot a stored state may inflate to: etcd takes values of a few MiB at most
// (--max-request-bytes, 1.5 MiB by default), and a 4096-node run's snapshot is ~0.6 MB before it
// is deflated. (docs/reliability.md)
inline constexpr uint64_t kMaxStateSnapshotBytes = uint64_t{16} << 20;

// zlib's inflation of `deflated`, which must give exactly `size` bytes (at most
// kMaxStateSnapshotBytes); INVALID_ARGUMENT otherwise. Memory grows with the output, not with
// the size stated.
StatusOr<std::string> inflateBounded(std::string_view deflated, uint64_t size);

std::string encodeStateValue(const std::vector<rendezvous::RendezvousState::Change>& changes,
                             const std::vector<rendezvous::RendezvousState::JoinDone>& answers,
                             const std::string& snapshot, std::optional<TimePoint> next_deadline);

class StateValue {
 public:
  // An empty `stored` (no key) reads as no changes, no answers, an empty snapshot. Only the
  // header (deadline, changes) is parsed here; answers and the snapshot when asked for.
  static StatusOr<StateValue> parse(std::shared_ptr<const std::string> stored);

  StateValue();

  const std::vector<rendezvous::RoundChange>& changes() const { return changes_; }
  std::optional<TimePoint> nextDeadline() const { return next_deadline_; }
  // The run's snapshot, inflated when it is stored deflated (INVALID_ARGUMENT when that fails).
  StatusOr<std::string> snapshot() const;
  // What the writing transaction answered to join call `call`; nullopt when it did not answer it
  // (or the record is damaged: the caller then learns the outcome from the snapshot).
  std::optional<StatusOr<rendezvous::RoundInfo>> joinAnswer(uint64_t call) const;

 private:
  std::shared_ptr<const std::string> stored_;
  std::vector<rendezvous::RoundChange> changes_;
  std::optional<TimePoint> next_deadline_;
  size_t answers_begin_ = 0, answers_end_ = 0, snapshot_begin_ = 0;
  uint64_t inflated_size_ = 0;  // 0: the snapshot is stored as it is
};

}  // namespace ddprun::etcd
