// The heartbeat file's first byte (DDPRUN_HEARTBEAT_FILE; SPEC §6). A worker SDK Trainer writes it
// at every touch (worker_sdk/src/peer_wait.h): kWaitingForPeers while one of its collectives has
// waited for its peers for a while, kNotWaiting otherwise. The agent's hang check reads it to tell
// a rank that hangs from the ranks that wait for it (agent/src/stat_heartbeat_probe.h). A file
// that says neither (empty, or touched by a program that does not write it) is kUnknown.
#pragma once

#include <string>

namespace ddprun {

inline constexpr char kWaitingForPeers = 'w';
inline constexpr char kNotWaiting = '-';

enum class HeartbeatMark { kUnknown, kWaiting, kNotWaiting };

// What the first byte of the file at `path` says; kUnknown when it cannot be read (missing, a
// directory, a symbolic link).
HeartbeatMark readHeartbeatMark(const std::string& path);

}  // namespace ddprun
