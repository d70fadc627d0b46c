// StatHeartbeatProbe against real processes: a live one, a stopped one, and one killed while it
// holds a socket (what in-place recovery asks when a worker's control channel closes).
#include "stat_heartbeat_probe.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>

using ddprun::agent::StatHeartbeatProbe;

namespace {

// A child holding one end of a socket pair; with `touch_mb`, that much memory written first, so
// that its teardown after a SIGKILL takes a while. `fd` is the parent's end. Killed and reaped at
// the end of the scope unless the test reaped it (no child outlives a failed check).
struct Holder {
  pid_t pid = -1;
  int fd = -1;
  bool reaped = false;

  explicit Holder(size_t touch_mb) {
    int pair[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, pair) == 0);
    pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      close(pair[0]);
      if (touch_mb > 0) {
        const size_t bytes = touch_mb << 20;
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p != MAP_FAILED) std::memset(p, 1, bytes);
      }
      const char ready = 'r';
      if (write(pair[1], &ready, 1) != 1) _exit(3);
      for (;;) pause();
    }
    close(pair[1]);
    fd = pair[0];
    char c = 0;
    REQUIRE(read(fd, &c, 1) == 1);
  }
  int reap() {
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    reaped = true;
    return status;
  }
  ~Holder() {
    if (pid > 0 && !reaped) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    if (fd >= 0) close(fd);
  }
};

}  // namespace

TEST_CASE("the /proc probe: a live worker has not ended, a stopped one is stopped", "[agent]") {
  StatHeartbeatProbe probe;
  Holder child(0);
  CHECK_FALSE(probe.ended(child.pid));
  CHECK_FALSE(probe.stopped(child.pid));
  REQUIRE(kill(child.pid, SIGSTOP) == 0);
  int status = 0;
  REQUIRE(waitpid(child.pid, &status, WUNTRACED) == child.pid);
  CHECK(probe.stopped(child.pid));
  CHECK_FALSE(probe.ended(child.pid));
  REQUIRE(kill(child.pid, SIGKILL) == 0);
  child.reap();
  CHECK(probe.ended(child.pid));  // reaped: gone
}

TEST_CASE("the /proc probe: a worker killed holding a socket has ended once the socket closes",
          "[agent]") {
  // Its socket may close before it is a zombie (the agent then sees the hang-up first): from the
  // SIGKILL on it is exiting, which counts.
  StatHeartbeatProbe probe;
  Holder child(64);
  REQUIRE(kill(child.pid, SIGKILL) == 0);
  char c = 0;
  CHECK(read(child.fd, &c, 1) == 0);  // the end of the stream: its files are closed
  CHECK(probe.ended(child.pid));      // not reaped yet
  CHECK(WIFSIGNALED(child.reap()));
}
