// TxnWorker: the thread that runs the service's requests against etcd, one at a time and in the
// order the loop made them: the first contact, the state transactions, key writes. Each request
// gets its `done` called on this thread with the result; the service passes callbacks that post
// to its loop.
//
// Every state change is a transaction: take the state and its mod_revision, apply the request
// (state_update.h), and write the result back if the key still has that mod_revision; on a
// conflict, again on the value the refused transaction returned (no second read). The first
// attempt starts from the state this agent already holds (held_state.h), so a request whose copy
// is current costs one round trip; a stale copy costs only a refused transaction. A decision to
// write nothing is taken only on a state read from etcd, never on the held copy.
//
// Threading: submit() and the request methods from the service's loop; jobs on the worker
// thread. Lifetime: close() and join() before the client, the lease or the held state go.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <thread>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/common/thread_annotations.h"
#include "held_state.h"
#include "keys.h"
#include "state_update.h"
#include "stopper.h"

namespace ddprun::etcd {

class EtcdClient;
class LeaseKeeper;

class TxnWorker {
 public:
  // What a transaction wrote (or found: nothing to write) and the store revision it is of.
  struct Applied {
    rendezvous::RendezvousState::Outbox out;
    int64_t revision = 0;
  };
  template <typename T>
  using Done = std::function<void(StatusOr<T>)>;

  TxnWorker(EtcdClient& client, Stopper& stopper, HeldState& held, LeaseKeeper& lease,
            const Keys& keys, std::string run_id);
  ~TxnWorker();
  TxnWorker(const TxnWorker&) = delete;
  TxnWorker& operator=(const TxnWorker&) = delete;

  void start();
  // No job starts after this; the one running ends at its next check of the stopper.
  void close() EXCLUDES(mu_);
  void join();

  // First contact: a v3 member answers with its version, the state key can be read (credentials
  // and permissions are checked here), and this agent gets its lease.
  void connect(Duration retry_for, std::function<void(Status)> done);
  // Applies `fn` to the stored run; `done` gets what `fn` returned on the state that was written
  // (or the transaction's error).
  template <typename T>
  void apply(std::function<StatusOr<T>(rendezvous::RendezvousState&, TimePoint)> fn,
             Duration retry_for, Done<T> done) {
    submit([this, fn = std::move(fn), retry_for, done = std::move(done)] {
      StatusOr<T> result = unavailable("not applied");
      auto applied =
          applyNow([&](rendezvous::RendezvousState& st, TimePoint now) { result = fn(st, now); },
                   retry_for, "");
      if (!applied.isOk()) result = applied.status();
      done(std::move(result));
    });
  }
  // A join: `node` and its alive key (under this agent's lease) appear in one transaction, so no
  // reader sees one without the other; `done` gets the transaction's outbox.
  void joinRun(const std::string& node, ApplyFn fn, Duration retry_for, Done<Applied> done);
  // A leave: applies `fn`, then deletes the node's alive key.
  void leaveRun(const std::string& node,
                std::function<Status(rendezvous::RendezvousState&, TimePoint)> fn,
                Duration retry_for, std::function<void(Status)> done);
  // A plain put (the run's key-value store).
  void put(std::string key, std::string value, Duration retry_for,
           std::function<void(Status)> done);
  // A plain delete of every key k with from <= k < to (OK when there was none).
  void removeRange(std::string from, std::string to, Duration retry_for,
                   std::function<void(Status)> done);

 private:
  void submit(std::function<void()> job) EXCLUDES(mu_);
  void run() EXCLUDES(mu_);
  Status connectNow(Duration retry_for);
  // The transaction; `alive_node`: a node id whose alive key is put in the same transaction.
  StatusOr<Applied> applyNow(const ApplyFn& fn, Duration retry_for, const std::string& alive_node);
  // The state key as etcd holds it now.
  StatusOr<StoredValue> readState(Duration retry_for);
  // Nothing to write: the alive key alone, when there is one.
  StatusOr<Applied> unchanged(StateUpdate update, int64_t revision, Duration retry_for,
                              const std::string& alive_node);
  // What a write of the state key came to: written, or refused with the value etcd holds.
  struct Commit {
    bool written = false;
    int64_t revision = 0;  // the store revision of the answer
    StoredValue now;       // refused: what etcd holds
  };
  // Writes `update` if the state key still has `mod`.
  StatusOr<Commit> commit(const StateUpdate& update, int64_t mod, Duration retry_for,
                          const std::string& alive_node);

  EtcdClient& client_;
  Stopper& stopper_;
  HeldState& held_;
  LeaseKeeper& lease_;
  const Keys& keys_;
  const std::string run_id_;
  Mutex mu_;
  std::condition_variable_any cv_;
  std::deque<std::function<void()>> jobs_ GUARDED_BY(mu_);
  bool closed_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // started and joined on the loop
};

}  // namespace ddprun::etcd
