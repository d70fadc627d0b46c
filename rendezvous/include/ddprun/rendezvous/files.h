// Reading the small files the rendezvous is configured with (token, TLS certificates and keys).
// Part of the rendezvous core (no gRPC): the --rdzv-conf parser and the daemon both use them.
// Plain functions; thread-safe.
#pragma once

#include <string>

#include "ddprun/common/status.h"

namespace ddprun::rendezvous {

// Reads a token file: its content without surrounding whitespace; an empty token is an error.
StatusOr<std::string> readTokenFile(const std::string& path);
// Reads a whole file (certificates, keys). NOT_FOUND when it cannot be read.
StatusOr<std::string> readFile(const std::string& path);

}  // namespace ddprun::rendezvous
