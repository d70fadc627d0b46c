// Forming a Gloo full mesh that the agent can give up on (in-place recovery).
//
// Gloo's own connectFullMesh keeps its pairs to itself until every one is connected, and a pair
// whose peer never connects (a node lost after it published its addresses) waits 5 x the
// connect timeout. Here the pairs belong to the context from the start, and a FormingWatch fails
// them the moment the store's cancel gives a reason (the agent aborted the generation being
// formed): the connect, or a collective of the planning that follows, throws at once.
#pragma once

#include <gloo/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/device.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/worker/store.h"

namespace ddprun::worker {

// Watches the contexts of one formation. With no cancel it does nothing (and starts no thread);
// with one, a thread asks it every 2 ms from the first watch() until the watch ends, and the
// first reason it gives fails every pair of every context watched (failGlooPairs), and of every
// one watched later. The watch keeps its contexts alive until it ends.
class FormingWatch {
 public:
  explicit FormingWatch(KeyValueStore::Cancel cancel);
  ~FormingWatch();
  FormingWatch(const FormingWatch&) = delete;
  FormingWatch& operator=(const FormingWatch&) = delete;

  bool active() const { return static_cast<bool>(cancel_); }
  void watch(std::shared_ptr<gloo::Context> ctx);
  // The reason it failed the pairs with; empty while it has not.
  std::string fired() const;

 private:
  void run();

  const KeyValueStore::Cancel cancel_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::string fired_;
  std::vector<std::shared_ptr<gloo::Context>> contexts_;
  std::thread thread_;
};

// A full mesh of `size` ranks (this one `rank`) over `device`, through `store`: each rank
// publishes the addresses of its pairs under its rank, then connects each pair to the peer's
// (Gloo's keys and layout; the pairs' local rank, which no transport of this Gloo reads, is not
// exchanged). `timeout` bounds the waits; the context's timeout is `timeout` too. `watch` (may be
// null) watches the context from before the first connect; `published` (may be empty) runs once
// this rank's addresses are in the store. Throws what Gloo and the store throw.
std::shared_ptr<gloo::Context> connectGlooMesh(
    int rank, int size, gloo::rendezvous::Store& store,
    const std::shared_ptr<gloo::transport::Device>& device, std::chrono::milliseconds timeout,
    FormingWatch* watch, const std::function<void()>& published = {});

}  // namespace ddprun::worker
