#include "posix_process_launcher.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>

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

std::string errnoText(int err) { return std::strerror(err); }

}  // namespace

PosixProcessLauncher::~PosixProcessLauncher() {
  for (auto& s : streams_) closeStream(*s);
}

StatusOr<int> PosixProcessLauncher::spawn(const WorkerLaunch& launch) {
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
  auto pid = spawnGuardedWorker(GuardedExec{argv.data(), envp.data(), child_out, child_err});
  if (child_out >= 0) ::close(child_out);
  if (child_err >= 0) ::close(child_err);
  if (!pid.isOk()) {
    if (tee_out_read >= 0) ::close(tee_out_read);
    if (tee_err_read >= 0) ::close(tee_err_read);
    return pid.status();
  }

  const int out_console = launch.to_console ? STDOUT_FILENO : -1;
  const int err_console = launch.to_console ? STDERR_FILENO : -1;
  if (tee_out_read >= 0) {
    DDPRUN_RETURN_IF_ERROR(
        addTee(tee_out_read, launch.stdout_file, out_console, launch.console_prefix));
  }
  if (tee_err_read >= 0) {
    DDPRUN_RETURN_IF_ERROR(
        addTee(tee_err_read, launch.stderr_file, err_console, launch.console_prefix));
  }
  return *pid;
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
  while (true) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) break;
    if (WIFSIGNALED(status)) {
      on_exit_(pid, ExitStatus{true, WTERMSIG(status)});
    } else if (WIFEXITED(status)) {
      on_exit_(pid, ExitStatus{false, WEXITSTATUS(status)});
    }
  }
  if (after_exits_) after_exits_();
}

void PosixProcessLauncher::signalGroup(int pid, int sig) {
  if (::kill(-pid, sig) != 0 && errno == ESRCH) ::kill(pid, sig);
}

Status PosixProcessLauncher::addTee(int read_fd, const std::string& file, int console_fd,
                                    const std::string& prefix) {
  auto s = std::make_shared<TeeStream>(io_);
  s->file_fd = file.empty() ? -1 : openLog(file);
  if (!file.empty() && s->file_fd < 0) {
    ::close(read_fd);
    return internalError("cannot open " + file + ": " + errnoText(errno));
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
  if (s.console_fd < 0) return;
  s.partial.append(data, n);
  size_t start = 0;
  std::string out;
  for (size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    out += s.prefix;
    out.append(s.partial, start, nl - start + 1);
  }
  s.partial.erase(0, start);
  if (!out.empty()) writeAll(s.console_fd, out.data(), out.size());
}

void PosixProcessLauncher::closeStream(TeeStream& s) {
  if (!s.open) return;
  s.open = false;
  if (s.console_fd >= 0 && !s.partial.empty()) {
    std::string out = s.prefix + s.partial + "\n";
    writeAll(s.console_fd, out.data(), out.size());
    s.partial.clear();
  }
  boost::system::error_code ignored;
  s.pipe.close(ignored);
  if (s.file_fd >= 0) ::close(s.file_fd);
  s.file_fd = -1;
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
