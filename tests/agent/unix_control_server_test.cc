// UnixControlServer over real Unix sockets: the test process is both the agent (its io_context
// runs here, in slices) and the worker peer (its SO_PEERCRED pid is getpid()).
#include "unix_control_server.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/write.hpp>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

using namespace ddprun;
using namespace ddprun::agent;
using boost::asio::local::stream_protocol;

namespace {

// A temp dir removed with everything in it at the end.
struct TempDir {
  TempDir() {
    char templ[] = "/tmp/ddprun-ucs-XXXXXX";
    path = mkdtemp(templ);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string path;
};

struct ControlFixture {
  boost::asio::io_context io;
  TempDir base;
  std::vector<std::pair<int, std::string>> lines;
  std::vector<std::pair<int, std::string>> closed;
  std::function<bool(int)> is_worker = [](int pid) { return pid == getpid(); };
  UnixControlServerOptions options;

  std::unique_ptr<UnixControlServer> open() {
    options.base_dir = base.path;
    UnixControlServer::Callbacks callbacks;
    callbacks.on_line = [this](int pid, const std::string& line) { lines.emplace_back(pid, line); };
    callbacks.on_closed = [this](int pid, const std::string& why) {
      closed.emplace_back(pid, why);
    };
    callbacks.is_worker = [this](int pid) { return is_worker(pid); };
    auto server = UnixControlServer::open(io, options, callbacks);
    REQUIRE(server.isOk());
    return std::move(server).value();
  }

  // Runs the loop in slices until `done` or 5 s have passed; whether `done` came true.
  bool runUntil(const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      io.restart();
      io.run_for(std::chrono::milliseconds(5));
    }
    return true;
  }
};

// A worker's end: blocking writes, non-blocking reads polled while the server's loop runs.
struct Client {
  Client(boost::asio::io_context& io, const std::string& path) : socket(io) {
    socket.connect(stream_protocol::endpoint(path));
    socket.non_blocking(true);
  }
  void write(const std::string& bytes) {
    socket.non_blocking(false);
    boost::asio::write(socket, boost::asio::buffer(bytes));
    socket.non_blocking(true);
  }
  // Reads what is there; true once the server has closed its end.
  bool poll() {
    char buf[4096];
    boost::system::error_code ec;
    for (;;) {
      const std::size_t n = socket.read_some(boost::asio::buffer(buf), ec);
      if (ec == boost::asio::error::would_block) return false;
      if (ec) return true;  // EOF or reset
      received.append(buf, n);
    }
  }
  stream_protocol::socket socket;
  std::string received;
};

int deadPid() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  return child;
}

mode_t modeOf(const std::string& path) {
  struct stat st {};
  REQUIRE(lstat(path.c_str(), &st) == 0);
  return st.st_mode & 0777;
}

}  // namespace

TEST_CASE("a worker's line reaches on_line with its pid, and send reaches the worker", "[agent]") {
  ControlFixture f;
  auto server = f.open();
  Client client(f.io, server->path());
  client.write("hello v=1 pid=1 caps=inplace\n");
  REQUIRE(f.runUntil([&] { return !f.lines.empty(); }));
  CHECK(f.lines.front() == std::make_pair(static_cast<int>(getpid()), std::string("hello v=1 "
                                                                                  "pid=1 "
                                                                                  "caps=inplace")));
  CHECK(server->connected(getpid()));
  CHECK(server->send(getpid(), "welcome v=1 gen=0 timeout_ms=60000"));
  CHECK(server->send(getpid(), "abort gen=1 reason=failure\n"));  // formatControlLine's '\n' kept
  const std::string expected = "welcome v=1 gen=0 timeout_ms=60000\nabort gen=1 reason=failure\n";
  REQUIRE(f.runUntil([&] {
    client.poll();
    return client.received.size() >= expected.size();
  }));
  CHECK(client.received == expected);
  CHECK_FALSE(server->send(getpid() + 1, "abort gen=1 reason=failure"));
  CHECK(f.closed.empty());
}

TEST_CASE("a peer that is not a worker is closed at accept with no callback", "[agent]") {
  ControlFixture f;
  f.is_worker = [](int) { return false; };
  auto server = f.open();
  Client client(f.io, server->path());
  client.write("hello v=1 pid=1 caps=\n");
  REQUIRE(f.runUntil([&] { return client.poll(); }));
  CHECK(f.lines.empty());
  CHECK(f.closed.empty());
  CHECK_FALSE(server->connected(getpid()));
}

TEST_CASE("a second connection from a worker is closed while its first still works", "[agent]") {
  ControlFixture f;
  auto server = f.open();
  Client first(f.io, server->path());
  first.write("hello v=1 pid=1 caps=\n");
  REQUIRE(f.runUntil([&] { return f.lines.size() == 1; }));
  Client second(f.io, server->path());
  second.write("hello v=1 pid=2 caps=\n");
  REQUIRE(f.runUntil([&] { return second.poll(); }));
  first.write("caps add=inplace\n");
  REQUIRE(f.runUntil([&] { return f.lines.size() == 2; }));
  CHECK(f.lines.back().second == "caps add=inplace");
  CHECK(f.closed.empty());
  CHECK(server->connected(getpid()));
}

TEST_CASE("a control line over 1024 bytes closes its connection, saying so", "[agent]") {
  ControlFixture f;
  auto server = f.open();
  Client client(f.io, server->path());
  client.write(std::string(2000, 'a') + "\n");
  REQUIRE(f.runUntil([&] { return !f.closed.empty(); }));
  CHECK(f.closed.front() ==
        std::make_pair(static_cast<int>(getpid()), std::string("line over 1024 bytes")));
  CHECK(f.lines.empty());
  CHECK_FALSE(server->connected(getpid()));
  CHECK(f.runUntil([&] { return client.poll(); }));
}

TEST_CASE("more than 100 control lines in a second close the connection", "[agent]") {
  ControlFixture f;
  auto server = f.open();
  Client client(f.io, server->path());
  std::string burst;
  for (int i = 0; i < 500; ++i) burst += "step gen=1 n=" + std::to_string(i) + "\n";
  client.write(burst);
  REQUIRE(f.runUntil([&] { return !f.closed.empty(); }));
  CHECK(f.closed.front().second == "more than 100 lines in a second");
  CHECK(f.lines.size() == 100);
}

TEST_CASE("a connection silent past the first-line timeout is closed", "[agent]") {
  ControlFixture f;
  f.options.first_line_timeout = std::chrono::milliseconds(200);
  auto server = f.open();
  Client client(f.io, server->path());
  client.write("no newline yet");
  REQUIRE(f.runUntil([&] { return !f.closed.empty(); }));
  CHECK(f.closed.front().second == "no complete line within 200 ms");
  CHECK(f.runUntil([&] { return client.poll(); }));
}

TEST_CASE("the worker hanging up is reported as closed by the worker", "[agent]") {
  ControlFixture f;
  auto server = f.open();
  {
    Client client(f.io, server->path());
    client.write("goodbye reason=done\n");
    REQUIRE(f.runUntil([&] { return f.lines.size() == 1; }));
  }
  REQUIRE(f.runUntil([&] { return !f.closed.empty(); }));
  CHECK(f.closed.front().second == "closed by the worker");
}

TEST_CASE("lines a worker does not read close its connection past max_unsent_lines", "[agent]") {
  ControlFixture f;
  auto server = f.open();
  Client client(f.io, server->path());
  client.write("hello v=1 pid=1 caps=\n");
  REQUIRE(f.runUntil([&] { return f.lines.size() == 1; }));
  // Without the loop running no write completes, so each send stays queued.
  for (int i = 0; i < 16; ++i) CHECK(server->send(getpid(), "step gen=1 n=1"));
  CHECK_FALSE(server->send(getpid(), "step gen=1 n=1"));
  REQUIRE(f.closed.size() == 1);
  CHECK(f.closed.front().second == "more than 16 lines unsent to the worker (it does not read)");
  CHECK_FALSE(server->connected(getpid()));
}

TEST_CASE("close() ends a connection without on_closed, also from within on_line", "[agent]") {
  boost::asio::io_context io;
  TempDir base;
  std::unique_ptr<UnixControlServer> server;
  int lines = 0;
  UnixControlServer::Callbacks callbacks;
  callbacks.on_line = [&](int pid, const std::string&) {
    ++lines;
    server->close(pid);
  };
  callbacks.on_closed = [&](int, const std::string&) { FAIL("on_closed after close()"); };
  callbacks.is_worker = [](int) { return true; };
  UnixControlServerOptions options;
  options.base_dir = base.path;
  server = std::move(UnixControlServer::open(io, options, callbacks)).value();
  stream_protocol::socket client(io);
  client.connect(stream_protocol::endpoint(server->path()));
  boost::asio::write(client, boost::asio::buffer(std::string("a\nb\nc\n")));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (server->connected(getpid()) || lines == 0) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    io.restart();
    io.run_for(std::chrono::milliseconds(5));
  }
  io.restart();
  io.run_for(std::chrono::milliseconds(20));
  CHECK(lines == 1);
}

TEST_CASE("the control socket is 0600 in 0700 directories, all removed by the destructor",
          "[agent]") {
  ControlFixture f;
  auto server = f.open();
  const std::filesystem::path socket = server->path();
  const std::filesystem::path dir = socket.parent_path();
  CHECK(socket.filename() == "control.sock");
  CHECK(dir.parent_path() == f.base.path + "/ddprun-" + std::to_string(getuid()));
  CHECK(modeOf(socket) == 0600);
  CHECK(modeOf(dir) == 0700);
  CHECK(modeOf(dir.parent_path()) == 0700);
  Client client(f.io, server->path());
  client.write("hello v=1 pid=1 caps=\n");
  REQUIRE(f.runUntil([&] { return f.lines.size() == 1; }));
  server.reset();
  CHECK_FALSE(std::filesystem::exists(socket));
  CHECK_FALSE(std::filesystem::exists(dir));
  CHECK(f.runUntil([&] { return client.poll(); }));
  CHECK(f.closed.empty());
  f.io.restart();
  f.io.run_for(std::chrono::milliseconds(20));  // handlers still queued do nothing
}

TEST_CASE("open removes the directories of dead agents and keeps those of live ones", "[agent]") {
  ControlFixture f;
  const std::string user_dir = f.base.path + "/ddprun-" + std::to_string(getuid());
  REQUIRE(mkdir(user_dir.c_str(), 0700) == 0);
  const std::string dead = user_dir + "/" + std::to_string(deadPid()) + "-deadbeef";
  const std::string live = user_dir + "/" + std::to_string(getppid()) + "-0badf00d";
  const std::string other = user_dir + "/not-an-agent";
  for (const auto& d : {dead, live, other}) REQUIRE(mkdir(d.c_str(), 0700) == 0);
  REQUIRE(std::system(("touch " + dead + "/control.sock").c_str()) == 0);
  auto server = f.open();
  CHECK_FALSE(std::filesystem::exists(dead));
  CHECK(std::filesystem::exists(live));
  CHECK(std::filesystem::exists(other));
}

TEST_CASE("open refuses a ddprun-<uid> directory that others can write", "[agent]") {
  TempDir base;
  const std::string user_dir = base.path + "/ddprun-" + std::to_string(getuid());
  REQUIRE(mkdir(user_dir.c_str(), 0700) == 0);
  REQUIRE(chmod(user_dir.c_str(), 0777) == 0);
  boost::asio::io_context io;
  UnixControlServerOptions options;
  options.base_dir = base.path;
  UnixControlServer::Callbacks callbacks;
  callbacks.on_line = [](int, const std::string&) {};
  callbacks.is_worker = [](int) { return true; };
  auto server = UnixControlServer::open(io, options, callbacks);
  REQUIRE_FALSE(server.isOk());
  CHECK(server.status().message() == "control socket directory " + user_dir +
                                         " is writable by group or others; chmod 700 it or set "
                                         "TMPDIR");
}

TEST_CASE("a socket path over 107 bytes goes under /tmp instead", "[agent]") {
  ControlFixture f;
  const std::string long_base = f.base.path + "/" + std::string(90, 'b');
  REQUIRE(mkdir(long_base.c_str(), 0700) == 0);
  f.options.base_dir = long_base;
  UnixControlServer::Callbacks callbacks;
  callbacks.on_line = [](int, const std::string&) {};
  callbacks.is_worker = [](int) { return true; };
  auto server = UnixControlServer::open(f.io, f.options, callbacks);
  REQUIRE(server.isOk());
  CHECK(server.value()->path().rfind("/tmp/ddprun-" + std::to_string(getuid()) + "/", 0) == 0);
  CHECK(server.value()->path().size() <= 107);
}

TEST_CASE(
    "drain hands over at once the lines a worker sent before it died, then its end, and the loop "
    "goes on as usual afterwards",
    "[agent]") {
  ControlFixture f;
  auto server = f.open();
  {
    Client client(f.io, server->path());
    client.write("hello v=1 pid=1 caps=\n");
    REQUIRE(f.runUntil([&] { return f.lines.size() == 1; }));
    // A live connection with nothing unread: nothing happens, and the loop's read goes on.
    server->drain(getpid());
    CHECK(f.lines.size() == 1);
    CHECK(f.closed.empty());
    client.write("aborted gen=1\nformed gen=2 ");  // the second line is not complete yet
    // Unread: the loop has not run since. drain reads it now, outside the loop.
    server->drain(getpid());
    REQUIRE(f.lines.size() == 2);
    CHECK(f.lines[1].second == "aborted gen=1");
    CHECK(f.closed.empty());
    client.write("rank=0 world=2\nsynced gen=2 step=5 source=0 discarded=0\n");
  }  // the worker is gone: its last lines, then its end
  server->drain(getpid());
  REQUIRE(f.lines.size() == 4);
  CHECK(f.lines[2].second == "formed gen=2 rank=0 world=2");
  CHECK(f.lines[3].second == "synced gen=2 step=5 source=0 discarded=0");
  REQUIRE(f.closed.size() == 1);
  CHECK(f.closed[0].second == "closed by the worker");
  CHECK_FALSE(server->connected(getpid()));
  // The loop's pending read, cancelled by the close, reports nothing twice; an unknown pid is
  // nothing to drain.
  f.io.restart();
  f.io.run_for(std::chrono::milliseconds(20));
  CHECK(f.lines.size() == 4);
  CHECK(f.closed.size() == 1);
  server->drain(getpid() + 1);
  // A line over the limit found by drain closes the connection as the loop would.
  Client again(f.io, server->path());
  again.write(std::string(1100, 'a'));
  f.io.restart();
  f.io.run_for(std::chrono::milliseconds(1));  // accepted (its read may take the bytes, or not)
  REQUIRE(f.runUntil([&] {
    server->drain(getpid());
    return f.closed.size() == 2;
  }));
  CHECK(f.closed[1].second == "line over 1024 bytes");
}
