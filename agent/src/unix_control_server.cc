#include "unix_control_server.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <array>
#include <boost/asio/write.hpp>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <random>
#include <system_error>
#include <utility>

#include "ddprun/common/control_protocol.h"
#include "ddprun/common/log.h"

namespace ddprun::agent {

namespace {

using Socket = boost::asio::local::stream_protocol::socket;
constexpr std::size_t kMaxSocketPath = 107;  // sun_path holds 108 bytes with the NUL
constexpr std::chrono::milliseconds kAcceptRetry{100};

std::string errnoText(int err) { return std::error_code(err, std::generic_category()).message(); }

std::string randomHex8() {
  std::random_device rd;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  std::uint32_t v = rd();
  for (int i = 0; i < 8; ++i, v >>= 4) out += kHex[v & 15];
  return out;
}

// <base>/ddprun-<uid>: created 0700, or an existing one that is this uid's directory (not a
// symlink) and not writable by group or others, since workers trust what they find there.
Status ensureUserDir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return unavailable("control socket directory " + dir + ": mkdir: " + errnoText(errno));
  }
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    return unavailable("control socket directory " + dir + ": " + errnoText(errno));
  }
  if (!S_ISDIR(st.st_mode)) {
    return failedPrecondition("control socket directory " + dir + " is not a directory");
  }
  if (st.st_uid != ::getuid()) {
    return failedPrecondition("control socket directory " + dir + " belongs to uid " +
                              std::to_string(st.st_uid) + ", not this user (" +
                              std::to_string(::getuid()) + "); remove it or set TMPDIR");
  }
  if ((st.st_mode & 022) != 0) {
    return failedPrecondition("control socket directory " + dir +
                              " is writable by group or others; chmod 700 it or set TMPDIR");
  }
  return Status::ok();
}

// "<pid>-<8 hex>" of an agent that is gone (kill(pid, 0) says ESRCH): its pid, else 0.
int deadAgentPid(const std::string& name) {
  const auto dash = name.find('-');
  if (dash == std::string::npos || dash == 0 || dash > 7 || name.size() != dash + 9) return 0;
  long pid = 0;
  for (std::size_t i = 0; i < dash; ++i) {
    if (name[i] < '0' || name[i] > '9') return 0;
    pid = pid * 10 + (name[i] - '0');
  }
  for (std::size_t i = dash + 1; i < name.size(); ++i) {
    if (!std::isxdigit(static_cast<unsigned char>(name[i]))) return 0;
  }
  if (pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) return 0;
  return static_cast<int>(pid);
}

void removeDeadAgentDirs(const std::string& user_dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(user_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (deadAgentPid(name) == 0) continue;
    std::error_code rm;
    std::filesystem::remove_all(entry.path(), rm);
    if (rm) {
      logger("agent")->warn(
          "could not remove {} (a control socket directory of an agent that is "
          "gone): {}",
          entry.path().string(), rm.message());
    } else {
      logger("agent")->debug("removed {}: its agent is gone", entry.path().string());
    }
  }
}

std::string baseDir(const UnixControlServerOptions& options) {
  if (!options.base_dir.empty()) return options.base_dir;
  const char* tmp = std::getenv("TMPDIR");
  return tmp != nullptr && *tmp != '\0' ? std::string(tmp) : std::string("/tmp");
}

// The peer's pid (SO_PEERCRED), or 0.
int peerPid(Socket& socket) {
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return 0;
  return static_cast<int>(cred.pid);
}

}  // namespace

struct UnixControlServer::Connection {
  Connection(Socket s, int peer, boost::asio::io_context& io)
      : socket(std::move(s)), pid(peer), first_line_timer(io) {}
  Socket socket;
  int pid;
  bool closed = false;
  bool got_line = false;  // a complete line arrived (the first-line deadline is off)
  boost::asio::steady_timer first_line_timer;
  std::string in;  // bytes read, not yet a complete line
  std::array<char, 4096> buf{};
  std::chrono::steady_clock::time_point window_start{};  // of the current one-second window
  int lines_in_window = 0;
  std::deque<std::string> out;  // lines queued towards the peer; the front one is being written
};

StatusOr<std::unique_ptr<UnixControlServer>> UnixControlServer::open(
    boost::asio::io_context& io, UnixControlServerOptions options, Callbacks callbacks) {
  DDPRUN_CHECK(callbacks.on_line && callbacks.is_worker,
               "UnixControlServer::open: on_line and is_worker are required");
  const std::string leaf = "/" + std::to_string(::getpid()) + "-" + randomHex8();
  const std::string socket_name = "/control.sock";
  std::string user_dir = baseDir(options) + "/ddprun-" + std::to_string(::getuid());
  if (user_dir.size() + leaf.size() + socket_name.size() > kMaxSocketPath) {
    user_dir = "/tmp/ddprun-" + std::to_string(::getuid());
  }
  DDPRUN_RETURN_IF_ERROR(ensureUserDir(user_dir));
  removeDeadAgentDirs(user_dir);
  const std::string dir = user_dir + leaf;
  if (::mkdir(dir.c_str(), 0700) != 0) {
    return unavailable("control socket directory " + dir + ": mkdir: " + errnoText(errno));
  }
  std::unique_ptr<UnixControlServer> server(
      new UnixControlServer(io, std::move(options), std::move(callbacks), dir, dir + socket_name));
  DDPRUN_RETURN_IF_ERROR(server->listen());
  return server;
}

UnixControlServer::UnixControlServer(boost::asio::io_context& io, UnixControlServerOptions options,
                                     Callbacks callbacks, std::string dir, std::string path)
    : io_(io),
      options_(std::move(options)),
      callbacks_(std::move(callbacks)),
      dir_(std::move(dir)),
      path_(std::move(path)),
      acceptor_(io),
      accept_retry_(io) {}

Status UnixControlServer::listen() {
  loop_.check();
  const auto fail = [&](const char* what, const boost::system::error_code& ec) {
    return unavailable("control socket " + path_ + ": " + what + ": " + ec.message());
  };
  boost::system::error_code ec;
  const boost::asio::local::stream_protocol::endpoint endpoint(path_);
  if (acceptor_.open(endpoint.protocol(), ec)) return fail("socket", ec);
  if (acceptor_.bind(endpoint, ec)) return fail("bind", ec);
  if (::chmod(path_.c_str(), 0600) != 0) {
    return unavailable("control socket " + path_ + ": chmod: " + errnoText(errno));
  }
  if (acceptor_.listen(boost::asio::socket_base::max_listen_connections, ec)) {
    return fail("listen", ec);
  }
  acceptNext();
  return Status::ok();
}

UnixControlServer::~UnixControlServer() {
  loop_.check();
  for (auto& [pid, c] : connections_) {
    c->closed = true;
    c->first_line_timer.cancel();
    boost::system::error_code ignored;
    c->socket.close(ignored);
  }
  connections_.clear();
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  accept_retry_.cancel();
  ::unlink(path_.c_str());
  ::rmdir(dir_.c_str());
}

const std::string& UnixControlServer::path() const { return path_; }

bool UnixControlServer::connected(int pid) const {
  loop_.check();
  return connections_.count(pid) != 0;
}

void UnixControlServer::acceptNext() {
  loop_.check();
  acceptor_.async_accept([this, alive = std::weak_ptr<char>(alive_)](
                             const boost::system::error_code& ec, Socket socket) {
    if (alive.expired()) return;
    loop_.check();
    if (ec == boost::asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (!ec) {
      onAccept(std::move(socket));
      return acceptNext();
    }
    warnRefused("accept", "control socket " + path_ + ": accept failed: " + ec.message());
    accept_retry_.expires_after(kAcceptRetry);
    accept_retry_.async_wait([this, alive](const boost::system::error_code& wait_ec) {
      if (alive.expired() || wait_ec) return;
      acceptNext();
    });
  });
}

void UnixControlServer::onAccept(Socket socket) {
  loop_.check();
  const int pid = peerPid(socket);
  boost::system::error_code ignored;
  if (pid <= 0 || !callbacks_.is_worker(pid)) {
    warnRefused("pid " + std::to_string(pid), "control socket: refused a connection from pid " +
                                                  std::to_string(pid) +
                                                  ", not a worker of this agent");
    socket.close(ignored);
    return;
  }
  if (connections_.count(pid) != 0) {
    warnRefused("pid " + std::to_string(pid),
                "control socket: refused a second connection from worker pid " +
                    std::to_string(pid) + " (its first stays open)");
    socket.close(ignored);
    return;
  }
  auto c = std::make_shared<Connection>(std::move(socket), pid, io_);
  connections_.emplace(pid, c);
  c->first_line_timer.expires_after(options_.first_line_timeout);
  c->first_line_timer.async_wait([this, c, alive = std::weak_ptr<char>(alive_)](
                                     const boost::system::error_code& ec) {
    if (alive.expired() || ec || c->closed || c->got_line) return;
    loop_.check();
    finish(c,
           "no complete line within " + std::to_string(options_.first_line_timeout.count()) + " ms",
           true);
  });
  readNext(c);
}

void UnixControlServer::drain(int pid) {
  loop_.check();
  const auto it = connections_.find(pid);
  if (it == connections_.end()) return;
  const ConnectionPtr c = it->second;
  // The pending async read stays: it finds nothing more, or the end, and goes on as usual (one
  // thread, so it cannot run in between).
  while (!c->closed) {
    const ssize_t n = ::recv(c->socket.native_handle(), c->buf.data(), c->buf.size(), MSG_DONTWAIT);
    if (n == 0) return finish(c, "closed by the worker", true);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      return finish(c, std::string("read failed: ") + std::strerror(errno), true);
    }
    if (!takeBytes(c, static_cast<std::size_t>(n))) return;
  }
}

void UnixControlServer::readNext(const ConnectionPtr& c) {
  loop_.check();
  c->socket.async_read_some(boost::asio::buffer(c->buf),
                            [this, c, alive = std::weak_ptr<char>(alive_)](
                                const boost::system::error_code& ec, std::size_t n) {
                              if (alive.expired() || c->closed) return;
                              loop_.check();
                              if (ec == boost::asio::error::eof)
                                return finish(c, "closed by the worker", true);
                              if (ec) return finish(c, "read failed: " + ec.message(), true);
                              onRead(c, n);
                            });
}

void UnixControlServer::onRead(const ConnectionPtr& c, std::size_t n) {
  loop_.check();
  if (takeBytes(c, n)) readNext(c);
}

bool UnixControlServer::takeBytes(const ConnectionPtr& c, std::size_t n) {
  c->in.append(c->buf.data(), n);
  if (!takeLines(c)) return false;
  if (c->in.size() > kMaxControlLine) {
    finish(c, "line over " + std::to_string(kMaxControlLine) + " bytes", true);
    return false;
  }
  return true;
}

bool UnixControlServer::takeLines(const ConnectionPtr& c) {
  loop_.check();
  std::size_t start = 0;
  for (auto end = c->in.find('\n'); end != std::string::npos; end = c->in.find('\n', start)) {
    if (end - start > kMaxControlLine) {
      finish(c, "line over " + std::to_string(kMaxControlLine) + " bytes", true);
      return false;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now - c->window_start >= std::chrono::seconds(1)) {
      c->window_start = now;
      c->lines_in_window = 0;
    }
    if (++c->lines_in_window > options_.max_lines_per_second) {
      finish(c, "more than " + std::to_string(options_.max_lines_per_second) + " lines in a second",
             true);
      return false;
    }
    c->got_line = true;
    c->first_line_timer.cancel();
    const std::string line = c->in.substr(start, end - start);
    start = end + 1;
    callbacks_.on_line(c->pid, line);
    if (c->closed) return false;  // on_line closed it
  }
  c->in.erase(0, start);
  return true;
}

bool UnixControlServer::send(int pid, const std::string& line) {
  loop_.check();
  const auto newline = line.find('\n');
  DDPRUN_CHECK(newline == std::string::npos || newline + 1 == line.size(),
               "UnixControlServer::send: a line with a '\\n' inside");
  const auto it = connections_.find(pid);
  if (it == connections_.end()) return false;
  const ConnectionPtr c = it->second;
  if (c->out.size() >= static_cast<std::size_t>(options_.max_unsent_lines)) {
    finish(c,
           "more than " + std::to_string(options_.max_unsent_lines) +
               " lines unsent to the worker (it does not read)",
           true);
    return false;
  }
  c->out.push_back(newline == std::string::npos ? line + "\n" : line);
  if (c->out.size() == 1) writeNext(c);
  return true;
}

void UnixControlServer::writeNext(const ConnectionPtr& c) {
  loop_.check();
  boost::asio::async_write(c->socket, boost::asio::buffer(c->out.front()),
                           [this, c, alive = std::weak_ptr<char>(alive_)](
                               const boost::system::error_code& ec, std::size_t) {
                             if (alive.expired() || c->closed) return;
                             loop_.check();
                             if (ec) return finish(c, "write failed: " + ec.message(), true);
                             c->out.pop_front();
                             if (!c->out.empty()) writeNext(c);
                           });
}

void UnixControlServer::close(int pid) {
  loop_.check();
  const auto it = connections_.find(pid);
  if (it != connections_.end()) finish(it->second, "closed by the agent", false);
}

void UnixControlServer::finish(ConnectionPtr c, const std::string& why, bool notify) {
  loop_.check();
  if (c->closed) return;
  c->closed = true;
  c->first_line_timer.cancel();
  boost::system::error_code ignored;
  c->socket.close(ignored);
  const auto it = connections_.find(c->pid);
  if (it != connections_.end() && it->second == c) connections_.erase(it);
  logger("agent")->debug("control connection of worker pid {} closed: {}", c->pid, why);
  if (notify && callbacks_.on_closed) callbacks_.on_closed(c->pid, why);
}

void UnixControlServer::warnRefused(const std::string& key, const std::string& what) {
  loop_.check();
  const auto n = refused_log_.note(key, std::chrono::steady_clock::now());
  if (!n) return;
  logger("agent")->warn("{}", withCount(what, *n));
}

}  // namespace ddprun::agent
