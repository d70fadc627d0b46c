// Small string helpers shared by the CLI, the rendezvous configuration and the Slurm parser.
// Pure functions, no state.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ddprun {

std::vector<std::string> split(std::string_view s, char sep);
std::string join(const std::vector<std::string>& parts, std::string_view sep);
std::string trim(std::string_view s);
bool startsWith(std::string_view s, std::string_view prefix);
bool endsWith(std::string_view s, std::string_view suffix);
std::string toLower(std::string_view s);
// `s` with every occurrence of `from` (not empty) replaced by `to`, left to right; what `to`
// brings in is not searched again.
std::string replaceAll(std::string s, std::string_view from, std::string_view to);

// Strict parsers: the whole string must be the number (no sign for unsigned, no trailing junk).
std::optional<long long> parseInt(std::string_view s);
std::optional<double> parseDouble(std::string_view s);
// "1"/"true"/"yes"/"on" and "0"/"false"/"no"/"off", case-insensitive.
std::optional<bool> parseBool(std::string_view s);

// `s` with each control byte (below 0x20, and 0x7f) written as \n, \r, \t or \xNN; every other
// byte as is. For messages that quote user input: an error stays one line and cannot drive the
// terminal. Idempotent (an escape has no control byte).
std::string escapeControl(std::string_view s);
// Whether `s` holds a control byte (below 0x20, or 0x7f): ids and addresses a peer or a user
// sends are refused with one (they are logged, and handed to others).
bool hasControlByte(std::string_view s);
// Text another process sent (a peer's error message): its first `max_bytes` bytes, escaped as
// escapeControl does, and when it was longer "... (N bytes)" after them. A log line that quotes
// it stays one line of bounded length whatever the peer sent.
std::string quotePeerText(std::string_view s, size_t max_bytes = 200);
// The host of a gRPC peer string, its port cut ("ipv4:10.0.0.7:41234" -> "ipv4:10.0.0.7",
// "ipv6:[::1]:5555" -> "ipv6:[::1]"): what the servers' per-host bounds and warnings count by.
std::string hostOfGrpcPeer(const std::string& peer);
// "HOST:PORT", an IPv6 address (a host with a ':') in brackets: "[::1]:29400".
std::string hostPort(const std::string& host, int port);

// This process's environment ("NAME=value" of environ) as a map.
std::map<std::string, std::string> environmentMap();

}  // namespace ddprun
