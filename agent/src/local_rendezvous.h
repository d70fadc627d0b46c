// LocalRendezvous: the rendezvous of a single-node job (--standalone, or static with one node).
// Every round completes at once with this node as group rank 0; --standalone picks a free
// MASTER_PORT for each round as torchrun does. Callbacks are posted to the io_context.
#pragma once

#include <boost/asio/io_context.hpp>

#include "ddprun/agent/rendezvous_client.h"

namespace ddprun::agent {

class LocalRendezvous final : public RendezvousClient {
 public:
  // `base` carries run id, master address and local world size; with pick_free_port each
  // round gets a port that was free on this host.
  LocalRendezvous(boost::asio::io_context& io, RoundInfo base, bool pick_free_port)
      : io_(io), base_(std::move(base)), pick_free_port_(pick_free_port) {}

  void nextRound(RoundCallback done) override;
  void reportFailure(FailureKind) override {}  // no other node to tell
  void leave() override {}
  // One node: nobody to wait for.
  void exitBarrier(Duration, StatusCallback done) override;
  void shutdown(bool succeeded, bool left, std::function<void()> done) override;
  uint64_t currentRound() const override {
    return next_round_ == 0 ? 0 : static_cast<uint64_t>(next_round_ - 1);
  }

 private:
  boost::asio::io_context& io_;
  RoundInfo base_;
  bool pick_free_port_;
  bool closed_ = false;
  int next_round_ = 0;
};

// A TCP port that was free on all interfaces a moment ago.
StatusOr<int> findFreePort();

}  // namespace ddprun::agent
