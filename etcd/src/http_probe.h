// The one question the etcd-v3 client asks over plain HTTP/1.1: which etcd answers on a port
// that refused gRPC's HTTP/2 preface with an HTTP/1.x reply (an etcd 2.x, which serves only the
// v2 API; a TLS-only member; or not etcd at all). No gRPC here, so tests include it freely.
//
// Threading: pure functions, callable from any thread.
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace ddprun::etcd {

// What a member that answered the v3 gRPC handshake with HTTP/1.x said to `GET /version`, the
// request etcd has answered since 2.0 ({"etcdserver":"2.3.8","etcdcluster":"2.3.0"}): the server
// version when `reply` (a whole HTTP/1.x response) is such a JSON, nullopt otherwise (a TLS-only
// member answers "Client sent an HTTP request to an HTTPS server", anything else is not etcd).
std::optional<std::string> etcdVersionFromHttpReply(const std::string& reply);

// `GET /version` over plain HTTP/1.1 to `endpoint` (HOST:PORT or [V6]:PORT), bounded by `timeout`
// in all: the response as read (possibly partial), or "" when nothing answered.
std::string httpGetVersion(const std::string& endpoint, std::chrono::milliseconds timeout);

}  // namespace ddprun::etcd
