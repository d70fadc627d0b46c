#include "control_client.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "ddprun/common/log_text.h"
#include "ddprun/worker/errors.h"

namespace ddprun::worker {

namespace {

using Clock = std::chrono::steady_clock;

std::string errnoText() { return std::strerror(errno); }

// Reads until `buffer` holds a complete line or the deadline passes; returns the line (without
// '\n') and leaves the rest in `buffer`. Throws CommError naming `path` on EOF, error, timeout or
// an over-long line.
std::string readLine(int fd, std::string& buffer, Clock::time_point deadline,
                     const std::string& path) {
  for (;;) {
    const auto eol = buffer.find('\n');
    if (eol != std::string::npos) {
      std::string line = buffer.substr(0, eol);
      buffer.erase(0, eol + 1);
      return line;
    }
    if (buffer.size() > ddprun::kMaxControlLine) {
      throw CommError("control channel " + path + ": the agent sent a line over " +
                      std::to_string(ddprun::kMaxControlLine) + " bytes");
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      throw CommError("control channel " + path + ": no welcome from the agent in time");
    }
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), 1000)));
    if (ready < 0 && errno != EINTR)
      throw CommError("control channel " + path + ": " + errnoText());
    if (ready <= 0) continue;
    char chunk[1024];
    const ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
    if (n == 0) throw CommError("control channel " + path + ": the agent hung up");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw CommError("control channel " + path + ": " + errnoText());
    }
    buffer.append(chunk, static_cast<size_t>(n));
  }
}

void sendAll(int fd, const std::string& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the agent is gone: the reader sees it
    off += static_cast<size_t>(n);
  }
}

}  // namespace

std::unique_ptr<ControlClient> ControlClient::connect(const std::string& path,
                                                      std::chrono::milliseconds timeout,
                                                      AbortHandler on_abort) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    throw ConfigError("DDPRUN_CONTROL_SOCKET='" + path.substr(0, 200) +
                      "' is not a usable path (1 to " + std::to_string(sizeof(addr.sun_path) - 1) +
                      " bytes)");
  }
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw CommError("control channel: socket: " + errnoText());
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const std::string why = errnoText();
    ::close(fd);
    throw CommError("cannot connect to the agent's control channel " + path +
                    " (DDPRUN_CONTROL_SOCKET): " + why);
  }
  std::string buffer;
  try {
    sendAll(fd, ddprun::formatControlLine(
                    ddprun::makeControl(ddprun::ControlType::kHello,
                                        {{"v", std::to_string(ddprun::kControlProtocolVersion)},
                                         {"pid", std::to_string(::getpid())},
                                         {"caps", ""}})));
    const std::string line = readLine(fd, buffer, Clock::now() + timeout, path);
    auto welcome = ddprun::parseControlLine(line);
    if (!welcome.isOk() || welcome->type != ddprun::ControlType::kWelcome) {
      throw CommError("control channel " + path + ": expected a welcome from the agent, got " +
                      (welcome.isOk() ? std::string(ddprun::controlTypeName(welcome->type))
                                      : welcome.status().message()));
    }
    return std::unique_ptr<ControlClient>(
        new ControlClient(fd, static_cast<int>(welcome->num("gen")),
                          std::chrono::milliseconds(welcome->num("timeout_ms")), path,
                          std::move(buffer), std::move(on_abort)));
  } catch (...) {
    ::close(fd);
    throw;
  }
}

ControlClient::ControlClient(int fd, int generation, std::chrono::milliseconds timeout,
                             std::string path, std::string pending, AbortHandler on_abort)
    : fd_(fd),
      welcome_generation_(generation),
      recovery_timeout_(timeout),
      path_(std::move(path)),
      pending_(std::move(pending)),
      on_abort_(std::move(on_abort)),
      reader_([this] { readLoop(); }) {}

ControlClient::~ControlClient() {
  ::shutdown(fd_, SHUT_RDWR);  // the reader's recv returns 0
  reader_.join();
  ::close(fd_);
}

void ControlClient::send(const ddprun::ControlMessage& message) {
  const std::string line = ddprun::formatControlLine(message);
  ddprun::MutexLock lock(send_mu_);
  sendAll(fd_, line);
}

void ControlClient::readLoop() {
  for (;;) {
    std::string line;
    try {
      line = readLine(fd_, pending_, Clock::time_point::max(), path_);
    } catch (const std::exception& e) {
      closeWith(e.what());
      return;
    }
    onLine(line);
  }
}

void ControlClient::onLine(const std::string& line) {
  auto message = ddprun::parseControlLine(line);
  if (!message.isOk()) {
    closeWith("control channel " + path_ + ": " + message.status().message());
    ::shutdown(fd_, SHUT_RDWR);
    return;
  }
  if (message->type == ddprun::ControlType::kAbort) {
    const int gen = static_cast<int>(message->num("gen"));
    {
      ddprun::MutexLock lock(mu_);
      if (gen <= aborted_generation_) return;
      aborted_generation_ = gen;
    }
    cv_.notify_all();
    if (on_abort_) on_abort_(gen, message->str("reason"));
    return;
  }
  if (message->type == ddprun::ControlType::kGroup) {
    {
      ddprun::MutexLock lock(mu_);
      if (!group_ || group_->num("gen") < message->num("gen")) group_ = *message;
    }
    cv_.notify_all();
  }
  // Other types are the worker's own to send: ignored.
}

void ControlClient::closeWith(const std::string& why) {
  {
    ddprun::MutexLock lock(mu_);
    if (closed_.empty()) closed_ = why.empty() ? "closed" : why;
  }
  cv_.notify_all();
  static const ddprun::TextLogger log("worker");
  DDPRUN_LOG(log, kDebug, "control channel ended: " << why);
}

std::optional<ddprun::ControlMessage> ControlClient::waitGroup(
    int after, std::chrono::milliseconds timeout, const std::function<bool()>& keep_waiting) {
  const auto deadline = Clock::now() + timeout;
  ddprun::MutexLock lock(mu_);
  for (;;) {
    // A stop asked for first: this rank leaves with the last step it completed rather than join a
    // group only to leave it at the next step (its agent replaces it in this recovery).
    if (keep_waiting && !keep_waiting()) return std::nullopt;
    if (group_ && group_->num("gen") > after) return group_;
    if (!closed_.empty()) {
      throw CommError(
          "in-place recovery: the agent's control channel closed before the new group "
          "came (" +
          closed_ + ")");
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      throw CommError("in-place recovery: no new group from the agent within " +
                      std::to_string(timeout.count()) + " ms (--rdzv-conf inplace_timeout)");
    }
    cv_.wait_until(mu_, std::min(deadline, now + std::chrono::milliseconds(100)));
  }
}

bool ControlClient::waitAbort(int gen, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  ddprun::MutexLock lock(mu_);
  while (aborted_generation_ < gen) {
    if (cv_.wait_until(mu_, deadline) == std::cv_status::timeout) return aborted_generation_ >= gen;
  }
  return true;
}

int ControlClient::abortedGeneration() const {
  ddprun::MutexLock lock(mu_);
  return aborted_generation_;
}

}  // namespace ddprun::worker
