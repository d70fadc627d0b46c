// Backend: the etcd side of one EtcdRendezvousService: the client and the three threads that use
// it, each a file of its own,
//   TxnWorker    the requests (first contact, state transactions, key writes), in order;
//   Watcher      the watch on the run's prefix (full syncs, resumed streams);
//   LeaseKeeper  this agent's lease, kept alive;
// with what they share: the Stopper they pause on and the HeldState of the state key. None of
// them touches the service's state: results reach its loop through the callbacks they are given.
//
// Threading: built, started and stopped on the service's loop. Lifetime: stop() (or the
// destructor) cancels what is in flight, joins the threads and revokes the lease.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "client.h"
#include "ddprun/etcd/rendezvous_service.h"
#include "held_state.h"
#include "keys.h"
#include "lease_keeper.h"
#include "stopper.h"
#include "txn_worker.h"
#include "watcher.h"

namespace ddprun::etcd {

struct Backend {
  Backend(const EtcdServiceOptions& options, const Keys& keys, Watcher::Events events);
  ~Backend() { stop(); }
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // The client's options for the service's: its endpoints split, TLS, credentials.
  static EtcdOptions clientOptions(const EtcdServiceOptions& o);
  // Starts the watcher and the lease keeper (the lease was granted).
  void startWatching();
  void stop();

  EtcdClient client;
  Stopper stopper;
  HeldState held;
  LeaseKeeper lease;
  TxnWorker worker;
  Watcher watcher;
};

}  // namespace ddprun::etcd
