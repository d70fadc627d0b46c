// The in-place recovery's test hook, DDPRUN_INPLACE_FAULT=<phase>:<rank> (trainer.h; `*`: every
// rank): the phases of a recovery where the tests make a rank fail, leave, or take its whole node
// down, and the caps phase, in which the Trainer does not announce in-place support (as a program
// that does not speak the control channel; recoveryFaultRequested only).
#pragma once

namespace ddprun::worker {

// Does what the hook asks when DDPRUN_INPLACE_FAULT names this phase and rank; nothing otherwise.
// In the abort or sync phase of an in-place recovery that rank exits 1 (a failure during the
// recovery, which falls back to a process restart); in the wait phase, as it starts waiting for
// the new group, it sends itself SIGTERM (a stop that reaches it mid-recovery: it leaves, and its
// agent replaces it in the same recovery); in the form phase, as it starts forming the new group,
// it kills its node (its agent, then itself): a node lost while the others form; in the connect
// phase, once every rank published its Gloo pair addresses and before it connects its own, it
// stops its agent and itself (SIGSTOP): a node gone silent while the others connect to it (the
// caller waits for the addresses); in the step phase it exits 1 once it completed the first step
// in the new group, before telling its agent: its node's recovery fails after the other nodes'
// ended.
void injectRecoveryFault(const char* phase, int rank);
// Whether DDPRUN_INPLACE_FAULT names this phase and rank.
bool recoveryFaultRequested(const char* phase, int rank);

}  // namespace ddprun::worker
