// Checkpoint signals: SIGTERM or SIGUSR1 ask the training loop to save a snapshot at the next step
// boundary and exit 0. The handler only sets an atomic flag; the loop polls it. Process-wide.
#pragma once

namespace ddprun::worker {

// Installs handlers for SIGTERM and SIGUSR1 (idempotent).
void installCheckpointSignalHandlers();
// True once a checkpoint signal arrived (or requestCheckpoint() was called).
bool checkpointRequested();
// True once SIGTERM asked: this process is going away, and under in-place recovery it may leave
// while the other ranks go on (SIGUSR1 and requestCheckpoint() ask every rank to stop).
bool terminationRequested();
void requestCheckpoint();
void clearCheckpointRequest();

}  // namespace ddprun::worker
