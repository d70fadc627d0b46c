// ControlClient: the worker's end of the agent's control channel (DDPRUN_CONTROL_SOCKET,
// --restart-mode=in-place; protocol in docs/in-place-recovery.md §1). It says hello, reads the
// welcome, then one thread reads the agent's lines: `abort` calls the handler at once (so the
// communicator is interrupted while the training thread is blocked in a collective), `group` is
// kept for waitGroup(). Lines are bounded (common/control_protocol.h); a malformed line or a
// hang-up closes the channel, and recovery then fails with a clear error (the agent falls back
// to restarting processes).
// Thread-safe. The handler runs on the reader thread and must not block.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "ddprun/common/control_protocol.h"
#include "ddprun/common/thread_annotations.h"

namespace ddprun::worker {

class ControlClient {
 public:
  using AbortHandler = std::function<void(int generation, const std::string& reason)>;

  // Connects to `path`, says hello (this pid, no capabilities yet) and reads the welcome within
  // `timeout`. Throws CommError naming the path and the problem.
  static std::unique_ptr<ControlClient> connect(const std::string& path,
                                                std::chrono::milliseconds timeout,
                                                AbortHandler on_abort);
  ~ControlClient();  // hangs up and joins the reader
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  // The generation the welcome named (the group this process forms first).
  int generation() const { return welcome_generation_; }
  // The bound on each recovery phase (the welcome's timeout_ms: --rdzv-conf inplace_timeout).
  std::chrono::milliseconds recoveryTimeout() const { return recovery_timeout_; }
  // Best effort: a failed write means the agent is gone, which the reader reports.
  void send(const ddprun::ControlMessage& message) EXCLUDES(send_mu_);
  // The newest `group` of a generation above `after`. Waits at most `timeout`, in slices in which
  // `keep_waiting` is asked first (a stop request ends the wait, a group there or not): nullopt
  // when it said no. Throws
  // CommError when the agent hung up or sent nothing in time.
  std::optional<ddprun::ControlMessage> waitGroup(int after, std::chrono::milliseconds timeout,
                                                  const std::function<bool()>& keep_waiting)
      EXCLUDES(mu_);
  // The highest generation an `abort` named; -1 when none came.
  int abortedGeneration() const EXCLUDES(mu_);
  // Waits at most `timeout` for an `abort` of generation `gen` or later; whether one came.
  bool waitAbort(int gen, std::chrono::milliseconds timeout) EXCLUDES(mu_);

 private:
  ControlClient(int fd, int generation, std::chrono::milliseconds timeout, std::string path,
                std::string pending, AbortHandler on_abort);
  void readLoop();
  void onLine(const std::string& line);
  void closeWith(const std::string& why) EXCLUDES(mu_);

  const int fd_;
  const int welcome_generation_;
  const std::chrono::milliseconds recovery_timeout_;
  const std::string path_;
  std::string pending_;  // bytes read past the welcome (reader thread only once it runs)
  AbortHandler on_abort_;
  ddprun::Mutex send_mu_;
  mutable ddprun::Mutex mu_;
  std::condition_variable_any cv_;
  std::optional<ddprun::ControlMessage> group_ GUARDED_BY(mu_);
  int aborted_generation_ GUARDED_BY(mu_) = -1;
  std::string closed_ GUARDED_BY(mu_);  // why the channel ended; empty while open
  std::thread reader_;                  // last: started once the rest is built
};

}  // namespace ddprun::worker
