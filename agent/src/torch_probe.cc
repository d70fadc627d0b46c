#include "torch_probe.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

extern char** environ;

namespace ddprun::agent {

namespace {
// importlib.metadata (Python >= 3.8) reads the installed distribution's version: milliseconds,
// where importing torch takes seconds.
constexpr const char* kAskVersion = "import importlib.metadata as m\nprint(m.version('torch'))\n";
}  // namespace

TorchProbe::TorchProbe(const std::string& interpreter) {
  if (interpreter.empty()) {
    done_ = true;
    return;
  }
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    done_ = true;
    return;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  std::vector<std::string> args = {interpreter, "-c", kAskVersion};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int rc = ::posix_spawn(&pid_, interpreter.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (rc != 0) {
    pid_ = -1;
    ::close(fds[0]);
    done_ = true;
    return;
  }
  fd_ = fds[0];
}

TorchProbe::~TorchProbe() { finish(); }

std::optional<TorchVersion> TorchProbe::result(std::chrono::milliseconds bound) {
  if (done_) return version_;
  const auto deadline = std::chrono::steady_clock::now() + bound;
  std::string out;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;  // no answer in time: unknown
    pollfd p{fd_, POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    char buf[256];
    const ssize_t got = ::read(fd_, buf, sizeof(buf));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {  // EOF: the interpreter answered and exited
      version_ = parseTorchVersion(out);
      break;
    }
    if (out.size() < 4096) out.append(buf, static_cast<size_t>(got));
  }
  finish();
  return version_;
}

void TorchProbe::finish() {
  done_ = true;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (pid_ <= 0) return;
  // Kill only a child not reaped yet: its pid cannot have been reused. The agent's SIGCHLD
  // handler reaps on this same thread, so it may have taken it already (ECHILD), never meanwhile.
  int r;
  while ((r = ::waitpid(pid_, nullptr, WNOHANG)) < 0 && errno == EINTR) {
  }
  if (r == 0) {
    ::kill(pid_, SIGKILL);
    while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
  pid_ = -1;
}

}  // namespace ddprun::agent
