// Interrupting Gloo collectives (in-place recovery). Gloo has no abort (pytorch#130345; gloo#388
// is open), and closing a pair wakes no waiter of this process. Shutting a pair's socket down
// does: Gloo's event loop reads end-of-file, fails every pending buffer of the pair with an
// IoException (a dead peer's path), and the op thread's collective throws. The peer reads
// end-of-file too, so its own collectives on that pair fail as well.
// Reaches tcp::Pair's protected socket and mutex: pinned to the libgloo the SDK is built with
// (Debian's 0.0~git20220518), checked by tests/worker_sdk/abort_test.cc.
#pragma once

#include <gloo/context.h>

#include <string>

namespace ddprun::worker {

// Shuts down the socket of every pair of `ctx` (under each pair's lock, so a closed descriptor is
// never touched). Thread-safe against the op thread and Gloo's loop; idempotent; frees nothing.
// Returns how many sockets were shut down.
int shutdownGlooPairs(gloo::Context& ctx);

// Fails every pair of `ctx`, connected or not, with an IoException carrying `why`: a pair still
// connecting (Gloo waits up to 5 x its timeout for a peer that never connects) throws at once, and
// so does every op pending on a connected one. Thread-safe, idempotent (a pair keeps its first
// failure); the pairs' sockets are closed. Returns how many pairs hold a failure now.
int failGlooPairs(gloo::Context& ctx, const std::string& why);

}  // namespace ddprun::worker
