// libprotobuf's own log lines, routed through ddprun's loggers and throttled. A peer can make
// libprotobuf log at will: a request whose string field is not UTF-8 fails to parse with a
// "[libprotobuf ERROR ...] String field '...' contains invalid UTF-8 data" line on stderr, one per
// call, before any ddprun code sees it. Routed, each such line is a warning of the "protobuf"
// logger, at most kProtobufLinesPerMinute a minute for each of libprotobuf's source lines; the
// next one says how many were not logged. FATAL lines are logged unthrottled (libprotobuf then
// aborts as it would have).
//
// A plain header (no protobuf type): the agent's and the daemon's mains call it.
#pragma once

#include <cstdint>
#include <string>

namespace ddprun::rendezvous {

inline constexpr uint64_t kProtobufLinesPerMinute = 3;

// Installs the handler for the whole process (libprotobuf has one). Idempotent, thread-safe.
void routeProtobufLogs();

// The text of the line for `count` events (1: the one logged now; more: it and those not logged
// since the last line of that source line). Exposed for tests.
std::string protobufLogLine(const std::string& message, uint64_t count);

}  // namespace ddprun::rendezvous
