// The process's limit on open files (RLIMIT_NOFILE), read and raised in one place: the agent's
// snapshot replication keeps a descriptor per replicated name, the rendezvous daemon one per
// client connection, and the accept guard keeps part of the limit for the process's own work.
#pragma once

#include <cstdint>

namespace ddprun {

// The soft limit on open files (0 when it cannot be read).
uint64_t openFileLimit();

// Raises the soft limit to the hard one; returns the soft limit in force. Workers inherit it; a
// program that kept under the old limit sees no descriptor numbers it did not see before.
uint64_t raiseOpenFileLimit();

}  // namespace ddprun
