#include "ddprun/common/log_throttle.h"

#include <catch2/catch.hpp>

#include "ddprun/common/strings.h"

using namespace ddprun;
using namespace std::chrono_literals;

TEST_CASE("a throttled warning is logged once per key per interval with a count", "[common]") {
  LogThrottle throttle(60s);
  const TimePoint t0{};
  CHECK(throttle.note("10.0.0.1", t0) == 1u);  // the first at once
  for (int i = 0; i < 399; ++i) CHECK_FALSE(throttle.note("10.0.0.1", t0 + 1s));
  CHECK(throttle.note("10.0.0.2", t0 + 1s) == 1u);     // another peer has its own line
  CHECK(throttle.note("10.0.0.1", t0 + 61s) == 400u);  // the 399 held back and this one
  CHECK_FALSE(throttle.note("10.0.0.1", t0 + 62s));
  CHECK(throttle.note("10.0.0.1", t0 + 122s) == 2u);
}

TEST_CASE("a throttle with a burst logs that many a key per interval", "[common]") {
  LogThrottle throttle(60s, 16, 3);
  const TimePoint t0{};
  CHECK(throttle.note("s", t0) == 1u);
  CHECK(throttle.note("s", t0 + 1s) == 1u);
  CHECK(throttle.note("s", t0 + 2s) == 1u);
  for (int i = 0; i < 10; ++i) CHECK_FALSE(throttle.note("s", t0 + 3s));
  CHECK(throttle.note("s", t0 + 61s) == 11u);  // the 10 held back, and this one
  CHECK(throttle.note("s", t0 + 62s) == 1u);
}

TEST_CASE("a throttle keeps a bounded number of keys", "[common]") {
  LogThrottle throttle(60s, 2);
  const TimePoint t0{};
  CHECK(throttle.note("a", t0) == 1u);
  CHECK(throttle.note("b", t0 + 1s) == 1u);
  CHECK(throttle.note("c", t0 + 2s) == 1u);  // "a" (the oldest) is forgotten
  CHECK(throttle.note("a", t0 + 3s) == 1u);  // so it counts as new
  CHECK_FALSE(throttle.note("c", t0 + 4s));  // "c" was kept
}

TEST_CASE("a peer's text is escaped and cut to a bounded length", "[common]") {
  CHECK(quotePeerText("short") == "short");
  CHECK(quotePeerText("\x1b[2Jwiped") == "\\x1b[2Jwiped");
  const std::string big(100000, 'x');
  CHECK(quotePeerText(big, 10) == "xxxxxxxxxx... (100000 bytes)");
  CHECK(quotePeerText(big).size() < 230);
}

TEST_CASE("a throttled line counts the events from the second on", "[common]") {
  CHECK(withCount("refused", 1) == "refused");
  CHECK(withCount("refused", 7) == "refused (7 times since the last such line)");
}
