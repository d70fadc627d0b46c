// GrpcRendezvous: the agent's RendezvousClient for multi-node jobs, over ddprun's gRPC
// rendezvous (rendezvous/client.h). The gRPC client blocks, so its calls run in order on a
// thread of their own; heartbeats on another; pushed round changes arrive on the watch's thread.
// Every result and event is posted to the agent's io_context, so the supervisor sees them on its
// one thread. Lives as long as the agent; the destructor stops all threads.
#pragma once

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "ddprun/agent/rendezvous_client.h"
#include "ddprun/rendezvous/client.h"

namespace ddprun::agent {

struct GrpcRendezvousOptions {
  rendezvous::ClientOptions client;  // TLS when client.tls_root_cert_pem is set
  std::string tls_ca_file;           // where that certificate came from, for error messages
  std::string run_id;
  std::string local_addr;  // advertised; MASTER_ADDR when this node is group rank 0
  int local_world_size = 1;
  rendezvous::RunConfig run_config;
  Duration join_timeout = std::chrono::seconds(600);
  int master_port = 0;  // 0: a free port found when this node is rank 0
  // Static backend (--node-rank given): group rank and master are fixed by the command line;
  // nodes exchange their node ranks through the rendezvous' key-value store.
  int static_node_rank = -1;
  std::string static_master_addr;
  Duration exit_barrier_timeout = std::chrono::seconds(300);
};

// Pushed changes the supervisor must act on.
enum class PeerEvent { kMembershipChange, kPeerFailure };

class GrpcRendezvous final : public RendezvousClient {
 public:
  using EventSink = std::function<void(PeerEvent)>;  // runs on the io_context thread

  GrpcRendezvous(boost::asio::io_context& io, GrpcRendezvousOptions options, EventSink sink);
  ~GrpcRendezvous() override;

  void nextRound(RoundCallback done) override;
  void reportFailure() override;
  void leave() override;
  void finish(bool succeeded, bool left) override;

  // The completed round this node holds (io thread), for metrics.
  uint64_t currentRound() const { return current_round_; }

 private:
  void enqueue(std::function<void()> task);
  void taskLoop();
  void heartbeatLoop();
  void startWatch();
  StatusOr<RoundInfo> joinAndResolveMaster();
  // An UNAVAILABLE rendezvous with what to check: gRPC says the same for a server that is down
  // and for a TLS mismatch (plaintext client, TLS server or the reverse, untrusted certificate).
  Status explainUnavailable(const Status& st) const;
  // Waits (bounded by the join timeout; ends early when stopping or leaving) until something
  // accepts TCP connections at the endpoint. See the .cc for why TLS needs it.
  Status waitForListener();
  void onChange(const rendezvous::RoundChange& change);  // io thread

  boost::asio::io_context& io_;
  GrpcRendezvousOptions options_;
  EventSink sink_;
  rendezvous::Client client_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  std::string node_id_;                      // guarded by mu_ (set after the first join)
  std::set<std::string> gone_;  // guarded by mu_: nodes the rendezvous saw leave or die (and not
                                // rejoin); the exit barrier does not wait for them

  // Task-thread state.
  std::vector<std::string> last_members_;
  int membership_epoch_ = 0;
  uint64_t joined_round_ = 0;
  bool listener_seen_ = false;

  // io-thread state.
  uint64_t current_round_ = 0;
  std::unique_ptr<rendezvous::Watch> watch_;  // created on the io thread after the first round
  std::atomic<bool> left_{false};

  std::thread task_thread_;
  std::thread heartbeat_thread_;
};

}  // namespace ddprun::agent
