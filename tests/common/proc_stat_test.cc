#include "ddprun/common/proc_stat.h"

#include <unistd.h>

#include <catch2/catch.hpp>

using ddprun::parseProcStat;
using ddprun::readProcStat;

TEST_CASE("/proc/<pid>/stat gives the state and the parent, whatever the command name holds",
          "[common][proc]") {
  auto s = parseProcStat("812 (train) S 811 812 700 0 -1 4194560 ...");
  REQUIRE(s);
  CHECK(s->state == 'S');
  CHECK(s->ppid == 811);
  CHECK(s->flags == 4194560);
  CHECK_FALSE(s->exiting());
  // Killed, its memory still being torn down: running, PF_EXITING set.
  s = parseProcStat("813 (train) R 811 812 700 0 -1 4195340 9 0 0");
  REQUIRE(s);
  CHECK(s->state == 'R');
  CHECK(s->exiting());
  CHECK(s->ended());
  CHECK(parseProcStat("813 (train) Z 811 812 700 0 -1 4195340")->ended());
  CHECK_FALSE(parseProcStat("812 (train) S 811 812 700 0 -1 4194560")->ended());
  s = parseProcStat("9 (a) b) (c) T 1 9 9");
  REQUIRE(s);
  CHECK(s->state == 'T');
  CHECK(s->ppid == 1);
  CHECK(s->flags == 0);  // the line ends before the flags
  CHECK_FALSE(s->exiting());
  CHECK_FALSE(parseProcStat(""));
  CHECK_FALSE(parseProcStat("12 (no closing parenthesis S 1"));
  CHECK_FALSE(parseProcStat("12 (x)"));
  CHECK_FALSE(parseProcStat("12 (x) S"));
  CHECK_FALSE(parseProcStat("12 (x) SS 1"));
  // This process: running, its parent the one getppid() names.
  auto self = readProcStat(static_cast<int>(::getpid()));
  REQUIRE(self);
  CHECK(self->state == 'R');
  CHECK(self->ppid == static_cast<int>(::getppid()));
  CHECK_FALSE(self->exiting());
  CHECK_FALSE(readProcStat(-5));
}
