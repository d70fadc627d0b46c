// RendezvousServer: the gRPC rendezvous service, embeddable (an agent with is_host starts one)
// and behind the ddprun-rendezvous daemon. It owns a RendezvousState on one io thread; gRPC
// callbacks only post into that thread, so the state needs no locks.
//
// Threading: start/port/address/shutdown may be called from any thread; shutdown is idempotent
// and also run by the destructor. Lifetime: the server listens from start() until shutdown().
#pragma once

#include <memory>
#include <string>

#include "ddprun/common/status.h"
#include "ddprun/rendezvous/files.h"  // readTokenFile, readFile (moved to the core)
#include "ddprun/rendezvous/state.h"

namespace ddprun::rendezvous {

struct ServerOptions {
  std::string listen = "127.0.0.1:0";  // HOST:PORT; port 0 picks a free one
  std::string token;                   // non-empty: every call must carry it
  std::string tls_cert_pem;            // both set: TLS
  std::string tls_key_pem;
  StateLimits limits;
  // Open Watch streams plus pending KvWait/GetMaster calls of one peer (gRPC's peer address: one
  // client connection); beyond it a call is refused with RESOURCE_EXHAUSTED. An agent holds a
  // handful; the benchmark's 4096 watchers over 16 connections hold 256 each.
  size_t max_streams_per_peer = 1024;
  // The same over all connections of one client host (its address): a host may open many
  // connections (up to the accept guard's bound), and each stream holds ~18 KB here. Many nodes
  // behind one NAT address hold a few each.
  size_t max_streams_per_host = 8192;
  // Changes queued for one Watch stream whose client does not read. Past it the stream ends with
  // RESOURCE_EXHAUSTED and its queue is freed; a client that subscribes again starts from a fresh
  // snapshot (what the client library does on every break), so nothing is lost but the backlog.
  size_t max_watch_queue = 4096;
  RunRetention retention;  // closed_run_ttl / idle_run_ttl: how long runs outlive their use
  // A connection that has not sent HTTP/2's settings (after TLS's handshake) this long after it
  // was accepted is closed (gRPC's default: 120 s); so is one that has had no call in flight for
  // `max_connection_idle` (a GOAWAY: a client's next call connects again; an agent always has its
  // Watch open). So a peer cannot hold connections open without using them.
  Duration handshake_timeout = std::chrono::seconds(20);
  Duration max_connection_idle = std::chrono::minutes(10);
};

// Why `listen` (HOST:PORT; `host` without IPv6 brackets) cannot be listened on, found by trying:
// HOST does not resolve, PORT is in use, HOST is not an address of this host, PORT needs
// privileges. INVALID_ARGUMENT naming the one that holds (a usage error of the --listen value).
Status whyCannotListen(const std::string& listen, const std::string& host, int port);

class RendezvousServer {
 public:
  // Binds and starts serving. INVALID_ARGUMENT when the address cannot be bound, with the one
  // reason (whyCannotListen).
  static StatusOr<std::unique_ptr<RendezvousServer>> start(ServerOptions options);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  int port() const;
  // HOST:PORT with the bound port.
  std::string address() const;
  // Fails pending joins/waits with UNAVAILABLE, ends watch streams, stops listening.
  void shutdown();
  // What the server holds (runs, tombstones, key-value stores, watch streams) as of its last
  // event; any thread.
  StateCensus census() const;

  struct Impl;

 private:
  explicit RendezvousServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddprun::rendezvous
