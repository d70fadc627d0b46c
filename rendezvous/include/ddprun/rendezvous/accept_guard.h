// The accept guard: keeps this process's gRPC listeners alive when it runs out of file
// descriptors, and bounds the connections of each peer host.
//
// gRPC 1.51 (Debian 12's) gives a listening socket up for good when accept4() fails with EMFILE
// or ENFILE (grpc/grpc#20418): a peer that opens as many connections as the descriptor limit
// allows, before any token is asked for, leaves the server deaf to everyone, also once it has
// gone. The executables that serve gRPC (ddprun, ddprun-agent, ddprun-rendezvous) link the target
// ddprun::accept_guard, whose accept4() the executable exports, so that libgrpc's calls reach it
// before libc's. It wraps libc's:
// - out of descriptors, it takes the pending connections off the listener's queue and closes
//   them (through a descriptor kept in reserve), logs that (throttled), and answers EAGAIN, on
//   which gRPC waits for the next connection as for any listener with nothing pending;
// - a connection from a host that already holds `max_connections_per_peer` connections to this
//   process's servers is closed at once (logged, throttled), and the next pending one is taken;
// - so is one that would leave the process fewer descriptors than it keeps for its own work (its
//   files, pipes and workers: descriptorsKept() in peer_connections.h, an eighth of the limit), so
//   that connections from many hosts together cannot starve it.
// Connections that are not TCP (a Unix socket) pass untouched.
//
// A plain header: the daemon's and the launcher's mains call it.
#pragma once

#include <cstddef>
#include <string>

namespace ddprun::rendezvous {

struct AcceptLimits {
  size_t max_connections_per_peer = 1024;
  // What a refused host's log line names as the bound's source (the daemon: its flag).
  std::string how_to_raise = "a bound of ddprun's agent";
};

// Sets the bound (any thread; connections already held are kept).
void setAcceptLimits(const AcceptLimits& limits);

// Whether libgrpc's accept4() calls reach the guard in this process (the executable links
// ddprun::accept_guard and exports accept4).
bool acceptGuardInstalled();

}  // namespace ddprun::rendezvous
