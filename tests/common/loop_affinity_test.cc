#include "ddprun/common/loop_affinity.h"

#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

using ddprun::LoopAffinity;

namespace {

// Runs `body` in a child process; its wait status.
template <typename F>
int inChild(F body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    body();
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

}  // namespace

TEST_CASE("a loop-only object used from its one thread passes its checks", "[common]") {
  LoopAffinity loop("Thing");
  loop.check();
  loop.check();
  std::thread other([&] {
    LoopAffinity own("Other");  // bound to the thread that first checks it
    own.check();
  });
  other.join();
}

TEST_CASE("a loop-only object used from a second thread aborts, naming it", "[common]") {
#if !defined(NDEBUG) || defined(DDPRUN_LOOP_CHECKS)
  char path[] = "/tmp/ddprun_loop_affinity_XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  const int status = inChild([fd] {
    ::dup2(fd, STDERR_FILENO);  // the abort's line, for the test to read
    LoopAffinity loop("Supervisor");
    loop.check();
    std::thread other([&] { loop.check(); });
    other.join();
  });
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
  std::ifstream in(path);
  std::string said((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ::close(fd);
  ::unlink(path);
  CHECK(said == "ddprun: Supervisor used off its loop thread\n");
#else
  WARN("skipped: loop checks are compiled out (NDEBUG without DDPRUN_LOOP_CHECKS)");
#endif
}
