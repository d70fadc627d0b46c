#include "worker_guardian.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <initializer_list>
#include <vector>

namespace ddprun::agent {
namespace {

// The guardian's parent-death signal: sent when the agent thread that forked it ends, which need
// not be the agent's death, so it only makes the guardian look at getppid().
constexpr int kParentDeathSignal = SIGUSR1;
// How long the guardian keeps killing descendants that do not die (a process stuck in
// uninterruptible sleep cannot) before it gives up and exits; what is left is reparented to the
// agent, or to init once the agent is gone.
constexpr int64_t kTeardownBoundMs = 10000;

// The guardian's one message to the agent, on the report pipe.
enum Stage : int32_t { kStarted = 0, kExecFailed, kForkFailed, kSetupFailed };
struct Report {
  int32_t worker_pid = 0;
  int32_t stage = kSetupFailed;
  int32_t err = 0;
};

// The agent's side: the lifeline's write end stays open (only here) for the process's life.
struct Lifeline {
  int read_fd = -1;
  int write_fd = -1;
  int err = 0;
  const char* what = "";
};

Lifeline openLifeline() {
  Lifeline l;
  // Orphans of the agent's subtree come to the agent, not to init: this is how a worker's zombie
  // reaches the agent once its guardian is done. The agent's waitpid(-1) loop reaps them all and
  // the supervisor ignores pids it does not know.
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    l.err = errno;
    l.what = "prctl(PR_SET_CHILD_SUBREAPER)";
    return l;
  }
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) {
    l.err = errno;
    l.what = "pipe";
    return l;
  }
  l.read_fd = p[0];
  l.write_fd = p[1];
  return l;
}

// ---- Guardian side: async-signal-safe only from here to the end of runGuardian. ----

int64_t monotonicMs() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

bool parsePid(const char* s, int* out) {
  int v = 0;
  int digits = 0;
  for (; *s != '\0'; ++s, ++digits) {
    if (*s < '0' || *s > '9' || digits == 9) return false;
    v = v * 10 + (*s - '0');
  }
  *out = v;
  return digits > 0;
}

// Calls f(n) for each directory entry of `dir_fd` whose name is a number.
template <typename F>
void forEachNumberedEntry(int dir_fd, F f) {
  alignas(dirent64) char buf[4096];
  while (true) {
    const ssize_t n = ::getdents64(dir_fd, buf, sizeof(buf));
    if (n <= 0) return;
    for (ssize_t off = 0; off < n;) {
      const auto* entry = reinterpret_cast<const dirent64*>(buf + off);
      int value = 0;
      if (parsePid(entry->d_name, &value)) f(value);
      off += entry->d_reclen;
    }
  }
}

}  // namespace

int childrenListed(pid_t self, pid_t* out, int max) {
  char path[64];  // "/proc/<self>/task/<self>/children"
  int len = 0;
  const auto append = [&](const char* text) {
    for (; *text != '\0'; ++text) path[len++] = *text;
  };
  const auto appendSelf = [&] {
    char digits[12];
    int nd = 0;
    for (int v = self; v > 0; v /= 10) digits[nd++] = static_cast<char>('0' + v % 10);
    while (nd > 0) path[len++] = digits[--nd];
  };
  append("/proc/");
  appendSelf();
  append("/task/");
  appendSelf();
  append("/children");
  path[len] = '\0';
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  int count = 0;
  int value = 0;
  bool digit = false;
  char buf[4096];
  while (count < max) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (ssize_t i = 0; i < n && count < max; ++i) {
      if (buf[i] >= '0' && buf[i] <= '9') {
        value = value * 10 + (buf[i] - '0');
        digit = true;
      } else if (digit) {
        out[count++] = value;
        value = 0;
        digit = false;
      }
    }
  }
  if (digit && count < max) out[count++] = value;
  ::close(fd);
  return count;
}

int childrenScanned(pid_t self, pid_t* out, int max) {
  const int proc = ::open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (proc < 0) return 0;
  int count = 0;
  forEachNumberedEntry(proc, [&](int pid) {
    if (count >= max) return;
    char path[24];  // "<pid>/stat"
    char digits[12];
    int nd = 0;
    for (int v = pid; v > 0; v /= 10) digits[nd++] = static_cast<char>('0' + v % 10);
    int len = 0;
    while (nd > 0) path[len++] = digits[--nd];
    for (const char* s = "/stat"; *s != '\0'; ++s) path[len++] = *s;
    path[len] = '\0';
    const int fd = ::openat(proc, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char stat[512];
    const ssize_t n = ::read(fd, stat, sizeof(stat) - 1);
    ::close(fd);
    if (n <= 0) return;
    // "pid (comm) S ppid ...": comm may hold anything, so look after its last ')'.
    ssize_t i = n - 1;
    while (i >= 0 && stat[i] != ')') --i;
    if (i < 0) return;
    i += 4;  // ") S " -> ppid
    int ppid = 0;
    bool any = false;
    for (; i < n && stat[i] >= '0' && stat[i] <= '9'; ++i, any = true) {
      ppid = ppid * 10 + (stat[i] - '0');
    }
    if (any && ppid == self) out[count++] = pid;
  });
  ::close(proc);
  return count;
}

int childrenOf(pid_t self, pid_t* out, int max) {
  const int listed = childrenListed(self, out, max);
  return listed >= 0 ? listed : childrenScanned(self, out, max);
}

namespace {

// Closes what exec would close (FD_CLOEXEC) but for `keep`: the guardian never execs, and must
// not hold the agent's sockets, pipes (another worker's lifeline or tee) or files open for as long
// as the worker runs. The fds it keeps are those the worker would inherit anyway.
void closeCloexecFds(std::initializer_list<int> keep) {
  const int dir = ::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return;
  forEachNumberedEntry(dir, [&](int fd) {
    if (fd <= STDERR_FILENO || fd == dir) return;
    for (int k : keep) {
      if (fd == k) return;
    }
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC) != 0) ::close(fd);
  });
  ::close(dir);
}

// The descriptors a guardian keeps: `keep` (its pipes, the worker's stdout and stderr) and those
// of `inherited` (the agent's without FD_CLOEXEC when it first spawned: what it was started with)
// that still lack FD_CLOEXEC. Everything else is closed by ranges (close_range, Linux 5.9), so a
// guardian's cost does not grow with the agent's descriptors: each one checking every descriptor
// made N workers' start O(N^2) (2048 of them: 2 million fcntl and close calls). Where the kernel
// has no close_range, closeCloexecFds does it descriptor by descriptor.
void closeAllBut(std::initializer_list<int> keep, const int* inherited, int n_inherited) {
  constexpr int kMaxKept = 256;
  if (n_inherited + static_cast<int>(keep.size()) > kMaxKept) return closeCloexecFds(keep);
  int kept[kMaxKept];
  int n = 0;
  for (int fd : keep) {
    if (fd > STDERR_FILENO) kept[n++] = fd;
  }
  for (int i = 0; i < n_inherited; ++i) {
    const int flags = ::fcntl(inherited[i], F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC) == 0) kept[n++] = inherited[i];
  }
  for (int i = 1; i < n; ++i) {  // insertion sort: a handful, and no allocation after fork
    for (int j = i; j > 0 && kept[j - 1] > kept[j]; --j) {
      const int t = kept[j];
      kept[j] = kept[j - 1];
      kept[j - 1] = t;
    }
  }
  unsigned next = STDERR_FILENO + 1;
  for (int i = 0; i <= n; ++i) {
    const unsigned last = i < n ? static_cast<unsigned>(kept[i]) : ~0U;
    if (last > next && ::close_range(next, last == ~0U ? last : last - 1, 0) != 0) {
      return closeCloexecFds(keep);  // ENOSYS: an older kernel
    }
    if (i < n) next = std::max(next, last + 1);
  }
}

void drainSignalfd(int sfd) {
  signalfd_siginfo info[8];
  while (::read(sfd, info, sizeof(info)) > 0) {
  }
}

// SIGKILLs and reaps every child but `keep` (the worker's zombie, or -1), over and over — the
// children of a killed one are reparented to us — until none is left or the bound has passed.
// Each round reads /proc/<pid>/stat of every process; it only runs at the end of a worker.
void killDescendants(pid_t self, pid_t keep, int sfd) {
  const int64_t deadline = monotonicMs() + kTeardownBoundMs;
  while (true) {
    int others = 0;
    pid_t children[256];  // more: the next round takes them
    const int n = childrenOf(self, children, 256);
    for (int c = 0; c < n; ++c) {
      const pid_t pid = children[c];
      if (pid == keep) continue;
      // One we may not signal (it ran a set-user-ID program) is not waited for.
      if (::kill(pid, SIGKILL) == 0 || errno != EPERM) ++others;
      ::waitpid(pid, nullptr, WNOHANG);
    }
    if (others == 0 || monotonicMs() >= deadline) return;
    pollfd p{sfd, POLLIN, 0};
    ::poll(&p, 1, 20);  // the next SIGCHLD, or 20 ms
    drainSignalfd(sfd);
  }
}

void writeReport(int fd, const Report& r) {
  const char* data = reinterpret_cast<const char*>(&r);
  size_t left = sizeof(r);
  while (left > 0) {
    const ssize_t w = ::write(fd, data, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // the agent is gone; the main loop will notice
    data += w;
    left -= static_cast<size_t>(w);
  }
}

[[noreturn]] void failSetup(int report_fd, Stage stage, int err) {
  writeReport(report_fd, Report{0, stage, err});
  ::_exit(127);
}

[[noreturn]] void runGuardian(const GuardedExec& exec, pid_t agent, const Lifeline& lifeline,
                              int report_fd, const std::vector<int>& inherited) {
  ::close(lifeline.write_fd);
  // The agent's handlers must not run here. Every signal stays blocked (the agent blocked them
  // around fork): those the guardian waits for come from a signalfd, and no other one can stop
  // it halfway through cleaning up.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) ::sigaction(sig, &dfl, nullptr);
  const pid_t self = ::getpid();
  // Out of the agent's process group: a Ctrl-C, or a kill of the job's group, is the agent's to
  // handle; the guardian only follows the agent's fate.
  ::setpgid(0, 0);
  ::prctl(PR_SET_NAME, "ddprun-guardian");
  ::prctl(PR_SET_PDEATHSIG, kParentDeathSignal);
  if (::getppid() != agent) ::_exit(0);  // the agent died before prctl: nothing started yet
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) failSetup(report_fd, kSetupFailed, errno);
  closeAllBut({lifeline.read_fd, report_fd, exec.stdout_fd, exec.stderr_fd}, inherited.data(),
              static_cast<int>(inherited.size()));
  sigset_t watched;
  sigemptyset(&watched);
  sigaddset(&watched, SIGCHLD);
  sigaddset(&watched, kParentDeathSignal);
  const int sfd = ::signalfd(-1, &watched, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) failSetup(report_fd, kSetupFailed, errno);
  int exec_pipe[2];
  if (::pipe2(exec_pipe, O_CLOEXEC) != 0) failSetup(report_fd, kSetupFailed, errno);

  const pid_t worker = ::fork();
  if (worker < 0) failSetup(report_fd, kForkFailed, errno);
  if (worker == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != self) ::_exit(127);  // the guardian died before prctl took effect
    if (exec.cpu_affinity != nullptr) ::sched_setaffinity(0, sizeof(cpu_set_t), exec.cpu_affinity);
    if (exec.stdout_fd >= 0) ::dup2(exec.stdout_fd, STDOUT_FILENO);
    if (exec.stderr_fd >= 0) ::dup2(exec.stderr_fd, STDERR_FILENO);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execve(exec.argv[0], exec.argv, exec.envp);
    int err = errno;
    ssize_t ignored = ::write(exec_pipe[1], &err, sizeof(err));
    (void)ignored;
    ::_exit(127);
  }
  ::setpgid(worker, worker);  // also from here, so a signal sent right away reaches the group
  ::close(exec_pipe[1]);
  if (exec.stdout_fd >= 0) ::close(exec.stdout_fd);
  if (exec.stderr_fd >= 0) ::close(exec.stderr_fd);
  int exec_errno = 0;
  ssize_t n;
  do {
    n = ::read(exec_pipe[0], &exec_errno, sizeof(exec_errno));
  } while (n < 0 && errno == EINTR);
  ::close(exec_pipe[0]);
  if (n > 0) {
    ::waitpid(worker, nullptr, 0);
    writeReport(report_fd, Report{worker, kExecFailed, exec_errno});
    ::_exit(127);
  }
  writeReport(report_fd, Report{worker, kStarted, 0});
  ::close(report_fd);

  bool agent_gone = false;
  bool worker_exited = false;
  while (!agent_gone && !worker_exited) {
    pollfd fds[2] = {{lifeline.read_fd, POLLIN, 0}, {sfd, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno != EINTR) {
        const timespec pause{0, 100 * 1000 * 1000};
        ::nanosleep(&pause, nullptr);
      }
      continue;
    }
    if (fds[0].revents != 0) {
      // Nobody writes to the lifeline: it reads EOF once the agent is gone.
      char c;
      const ssize_t r = ::read(lifeline.read_fd, &c, 1);
      if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) agent_gone = true;
    }
    if (fds[1].revents != 0) drainSignalfd(sfd);
    if (::getppid() != agent) agent_gone = true;
    // Reap the orphans that came to us; notice the worker's exit without reaping it.
    while (!worker_exited) {
      siginfo_t info;
      std::memset(&info, 0, sizeof(info));
      if (::waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0) break;
      if (info.si_pid == worker) {
        worker_exited = true;
      } else {
        ::waitpid(info.si_pid, nullptr, WNOHANG);
      }
    }
  }

  ::kill(-worker, SIGKILL);
  if (agent_gone) {
    killDescendants(self, -1, sfd);  // the worker too
    ::_exit(0);
  }
  // The worker is done; so is the rest of its tree. Exiting with the worker's zombie unreaped
  // hands it to the agent (a subreaper), whose waitpid then reports the worker's own pid and
  // status.
  killDescendants(self, worker, sfd);
  ::_exit(0);
}

// The agent's descriptors above stderr without FD_CLOEXEC: what it was started with (its own it
// opens with O_CLOEXEC), for its workers to inherit as they would from torchrun's exec.
std::vector<int> inheritedFds() {
  std::vector<int> out;
  const int dir = ::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return out;
  forEachNumberedEntry(dir, [&](int fd) {
    if (fd <= STDERR_FILENO || fd == dir) return;
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC) == 0) out.push_back(fd);
  });
  ::close(dir);
  return out;
}

}  // namespace

StatusOr<GuardedPids> spawnGuardedWorker(const GuardedExec& exec, int report_within_ms) {
  static const Lifeline lifeline = openLifeline();
  static const std::vector<int> inherited = inheritedFds();
  if (lifeline.err != 0) {
    return internalError(std::string(lifeline.what) + ": " + std::strerror(lifeline.err));
  }
  int report[2];
  if (::pipe2(report, O_CLOEXEC) != 0) {
    return internalError(std::string("pipe: ") + std::strerror(errno));
  }
  // Blocked across fork, so none of the agent's signal handlers can run in the guardian before
  // it has reset them.
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t agent = ::getpid();
  const pid_t guardian = ::fork();
  if (guardian == 0) {
    ::close(report[0]);
    runGuardian(exec, agent, lifeline, report[1], inherited);
  }
  const int fork_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  ::close(report[1]);
  if (guardian < 0) {
    ::close(report[0]);
    return internalError(std::string("fork: ") + std::strerror(fork_errno));
  }
  Report r;
  size_t got = 0;
  bool late = false;
  const int64_t report_by = monotonicMs() + report_within_ms;
  while (got < sizeof(r)) {
    pollfd p{report[0], POLLIN, 0};
    const int64_t left = report_by - monotonicMs();
    const int ready = left > 0 ? ::poll(&p, 1, static_cast<int>(left)) : 0;
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      late = true;
      break;
    }
    const ssize_t n = ::read(report[0], reinterpret_cast<char*>(&r) + got, sizeof(r) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(report[0]);
  if (got == sizeof(r) && r.stage == kStarted) {
    return GuardedPids{static_cast<int>(r.worker_pid), static_cast<int>(guardian)};
  }
  if (late) {
    // Stopped or stuck before it reported: killed (a worker it started dies with it, by its
    // parent-death signal) and reaped.
    ::kill(guardian, SIGKILL);
    int status = 0;
    while (::waitpid(guardian, &status, 0) < 0 && errno == EINTR) {
    }
    return internalError("the worker's guardian process (pid " + std::to_string(guardian) +
                         ") did not start it within " + std::to_string(report_within_ms / 1000) +
                         " s; killed it");
  }

  int status = 0;
  while (::waitpid(guardian, &status, 0) < 0 && errno == EINTR) {
  }
  if (got < sizeof(r))
    return internalError("the worker's guardian process ended before starting it");
  const std::string reason = std::strerror(r.err);
  switch (r.stage) {
    case kExecFailed:
      return failedPrecondition("cannot execute " + std::string(exec.argv[0]) + ": " + reason);
    case kForkFailed:
      return internalError("fork: " + reason);
    default:
      return internalError("starting the worker's guardian: " + reason);
  }
}

}  // namespace ddprun::agent
