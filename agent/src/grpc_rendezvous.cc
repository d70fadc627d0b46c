#include "grpc_rendezvous.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <cerrno>
#include <future>

#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "local_rendezvous.h"

namespace ddprun::agent {

namespace {

// True when a TCP connection to `endpoint` (HOST:PORT or [V6]:PORT) completes within `timeout`.
bool acceptsConnections(const std::string& endpoint, std::chrono::milliseconds timeout) {
  const auto colon = endpoint.rfind(':');
  if (colon == std::string::npos) return false;
  std::string host = endpoint.substr(0, colon);
  const std::string port = endpoint.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) return false;
  bool connected = false;
  for (addrinfo* a = res; a != nullptr && !connected; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, static_cast<int>(timeout.count())) == 1) {
        int err = 0;
        socklen_t len = sizeof(err);
        rc = ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0 ? 0 : -1;
      } else {
        rc = -1;
      }
    }
    connected = rc == 0;
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return connected;
}

}  // namespace

GrpcRendezvous::GrpcRendezvous(boost::asio::io_context& io, GrpcRendezvousOptions options,
                               EventSink sink)
    : io_(io), options_(std::move(options)), sink_(std::move(sink)), client_(options_.client) {
  task_thread_ = std::thread([this] { taskLoop(); });
  heartbeat_thread_ = std::thread([this] { heartbeatLoop(); });
}

GrpcRendezvous::~GrpcRendezvous() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  client_.cancelAll();
  watch_.reset();
  if (task_thread_.joinable()) task_thread_.join();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
}

void GrpcRendezvous::enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_all();
}

void GrpcRendezvous::taskLoop() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (stopping_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void GrpcRendezvous::heartbeatLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, options_.run_config.heartbeat_interval, [this] { return stopping_; });
    if (stopping_ || node_id_.empty() || left_) continue;
    const std::string node = node_id_;
    lock.unlock();
    auto st = client_.heartbeat(options_.run_id, node);
    if (!st.isOk()) {
      logger("agent")->debug("heartbeat: {}", st.status().toString());
      if (st.status().code() == StatusCode::kNotFound && !left_) {
        // Declared dead (e.g. a network cut healed): the others went on; join them again.
        logger("agent")->warn("the rendezvous no longer counts this node ({}); re-joining",
                              st.status().message());
        boost::asio::post(io_, [this] { sink_(PeerEvent::kMembershipChange); });
      }
    }
    lock.lock();
  }
}

// gRPC 1.51 (Debian 12's): a TLS channel whose first connection attempts were refused never
// completes a handshake afterwards (each later attempt is shut down), while a plaintext channel
// and a TLS channel that was connected once (server restarts) recover. An agent that starts
// before its rendezvous (the usual race with an is_host peer) would wait out its join timeout, so
// over TLS the first call waits until the endpoint accepts connections.
Status GrpcRendezvous::waitForListener() {
  const std::string& endpoint = options_.client.endpoint;
  const auto give_up = std::chrono::steady_clock::now() + options_.join_timeout;
  Duration backoff = std::chrono::milliseconds(50);
  bool logged = false;
  while (!acceptsConnections(endpoint, std::chrono::seconds(1))) {
    if (std::chrono::steady_clock::now() + backoff > give_up) {
      return unavailable("rendezvous at " + endpoint +
                         " unreachable: nothing accepted a connection within the join timeout");
    }
    if (!logged) {
      logger("agent")->info("waiting for the rendezvous at {} to accept connections", endpoint);
      logged = true;
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (cv_.wait_for(lock, backoff, [this] { return stopping_ || left_.load(); })) {
      return Status(StatusCode::kCancelled, "cancelled");
    }
    backoff = std::min<Duration>(backoff * 2, std::chrono::seconds(1));
  }
  return Status::ok();
}

StatusOr<RoundInfo> GrpcRendezvous::joinAndResolveMaster() {
  if (!listener_seen_ && !options_.client.tls_root_cert_pem.empty()) {
    DDPRUN_RETURN_IF_ERROR(waitForListener());
  }
  listener_seen_ = true;
  rendezvous::JoinRequest req;
  req.run_id = options_.run_id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    req.node_id = node_id_;
  }
  req.address = options_.local_addr;
  req.local_world_size = static_cast<uint32_t>(options_.local_world_size);
  req.config = options_.run_config;
  req.join_timeout = options_.join_timeout;
  DDPRUN_ASSIGN_OR_RETURN(rendezvous::RoundInfo joined, client_.join(req));
  {
    std::lock_guard<std::mutex> lock(mu_);
    node_id_ = joined.node_id;
  }
  joined_round_ = joined.round;

  RoundInfo round;
  round.round = static_cast<int>(joined.round);
  round.group_rank = static_cast<int>(joined.group_rank);
  round.run_id = options_.run_id;
  std::vector<std::string> members;
  for (const auto& p : *joined.participants) {
    round.local_world_sizes.push_back(static_cast<int>(p.local_world_size));
    members.push_back(p.node_id);
  }
  if (!last_members_.empty() && members != last_members_) ++membership_epoch_;
  last_members_ = members;
  round.membership_epoch = membership_epoch_;

  if (options_.static_node_rank >= 0) {
    // Ranks come from --node-rank: learn every participant's, order the nodes by it.
    const std::string prefix = "static_rank/" + std::to_string(joined.round) + "/";
    DDPRUN_RETURN_IF_ERROR(client_.kvSet(options_.run_id, prefix + joined.node_id,
                                         std::to_string(options_.static_node_rank)));
    std::vector<std::string> keys;
    for (const auto& m : members) keys.push_back(prefix + m);
    DDPRUN_ASSIGN_OR_RETURN(auto values,
                            client_.kvWait(options_.run_id, keys, options_.join_timeout));
    std::vector<int> sizes(members.size(), -1);
    for (size_t i = 0; i < values.size(); ++i) {
      auto r = parseInt(values[i]);
      if (!r || *r < 0 || *r >= static_cast<long long>(members.size()) || sizes[*r] != -1) {
        return failedPrecondition("--node-rank: the nodes' ranks must be 0.." +
                                  std::to_string(members.size() - 1) + ", each used once; got " +
                                  values[i] + " twice or out of range");
      }
      sizes[*r] = static_cast<int>((*joined.participants)[i].local_world_size);
    }
    round.local_world_sizes = sizes;
    round.group_rank = options_.static_node_rank;
    round.master_addr = options_.static_master_addr;
    round.master_port = options_.master_port;
  } else if (joined.group_rank == 0) {
    rendezvous::MasterAddress master{options_.local_addr,
                                     static_cast<uint32_t>(options_.master_port)};
    if (master.port == 0) {
      DDPRUN_ASSIGN_OR_RETURN(int port, findFreePort());
      master.port = static_cast<uint32_t>(port);
    }
    DDPRUN_RETURN_IF_ERROR(
        client_.publishMaster(options_.run_id, joined.node_id, joined.round, master));
    round.master_addr = master.addr;
    round.master_port = static_cast<int>(master.port);
  } else if (!joined.master_addr.empty() && joined.master_port != 0) {
    round.master_addr = joined.master_addr;
    round.master_port = static_cast<int>(joined.master_port);
  } else {
    DDPRUN_ASSIGN_OR_RETURN(
        auto master, client_.waitMaster(options_.run_id, joined.round, options_.join_timeout));
    round.master_addr = master.addr;
    round.master_port = static_cast<int>(master.port);
  }
  logger("agent")->info("round {}: group rank {} of {}, world size {}, master {}:{}", round.round,
                        round.group_rank, round.local_world_sizes.size(), joined.world_size,
                        round.master_addr, round.master_port);
  return round;
}

Status GrpcRendezvous::explainUnavailable(const Status& st) const {
  const std::string& endpoint = options_.client.endpoint;
  if (options_.client.tls_root_cert_pem.empty()) {
    return Status(st.code(), st.message() +
                                 " (this agent speaks plaintext gRPC: if the rendezvous at " +
                                 endpoint +
                                 " serves TLS, give --rdzv-conf tls_ca=<the CA certificate of "
                                 "its certificate>)");
  }
  const std::string host = endpoint.substr(0, endpoint.rfind(':'));
  return Status(st.code(), st.message() + " (this agent speaks TLS to " + endpoint +
                               ", trusting tls_ca=" + options_.tls_ca_file +
                               ": check that the rendezvous serves TLS with a certificate for " +
                               host + " signed by that CA)");
}

void GrpcRendezvous::nextRound(RoundCallback done) {
  enqueue([this, done = std::move(done)]() mutable {
    auto result = joinAndResolveMaster();
    if (!result.isOk() && result.status().code() == StatusCode::kUnavailable) {
      result = explainUnavailable(result.status());
    }
    boost::asio::post(io_, [this, done = std::move(done), result = std::move(result)]() mutable {
      if (result.isOk()) {
        current_round_ = static_cast<uint64_t>(result->round);
        if (!watch_) startWatch();
      }
      done(std::move(result));
    });
  });
}

void GrpcRendezvous::startWatch() {
  std::string node;
  {
    std::lock_guard<std::mutex> lock(mu_);
    node = node_id_;
  }
  watch_ = client_.watch(options_.run_id, node, [this](const rendezvous::RoundChange& change) {
    // Recorded here, not on the io loop: the exit barrier runs after that loop stopped.
    if (!change.node_id.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (change.reason == rendezvous::ChangeReason::kNodeDead ||
          change.reason == rendezvous::ChangeReason::kNodeLeft) {
        gone_.insert(change.node_id);
      } else if (change.reason == rendezvous::ChangeReason::kNodeJoined) {
        gone_.erase(change.node_id);
      }
    }
    boost::asio::post(io_, [this, change] { onChange(change); });
  });
}

void GrpcRendezvous::onChange(const rendezvous::RoundChange& change) {
  if (change.kind != rendezvous::ChangeKind::kRoundPending) return;
  if (change.round <= current_round_) return;  // about a round this node already holds
  std::string node;
  {
    std::lock_guard<std::mutex> lock(mu_);
    node = node_id_;
  }
  logger("agent")->info("round {} is forming ({} by {})", change.round,
                        rendezvous::changeReasonName(change.reason), change.node_id);
  if (change.reason == rendezvous::ChangeReason::kFailureReported) {
    if (change.node_id != node) sink_(PeerEvent::kPeerFailure);
    return;
  }
  sink_(PeerEvent::kMembershipChange);
}

void GrpcRendezvous::reportFailure() {
  enqueue([this] {
    std::string node;
    {
      std::lock_guard<std::mutex> lock(mu_);
      node = node_id_;
    }
    auto next = client_.reportFailure(options_.run_id, node, joined_round_);
    if (!next.isOk()) {
      logger("agent")->warn("could not report the failure: {}", next.status().toString());
    }
  });
}

void GrpcRendezvous::leave() {
  left_ = true;
  // A join in flight would block the leave behind it: cancel it (its answer is ignored).
  client_.cancelAll();
  // Leave before the workers are signalled (SPEC §4), so the others hear of it from the
  // rendezvous rather than from their collectives breaking; bounded, the server may be gone.
  auto left = std::make_shared<std::promise<void>>();
  auto done = left->get_future();
  enqueue([this, left] {
    std::string node;
    {
      std::lock_guard<std::mutex> lock(mu_);
      node = node_id_;
    }
    if (!node.empty()) {
      auto st = client_.leave(options_.run_id, node);
      if (!st.isOk()) logger("agent")->warn("could not leave the run: {}", st.toString());
    }
    left->set_value();
  });
  if (done.wait_for(std::chrono::seconds(2)) != std::future_status::ready) {
    logger("agent")->warn("leaving the run is taking long; stopping the workers anyway");
  }
}

void GrpcRendezvous::finish(bool succeeded, bool left) {
  // Runs after the io loop stopped: drain the queued calls (a leave, a failure report) first.
  auto drained = std::make_shared<std::promise<void>>();
  auto done = drained->get_future();
  enqueue([drained] { drained->set_value(); });
  done.wait_for(std::chrono::seconds(10));
  // The watch stays until this node is done with the run: the server takes a watch that ends
  // without a leave for a dead node.
  std::string node;
  {
    std::lock_guard<std::mutex> lock(mu_);
    node = node_id_;
  }
  if (left || node.empty()) {
    watch_.reset();
    return;
  }
  // The others may be gone already (or the host's server with them): retry only briefly.
  rendezvous::ClientOptions quick = options_.client;
  quick.retry_timeout = std::chrono::seconds(2);
  quick.rpc_timeout = std::max<Duration>(options_.exit_barrier_timeout, std::chrono::seconds(5)) +
                      std::chrono::seconds(5);
  rendezvous::Client client(quick);
  auto log = logger("agent");
  const std::string run = options_.run_id;
  const std::string prefix = "exit_barrier/" + std::to_string(joined_round_) + "/";
  // The members still expected: a node the rendezvous declared dead (or that left) never
  // arrives, so waiting for it would only hold this node for the whole barrier timeout.
  auto keysOf = [&](const std::string& phase) {
    std::vector<std::string> keys;
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& member : last_members_) {
      if (member == node || gone_.count(member) == 0) keys.push_back(prefix + phase + "/" + member);
    }
    return keys;
  };
  // Waits for the keys of the members still expected, re-reading who is gone every slice.
  auto waitFor = [&](const std::string& phase, Duration timeout) -> Status {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto left = deadline - std::chrono::steady_clock::now();
      const Duration slice =
          std::clamp<Duration>(left, std::chrono::milliseconds(1), std::chrono::milliseconds(500));
      auto all = client.kvWait(run, keysOf(phase), slice);
      if (all.isOk()) return Status::ok();
      if (all.status().code() != StatusCode::kDeadlineExceeded ||
          std::chrono::steady_clock::now() >= deadline) {
        return all.status();
      }
    }
  };
  const bool closer = !last_members_.empty() && last_members_.front() == node;  // group rank 0
  if (succeeded) {
    // Exit barrier, in two phases: wait (bounded) until every node's workers are done, then
    // say so; the node that closes the run waits for everyone's departure first, so a node
    // hosting the rendezvous never takes it away from a node still inside the barrier.
    log->info(
        "local workers finished; waiting up to {:.0f} s for the other nodes to finish (exit "
        "barrier)",
        std::chrono::duration<double>(options_.exit_barrier_timeout).count());
    Status st = client.kvSet(run, prefix + "arrive/" + node, "1");
    if (st.isOk()) {
      st = waitFor("arrive", options_.exit_barrier_timeout);
    }
    if (!st.isOk()) {
      log->warn("exit barrier: not every node finished ({}); exiting anyway", st.toString());
    }
    auto departed = client.kvSet(run, prefix + "depart/" + node, "1");
    if (departed.isOk() && closer) {
      const Status all = waitFor("depart", std::chrono::seconds(10));
      if (!all.isOk()) log->debug("exit barrier departures: {}", all.toString());
    }
    if (!closer) {
      auto st = client.leave(run, node);  // done: not dead, and nothing to wait for
      if (!st.isOk()) log->debug("leave: {}", st.toString());
      watch_.reset();
      return;
    }
  }
  auto closed = client.close(run);
  if (!closed.isOk()) log->debug("close: {}", closed.toString());
  watch_.reset();
}

}  // namespace ddprun::agent
