// RoundKeys (agent/src/round_keys.h): the lowest node of each round deletes, in one range, every
// key of its kind published for a round below; the key format (common/round_key.h) sorts every
// round below r under that range, and no key of round r or above.
#include "ddprun/agent/round_keys.h"

#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>

#include "fake_rendezvous_service.h"

using namespace ddprun;
using namespace ddprun::agent;
using ddprun::testing::FakeRendezvousService;

namespace {

std::vector<std::string> deletes(FakeRendezvousService& service) {
  std::vector<std::string> out;
  for (const auto& c : service.calls) {
    if (c.rfind("kvDeleteRange ", 0) == 0) out.push_back(c.substr(14));
  }
  service.calls.clear();
  return out;
}

// Whether `key` lies in the range a call recorded as "<from> <to>".
bool inRange(const std::string& range, const std::string& key) {
  const auto space = range.find(' ');
  return range.substr(0, space) <= key && key < range.substr(space + 1);
}

}  // namespace

TEST_CASE("a round's key is its kind, its round in 20 digits and its rank", "[agent]") {
  CHECK(roundKeyPrefix("job", 7) == "job/00000000000000000007/");
  CHECK(roundKeyPrefix("snapshot", UINT64_MAX) == "snapshot/18446744073709551615/");
}

TEST_CASE("the lowest node of a round deletes every key of its kind of the rounds below, once",
          "[agent]") {
  boost::asio::io_context io;
  FakeRendezvousService service(io);
  RoundKeys lowest(service, "k"), other(service, "k");
  // Only the lowest node (self 0) deletes.
  other.tookPart(2, 1);
  CHECK(deletes(service).empty());
  lowest.tookPart(2, 0);
  const auto range = deletes(service);
  REQUIRE(range.size() == 1);
  // Rounds below 2, however numbered (9 sorts above 10 as text, not as padded digits), and
  // nothing of round 2 or above, nor of another kind.
  CHECK(inRange(range[0], roundKeyPrefix("k", 1) + "0"));
  CHECK(inRange(range[0], roundKeyPrefix("k", 0) + "read/3"));
  CHECK_FALSE(inRange(range[0], roundKeyPrefix("k", 2) + "0"));
  CHECK_FALSE(inRange(range[0], roundKeyPrefix("k", 10) + "0"));
  CHECK_FALSE(inRange(range[0], roundKeyPrefix("kk", 1) + "0"));
  CHECK_FALSE(inRange(range[0], roundKeyPrefix("j", 1) + "0"));
  // The same round again deletes nothing more; a later one (rounds skipped) all below it.
  lowest.tookPart(2, 0);
  CHECK(deletes(service).empty());
  lowest.tookPart(100, 0);
  const auto later = deletes(service);
  REQUIRE(later.size() == 1);
  CHECK(inRange(later[0], roundKeyPrefix("k", 9) + "1"));
  CHECK(inRange(later[0], roundKeyPrefix("k", 99) + "1"));
  CHECK_FALSE(inRange(later[0], roundKeyPrefix("k", 100) + "0"));
  CHECK_FALSE(inRange(later[0], roundKeyPrefix("k", 1000) + "0"));
  // A node new to the job deletes as any other lowest node (the keys of nodes gone included),
  // and a rendezvous server that restarted without its state numbers rounds from 1 again.
  RoundKeys fresh(service, "k");
  fresh.tookPart(3, 0);
  REQUIRE(deletes(service).size() == 1);
  lowest.tookPart(1, 0);
  const auto restarted = deletes(service);
  REQUIRE(restarted.size() == 1);
  CHECK(inRange(restarted[0], roundKeyPrefix("k", 0) + "0"));
  CHECK_FALSE(inRange(restarted[0], roundKeyPrefix("k", 1) + "0"));
}
