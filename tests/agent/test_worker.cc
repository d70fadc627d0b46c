// ddprun_test_worker: a worker program whose behaviour the integration tests choose by flag.
//   --exit-code N            exit with N (after everything else); default 0
//   --only-rank R            --exit-code applies to RANK R only (others exit 0)
//   --fail-until-restart K   --exit-code applies only while TORCHELASTIC_RESTART_COUNT < K
//   --sleep S                sleep S seconds before exiting (not when --exit-code applies
//                            and --fail-fast is given)
//   --fail-fast              a rank whose --exit-code applies exits at once
//   --wait-for FILE          before anything else, wait (up to 60 s) until FILE exists
//   --ignore-sigterm         ignore SIGTERM
//   --on-signal-exit N       on TERM/INT/HUP/QUIT/USR1: record it in --state-dir, exit N
//   --state-dir D            write D/pid.<RANK>.<RESTART> once started, D/sig.<RANK>.<SIG> on
//   signals
//   --env-out D              write the environment to D/env.<RANK> ("NAME=value" lines, sorted)
//   --write-error-file MSG   write torchrun's error JSON with MSG to TORCHELASTIC_ERROR_FILE
//   --print TEXT / --eprint TEXT   a line on stdout / stderr
//   --hang-after-heartbeats N   where --only-rank and --fail-until-restart apply: touch
//                            DDPRUN_HEARTBEAT_FILE N times, 20 ms apart (exit 3 when it is
//                            unset), then never exit until a signal ends it
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

std::string g_state_dir;
int g_signal_exit = -1;
std::string g_rank = "0";

std::string envOr(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

void writeFileAtomic(const std::string& path, const std::string& content) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << content;
  }
  std::rename(tmp.c_str(), path.c_str());
}

void onSignal(int sig) {
  if (!g_state_dir.empty()) {
    std::string path = g_state_dir + "/sig." + g_rank + "." + std::to_string(sig);
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) ::close(fd);
  }
  ::_exit(g_signal_exit);
}

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  int only_rank = -1;
  int fail_until_restart = -1;
  double sleep_s = 0;
  bool ignore_sigterm = false;
  bool fail_fast = false;
  int hang_after_heartbeats = -1;
  std::string env_out, error_msg, wait_for;
  std::vector<std::pair<bool, std::string>> prints;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "test_worker: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--exit-code")
      exit_code = std::atoi(next().c_str());
    else if (a == "--only-rank")
      only_rank = std::atoi(next().c_str());
    else if (a == "--fail-until-restart")
      fail_until_restart = std::atoi(next().c_str());
    else if (a == "--sleep")
      sleep_s = std::atof(next().c_str());
    else if (a == "--ignore-sigterm")
      ignore_sigterm = true;
    else if (a == "--fail-fast")
      fail_fast = true;
    else if (a == "--wait-for")
      wait_for = next();
    else if (a == "--on-signal-exit")
      g_signal_exit = std::atoi(next().c_str());
    else if (a == "--state-dir")
      g_state_dir = next();
    else if (a == "--env-out")
      env_out = next();
    else if (a == "--write-error-file")
      error_msg = next();
    else if (a == "--hang-after-heartbeats")
      hang_after_heartbeats = std::atoi(next().c_str());
    else if (a == "--print")
      prints.push_back({false, next()});
    else if (a == "--eprint")
      prints.push_back({true, next()});
    else {
      std::fprintf(stderr, "test_worker: unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  g_rank = envOr("RANK", "0");
  const int rank = std::atoi(g_rank.c_str());
  const int restart = std::atoi(envOr("TORCHELASTIC_RESTART_COUNT", "0").c_str());

  if (ignore_sigterm) std::signal(SIGTERM, SIG_IGN);
  if (g_signal_exit >= 0) {
    for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1}) std::signal(sig, onSignal);
  }
  if (!env_out.empty()) {
    std::vector<std::string> lines;
    for (char** e = environ; *e != nullptr; ++e) lines.emplace_back(*e);
    std::sort(lines.begin(), lines.end());
    std::string all;
    for (const auto& l : lines) all += l + "\n";
    writeFileAtomic(env_out + "/env." + g_rank, all);
  }
  for (const auto& [err, text] : prints) {
    std::fprintf(err ? stderr : stdout, "%s\n", text.c_str());
    std::fflush(err ? stderr : stdout);
  }
  if (!g_state_dir.empty()) {
    writeFileAtomic(g_state_dir + "/pid." + g_rank + "." + std::to_string(restart),
                    std::to_string(::getpid()));
  }
  bool applies = (only_rank < 0 || only_rank == rank) &&
                 (fail_until_restart < 0 || restart < fail_until_restart);
  if (hang_after_heartbeats >= 0 && applies) {
    const std::string file = envOr("DDPRUN_HEARTBEAT_FILE", "");
    if (file.empty()) {
      std::fprintf(stderr,
                   "test_worker: --hang-after-heartbeats: DDPRUN_HEARTBEAT_FILE is not set\n");
      return 3;
    }
    for (int i = 0; i < hang_after_heartbeats; ++i) {
      if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
      if (fd < 0 || ::futimens(fd, nullptr) != 0) {
        std::fprintf(stderr, "test_worker: cannot touch %s: %s\n", file.c_str(),
                     std::strerror(errno));
        return 3;
      }
      ::close(fd);
    }
    while (true) ::pause();
  }
  if (!wait_for.empty() && applies) {
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (::access(wait_for.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  if (sleep_s > 0 && !(fail_fast && applies && exit_code != 0)) {
    auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(sleep_s);
    while (std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  int code = applies ? exit_code : 0;
  if (code != 0 && !error_msg.empty()) {
    std::string file = envOr("TORCHELASTIC_ERROR_FILE", "");
    char json[4096];
    std::snprintf(json, sizeof(json),
                  "{\"message\": {\"message\": \"%s\", \"extraInfo\": {\"py_callstack\": "
                  "\"Traceback (test_worker)\\n%s\", \"timestamp\": \"%ld\"}}}",
                  error_msg.c_str(), error_msg.c_str(), static_cast<long>(std::time(nullptr)));
    if (!file.empty()) writeFileAtomic(file, json);
  }
  return code;
}
