// PeerConnections: each peer host's open connections to this process's gRPC servers, and the
// bound on them (the pure core of accept_guard.h, which feeds it every accepted connection).
//
// The guard sees connections open (accept4) but not close (gRPC closes them), so a record is
// checked when it matters: once a host is at the bound, each of its records is asked whether its
// descriptor still holds that connection (the same peer endpoint), and those that do not are
// dropped. A descriptor number accepted again replaces whatever record it had. Records are at
// most one per descriptor number, so they are bounded by the process's descriptor limit.
//
// Not thread-safe: the guard holds a mutex around it.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <string>

namespace ddprun::rendezvous {

class PeerConnections {
 public:
  // Whether descriptor `fd` still holds the connection from `endpoint` recorded for it.
  using Alive = std::function<bool(int fd, const std::string& endpoint)>;

  explicit PeerConnections(size_t max_per_host) : max_per_host_(max_per_host) {}

  // A connection from `endpoint` (HOST:PORT) of `host` was accepted on `fd`. True: recorded;
  // false: `host` already holds max_per_host live connections (nothing recorded: the caller
  // closes it).
  bool admit(const std::string& host, const std::string& endpoint, int fd, const Alive& alive);

  // The live-or-unchecked connections recorded for `host`.
  size_t count(const std::string& host) const;
  size_t maxPerHost() const { return max_per_host_; }
  void setMaxPerHost(size_t n) { max_per_host_ = n; }

 private:
  struct Record {
    std::string host;
    std::string endpoint;
  };
  void erase(int fd);
  size_t max_per_host_;
  std::map<int, Record> by_fd_;
  std::map<std::string, std::map<int, std::string>> by_host_;  // host -> fd -> endpoint
};

// The descriptors a process keeps for its own work (its files, pipes, workers) out of `limit`:
// an eighth, at least 32, at most half. The kernel gives the lowest free number, so a connection
// accepted as descriptor `fd` >= limit - that many means fewer are left: it is refused.
size_t descriptorsKept(size_t limit);
bool leavesTooFewDescriptors(int fd, size_t limit);

}  // namespace ddprun::rendezvous
