// PosixProcessLauncher: starts workers with fork/exec — each in its own process group, under a
// guardian process so that nothing the worker starts outlives the agent (worker_guardian.h) — and
// pumps tee'd streams through the agent's io_context into the log file and the console. Used from
// the io_context's thread only.
#pragma once

#include <array>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/agent/process.h"

namespace ddprun::agent {

class PosixProcessLauncher final : public ProcessLauncher {
 public:
  explicit PosixProcessLauncher(boost::asio::io_context& io) : io_(io) {}
  ~PosixProcessLauncher() override;

  StatusOr<int> spawn(const WorkerLaunch& launch) override;
  void signalGroup(int pid, int sig) override;

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
    std::string partial;
    std::array<char, 16384> buf{};
    bool open = true;
  };

  Status addTee(int read_fd, const std::string& file, int console_fd, const std::string& prefix);
  void readMore(const std::shared_ptr<TeeStream>& s);
  static void consume(TeeStream& s, const char* data, size_t n);
  static void closeStream(TeeStream& s);

  boost::asio::io_context& io_;
  std::vector<std::shared_ptr<TeeStream>> streams_;
};

}  // namespace ddprun::agent
