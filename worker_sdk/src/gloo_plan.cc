#include "gloo_plan.h"

#include <gloo/allgather.h>

#include <algorithm>

#include "ddprun/common/log_text.h"
#include "ddprun/worker/errors.h"
#include "gloo_ring.h"
#include "topology.h"

namespace ddprun::worker {

GlooStoreAdapter::GlooStoreAdapter(std::shared_ptr<KeyValueStore> store, std::string prefix,
                                   std::chrono::milliseconds timeout)
    : store_(std::move(store)), prefix_(std::move(prefix)), timeout_(timeout) {}

void GlooStoreAdapter::set(const std::string& key, const std::vector<char>& data) {
  store_->set(prefix_ + key, data);
}

std::vector<char> GlooStoreAdapter::get(const std::string& key) {
  store_->wait({prefix_ + key}, timeout_);
  return store_->get(prefix_ + key);
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void GlooStoreAdapter::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(prefix_ + k);
  store_->wait(full, timeout);
}

std::shared_ptr<gloo::Context> connectGlooContext(int index, int count,
                                                  const std::shared_ptr<KeyValueStore>& store,
                                                  const std::string& prefix,
                                                  std::shared_ptr<gloo::transport::Device> device,
                                                  const GlooOptions& options,
                                                  const std::string& whom, FormingWatch* watch) {
  GlooStoreAdapter adapter(store, options.prefix + prefix, options.connect_timeout);
  std::shared_ptr<gloo::Context> context;
  try {
    context = connectGlooMesh(index, count, adapter, device, options.connect_timeout, watch);
  } catch (const std::exception& e) {
    throw CommError("gloo: " + whom + ": " + e.what());
  }
  context->setTimeout(options.op_timeout);
  return context;
}

namespace {

// FNV-1a: the same on every rank and build, unlike std::hash.
uint64_t fingerprint(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Collective over `ctx`. Finds which ranks share a host (a fingerprint of the host identity,
// all-gathered), plans the topology from that (planTopology), then sets up shared memory per host
// and, for a hierarchical plan, one Gloo context per local index across the hosts. Any rank or
// host that cannot take part makes every rank fall back to the plain ring.
}  // namespace

AllReducePlan planAllReduce(int rank, int size, const std::shared_ptr<KeyValueStore>& store,
                            const GlooOptions& options, const std::shared_ptr<gloo::Context>& ctx,
                            const std::shared_ptr<gloo::transport::Device>& device,
                            FormingWatch* watch) {
  static const ddprun::TextLogger log("worker");
  AllReducePlan plan;
  const bool wanted = options.shared_memory && !shmDisabledByEnvironment();
  if (size < 2) return plan;
  const std::string identity =
      options.host_identity.empty() ? localHostIdentity() : options.host_identity;
  // A rank that does not want shared memory says so (kOptedOut): every rank falls back together.
  const HostKey mine = wanted ? std::max<HostKey>(fingerprint(identity), 1) : kOptedOut;
  std::vector<HostKey> hosts(static_cast<size_t>(size));
  {
    gloo::AllgatherOptions opts(ctx);
    opts.setInput(const_cast<HostKey*>(&mine), 1);
    opts.setOutput(hosts.data(), hosts.size());
    opts.setTag(0x7ffffff0u);
    opts.setTimeout(options.connect_timeout);
    gloo::allgather(opts);
  }
  const TopologyPlan topology = planTopology(hosts, rank);
  const int num_hosts = topology.num_hosts;
  const int host_index = topology.host_index;
  const int local_rank = topology.local_rank;
  const int local_size = static_cast<int>(topology.host_ranks.size());
  if (topology.kind == TopologyKind::kFlat) {
    DDPRUN_LOG(log, kDebug,
               "rank " << rank << ": " << num_hosts << " host(s), " << local_size
                       << " rank(s) on this one: no shared-memory all-reduce");
    return plan;
  }

  ShmOptions shm_options;
  shm_options.prefix = options.prefix + "/host" + std::to_string(host_index);
  shm_options.setup_timeout = options.connect_timeout;
  shm_options.op_timeout = options.op_timeout;
  shm_options.host_identity = identity;
  // A host of one rank (leaders plan) has nobody to share memory with.
  auto shm = local_size > 1 ? ShmAllReduce::tryCreate(local_rank, local_size, store, shm_options)
                            : nullptr;
  auto connect = [&](int index, int count, const std::string& prefix, const std::string& whom) {
    return connectGlooContext(index, count, store, prefix, device, options,
                              "rank " + std::to_string(rank) + " could not connect to " + whom,
                              watch);
  };
  // Collective over ctx: whether every rank can go on with the plan.
  auto everyRank = [&](bool mine) {
    return everyRankAgrees(ctx, mine, 0x7ffffff1u, options.connect_timeout);
  };
  if (topology.kind == TopologyKind::kLeaders) {
    // Every host of several ranks must have its group, or nobody uses one.
    if (!everyRank(shm || local_size == 1)) return plan;
    if (topology.isLeader()) {
      plan.leaders = connect(host_index, num_hosts, "/leaders/", "the other hosts' leaders");
    }
    plan.shm = std::move(shm);
    plan.leader_mode = true;
    plan.description = topology.describe();
    return plan;
  }
  if (topology.kind == TopologyKind::kHierarchical) {
    // Every host must have its group, or nobody uses one.
    if (!everyRank(shm != nullptr)) return plan;
    plan.column = connect(host_index, num_hosts, "/column" + std::to_string(local_rank) + "/",
                          "its peers on the other hosts");
  }
  if (!shm) return plan;
  plan.shm = std::move(shm);
  plan.description = topology.describe();
  return plan;
}

}  // namespace ddprun::worker
