// One request applied to the stored run, with no etcd in sight: the stored value is parsed,
// imported into a fresh RendezvousState, the request applied, and the run exported and encoded
// again with the request's round changes and join answers (state_value.h). The transaction worker
// writes the result back in a transaction; the decisions are the rendezvous core's, the same
// code the gRPC server runs.
//
// Threading: pure functions, callable from any thread.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/rendezvous/state.h"

namespace ddprun::etcd {

// A request, as a change of the run's state at a time.
using ApplyFn = std::function<void(rendezvous::RendezvousState&, TimePoint)>;

// What a request did to the stored run.
struct StateUpdate {
  rendezvous::RendezvousState::Outbox out;   // the request's round changes and join answers
  std::shared_ptr<const std::string> value;  // the value to write; null when nothing changed
};

// Deadlines in the shared state are wall-clock times, the same on every agent (within NTP), so
// any agent can apply them.
TimePoint wallNow();

// Applies `fn` at `now` to run `run_id` as `stored` holds it (an empty value: no run yet). The
// error of the parse or the import when `stored` cannot be read.
StatusOr<StateUpdate> updateStateValue(const std::string& run_id,
                                       std::shared_ptr<const std::string> stored, const ApplyFn& fn,
                                       TimePoint now);

}  // namespace ddprun::etcd
