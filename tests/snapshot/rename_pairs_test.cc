// How the snapshot replicator pairs a rename's two inotify events (snapshot/rename_pairs.h): a
// name renamed away is gone only once its IN_MOVED_TO has not come for the whole wait.
#include "ddprun/snapshot/rename_pairs.h"

#include <catch2/catch.hpp>
#include <chrono>

using namespace ddprun;
using namespace ddprun::snapshot;
using std::chrono::milliseconds;

namespace {

std::vector<std::string> names(const std::vector<RenamePairs::Away>& away) {
  std::vector<std::string> out;
  for (const auto& a : away) out.push_back(a.name + (a.dir ? "/" : ""));
  return out;
}

}  // namespace

TEST_CASE("a rename whose IN_MOVED_TO is read late is still a rename", "[rename_pairs]") {
  RenamePairs pairs(milliseconds(50));
  const TimePoint t0{};
  pairs.movedFrom(7, {"snapshot.pt.tmp", false}, t0);
  REQUIRE(pairs.nextDue() == t0 + milliseconds(50));
  // The read that returned the IN_MOVED_FROM ended before its IN_MOVED_TO was queued.
  CHECK(pairs.gone(t0).empty());
  CHECK(pairs.gone(t0 + milliseconds(49)).empty());
  // It comes in the next read.
  auto from = pairs.movedTo(7);
  REQUIRE(from.has_value());
  CHECK(from->name == "snapshot.pt.tmp");
  CHECK_FALSE(from->dir);
  CHECK_FALSE(pairs.nextDue().has_value());
  CHECK(pairs.gone(t0 + milliseconds(500)).empty());
  // Taken once: a second IN_MOVED_TO with that cookie is no rename.
  CHECK_FALSE(pairs.movedTo(7).has_value());
}

TEST_CASE("a name renamed away is gone once its wait has passed, in the order read",
          "[rename_pairs]") {
  RenamePairs pairs(milliseconds(50));
  const TimePoint t0{};
  // Cookies do not follow the order of the renames.
  pairs.movedFrom(900, {"ckpt", true}, t0);
  pairs.movedFrom(3, {"a.pt", false}, t0 + milliseconds(10));
  pairs.movedFrom(40, {"b.pt", false}, t0 + milliseconds(30));
  CHECK(pairs.gone(t0 + milliseconds(49)).empty());
  CHECK(names(pairs.gone(t0 + milliseconds(50))) == std::vector<std::string>{"ckpt/"});
  REQUIRE(pairs.nextDue() == t0 + milliseconds(60));
  // One of the others is a rename after all.
  CHECK(pairs.movedTo(40).has_value());
  CHECK(names(pairs.gone(t0 + milliseconds(200))) == std::vector<std::string>{"a.pt"});
  CHECK_FALSE(pairs.nextDue().has_value());
  // An IN_MOVED_TO whose IN_MOVED_FROM was outside the watched tree (or already gone).
  CHECK_FALSE(pairs.movedTo(3).has_value());
  CHECK_FALSE(pairs.movedTo(12345).has_value());
}

TEST_CASE("a zero wait counts a name renamed away as gone at once", "[rename_pairs]") {
  RenamePairs pairs(Duration::zero());
  const TimePoint t0{};
  pairs.movedFrom(1, {"x", false}, t0);
  CHECK(names(pairs.gone(t0)) == std::vector<std::string>{"x"});
}
