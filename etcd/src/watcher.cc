#include "watcher.h"

#include <algorithm>
#include <optional>

#include "client.h"
#include "log.h"

namespace ddprun::etcd {

namespace ep = etcdserverpb;

namespace {

// The cluster id and the highest revision the headers of one store carried.
class StoreIdentity {
 public:
  // Why `h` is not of this store (or of it gone back in time); nullopt when it may be.
  std::optional<std::string> wentBack(const ep::ResponseHeader& h) const {
    if (cluster_id_ != 0 && h.cluster_id() != 0 && h.cluster_id() != cluster_id_) {
      return "its cluster id changed from " + std::to_string(cluster_id_) + " to " +
             std::to_string(h.cluster_id());
    }
    if (h.revision() != 0 && h.revision() < revision_) {
      return "it is at revision " + std::to_string(h.revision()) + ", before the revision " +
             std::to_string(revision_) + " this agent saw";
    }
    return std::nullopt;
  }
  void note(const ep::ResponseHeader& h) {
    if (h.cluster_id() != 0) cluster_id_ = h.cluster_id();
    revision_ = std::max(revision_, h.revision());
  }

 private:
  uint64_t cluster_id_ = 0;
  int64_t revision_ = 0;
};

}  // namespace

struct Watcher::Cursor {
  int64_t next_rev = 0;  // 0: a full sync is needed
  bool resumed = false;  // the next stream continues an earlier one
  StoreIdentity store;   // what the headers said so far
};

Watcher::Watcher(EtcdClient& client, Stopper& stopper, HeldState& held, const Keys& keys,
                 Events events)
    : client_(client), stopper_(stopper), held_(held), keys_(keys), events_(std::move(events)) {}

Watcher::~Watcher() { join(); }

void Watcher::start() {
  thread_ = std::thread([this] { run(); });
}

void Watcher::join() {
  if (thread_.joinable()) thread_.join();
}

void Watcher::run() {
  Cursor at;
  int refused = 0;  // streams in a row that ended before etcd created the watch
  while (!stopper_.stopping()) {
    if (at.next_rev == 0 && !syncAll(at)) {
      if (!stopper_.pause(std::chrono::milliseconds(250))) return;
      continue;
    }
    std::string ended;
    const bool created = watchFrom(at, &ended);
    if (stopper_.stopping()) return;
    refused = created ? 0 : refused + 1;
    // While no member answers, one line says so (not one per attempt), and the attempts slow
    // down to one a second.
    etcdLog()->log(refused <= 1 ? spdlog::level::info : spdlog::level::debug,
                   "etcd rendezvous: watch ended ({}); {} on the next member", ended,
                   at.next_rev == 0 ? std::string("reading the whole run again")
                                    : "resuming at revision " + std::to_string(at.next_rev));
    at.resumed = true;
    client_.rotate();
    const auto wait = std::chrono::milliseconds(100 << std::min(refused, 4));
    if (!stopper_.pause(std::min<Duration>(wait, std::chrono::seconds(1)))) return;
  }
}

bool Watcher::syncAll(Cursor& at) {
  ep::RangeRequest range;
  range.set_key(keys_.prefix);
  range.set_range_end(prefixEnd(keys_.prefix));
  ep::RangeResponse resp;
  Status st = client_.range(range, &resp);
  if (!st.isOk()) {
    etcdLog()->debug("etcd rendezvous: sync failed: {}", st.message());
    if (st.code() != StatusCode::kUnavailable && st.code() != StatusCode::kDeadlineExceeded &&
        st.code() != StatusCode::kCancelled) {
      events_.failed(st);  // credentials or permissions: waiting will not help
    }
    return false;
  }
  const int64_t revision = resp.header().revision();
  if (auto why = at.store.wentBack(resp.header())) forgetStore(*why);
  at.store.note(resp.header());
  std::vector<KeyEvent> keys;
  bool has_state = false;
  for (auto& kv : *resp.mutable_kvs()) {
    KeyEvent key;
    key.key = kv.key();
    key.value = std::make_shared<const std::string>(std::move(*kv.mutable_value()));
    key.mod_revision = kv.mod_revision();
    if (key.key == keys_.state) {
      held_.note({key.value, key.mod_revision, revision});
      has_state = true;
    }
    keys.push_back(std::move(key));
  }
  if (!has_state) held_.note({std::make_shared<const std::string>(), 0, revision});
  events_.synced(std::move(keys), revision);
  at.next_rev = revision + 1;
  at.resumed = false;
  return true;
}

bool Watcher::watchFrom(Cursor& at, std::string* ended) {
  grpc::ClientContext ctx;
  // A member cut off from its cluster's leader ends the watch instead of going quiet.
  ctx.AddMetadata("hasleader", "true");
  auto stream = client_.openWatch(&ctx);
  ep::WatchRequest req;
  ep::WatchCreateRequest* create = req.mutable_create_request();
  create->set_key(keys_.prefix);
  create->set_range_end(prefixEnd(keys_.prefix));
  create->set_start_revision(at.next_rev);
  bool created = false;
  if (stream->Write(req)) {
    ep::WatchResponse wr;
    while (stream->Read(&wr)) {
      if (!onResponse(at, wr, created)) break;
    }
  }
  ctx.TryCancel();
  grpc::Status fin = stream->Finish();
  client_.release(&ctx);
  *ended = fin.error_message();
  return created;
}

bool Watcher::onResponse(Cursor& at, ep::WatchResponse& wr, bool& created) {
  if (auto why = at.store.wentBack(wr.header())) {
    forgetStore(*why);
    at.store = StoreIdentity{};
    at.next_rev = 0;
    return false;
  }
  at.store.note(wr.header());
  created = created || wr.created();
  if (wr.compact_revision() != 0) {
    etcdLog()->warn("etcd rendezvous: revision {} was compacted; syncing the whole run again",
                    at.next_rev);
    at.next_rev = 0;
    return false;
  }
  if (wr.canceled()) return false;
  if (wr.created() && at.resumed) events_.resumed();
  if (wr.events_size() == 0) return true;
  std::vector<KeyEvent> events;
  for (mvccpb::Event& e : *wr.mutable_events()) {
    KeyEvent ev;
    ev.put = e.type() == mvccpb::Event::PUT;
    ev.key = e.kv().key();
    ev.value = std::make_shared<const std::string>(
        ev.put ? std::move(*e.mutable_kv()->mutable_value()) : std::string());
    ev.mod_revision = e.kv().mod_revision();
    at.next_rev = std::max(at.next_rev, ev.mod_revision + 1);
    if (ev.key == keys_.state) {
      held_.note({ev.value, ev.put ? ev.mod_revision : 0, ev.mod_revision});
    }
    events.push_back(std::move(ev));
  }
  events_.changed(std::move(events), wr.header().revision());
  return true;
}

// The store went back: nothing read from the old one is kept for transactions, and the loop
// forgets the revisions it had seen (the full sync that follows brings the new store's).
void Watcher::forgetStore(const std::string& why) {
  etcdLog()->warn(
      "etcd rendezvous: etcd's store went back ({}: restarted on an empty or older data "
      "directory?); reading the run again, and the nodes join again",
      why);
  held_.forget();
  events_.store_went_back();
}

}  // namespace ddprun::etcd
