// chooseRendezvous: which rendezvous a node's agent uses for its job, decided from the config
// alone — in-process for one node (--standalone, or the static backend with one node), else the
// multi-node protocol over ddprun's gRPC rendezvous at --rdzv-endpoint, hosted by this agent
// when the endpoint is this host (torchrun's is_host) or when it is static node rank 0.
// Pure: whether a host is this host is asked through `is_this_host`. Thread-compatible.
#pragma once

#include <functional>
#include <string>

#include "ddprun/agent/config.h"
#include "ddprun/agent/multinode_rendezvous.h"
#include "ddprun/agent/worker_env.h"
#include "ddprun/common/status.h"
#include "ddprun/rendezvous/conf.h"

namespace ddprun::agent {

// kEtcd: the same multi-node protocol over etcd v3 (--rdzv-backend=etcd-v3; `endpoint` lists the
// members, nobody hosts anything).
enum class RendezvousKind { kLocal, kGrpc, kEtcd };
// Whether this agent starts the rendezvous server: never, when it can bind the endpoint (another
// agent on this host may have been first), or always (failing when it cannot).
enum class Hosting { kNo, kMay, kMust };

struct RendezvousChoice {
  RendezvousKind kind = RendezvousKind::kLocal;
  // kLocal: the round every attempt gets; with pick_free_port a fresh free MASTER_PORT each.
  RoundInfo local_round;
  bool pick_free_port = false;
  // kGrpc:
  std::string endpoint;  // HOST:PORT of the rendezvous
  Hosting hosting = Hosting::kNo;
  MultiNodeOptions multinode;
  // Static backend without --rdzv-endpoint: the endpoint is MASTER_PORT+1 on --master-addr, a
  // second port users do not expect; this says so, and how to move it, in every message about
  // the endpoint (waiting for it, failing to bind or reach it). Empty otherwise.
  std::string endpoint_note;
  // How long a local worker failure is held before it is reported (SupervisorOptions).
  Duration failure_grace = Duration::zero();
};

using IsThisHost = std::function<bool(const std::string& host)>;

// INVALID_ARGUMENT for a combination that cannot work (the static backend's MASTER_PORT+1
// beyond 65535).
StatusOr<RendezvousChoice> chooseRendezvous(const AgentConfig& cfg, const std::string& local_addr,
                                            const IsThisHost& is_this_host);

}  // namespace ddprun::agent
