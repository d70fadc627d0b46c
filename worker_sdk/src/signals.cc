#include "ddprun/worker/signals.h"

#include <atomic>
#include <csignal>

namespace ddprun::worker {

namespace {
std::atomic<int> g_requested{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");

extern "C" void onCheckpointSignal(int) { g_requested.store(1); }
}  // namespace

void installCheckpointSignalHandlers() {
  struct sigaction sa {};
  sa.sa_handler = onCheckpointSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
}

bool checkpointRequested() { return g_requested.load() != 0; }
void requestCheckpoint() { g_requested.store(1); }
void clearCheckpointRequest() { g_requested.store(0); }

}  // namespace ddprun::worker
