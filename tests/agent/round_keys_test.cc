// RoundKeys (agent/src/round_keys.h): what a node published for a round is deleted once it takes
// part in a later one, by itself, and by the new round's lowest node for every node of the round
// it took part in before.
#include "round_keys.h"

#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>

#include "fake_rendezvous_service.h"

using namespace ddprun;
using namespace ddprun::agent;
using ddprun::testing::FakeRendezvousService;

namespace {

std::vector<std::string> keysOf(const std::string& round, int nodes) {
  std::vector<std::string> keys;
  for (int i = 0; i < nodes; ++i) keys.push_back("k/" + round + "/" + std::to_string(i));
  return keys;
}

std::vector<std::string> deletes(FakeRendezvousService& service) {
  std::vector<std::string> out;
  for (const auto& c : service.calls) {
    if (c.rfind("kvDelete ", 0) == 0) out.push_back(c.substr(9));
  }
  service.calls.clear();
  return out;
}

}  // namespace

TEST_CASE("a node deletes its own key of its previous round, the lowest node every key of it",
          "[agent]") {
  boost::asio::io_context io;
  FakeRendezvousService service(io);
  RoundKeys mine(service), lowest(service);
  // Round 1: nothing before it.
  mine.tookPart(1, keysOf("1", 3), 2);
  lowest.tookPart(1, keysOf("1", 3), 0);
  CHECK(deletes(service).empty());
  // Round 2: each deletes what round 1 left; the lowest node all of it (a node gone included).
  mine.tookPart(2, keysOf("2", 2), 1);
  CHECK(deletes(service) == std::vector<std::string>{"k/1/2"});
  lowest.tookPart(2, keysOf("2", 2), 0);
  CHECK(deletes(service) == keysOf("1", 3));
  // The same round again deletes nothing; the next round deletes round 2's.
  mine.tookPart(2, keysOf("2", 2), 1);
  CHECK(deletes(service).empty());
  mine.tookPart(5, keysOf("5", 2), 0);  // it is the lowest node of round 5
  CHECK(deletes(service) == keysOf("2", 2));
  // A rendezvous server that restarted numbers rounds from 1 again: round 5's keys went with its
  // state, nothing is deleted, and from then on each round deletes the one before.
  mine.tookPart(1, keysOf("1", 2), 1);
  CHECK(deletes(service).empty());
  mine.tookPart(2, keysOf("2", 2), 1);
  CHECK(deletes(service) == std::vector<std::string>{"k/1/1"});
}
