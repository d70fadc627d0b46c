// RendezvousService: the agent's name for the backend seam, rendezvous::Service
// (ddprun/rendezvous/service.h): what MultiNodeRendezvous, the job identity check and snapshot
// replication call, and what the gRPC and etcd-v3 backends implement. The interface lives in the
// rendezvous core so that the etcd adapter, a component below the agent, implements it too.
#pragma once

#include "ddprun/rendezvous/service.h"

namespace ddprun::agent {

using RendezvousService = rendezvous::Service;
using rendezvous::CallPolicy;
using rendezvous::FailureKind;

}  // namespace ddprun::agent
