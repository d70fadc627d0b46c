#include "ddprun/worker/signals.h"

#include <atomic>
#include <csignal>

namespace ddprun::worker {

namespace {
// 0: none; SIGTERM once it arrived, else SIGUSR1 or -1 (requestCheckpoint()).
std::atomic<int> g_requested{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");

extern "C" void onCheckpointSignal(int sig) {
  int seen = g_requested.load();
  while (seen != SIGTERM && !g_requested.compare_exchange_weak(seen, sig)) {
  }
}
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
bool terminationRequested() { return g_requested.load() == SIGTERM; }
void requestCheckpoint() {
  int seen = 0;
  g_requested.compare_exchange_strong(seen, -1);
}
void clearCheckpointRequest() { g_requested.store(0); }

}  // namespace ddprun::worker
