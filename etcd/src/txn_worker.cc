#include "txn_worker.h"

#include "client.h"
#include "lease_keeper.h"
#include "log.h"

namespace ddprun::etcd {

namespace ep = etcdserverpb;

TxnWorker::TxnWorker(EtcdClient& client, Stopper& stopper, HeldState& held, LeaseKeeper& lease,
                     const Keys& keys, std::string run_id)
    : client_(client),
      stopper_(stopper),
      held_(held),
      lease_(lease),
      keys_(keys),
      run_id_(std::move(run_id)) {}

TxnWorker::~TxnWorker() {
  close();
  join();
}

void TxnWorker::start() {
  thread_ = std::thread([this] { run(); });
}

void TxnWorker::close() {
  {
    MutexLock lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

void TxnWorker::join() {
  if (thread_.joinable()) thread_.join();
}

void TxnWorker::submit(std::function<void()> job) {
  {
    MutexLock lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_all();
}

void TxnWorker::run() {
  for (;;) {
    std::function<void()> job;
    {
      MutexLock lock(mu_);
      while (!closed_ && jobs_.empty()) cv_.wait(mu_);
      if (closed_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

void TxnWorker::connect(Duration retry_for, std::function<void(Status)> done) {
  submit([this, retry_for, done = std::move(done)] { done(connectNow(retry_for)); });
}

void TxnWorker::joinRun(const std::string& node, ApplyFn fn, Duration retry_for,
                        Done<Applied> done) {
  submit([this, node, fn = std::move(fn), retry_for, done = std::move(done)] {
    lease_.keep(node);
    done(applyNow(fn, retry_for, node));
  });
}

void TxnWorker::leaveRun(const std::string& node,
                         std::function<Status(rendezvous::RendezvousState&, TimePoint)> fn,
                         Duration retry_for, std::function<void(Status)> done) {
  submit([this, node, fn = std::move(fn), retry_for, done = std::move(done)] {
    Status result = Status::ok();
    auto applied =
        applyNow([&](rendezvous::RendezvousState& st, TimePoint now) { result = fn(st, now); },
                 retry_for, "");
    if (!applied.isOk()) result = applied.status();
    ep::DeleteRangeRequest del;
    del.set_key(keys_.alive + node);
    (void)client_.deleteRange(del);
    lease_.drop(node);
    done(result);
  });
}

void TxnWorker::put(std::string key, std::string value, Duration retry_for,
                    std::function<void(Status)> done) {
  submit([this, key = std::move(key), value = std::move(value), retry_for, done = std::move(done)] {
    ep::PutRequest put;
    put.set_key(key);
    put.set_value(value);
    ep::PutResponse resp;
    done(stopper_.retrying(retry_for, [&] { return client_.put(put, &resp); }));
  });
}

void TxnWorker::removeRange(std::string from, std::string to, Duration retry_for,
                            std::function<void(Status)> done) {
  submit([this, from = std::move(from), to = std::move(to), retry_for, done = std::move(done)] {
    ep::DeleteRangeRequest del;
    del.set_key(from);
    del.set_range_end(to);
    done(stopper_.retrying(retry_for, [&] { return client_.deleteRange(del); }));
  });
}

Status TxnWorker::connectNow(Duration retry_for) {
  StatusOr<std::string> version = unavailable("not tried");
  Status st = stopper_.retrying(retry_for, [&] {
    version = client_.version();
    return version.status();
  });
  if (!st.isOk()) {
    if (st.code() == StatusCode::kUnimplemented) {
      return unavailable("etcd at " + client_.membersText() + " does not serve the v3 API (" +
                         st.message() + "); etcd-v3 needs etcd 3.x with the v3 API on");
    }
    return st;
  }
  const std::string& v = version.value();
  if (v.empty() || v[0] < '3') {
    return failedPrecondition("etcd at " + client_.membersText() + " is version " + v +
                              "; etcd-v3 needs etcd 3.x");
  }
  etcdLog()->info("etcd rendezvous: etcd {} at {}, key prefix {}", v, client_.membersText(),
                  keys_.prefix);
  // A read of the run's state: credentials and permissions on the prefix are checked here,
  // before anything waits on the watch.
  ep::RangeRequest probe;
  probe.set_key(keys_.state);
  probe.set_keys_only(true);
  ep::RangeResponse probe_resp;
  st = stopper_.retrying(retry_for, [&] { return client_.range(probe, &probe_resp); });
  if (!st.isOk()) return st;
  return lease_.grant(retry_for);
}

StatusOr<TxnWorker::Applied> TxnWorker::applyNow(const ApplyFn& fn, Duration retry_for,
                                                 const std::string& alive_node) {
  StoredValue at = held_.get();
  bool held = at.value != nullptr;  // `at` is the held copy, not a read
  for (int attempt = 0;; ++attempt) {
    if (stopper_.stopping())
      return Status(StatusCode::kCancelled, "the rendezvous service stopped");
    if (!at.value) {
      StatusOr<StoredValue> read = readState(retry_for);
      if (!read.isOk()) return read.status();
      at = std::move(read).value();
      held = false;
    }
    StatusOr<StateUpdate> update = updateStateValue(run_id_, at.value, fn, wallNow());
    if (held && (!update.isOk() || !update->value)) {  // decide on what etcd holds instead
      at = StoredValue{};
      held = false;
      continue;
    }
    if (!update.isOk()) return update.status();
    if (!update->value) {
      return unchanged(std::move(update).value(), at.revision, retry_for, alive_node);
    }
    StatusOr<Commit> done = commit(update.value(), at.mod, retry_for, alive_node);
    if (!done.isOk()) return done.status();
    if (done->written) {
      held_.note({update->value, done->revision, done->revision});
      return Applied{std::move(update->out), done->revision};
    }
    // Another agent wrote first (or the held copy was stale): apply to what etcd holds.
    at = done->now;
    held = false;
    if (attempt > 0 && attempt % 50 == 0) {
      etcdLog()->warn("etcd rendezvous: {} conflicting transactions in a row on {}", attempt,
                      keys_.state);
    }
  }
}

StatusOr<StoredValue> TxnWorker::readState(Duration retry_for) {
  ep::RangeRequest range;
  range.set_key(keys_.state);
  ep::RangeResponse resp;
  Status st = stopper_.retrying(retry_for, [&] { return client_.range(range, &resp); });
  if (!st.isOk()) return st;
  StoredValue read;
  read.value = std::make_shared<const std::string>(
      resp.kvs_size() > 0 ? std::move(*resp.mutable_kvs(0)->mutable_value()) : std::string());
  read.mod = resp.kvs_size() > 0 ? resp.kvs(0).mod_revision() : 0;
  read.revision = resp.header().revision();
  held_.note(read);
  return read;
}

StatusOr<TxnWorker::Applied> TxnWorker::unchanged(StateUpdate update, int64_t revision,
                                                  Duration retry_for,
                                                  const std::string& alive_node) {
  if (!alive_node.empty()) {
    Status st = stopper_.retrying(retry_for, [&] { return lease_.putAlive(alive_node); });
    if (!st.isOk()) return st;
  }
  return Applied{std::move(update.out), revision};
}

StatusOr<TxnWorker::Commit> TxnWorker::commit(const StateUpdate& update, int64_t mod,
                                              Duration retry_for, const std::string& alive_node) {
  ep::TxnRequest txn;
  ep::Compare* cmp = txn.add_compare();
  cmp->set_key(keys_.state);
  cmp->set_result(ep::Compare::EQUAL);
  if (mod == 0) {
    cmp->set_target(ep::Compare::CREATE);
    cmp->set_create_revision(0);
  } else {
    cmp->set_target(ep::Compare::MOD);
    cmp->set_mod_revision(mod);
  }
  ep::PutRequest* put = txn.add_success()->mutable_request_put();
  put->set_key(keys_.state);
  put->set_value(*update.value);
  ep::PutRequest* alive = nullptr;
  if (!alive_node.empty()) {
    alive = txn.add_success()->mutable_request_put();
    alive->set_key(keys_.alive + alive_node);
    alive->set_value("1");
  }
  txn.add_failure()->mutable_request_range()->set_key(keys_.state);
  ep::TxnResponse resp;
  Status st = stopper_.retrying(retry_for, [&] {
    if (alive == nullptr) return client_.txn(txn, &resp);
    return lease_.underLease([&](int64_t lease) {
      alive->set_lease(lease);
      return client_.txn(txn, &resp);
    });
  });
  if (!st.isOk()) return st;
  Commit out;
  out.written = resp.succeeded();
  out.revision = resp.header().revision();
  if (out.written) return out;
  ep::RangeResponse* now = resp.mutable_responses(0)->mutable_response_range();
  out.now.value = std::make_shared<const std::string>(
      now->kvs_size() > 0 ? std::move(*now->mutable_kvs(0)->mutable_value()) : std::string());
  out.now.mod = now->kvs_size() > 0 ? now->kvs(0).mod_revision() : 0;
  out.now.revision = out.revision;
  held_.note(out.now);
  return out;
}

}  // namespace ddprun::etcd
