// RoundKeys (agent/include/ddprun/agent/round_keys.h): the lowest node of each round deletes, in
// one range, every key of its kind published for a round below; the key format (common/round_key.h)
// sorts every round below r under that range, and no key of round r or above.
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

// Whether the one range `service` was asked to delete since the last look holds every key of kind
// "k" of the rounds below `round` (however numbered: 9 sorts above 10 as text, not as padded
// digits) and none of `round` or above, nor of another kind.
bool deletedExactlyBelow(FakeRendezvousService& service, uint64_t round) {
  const auto ranges = deletes(service);
  if (ranges.size() != 1) return false;
  const std::string& range = ranges[0];
  for (uint64_t below : {uint64_t{0}, round / 2, round - 1}) {
    if (!inRange(range, roundKeyPrefix("k", below) + "0") ||
        !inRange(range, roundKeyPrefix("k", below) + "read/3")) {
      return false;
    }
  }
  for (uint64_t above : {round, round + 1, round * 10, UINT64_MAX}) {
    if (inRange(range, roundKeyPrefix("k", above) + "0")) return false;
  }
  return !inRange(range, roundKeyPrefix("kk", 1) + "0") &&
         !inRange(range, roundKeyPrefix("j", 1) + "0");
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
  CHECK(deletedExactlyBelow(service, 2));
  // The same round again deletes nothing more; a later one (rounds skipped) all below it.
  lowest.tookPart(2, 0);
  CHECK(deletes(service).empty());
  lowest.tookPart(100, 0);
  CHECK(deletedExactlyBelow(service, 100));
  // A node new to the job deletes as any other lowest node (the keys of nodes gone included),
  // and a rendezvous server that restarted without its state numbers rounds from 1 again.
  RoundKeys fresh(service, "k");
  fresh.tookPart(3, 0);
  CHECK(deletedExactlyBelow(service, 3));
  lowest.tookPart(1, 0);
  CHECK(deletedExactlyBelow(service, 1));
}
