// PosixProcessLauncher: starts workers with fork/exec — each in its own process group, under a
// guardian process so that nothing the worker starts outlives the agent (worker_guardian.h) —
// pumps tee'd streams through the agent's io_context into the log file and the console, and reaps
// exited children on SIGCHLD (the agent is a child subreaper: a worker's zombie is handed to it by
// its guardian, so waitpid sees the worker's own pid and status). Used from
// the io_context's thread only.
#pragma once

#include <array>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/agent/process.h"
#include "ddprun/common/loop_affinity.h"

namespace ddprun::agent {

class PosixProcessLauncher final : public ProcessLauncher {
 public:
  using ExitCallback = std::function<void(int pid, ExitStatus status)>;

  explicit PosixProcessLauncher(boost::asio::io_context& io) : io_(io), sigchld_(io, SIGCHLD) {}
  ~PosixProcessLauncher() override;

  // From now on, every child that exits is reaped on the loop and reported to `on_exit` (then
  // `after` runs once per batch). Call before the first spawn.
  void watchExits(ExitCallback on_exit, std::function<void()> after);
  // Reaps and reports the children that exited by now, ahead of their SIGCHLD's turn on the loop:
  // news handled next (an agent stopped and continued finds both queued) then meets the workers
  // as they are, not as they were.
  void reapExited() { reap(); }

  StatusOr<int> spawn(const WorkerLaunch& launch) override;
  void signalGroup(int pid, int sig) override;
  // SIGKILL to the worker's guardian (and the worker's group again): the worker's zombie is then
  // handed to the agent, a subreaper, and reaped as any exit.
  void forceEnd(int pid) override;

  // Reads what is left in every tee pipe (the io_context must not be running) and flushes
  // partial lines, so nothing a worker wrote before exiting is lost.
  void drainAll();

 private:
  struct TeeStream {
    explicit TeeStream(boost::asio::io_context& io) : pipe(io) {}
    boost::asio::posix::stream_descriptor pipe;
    int file_fd = -1;
    int console_fd = -1;  // -1: file only
    std::string prefix;
    int filter_fd = -1;  // --duplicate-*-filters: matching lines also go here
    std::vector<std::string> needles;
    std::string partial;
    std::array<char, 16384> buf{};
    bool open = true;
  };

  Status addTee(int read_fd, const std::string& file, int console_fd, const std::string& prefix,
                const LineFilter& filter);
  void readMore(const std::shared_ptr<TeeStream>& s);
  static void consume(TeeStream& s, const char* data, size_t n);
  // Writes the complete lines of s.partial (all of it when `flush`) to the console and the
  // filtered file.
  static void emitLines(TeeStream& s, bool flush);
  static void closeStream(TeeStream& s);
  void waitForExits();
  void reap();
  // The worker exited (its pidfd is readable) and was not reaped: its guardian should hand its
  // zombie over at once; one that has not within kHandOver (stopped) is killed.
  void watchExit(int pid);

  struct Child {
    int guardian = 0;
    std::unique_ptr<boost::asio::posix::stream_descriptor> pidfd;  // null: no pidfd here
    std::unique_ptr<boost::asio::steady_timer> hand_over;
  };
  std::map<int, Child> children_;  // running workers by pid

  boost::asio::io_context& io_;
  std::vector<std::shared_ptr<TeeStream>> streams_;
  boost::asio::signal_set sigchld_;
  ExitCallback on_exit_;
  std::function<void()> after_exits_;
  LoopAffinity loop_{"PosixProcessLauncher"};
};

}  // namespace ddprun::agent
