#include "state_update.h"

#include <optional>

#include "state_value.h"

namespace ddprun::etcd {

using rendezvous::RendezvousState;

TimePoint wallNow() {
  return TimePoint(
      std::chrono::duration_cast<Duration>(std::chrono::system_clock::now().time_since_epoch()));
}

StatusOr<StateUpdate> updateStateValue(const std::string& run_id,
                                       std::shared_ptr<const std::string> stored, const ApplyFn& fn,
                                       TimePoint now) {
  auto old = StateValue::parse(std::move(stored));
  StatusOr<std::string> old_snapshot =
      old.isOk() ? old->snapshot() : StatusOr<std::string>(old.status());
  if (!old_snapshot.isOk()) return old_snapshot.status();
  RendezvousState state;
  Status imported = state.importRun(run_id, old_snapshot.value());
  if (!imported.isOk()) return imported;
  fn(state, now);
  StateUpdate update;
  update.out = state.drain();
  const std::string snapshot = state.exportRun(run_id);
  if (snapshot == old_snapshot.value() && update.out.changes.empty()) return update;
  // The deadlines a fresh import sees (the applying state also holds stale ones).
  RendezvousState reread;
  std::optional<TimePoint> next_deadline;
  if (reread.importRun(run_id, snapshot).isOk()) next_deadline = reread.nextDeadline();
  update.value = std::make_shared<const std::string>(
      encodeStateValue(update.out.changes, update.out.joins, snapshot, next_deadline));
  return update;
}

}  // namespace ddprun::etcd
