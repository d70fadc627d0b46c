// FakeRendezvous: answers nextRound and the exit barrier at once (or holds them when `hold` /
// `hold_barrier` is set, for the test to answer later) and counts calls.
#pragma once

#include <vector>

#include "ddprun/agent/rendezvous_client.h"

namespace ddprun::testing {

class FakeRendezvous final : public agent::RendezvousClient {
 public:
  void nextRound(RoundCallback done) override {
    ++joins;
    if (hold) {
      pending = std::move(done);
      return;
    }
    agent::RoundInfo r = round;
    r.round = joins - 1;
    done(r);
  }
  void reportFailure(agent::FailureKind kind) override {
    ++failures;
    failure_kinds.push_back(kind);
  }
  void leave() override { ++leaves; }
  void exitBarrier(Duration timeout, StatusCallback done) override {
    ++barriers;
    barrier_timeout = timeout;
    if (hold_barrier) {
      pending_barrier = std::move(done);
      return;
    }
    done(Status::ok());
  }
  void shutdown(bool, bool, std::function<void()> done) override {
    ++closes;
    done();
  }
  uint64_t currentRound() const override { return joins == 0 ? 0 : joins - 1; }
  uint64_t formingRound() const override { return forming; }

  agent::RoundInfo round;
  bool hold = false;
  RoundCallback pending;
  bool hold_barrier = false;
  StatusCallback pending_barrier;
  Duration barrier_timeout{};
  uint64_t forming = 0;  // what formingRound() answers
  int joins = 0, failures = 0, leaves = 0, closes = 0, barriers = 0;
  std::vector<agent::FailureKind> failure_kinds;  // one per reportFailure, in order
};

}  // namespace ddprun::testing
