// The guardian's list of its children (worker_guardian.h): the kernel's list where it has one,
// a scan of /proc otherwise, and both give the same children.
#include "worker_guardian.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <set>
#include <vector>

using namespace ddprun::agent;

namespace {

std::set<pid_t> asSet(const pid_t* pids, int n) { return std::set<pid_t>(pids, pids + n); }

}  // namespace

TEST_CASE("a guardian finds its children from the kernel's list or a scan of /proc alike",
          "[agent]") {
  std::vector<pid_t> mine;
  for (int i = 0; i < 5; ++i) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::pause();
      ::_exit(0);
    }
    mine.push_back(pid);
  }
  const std::set<pid_t> expected(mine.begin(), mine.end());
  pid_t out[64];
  const int scanned = childrenScanned(::getpid(), out, 64);
  const std::set<pid_t> by_scan = asSet(out, std::max(scanned, 0));
  const int listed = childrenListed(::getpid(), out, 64);
  const std::set<pid_t> by_list = asSet(out, std::max(listed, 0));
  const int any = childrenOf(::getpid(), out, 64);
  const std::set<pid_t> by_any = asSet(out, std::max(any, 0));
  // A test runner may have children of its own besides ours: ours are among them.
  for (pid_t p : mine) {
    CHECK(by_scan.count(p) == 1);
    CHECK(by_any.count(p) == 1);
  }
  if (listed < 0) {
    WARN("this kernel has no /proc/<pid>/task/<tid>/children (CONFIG_PROC_CHILDREN): scan only");
  } else {
    CHECK(by_list == by_scan);
  }
  // At most `max` of them.
  CHECK(childrenOf(::getpid(), out, 2) == 2);
  CHECK(childrenScanned(::getpid(), out, 3) == 3);
  for (pid_t p : mine) {
    ::kill(p, SIGKILL);
    ::waitpid(p, nullptr, 0);
  }
  const int after = childrenOf(::getpid(), out, 64);
  for (pid_t p : mine) CHECK(asSet(out, after).count(p) == 0);
}
