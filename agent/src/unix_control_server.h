// UnixControlServer: the agent's end of the in-place recovery control channel
// (docs/in-place-recovery.md §1). Listens on a Unix stream socket in a directory of its own,
// <base>/ddprun-<uid>/<agent pid>-<8 hex>/control.sock (directories 0700, socket 0600), accepts
// one connection per worker pid (SO_PEERCRED, asked of `is_worker`) and moves lines: each complete
// line a worker sends goes to `on_line`, `send` queues one towards it. It does not parse messages
// (the caller does, with common/control_protocol.h); it only bounds what one peer can cost: a line
// over kMaxControlLine bytes, more than `max_lines_per_second`, no complete first line within
// `first_line_timeout`, or more than `max_unsent_lines` waiting towards a peer that does not read
// closes that connection, and on_closed says why.
//
// Threading: lives on the agent's io_context (its one loop); every public method and every
// handler runs there (LoopAffinity). No threads.
// Callbacks run on the loop from within the server's handlers; they may call send, close and
// connected re-entrantly, but must not destroy the server (post the destruction instead).
// Lifetime: the destructor closes every connection without calling on_closed and removes the
// socket and its directory; handlers still queued on the io_context then do nothing.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "ddprun/common/log_throttle.h"
#include "ddprun/common/loop_affinity.h"
#include "ddprun/common/status.h"

namespace ddprun::agent {

struct UnixControlServerOptions {
  // Empty: ${TMPDIR:-/tmp}. When the socket's path would exceed 107 bytes (sun_path), /tmp.
  std::string base_dir;
  // A connection that sends no complete line within this is closed.
  std::chrono::milliseconds first_line_timeout{5000};
  // More lines than this from one connection within one second: closed.
  int max_lines_per_second = 100;
  // More lines than this queued towards one peer (it does not read): closed.
  int max_unsent_lines = 16;
};

class UnixControlServer {
 public:
  struct Callbacks {
    // A complete line, without its '\n', at most kMaxControlLine bytes.
    std::function<void(int pid, const std::string& line)> on_line;
    // pid's connection ended: EOF ("closed by the worker"), an error, or a limit (`why` says
    // which, e.g. "line over 1024 bytes"). Not called for close() or the destructor.
    std::function<void(int pid, const std::string& why)> on_closed;
    // Whether the peer (its SO_PEERCRED pid) is a worker of this agent; others are closed at
    // accept, with no callback.
    std::function<bool(int pid)> is_worker;
  };

  // on_line and is_worker are required (DDPRUN_CHECK); on_closed may be empty.
  // Creates the socket's directory (0700; its parent ddprun-<uid> 0700 too, refusing one that is
  // not this uid's or is group- or world-writable), removes the sibling directories of agents no
  // longer alive, binds and listens (socket 0600). Errors name the path.
  static StatusOr<std::unique_ptr<UnixControlServer>> open(boost::asio::io_context& io,
                                                           UnixControlServerOptions options,
                                                           Callbacks callbacks);
  ~UnixControlServer();

  UnixControlServer(const UnixControlServer&) = delete;
  UnixControlServer& operator=(const UnixControlServer&) = delete;

  // The socket's path (DDPRUN_CONTROL_SOCKET for the workers).
  const std::string& path() const;
  // Queues `line` and a '\n' towards pid (a line that already ends with its '\n', as
  // formatControlLine's, gets no second one; any other '\n' in it is a programming error). False
  // when pid has no open connection, or when this line was one too many waiting towards it: then
  // the connection is closed and on_closed says so.
  bool send(int pid, const std::string& line);
  // Closes pid's connection, if any, without calling on_closed.
  void close(int pid);
  bool connected(int pid) const;
  // Reads, without waiting, what pid's connection holds unread, and hands its complete lines to
  // on_line now (and on_closed, at its end), under the same limits as the loop's reads. For a
  // worker whose exit is being handled: whatever it wrote before it died comes before its exit.
  void drain(int pid);

 private:
  struct Connection;
  using ConnectionPtr = std::shared_ptr<Connection>;

  UnixControlServer(boost::asio::io_context& io, UnixControlServerOptions options,
                    Callbacks callbacks, std::string dir, std::string path);
  Status listen();
  void acceptNext();
  void onAccept(boost::asio::local::stream_protocol::socket socket);
  void readNext(const ConnectionPtr& c);
  void onRead(const ConnectionPtr& c, std::size_t n);
  // The n bytes read into c->buf join its buffer, whose complete lines go to on_line; false once
  // c is closed (by a line, or a partial line over the limit).
  bool takeBytes(const ConnectionPtr& c, std::size_t n);
  // Hands the complete lines of c's buffer to on_line; false once c is closed.
  bool takeLines(const ConnectionPtr& c);
  void writeNext(const ConnectionPtr& c);
  // Closes c (once); on_closed(pid, why) when `notify`. By value: the map's copy is erased here.
  void finish(ConnectionPtr c, const std::string& why, bool notify);
  void warnRefused(const std::string& key, const std::string& what);

  boost::asio::io_context& io_;
  UnixControlServerOptions options_;
  Callbacks callbacks_;
  std::string dir_;
  std::string path_;
  boost::asio::local::stream_protocol::acceptor acceptor_;
  // After a failed accept (EMFILE, say, which lasts), the next waits a little instead of spinning.
  boost::asio::steady_timer accept_retry_;
  std::map<int, ConnectionPtr> connections_;  // open connections, by peer pid
  LogThrottle refused_log_{std::chrono::seconds(60)};
  // Handlers hold a weak_ptr to this: expired once the server is gone.
  std::shared_ptr<char> alive_ = std::make_shared<char>();
  LoopAffinity loop_{"UnixControlServer"};
};

}  // namespace ddprun::agent
