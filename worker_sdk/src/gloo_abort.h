// Interrupting Gloo collectives (in-place recovery). Gloo has no abort (pytorch#130345; gloo#388
// is open), and closing a pair wakes no waiter of this process. Shutting a pair's socket down
// does: Gloo's event loop reads end-of-file, fails every pending buffer of the pair with an
// IoException (a dead peer's path), and the op thread's collective throws. The peer reads
// end-of-file too, so its own collectives on that pair fail as well.
// Reaches tcp::Pair's protected socket and mutex: pinned to the libgloo the SDK is built with
// (Debian's 0.0~git20220518), checked by tests/worker_sdk/abort_test.cc.
#pragma once

#include <gloo/context.h>

namespace ddprun::worker {

// Shuts down the socket of every pair of `ctx` (under each pair's lock, so a closed descriptor is
// never touched). Thread-safe against the op thread and Gloo's loop; idempotent; frees nothing.
// Returns how many sockets were shut down.
int shutdownGlooPairs(gloo::Context& ctx);

}  // namespace ddprun::worker
