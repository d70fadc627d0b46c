// How a Gloo group's all_reduce runs, decided once when the group forms: which ranks share a host
// (a fingerprint of each rank's host identity, all-gathered), the topology plan from that
// (topology.h), then shared memory per host and, for a hierarchical plan, one Gloo context per
// local index across the hosts, or for a leaders plan the leaders' context. Any rank or host that
// cannot take part makes every rank fall back to the plain ring together.
#pragma once

#include <gloo/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/device.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/worker/store.h"
#include "gloo_communicator.h"
#include "gloo_mesh.h"
#include "shm_allreduce.h"

namespace ddprun::worker {

// gloo::rendezvous::Store over our KeyValueStore, with keys under a prefix.
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(std::shared_ptr<KeyValueStore> store, std::string prefix,
                   std::chrono::milliseconds timeout);
  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  std::shared_ptr<KeyValueStore> store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

// A full mesh of `count` ranks (this one `index`) over `device`, through `store` under `prefix`;
// connect_timeout to form, op_timeout for its collectives; watched by `watch` (may be null).
// CommError naming `whom` on failure.
std::shared_ptr<gloo::Context> connectGlooContext(int index, int count,
                                                  const std::shared_ptr<KeyValueStore>& store,
                                                  const std::string& prefix,
                                                  std::shared_ptr<gloo::transport::Device> device,
                                                  const GlooOptions& options,
                                                  const std::string& whom, FormingWatch* watch);

struct AllReducePlan {
  std::unique_ptr<ShmAllReduce> shm;      // this host's group, if any
  std::shared_ptr<gloo::Context> column;  // hierarchical only: this rank's ring across hosts
  // Leaders plan (hosts of unequal sizes): this host's representative holds the ring of all
  // hosts' representatives; shm is null on a host of one rank.
  bool leader_mode = false;
  std::shared_ptr<gloo::Context> leaders;
  std::string description = "gloo TCP ring";
};

// Collective over `ctx` (every rank of the group calls it at the same point). The contexts it
// connects are watched by `watch` (may be null).
AllReducePlan planAllReduce(int rank, int size, const std::shared_ptr<KeyValueStore>& store,
                            const GlooOptions& options, const std::shared_ptr<gloo::Context>& ctx,
                            const std::shared_ptr<gloo::transport::Device>& device,
                            FormingWatch* watch);

}  // namespace ddprun::worker
