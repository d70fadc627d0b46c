// Plain value types of the rendezvous, shared by the pure state machine, the gRPC service and the
// client library, so users (the agent) never see protobuf or gRPC types. Value types; no threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/common/strings.h"

namespace ddprun::rendezvous {

// How the DEADLINE_EXCEEDED of a join that the rendezvous itself timed out begins (the gRPC
// server's state machine and the etcd service both say it): an answer from the rendezvous, which
// was reachable, not a transport failure to explain.
inline constexpr const char* kJoinTimeoutExpired = "join_timeout expired waiting for ";

// What every call on a closed run answers, through any backend (FAILED_PRECONDITION).
inline Status runClosed(const std::string& run_id) {
  return failedPrecondition("run " + run_id + " is closed");
}
// Whether `st` is `code` with a message "run <id><tail>", as the helpers below make them.
inline bool isRunStatus(const Status& st, StatusCode code, std::string_view tail) {
  return st.code() == code && startsWith(st.message(), "run ") && endsWith(st.message(), tail);
}
inline bool isRunClosed(const Status& st) {
  return isRunStatus(st, StatusCode::kFailedPrecondition, " is closed");
}

// What a call about a run the server does not hold answers (NOT_FOUND): a server started again
// without its state, or a run collected. (A node the run no longer counts is told otherwise.)
inline Status runUnknown(const std::string& run_id) {
  return notFound("run " + run_id + " is unknown to this server");
}
inline bool isRunUnknown(const Status& st) {
  return isRunStatus(st, StatusCode::kNotFound, " is unknown to this server");
}

// Settings of a run, fixed by its first joiner (torchrun's --nnodes and --rdzv-conf).
struct RunConfig {
  uint32_t min_nodes = 1;
  uint32_t max_nodes = 1;
  Duration last_call_timeout = std::chrono::seconds(30);
  Duration heartbeat_interval = std::chrono::seconds(5);
  uint32_t heartbeat_misses = 3;
};

struct JoinRequest {
  std::string run_id;
  std::string node_id;  // empty on a node's first join: the server assigns one
  std::string address;  // what this node advertises (MASTER_ADDR when it becomes rank 0)
  uint32_t local_world_size = 1;
  RunConfig config;
  Duration join_timeout = std::chrono::seconds(600);
};

struct Participant {
  std::string node_id;
  std::string address;
  uint32_t local_world_size = 0;
  uint32_t group_rank = 0;
};

// What a node gets when its round completes.
struct RoundInfo {
  uint64_t round = 0;
  std::string node_id;
  uint32_t group_rank = 0;
  uint32_t group_world_size = 0;
  uint32_t base_rank = 0;   // first worker RANK of this node
  uint32_t world_size = 0;  // WORLD_SIZE: sum of local world sizes
  // Every participant in rank order; shared between all joiners of the round.
  std::shared_ptr<const std::vector<Participant>> participants;
  std::string master_addr;  // set when already published for this round
  uint32_t master_port = 0;
};

struct RunStatus {
  uint64_t completed_round = 0;  // 0 before the first round completes
  uint64_t pending_round = 0;    // 0 when no round is forming
  bool closed = false;
  uint32_t participants = 0;
  uint32_t waiting = 0;
  uint32_t spares = 0;
};

enum class ChangeKind { kSnapshot = 1, kRoundPending = 2, kRoundComplete = 3, kClosed = 4 };
enum class ChangeReason {
  kNone = 0,
  kNodeJoined = 1,
  kNodeLeft = 2,
  kNodeDead = 3,
  kFailureReported = 4,
  kRecoveryFailed = 5,
};

// What a failure report is about. kWorkers: a node's workers failed, every node charges one
// restart. kRecovery: a node's in-place recovery failed and it restarts its workers; the failure
// it recovered from was charged when the recovery began, so no node charges it again.
enum class FailureKind { kWorkers = 0, kRecovery = 1 };

const char* changeKindName(ChangeKind kind);
const char* changeReasonName(ChangeReason reason);

// Pushed to every watcher of a run. On kRoundPending with the agent's node among the last round's
// participants, the agent stops its workers and joins `round`; kFailureReported charges a restart,
// kRecoveryFailed does not (FailureKind::kRecovery).
struct RoundChange {
  ChangeKind kind = ChangeKind::kSnapshot;
  ChangeReason reason = ChangeReason::kNone;
  std::string node_id;
  uint64_t round = 0;
  RunStatus status;
};

struct MasterAddress {
  std::string addr;
  uint32_t port = 0;
};

}  // namespace ddprun::rendezvous
