// A hostile peer for the --snapshot-dir e2e tests (issue 34): a node of the round that is not
// ddprun. It joins the run through the rendezvous as an agent would (heartbeats, the master
// address when it is rank 0, its snapshot holdings for the round), serves Fetch from a gRPC
// service whose answers the test writes (stalls, oversized chunks, errors), and sends whatever
// announcements the test asks for. The real agent under test sees it as one more node.
//
// Threading: the rendezvous client and the gRPC server run threads of their own; the test calls
// everything from its own thread. Lifetime: destroy before the RendezvousDaemon it joined.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <functional>
#include <future>
#include <memory>
#include <regex>
#include <string>
#include <thread>

#include "ddprun/common/crc32.h"
#include "ddprun/common/round_key.h"
#include "ddprun/rendezvous/client.h"
#include "ddprun/snapshot/transfer.h"
#include "ddprun/snapshot/v1/snapshot.grpc.pb.h"
#include "process_helpers.h"

namespace ddprun::testing {

namespace spb = ::ddprun::snapshot::v1;

// What the hostile holder answers to a Fetch (the test sets it; the default: NOT_FOUND).
using FetchHandler = std::function<grpc::Status(grpc::ServerContext*, const spb::FetchRequest&,
                                                grpc::ServerWriter<spb::Chunk>*)>;

class HostileService final : public spb::SnapshotReplication::Service {
 public:
  grpc::Status Announce(grpc::ServerContext*, const spb::AnnounceRequest*,
                        spb::AnnounceResponse*) override {
    return grpc::Status::OK;
  }
  grpc::Status Fetch(grpc::ServerContext* ctx, const spb::FetchRequest* req,
                     grpc::ServerWriter<spb::Chunk>* writer) override {
    ++fetches;
    FetchHandler h;
    {
      std::lock_guard<std::mutex> lock(mu);
      h = handler;
    }
    if (!h) return grpc::Status(grpc::StatusCode::NOT_FOUND, "nothing here");
    return h(ctx, *req, writer);
  }
  std::mutex mu;
  FetchHandler handler;  // guarded by mu
  std::atomic<int> fetches{0};
};

// Serves `content` honestly as the version asked for (chunks of `chunk` bytes, CRC-32s right).
inline FetchHandler serveContent(std::string content, size_t chunk = 64 << 10) {
  return [content = std::move(content), chunk](grpc::ServerContext*, const spb::FetchRequest& req,
                                               grpc::ServerWriter<spb::Chunk>* w) {
    const uint64_t end = req.length() == 0 ? content.size() : req.offset() + req.length();
    for (uint64_t at = req.offset(); at < end;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk, end - at));
      spb::Chunk c;
      c.set_offset(at);
      c.set_data(content.substr(at, n));
      c.set_crc32(crc32Update(0, content.data() + at, n));
      if (at + n == end) c.set_file_crc32(crc32Update(0, content.data(), content.size()));
      if (!w->Write(c)) return grpc::Status(grpc::StatusCode::CANCELLED, "gone");
      at += n;
    }
    return grpc::Status::OK;
  };
}

class HostileNode {
 public:
  // Joins run `run_id` at `rdzv` (with `token`, if any) as a node of `nodes` in all, advertising
  // 127.0.0.1, once start() is called.
  HostileNode(std::string rdzv, std::string run_id, std::string token = "")
      : run_id_(std::move(run_id)), token_(std::move(token)) {
    rendezvous::ClientOptions o;
    o.endpoint = std::move(rdzv);
    o.token = token_;
    client_ = std::make_unique<rendezvous::Client>(o);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&service);
    server_ = b.BuildAndStart();
    REQUIRE(server_);
    endpoint = "127.0.0.1:" + std::to_string(port);
  }
  ~HostileNode() {
    stop_ = true;
    if (heartbeats_.joinable()) heartbeats_.join();
    if (joined_.valid()) joined_.wait();
    if (!node_id_.empty()) (void)client_->leave(run_id_, node_id_);
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  // Starts joining a round of `nodes` nodes (the agent under test joins it too), or of
  // `min_nodes` to `nodes` when given.
  void start(int nodes = 2, int min_nodes = 0) {
    joined_ = std::async(std::launch::async, [this, nodes, min_nodes] {
      rendezvous::JoinRequest req;
      req.run_id = run_id_;
      req.address = "127.0.0.1";
      req.local_world_size = 1;
      req.config.min_nodes = static_cast<uint32_t>(min_nodes > 0 ? min_nodes : nodes);
      req.config.max_nodes = static_cast<uint32_t>(nodes);
      req.config.last_call_timeout = std::chrono::seconds(1);
      req.config.heartbeat_interval = std::chrono::seconds(1);
      req.config.heartbeat_misses = 3;
      req.join_timeout = std::chrono::seconds(120);
      return client_->join(req);
    });
  }

  // Waits for the round, then acts as a node of it: the master address when rank 0, heartbeats,
  // and this node's holdings (nothing but its endpoint).
  rendezvous::RoundInfo waitJoined() {
    auto joined = joined_.get();
    REQUIRE(joined.isOk());
    round = *joined;
    node_id_ = round.node_id;
    if (round.group_rank == 0) {
      REQUIRE(client_
                  ->publishMaster(run_id_, node_id_, round.round,
                                  rendezvous::MasterAddress{"127.0.0.1", 1})
                  .isOk());
    }
    heartbeats_ = std::thread([this] {
      while (!stop_) {
        (void)client_->heartbeat(run_id_, node_id_);
        for (int i = 0; i < 10 && !stop_; ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      }
    });
    REQUIRE(client_
                ->kvSet(run_id_,
                        roundKeyPrefix("snapshot", round.round) + std::to_string(round.group_rank),
                        endpoint + "\n")
                .isOk());
    // What it runs (agent/src/job_identity.h): the agents under test run /bin/sh.
    REQUIRE(client_
                ->kvSet(run_id_,
                        roundKeyPrefix("job", round.round) + std::to_string(round.group_rank),
                        "127.0.0.1\n/bin/sh")
                .isOk());
    return round;
  }

  // A version number of the joined round.
  uint64_t version(uint32_t sequence) const { return (round.round << 32) | sequence; }

  // Tells the agent serving at `agent` that this node holds `file` (source: this node, unless
  // `source` says otherwise).
  Status announce(const std::string& agent, const snapshot::SnapshotFile& file,
                  const std::string& source = "") {
    snapshot::SnapshotPeer peer{agent, run_id_, {}};
    peer.security.token = token_;
    const std::string from = source.empty() ? endpoint : source;
    return snapshot::announceSnapshot(peer, file, from, from, std::chrono::seconds(5));
  }

  // Leaves the run now (as a node that stops would): the next round is formed without it.
  void leave() {
    stop_ = true;
    if (heartbeats_.joinable()) heartbeats_.join();
    if (!node_id_.empty()) (void)client_->leave(run_id_, node_id_);
    node_id_.clear();
  }

  // What `h` refers to must outlive this node: its server runs fetches until it is destroyed.
  void serve(FetchHandler h) {
    std::lock_guard<std::mutex> lock(service.mu);
    service.handler = std::move(h);
  }

  HostileService service;
  std::string endpoint;  // 127.0.0.1:PORT of its replication service
  rendezvous::RoundInfo round;

 private:
  std::string run_id_;
  std::string token_;
  std::string node_id_;
  std::unique_ptr<rendezvous::Client> client_;
  std::unique_ptr<grpc::Server> server_;
  std::future<StatusOr<rendezvous::RoundInfo>> joined_;
  std::thread heartbeats_;
  std::atomic<bool> stop_{false};
};

// The replication endpoint an agent logged ("serving at HOST:PORT").
inline std::string servingAt(const std::string& log) {
  std::smatch m;
  if (!std::regex_search(log, m, std::regex(R"(serving at (\S+:\d+))"))) return "";
  return m[1].str();
}

}  // namespace ddprun::testing
