// Reading the small files the rendezvous is configured with (token, TLS certificates and keys).
// Part of the rendezvous core (no gRPC): the --rdzv-conf parser and the daemon both use them.
// Plain functions; thread-safe.
#pragma once

#include <cstddef>
#include <string>

#include "ddprun/common/status.h"

namespace ddprun::rendezvous {

inline constexpr size_t kMaxTokenBytes = 4096;

// Reads a token file: its content without surrounding whitespace, which must be a valid token
// (validateToken); an empty token is an error.
StatusOr<std::string> readTokenFile(const std::string& path);
// A token travels as gRPC metadata: printable ASCII without spaces, at most kMaxTokenBytes.
// INVALID_ARGUMENT saying what is wrong (and where) otherwise.
Status validateToken(const std::string& token);
// Reads a whole regular file (certificates, keys) of at most `max_bytes`, without blocking on a
// FIFO or reading a device forever. NOT_FOUND when it cannot be read; INVALID_ARGUMENT when it is
// not a regular file or is too large.
StatusOr<std::string> readFile(const std::string& path, size_t max_bytes = 1 << 20);
// Reads a PEM file named by `label` (a --rdzv-conf key or a daemon flag) and checks that it holds
// what is needed (a certificate, or a private key), so a wrong file is reported up front and not
// as an obscure handshake or listen failure later. INVALID_ARGUMENT naming label and path.
StatusOr<std::string> readPem(const std::string& label, const std::string& path, bool private_key);

}  // namespace ddprun::rendezvous
