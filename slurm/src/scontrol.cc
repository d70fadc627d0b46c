#include "ddprun/slurm/scontrol.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "ddprun/common/strings.h"

extern char** environ;

namespace ddprun::slurm {
namespace {

struct Output {
  int exit_code = -1;  // 128+signal when killed
  std::string out;
  std::string err;
};

void closeFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// Runs argv (PATH lookup) with stdin from /dev/null; collects stdout and stderr; kills it past
// `timeout`.
StatusOr<Output> runCaptured(const std::vector<std::string>& argv,
                             std::chrono::milliseconds timeout) {
  int out_pipe[2] = {-1, -1};
  int err_pipe[2] = {-1, -1};
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) {
    closeFd(out_pipe[0]);
    closeFd(out_pipe[1]);
    return internalError(std::string("pipe: ") + std::strerror(errno));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], 1);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  closeFd(out_pipe[1]);
  closeFd(err_pipe[1]);
  if (rc != 0) {
    closeFd(out_pipe[0]);
    closeFd(err_pipe[0]);
    if (rc == ENOENT) return notFound("'" + argv[0] + "' not found on PATH");
    return unavailable("cannot run '" + argv[0] + "': " + std::strerror(rc));
  }

  Output result;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool timed_out = false;
  int fds[2] = {out_pipe[0], err_pipe[0]};
  std::string* sinks[2] = {&result.out, &result.err};
  while (fds[0] >= 0 || fds[1] >= 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd pfds[2];
    nfds_t n = 0;
    int which[2];
    for (int k = 0; k < 2; ++k) {
      if (fds[k] < 0) continue;
      pfds[n] = pollfd{fds[k], POLLIN, 0};
      which[n++] = k;
    }
    const int ready = ::poll(pfds, n, static_cast<int>(left.count()));
    if (ready < 0 && errno != EINTR) break;
    for (nfds_t j = 0; ready > 0 && j < n; ++j) {
      if (pfds[j].revents == 0) continue;
      char buf[4096];
      const ssize_t got = ::read(pfds[j].fd, buf, sizeof buf);
      if (got > 0) {
        sinks[which[j]]->append(buf, static_cast<size_t>(got));
      } else if (got == 0 || errno != EINTR) {
        closeFd(fds[which[j]]);
      }
    }
  }
  closeFd(fds[0]);
  closeFd(fds[1]);
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) {
    return deadlineExceeded("'" + join(argv, " ") + "' did not finish within " +
                            std::to_string(timeout.count()) + " ms");
  }
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

}  // namespace

StatusOr<std::string> parseNodeAddr(const std::string& scontrol_output,
                                    const std::string& node_name) {
  for (const auto& line : split(scontrol_output, '\n')) {
    bool ours = false;
    std::string addr;
    for (const auto& field : split(trim(line), ' ')) {
      if (field == "NodeName=" + node_name) ours = true;
      if (startsWith(field, "NodeAddr=")) addr = field.substr(9);
    }
    if (!ours) continue;
    if (addr.empty() || addr == "(null)") {
      return invalidArgument("scontrol shows no NodeAddr for node '" + node_name + "'");
    }
    return addr;
  }
  return invalidArgument("scontrol output has no line for node '" + node_name + "'");
}

AddressLookup scontrolAddressLookup(const ScontrolOptions& options) {
  return [options](const std::string& node) -> StatusOr<std::string> {
    const std::vector<std::string> argv = {options.scontrol, "show", "node", "-o", node};
    auto ran = runCaptured(argv, options.timeout);
    const std::string context = "looking up the address of Slurm node '" + node + "'";
    if (!ran.isOk()) return ran.status().withContext(context);
    if (ran->exit_code != 0) {
      return unavailable("'" + join(argv, " ") + "' exited with " + std::to_string(ran->exit_code) +
                         ": " + trim(ran->err))
          .withContext(context);
    }
    return parseNodeAddr(ran->out, node);
  };
}

}  // namespace ddprun::slurm
