// KeyValueStore: the rendezvous store workers use to find each other. Wraps LibTorch's c10d
// TCPStore (rank 0 hosts it at MASTER_ADDR:MASTER_PORT) or an in-memory HashStore (thread-ranks
// in tests). The c10d types stay behind a pimpl so this header is LibTorch-free.
// Thread-safe: one store may be shared by every thread of a process.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ddprun::worker {

class KeyValueStore {
 public:
  struct Impl;
  // Asked while a wait goes on: the reason to give it up (it then throws CommError naming it), or
  // "" to go on waiting. An in-place recovery's formation gives up this way when the agent aborts
  // the generation it forms (a node was lost meanwhile).
  using Cancel = std::function<std::string()>;

  // Hosts a TCPStore on host:port (port 0 picks a free one, see port()). Throws CommError when
  // the port cannot be bound.
  static std::shared_ptr<KeyValueStore> tcpServer(const std::string& host, int port,
                                                  std::chrono::milliseconds timeout);
  // Connects to a TCPStore, retrying until `timeout` or until `cancel` gives a reason. Throws
  // CommError naming host:port.
  static std::shared_ptr<KeyValueStore> tcpClient(const std::string& host, int port,
                                                  std::chrono::milliseconds timeout,
                                                  const Cancel& cancel = {});
  // A process-local store; share the pointer between thread-ranks.
  static std::shared_ptr<KeyValueStore> inMemory(std::chrono::milliseconds timeout);

  ~KeyValueStore();

  void set(const std::string& key, const std::vector<char>& value);
  // Blocks until the key exists (bounded by the store timeout).
  std::vector<char> get(const std::string& key);
  std::int64_t add(const std::string& key, std::int64_t delta);
  // Throws CommError listing the keys when they do not all appear within `timeout` (0: at once
  // if they are not there). It asks the store every few milliseconds: for the first 50 ms, after
  // which the wait is marked in the heartbeat file as waiting for peers and c10d's blocking wait
  // takes the rest; with a cancel set (setCancel) until the end, throwing CommError naming the
  // reason once the cancel gives one.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // Sets (or, with an empty function, clears) the cancel every wait asks until it is cleared.
  void setCancel(Cancel cancel);
  // The cancel set now (empty when none): what else the formation waits on asks it too.
  Cancel cancel() const;
  int port() const;  // 0 for in-memory stores

  Impl& impl() { return *impl_; }

 private:
  explicit KeyValueStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddprun::worker
