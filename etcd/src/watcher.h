// Watcher: the watch thread. It reads the whole prefix once (a full sync), then watches it from
// the revision after that read. When the stream breaks (a member went away, etcd restarted), the
// next watch resumes on the next member at the revision after the last event delivered, so no
// change written meanwhile is lost; only a compacted revision forces a full sync again. Each
// watch carries etcd's `hasleader` metadata, so a member cut off from its leader ends the stream
// instead of going quiet.
//
// A store that went back (etcd restarted on an empty or older data directory, or another cluster
// behind the same address) is noticed from the headers etcd sends: a cluster id other than the
// one seen, or a revision below one seen. The watch would otherwise wait at a revision the new
// store never reaches; instead the held state is forgotten and the run is read again as on a
// first sync (the agents then join again).
//
// The thread keeps the held copy of the state key current (held_state.h) and hands everything
// else to its Events, called on the watch thread: the service's posts them to its loop.
//
// Threading: start() and join() on the service's loop; everything else on the watch thread.
// Lifetime: join() before the client, the stopper, the held state or the events go.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/common/status.h"
#include "held_state.h"
#include "keys.h"
#include "stopper.h"

namespace etcdserverpb {
class WatchResponse;
}

namespace ddprun::etcd {

class EtcdClient;

// One key under the prefix as a read or the watch delivered it: written (put) or deleted.
struct KeyEvent {
  bool put = true;
  std::string key;
  std::shared_ptr<const std::string> value;  // shared with the held copy of the state key
  int64_t mod_revision = 0;
};

class Watcher {
 public:
  struct Events {
    // Every key under the prefix at `revision` (a first sync, or a sync after a compaction or a
    // store that went back).
    std::function<void(std::vector<KeyEvent>, int64_t revision)> synced;
    // The events of one watch response; `revision` is the store's at that response.
    std::function<void(std::vector<KeyEvent>, int64_t revision)> changed;
    // A watch that continues a broken one was created.
    std::function<void()> resumed;
    // Reading the prefix failed with what waiting does not fix (credentials, permissions).
    std::function<void(Status)> failed;
    // The store went back: revisions seen before mean nothing now.
    std::function<void()> store_went_back;
  };

  Watcher(EtcdClient& client, Stopper& stopper, HeldState& held, const Keys& keys, Events events);
  ~Watcher();
  Watcher(const Watcher&) = delete;
  Watcher& operator=(const Watcher&) = delete;

  void start();
  void join();

 private:
  struct Cursor;  // where the watch stands (the watch thread's own)

  void run();
  // A full read of the prefix; false when it failed.
  bool syncAll(Cursor& at);
  // One watch stream from `at`, read until it ends; whether etcd created the watch, and in
  // `ended` what the stream ended with.
  bool watchFrom(Cursor& at, std::string* ended);
  // One response of the stream; false when the stream is done with.
  bool onResponse(Cursor& at, etcdserverpb::WatchResponse& wr, bool& created);
  void forgetStore(const std::string& why);

  EtcdClient& client_;
  Stopper& stopper_;
  HeldState& held_;
  const Keys& keys_;
  const Events events_;
  std::thread thread_;  // started and joined on the loop
};

}  // namespace ddprun::etcd
