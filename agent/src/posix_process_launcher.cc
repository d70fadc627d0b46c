#include "posix_process_launcher.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <string_view>

#include "ddprun/common/log.h"
#include "worker_guardian.h"

namespace ddprun::agent {
namespace {

void writeAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // console gone or disk full: the worker must not block on us
    data += w;
    n -= static_cast<size_t>(w);
  }
}

int openLog(const std::string& path) {
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
}

// Shared by every worker of a round: each line lands with one O_APPEND write.
int openShared(const std::string& path) {
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

// A worker that never writes a newline must not grow the agent: past this, the pending text is
// emitted as a line of its own.
constexpr size_t kMaxLineBytes = 64 * 1024;

bool containsAny(std::string_view line, const std::vector<std::string>& needles) {
  for (const auto& n : needles) {
    if (line.find(n) != std::string_view::npos) return true;
  }
  return false;
}

std::string errnoText(int err) { return std::strerror(err); }

}  // namespace

PosixProcessLauncher::~PosixProcessLauncher() {
  for (auto& s : streams_) closeStream(*s);
}

StatusOr<int> PosixProcessLauncher::spawn(const WorkerLaunch& launch) {
  loop_.check();
  if (launch.argv.empty()) return invalidArgument("empty command line");

  // Everything the child needs is prepared before fork: after it only async-signal-safe calls.
  std::vector<char*> argv;
  for (const auto& a : launch.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const auto& e : launch.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);

  int child_out = -1, child_err = -1;  // fds the child dup2s onto 1 and 2
  int tee_out_read = -1, tee_err_read = -1;
  auto closeAll = [&] {
    for (int fd : {child_out, child_err, tee_out_read, tee_err_read}) {
      if (fd >= 0) ::close(fd);
    }
  };
  auto prepare = [&](bool tee, const std::string& file, int& child_fd, int& read_fd) -> Status {
    if (tee) {
      int p[2];
      if (::pipe2(p, O_CLOEXEC) != 0) return internalError("pipe: " + errnoText(errno));
      read_fd = p[0];
      child_fd = p[1];
    } else if (!file.empty()) {
      child_fd = openLog(file);
      if (child_fd < 0) return internalError("cannot open " + file + ": " + errnoText(errno));
    }
    return Status::ok();
  };
  Status st = prepare(launch.tee_stdout, launch.stdout_file, child_out, tee_out_read);
  if (st.isOk()) st = prepare(launch.tee_stderr, launch.stderr_file, child_err, tee_err_read);
  if (!st.isOk()) {
    closeAll();
    return st;
  }

  // A guardian process sits between the agent and the worker, so nothing the worker starts
  // outlives the agent (worker_guardian.h); the pid is the worker's own.
  cpu_set_t affinity;
  CPU_ZERO(&affinity);
  for (int cpu : launch.cpu_affinity) CPU_SET(cpu, &affinity);
  auto pids = spawnGuardedWorker(GuardedExec{argv.data(), envp.data(), child_out, child_err,
                                             launch.cpu_affinity.empty() ? nullptr : &affinity});
  if (child_out >= 0) ::close(child_out);
  if (child_err >= 0) ::close(child_err);
  if (!pids.isOk()) {
    if (tee_out_read >= 0) ::close(tee_out_read);
    if (tee_err_read >= 0) ::close(tee_err_read);
    return pids.status();
  }
  const int pid = pids->worker;
  children_[pid].guardian = pids->guardian;
  watchExit(pid);

  const int out_console = launch.to_console ? STDOUT_FILENO : -1;
  const int err_console = launch.to_console ? STDERR_FILENO : -1;
  if (tee_out_read >= 0) {
    DDPRUN_RETURN_IF_ERROR(addTee(tee_out_read, launch.stdout_file, out_console,
                                  launch.console_prefix, launch.stdout_filter));
  }
  if (tee_err_read >= 0) {
    DDPRUN_RETURN_IF_ERROR(addTee(tee_err_read, launch.stderr_file, err_console,
                                  launch.console_prefix, launch.stderr_filter));
  }
  return pid;
}

namespace {
// How long a worker that exited may wait for its guardian to hand its zombie over (a guardian
// does at once) before the guardian is killed.
constexpr auto kHandOver = std::chrono::seconds(5);

int pidfdOpen(int pid) {
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
}
}  // namespace

void PosixProcessLauncher::watchExit(int pid) {
  // Only here, before the loop runs again, can the pid not have been reaped and reused.
  const int fd = pidfdOpen(pid);
  if (fd < 0) return;  // no pidfd (before Linux 5.3): the supervisor's reap bound still holds
  auto& child = children_[pid];
  child.pidfd = std::make_unique<boost::asio::posix::stream_descriptor>(io_, fd);
  child.pidfd->async_wait(
      boost::asio::posix::stream_descriptor::wait_read,
      [this, pid](const boost::system::error_code& ec) {
        if (ec) return;  // reaped (the descriptor closed) or the launcher is going
        auto it = children_.find(pid);
        if (it == children_.end()) return;
        it->second.hand_over = std::make_unique<boost::asio::steady_timer>(io_, kHandOver);
        it->second.hand_over->async_wait([this, pid](const boost::system::error_code& ec2) {
          if (ec2) return;
          auto c = children_.find(pid);
          if (c == children_.end()) return;
          logger("agent")->error(
              "worker pid {} exited, but its guardian process (pid {}) did not hand it over "
              "within {} s (stopped?); killing the guardian",
              pid, c->second.guardian,
              std::chrono::duration_cast<std::chrono::seconds>(kHandOver).count());
          ::kill(c->second.guardian, SIGKILL);
        });
      });
}

void PosixProcessLauncher::forceEnd(int pid) {
  loop_.check();
  auto it = children_.find(pid);
  if (it != children_.end()) {
    ::kill(it->second.guardian, SIGKILL);
    children_.erase(it);  // its late exit is reaped as anyone's
  }
  ::kill(-pid, SIGKILL);
}

void PosixProcessLauncher::watchExits(ExitCallback on_exit, std::function<void()> after) {
  on_exit_ = std::move(on_exit);
  after_exits_ = std::move(after);
  waitForExits();
}

void PosixProcessLauncher::waitForExits() {
  sigchld_.async_wait([this](const boost::system::error_code& ec, int) {
    if (ec) return;
    reap();
    waitForExits();
  });
}

void PosixProcessLauncher::reap() {
  loop_.check();
  while (true) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) break;
    children_.erase(pid);
    if (WIFSIGNALED(status)) {
      on_exit_(pid, ExitStatus{true, WTERMSIG(status)});
    } else if (WIFEXITED(status)) {
      on_exit_(pid, ExitStatus{false, WEXITSTATUS(status)});
    }
  }
  if (after_exits_) after_exits_();
}

void PosixProcessLauncher::signalGroup(int pid, int sig) {
  loop_.check();
  if (::kill(-pid, sig) != 0 && errno == ESRCH) ::kill(pid, sig);
}

Status PosixProcessLauncher::addTee(int read_fd, const std::string& file, int console_fd,
                                    const std::string& prefix, const LineFilter& filter) {
  auto s = std::make_shared<TeeStream>(io_);
  s->file_fd = file.empty() ? -1 : openLog(file);
  if (!file.empty() && s->file_fd < 0) {
    ::close(read_fd);
    return internalError("cannot open " + file + ": " + errnoText(errno));
  }
  if (!filter.file.empty()) {
    s->filter_fd = openShared(filter.file);
    if (s->filter_fd < 0) {
      const int err = errno;
      ::close(read_fd);
      if (s->file_fd >= 0) ::close(s->file_fd);
      return internalError("cannot open " + filter.file + ": " + errnoText(err));
    }
    s->needles = filter.needles;
  }
  s->console_fd = console_fd;
  s->prefix = prefix;
  s->pipe.assign(read_fd);
  s->pipe.non_blocking(true);
  streams_.push_back(s);
  readMore(s);
  return Status::ok();
}

void PosixProcessLauncher::readMore(const std::shared_ptr<TeeStream>& s) {
  s->pipe.async_read_some(boost::asio::buffer(s->buf),
                          [this, s](const boost::system::error_code& ec, size_t n) {
                            if (n > 0) consume(*s, s->buf.data(), n);
                            if (ec) {
                              closeStream(*s);
                              return;
                            }
                            readMore(s);
                          });
}

void PosixProcessLauncher::consume(TeeStream& s, const char* data, size_t n) {
  if (s.file_fd >= 0) writeAll(s.file_fd, data, n);
  if (s.console_fd < 0 && s.filter_fd < 0) return;
  s.partial.append(data, n);
  emitLines(s, /*flush=*/false);
}

void PosixProcessLauncher::emitLines(TeeStream& s, bool flush) {
  std::string console, filtered;
  auto emit = [&](std::string_view line) {  // without its newline
    if (s.console_fd >= 0) {
      console += s.prefix;
      console.append(line);
      console += '\n';
    }
    if (s.filter_fd >= 0 && containsAny(line, s.needles)) {
      filtered += s.prefix;
      filtered.append(line);
      filtered += '\n';
    }
  };
  const std::string_view text(s.partial);
  size_t start = 0;
  for (size_t nl; (nl = text.find('\n', start)) != std::string_view::npos; start = nl + 1) {
    emit(text.substr(start, nl - start));
  }
  for (; text.size() - start >= kMaxLineBytes; start += kMaxLineBytes) {
    emit(text.substr(start, kMaxLineBytes));
  }
  if (flush && start < text.size()) {
    emit(text.substr(start));
    start = text.size();
  }
  s.partial.erase(0, start);
  if (!console.empty()) writeAll(s.console_fd, console.data(), console.size());
  if (!filtered.empty()) writeAll(s.filter_fd, filtered.data(), filtered.size());
}

void PosixProcessLauncher::closeStream(TeeStream& s) {
  if (!s.open) return;
  s.open = false;
  emitLines(s, /*flush=*/true);
  boost::system::error_code ignored;
  s.pipe.close(ignored);
  for (int* fd : {&s.file_fd, &s.filter_fd}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

void PosixProcessLauncher::drainAll() {
  for (auto& s : streams_) {
    if (!s->open) continue;
    const int fd = s->pipe.native_handle();
    while (true) {
      ssize_t n = ::read(fd, s->buf.data(), s->buf.size());
      if (n > 0) {
        consume(*s, s->buf.data(), static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      break;  // EOF, or EAGAIN: a grandchild still holds the pipe; stop here
    }
    closeStream(*s);
  }
  streams_.clear();
}

}  // namespace ddprun::agent
