// Helpers for tests that drive real processes: start a program with its output in files (or one
// log), wait for it (or for a condition) with a bound, signal it, kill it on destruction so no test
// leaves a process behind, inspect /proc, find a free port. Header-only; used from the test's own
// thread. Shared by the launcher, slurm and worker_sdk tests.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ddprun::testing {

inline std::string envOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

// Where the build put the binaries and where the sources are: compiled in by the test's CMake
// (DDPRUN_TEST_BUILD_DIR / DDPRUN_TEST_SOURCE_DIR); the environment may override them.
#ifndef DDPRUN_TEST_BUILD_DIR
#define DDPRUN_TEST_BUILD_DIR "build"
#endif
#ifndef DDPRUN_TEST_SOURCE_DIR
#define DDPRUN_TEST_SOURCE_DIR "."
#endif
inline std::string buildDir() { return envOr("DDPRUN_BUILD_DIR", DDPRUN_TEST_BUILD_DIR); }
inline std::string sourceDir() { return envOr("DDPRUN_SOURCE_DIR", DDPRUN_TEST_SOURCE_DIR); }
inline std::string ddprunBin() { return buildDir() + "/launcher/ddprun"; }
inline std::string testWorkerBin() { return buildDir() + "/tests/agent/ddprun_test_worker"; }
// The Python with torch (plain python3 on PATH may lack it).
inline std::string torchPython() { return envOr("PYTHON_EXEC", "/usr/bin/python3"); }

inline std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline bool fileExists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

inline bool isDirectory(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// A fresh directory, removed with its contents when the object goes away.
class TempDir {
 public:
  TempDir() : TempDir(envOr("TMPDIR", "/tmp")) {}
  explicit TempDir(const std::string& base) {
    std::string templ = base + "/ddprun_test_XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = buf.data();
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Polls `pred` until it holds or `bound` passes; true when it held.
inline bool waitUntil(const std::function<bool()>& pred,
                      std::chrono::milliseconds bound = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  while (true) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Alive and not a zombie.
inline bool pidAlive(int pid) {
  if (::kill(pid, 0) != 0) return false;
  std::string stat = readFile("/proc/" + std::to_string(pid) + "/stat");
  auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return false;
  return stat[close + 2] != 'Z';
}

// Direct children of `pid` (all its threads).
inline std::vector<int> childPids(int pid) {
  std::vector<int> out;
  const std::string task_dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* dir = ::opendir(task_dir.c_str());
  if (dir == nullptr) return out;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::istringstream in(readFile(task_dir + "/" + e->d_name + "/children"));
    int child;
    while (in >> child) out.push_back(child);
  }
  ::closedir(dir);
  return out;
}

// The workers of a running ddprun: each is the child of a guardian process the agent forked for
// it (agent/src/worker_guardian.h), so a grandchild of the agent.
inline std::vector<int> workerPids(int agent_pid) {
  std::vector<int> out;
  for (int guardian : childPids(agent_pid)) {
    for (int worker : childPids(guardian)) out.push_back(worker);
  }
  return out;
}

struct Finished {
  int exit_code = -1;  // exit status, or 128+signal when killed
  std::string out;
  std::string err;
};

// How Process starts a program; the defaults suit the launcher tests.
struct ProcessOptions {
  // When set, stdout and stderr both go to this one file (interleaved as written); otherwise to
  // separate files in a temp dir of the Process.
  std::string log_path;
  // In a process group of its own, so that destroying the Process also kills what it started
  // (a launcher's workers).
  bool own_process_group = false;
};

// A program started with stdout and stderr captured in files; killed (SIGKILL) and reaped on
// destruction if it is still running.
class Process {
 public:
  Process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {},
          const ProcessOptions& options = {})
      : out_path_(options.log_path.empty() ? dir_ / "stdout" : options.log_path),
        err_path_(options.log_path.empty() ? dir_ / "stderr" : options.log_path),
        own_group_(options.own_process_group) {
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      if (own_group_) ::setpgid(0, 0);
      int out = ::open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      int err = out_path_ == err_path_
                    ? out
                    : ::open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      int in = ::open("/dev/null", O_RDONLY);
      ::dup2(out, 1);
      ::dup2(err, 2);
      ::dup2(in, 0);
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      ::_exit(127);
    }
  }
  ~Process() {
    if (!finished_) {
      if (own_group_) ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);
      int st;
      ::waitpid(pid_, &st, 0);
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  int pid() const { return pid_; }
  void signal(int sig) { ::kill(pid_, sig); }
  std::string out() const { return readFile(out_path_); }
  std::string err() const { return readFile(err_path_); }
  // Everything it printed: the one log with ProcessOptions::log_path, else stdout then stderr.
  std::string output() const { return out_path_ == err_path_ ? out() : out() + err(); }

  // Waits up to `bound`; nullopt (and the process is still running) on timeout.
  std::optional<Finished> wait(std::chrono::milliseconds bound = std::chrono::seconds(120)) {
    if (!finished_) {
      bool done = waitUntil(
          [&] {
            int st;
            pid_t r = ::waitpid(pid_, &st, WNOHANG);
            if (r == pid_) {
              finished_ = true;
              code_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
            }
            return finished_;
          },
          bound);
      if (!done) return std::nullopt;
    }
    return Finished{code_, out(), err()};
  }
  // The exit code alone (128+signal when killed), or nullopt if still running after `bound`.
  std::optional<int> waitExit(std::chrono::milliseconds bound = std::chrono::seconds(120)) {
    auto f = wait(bound);
    if (!f) return std::nullopt;
    return f->exit_code;
  }

 private:
  TempDir dir_;
  std::string out_path_, err_path_;
  bool own_group_ = false;
  int pid_ = -1;
  bool finished_ = false;
  int code_ = -1;
};

// Runs to completion (bounded) and returns what it printed.
inline Finished run(const std::vector<std::string>& argv,
                    const std::map<std::string, std::string>& env = {},
                    std::chrono::milliseconds bound = std::chrono::seconds(120)) {
  Process p(argv, env);
  auto f = p.wait(bound);
  if (!f) throw std::runtime_error("timed out: " + argv.at(0));
  return *f;
}

// A TCP port that no socket holds, on any address, and that no other test process is handed.
// Bound to port 0 and released, a port comes from the kernel's ephemeral range, which every
// connect() draws its local port from too: one of the suite's many connections could take it
// before the test's server binds it (a rendezvous host that finds its port taken waits out
// join_timeout as a client). So the port comes from below that range, where only explicit
// binds land, and an flock on /tmp/ddprun-test-ports/<port>, held until this process exits,
// keeps concurrent test processes (ctest -j) and this one's later calls off it.
inline int freePort() {
  int ephemeral_low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> ephemeral_low;
  // Below 28672: the suite's fixed ports (29400, 29500, 29555, ...) lie above it. The Python and
  // shell parts take theirs below 16384 (tests/support/free_ports.py).
  const int hi = std::min(ephemeral_low, 28672), lo = std::max(1024, hi - 12288);
  const std::string dir = "/tmp/ddprun-test-ports";
  ::mkdir(dir.c_str(), 0777);
  ::chmod(dir.c_str(), 0777);
  const int span = hi - lo;
  const int first = static_cast<int>(std::random_device{}() % static_cast<unsigned>(span));
  for (int i = 0; i < span; ++i) {
    const int port = lo + (first + i) % span;
    const std::string lock = dir + "/" + std::to_string(port);
    const int lock_fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (lock_fd < 0) continue;
    if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(lock_fd);
      continue;
    }
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (fd >= 0) ::close(fd);
    if (free) return port;  // lock_fd stays open: the port is this process's until it exits
    ::close(lock_fd);
  }
  throw std::runtime_error("freePort: no free port in [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + ")");
}

// Whether torchPython() can import torch.distributed (tests that need it skip otherwise).
inline bool torchAvailable() {
  return run({torchPython(), "-c", "import torch.distributed"}, {}, std::chrono::seconds(60))
             .exit_code == 0;
}

// "NAME=value" lines (a worker's --env-out file) as a map.
inline std::map<std::string, std::string> parseEnvFile(const std::string& text) {
  std::map<std::string, std::string> env;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    auto eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return env;
}

// The last `n` lines of `text`.
inline std::string lastLines(const std::string& text, size_t n) {
  size_t at = text.size();
  if (at > 0 && text[at - 1] == '\n') --at;
  while (n > 0 && at > 0) {
    at = text.rfind('\n', at - 1);
    if (at == std::string::npos) return text;
    --n;
  }
  return n == 0 ? text.substr(at + 1) : text;
}

// "pid P (name) state S, waits in W": what a process is doing, from /proc.
inline std::string procSummary(int pid) {
  const std::string dir = "/proc/" + std::to_string(pid);
  const std::string stat = readFile(dir + "/stat");
  const auto open = stat.find('('), close = stat.rfind(')');
  if (open == std::string::npos || close == std::string::npos || close + 2 >= stat.size()) {
    return "pid " + std::to_string(pid) + " gone";
  }
  return "pid " + std::to_string(pid) + " " + stat.substr(open, close - open + 1) + " state " +
         stat[close + 2] + ", waits in " + readFile(dir + "/wchan");
}

// For the failure message of a test whose launcher `p` did not finish within `waited`: the states
// of the launcher and its workers; where each Python worker's threads were (the launcher stopped,
// each is sent SIGABRT: started with PYTHONFAULTHANDLER=1, it prints them); then the last lines
// the launcher printed before.
inline std::string stuckReport(const Process& p, const std::string& name,
                               std::chrono::seconds waited, size_t lines = 30) {
  std::ostringstream r;
  r << name << " did not finish within " << waited.count() << " s: " << procSummary(p.pid());
  const auto workers = workerPids(p.pid());
  if (workers.empty()) r << "; no workers";
  for (int w : workers) r << "\n  worker " << procSummary(w);
  const std::string before = p.err();
  std::string seen = before;
  // Stopped, the launcher does not stop the other workers when the first one dies.
  ::kill(p.pid(), SIGSTOP);
  for (int w : workers) {
    // One at a time: their tracebacks would interleave on the one stderr.
    if (readFile("/proc/" + std::to_string(w) + "/cmdline").find("python") == std::string::npos ||
        ::kill(w, SIGABRT) != 0) {
      continue;
    }
    waitUntil([&] { return !pidAlive(w); }, std::chrono::seconds(2));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // its last lines relayed
    const std::string now = p.err();
    std::istringstream in(now.size() > seen.size() ? now.substr(seen.size()) : "");
    seen = now;
    r << "\nwhere the threads of Python worker " << w << " were (SIGABRT):";
    size_t shown = 0;
    for (std::string line; std::getline(in, line) && shown < lines;) {
      if (line.find("File \"") != std::string::npos || line.find("hread 0x") != std::string::npos) {
        r << "\n" << line;
        ++shown;
      }
    }
  }
  ::kill(p.pid(), SIGCONT);
  r << "\nthe last lines of its stdout:\n"
    << lastLines(p.out(), lines / 3) << "\nthe last lines of its stderr:\n"
    << lastLines(before, lines) << "\n";
  return r.str();
}

// Whether process `pid` holds an established TCP connection to `remote_port` (read from /proc:
// its socket descriptors' inodes, looked up in /proc/net/tcp and tcp6, where IPv4 peers of a
// dual-stack socket are).
inline bool hasConnectionTo(int pid, int remote_port) {
  std::vector<std::string> inodes;
  const std::string fds = "/proc/" + std::to_string(pid) + "/fd";
  if (DIR* d = opendir(fds.c_str())) {
    while (dirent* e = readdir(d)) {
      char target[128] = {};
      const std::string link = fds + "/" + e->d_name;
      const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
      const std::string t(target, n > 0 ? static_cast<size_t>(n) : 0);
      if (t.rfind("socket:[", 0) == 0) inodes.push_back(t.substr(8, t.size() - 9));
    }
    closedir(d);
  }
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream tcp(table);
    std::string line;
    std::getline(tcp, line);  // the header
    while (std::getline(tcp, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      const size_t colon = remote.rfind(':');
      if (colon == std::string::npos || state != "01") continue;  // 01: ESTABLISHED
      if (std::stoi(remote.substr(colon + 1), nullptr, 16) != remote_port) continue;
      if (std::find(inodes.begin(), inodes.end(), inode) != inodes.end()) return true;
    }
  }
  return false;
}

inline int countOf(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t p = 0; (p = haystack.find(needle, p)) != std::string::npos; p += needle.size()) ++n;
  return n;
}

}  // namespace ddprun::testing
