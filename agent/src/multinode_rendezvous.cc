#include "ddprun/agent/multinode_rendezvous.h"

#include <algorithm>

#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "local_rendezvous.h"

namespace ddprun::agent {

namespace {
auto agentLog() { return logger("agent"); }

// The value of a node's exit-barrier key in a round it left for round N before its workers
// finished: "next:N" (a node that finished there writes "1").
constexpr const char* kMovedOnMark = "next:";

// A service error that ends the exit barrier: never one that reads as isRoundAbandoned().
Status barrierError(const Status& st) {
  if (!isRoundAbandoned(st)) return st;
  return Status(StatusCode::kUnknown, st.message());
}
}  // namespace

MultiNodeRendezvous::MultiNodeRendezvous(boost::asio::io_context& io, MultiNodeOptions options,
                                         RendezvousService& service, EventSink sink)
    : options_(std::move(options)),
      service_(service),
      sink_(std::move(sink)),
      heartbeat_timer_(io) {}

MultiNodeRendezvous::~MultiNodeRendezvous() = default;

void MultiNodeRendezvous::enqueue(Op op) {
  ops_.push_back(std::move(op));
  if (!op_running_) runNext();
}

void MultiNodeRendezvous::runNext() {
  if (ops_.empty()) {
    op_running_ = false;
    return;
  }
  op_running_ = true;
  Op op = std::move(ops_.front());
  ops_.pop_front();
  op([this] { runNext(); });
}

void MultiNodeRendezvous::nextRound(RoundCallback done) {
  loop_.check();
  enqueue([this, done = std::move(done)](std::function<void()> next) mutable {
    // Leaving the round its workers ran in for a newer one: a node that waits in that round's exit
    // barrier would wait for this one in vain. Its barrier key says where it went. Not awaited,
    // and sent after the join (which answers later, never inline), so the join goes first where
    // the backend runs calls one at a time (etcd): a node waiting there is needed for the newer
    // round anyway, and reads the key at its next slice.
    // (Not after a superseded round: no worker of any node finished that one without this node's.)
    const bool moving_on =
        !node_id_.empty() && !left_ && !answered_behind_ && forming_round_ > joined_round_;
    const std::string key = barrierPrefix() + "arrive/" + node_id_;
    const std::string mark = kMovedOnMark + std::to_string(forming_round_);
    join(std::move(done), std::move(next));
    if (!moving_on) return;
    CallPolicy brief;
    brief.retry_for = options_.endgame_retry;
    service_.kvSet(key, mark, brief, [](Status st) {
      if (!st.isOk()) agentLog()->debug("exit barrier: moved on: {}", st.toString());
    });
  });
}

void MultiNodeRendezvous::join(RoundCallback done, std::function<void()> next) {
  if (left_) {
    done(Status(StatusCode::kCancelled, "left the run"));
    next();
    return;
  }
  rendezvous::JoinRequest req;
  req.run_id = options_.run_id;
  req.node_id = node_id_;
  req.address = options_.local_addr;
  req.local_world_size = static_cast<uint32_t>(options_.local_world_size);
  req.config = options_.run_config;
  req.join_timeout = options_.join_timeout;
  service_.join(req, [this, done = std::move(done),
                      next = std::move(next)](StatusOr<rendezvous::RoundInfo> joined) mutable {
    if (!joined.isOk()) {
      Status st = joined.status();
      // (A port held by something that is not our rendezvous ends in a deadline, not a refusal.
      // The rendezvous's own join timeout is an answer: nothing to explain about reaching it.)
      const bool answered = st.code() == StatusCode::kDeadlineExceeded &&
                            startsWith(st.message(), rendezvous::kJoinTimeoutExpired);
      if (!answered &&
          (st.code() == StatusCode::kUnavailable || st.code() == StatusCode::kDeadlineExceeded)) {
        st = service_.explainUnavailable(st);
      }
      done(st);
      next();
      return;
    }
    // Answered a round below one this node heard forming: superseded on its way (the supervisor
    // joins again). Below the round it held before, or the same round twice so, the service lost
    // the rounds this node heard of (a rendezvous server started again without its state, an
    // etcd store gone back) and numbers its own: the newer round will never come.
    bool behind = joined->round < forming_round_;
    if (behind && joined_round_ != 0 &&
        (joined->round < joined_round_ || (answered_behind_ && joined->round == joined_round_))) {
      agentLog()->warn(
          "the rendezvous answers round {}, below round {} this node heard of: it lost its rounds "
          "(restarted without its state?); going on from its round {}",
          joined->round, forming_round_, joined->round);
      forming_round_ = joined->round;
      behind = false;
    }
    answered_behind_ = behind;
    node_id_ = joined->node_id;
    joined_round_ = joined->round;
    if (joined->round > 1) barriers_.tookPart(joined->round - 1, joined->group_rank);
    RoundInfo round;
    round.round = static_cast<int>(joined->round);
    round.group_rank = static_cast<int>(joined->group_rank);
    round.run_id = options_.run_id;
    std::vector<std::string> members;
    if (joined->participants) {
      for (const auto& p : *joined->participants) {
        round.local_world_sizes.push_back(static_cast<int>(p.local_world_size));
        members.push_back(p.node_id);
      }
    }
    if (!last_members_.empty() && members != last_members_) ++membership_epoch_;
    last_members_ = members;
    for (const auto& m : members) gone_.erase(m);
    round.membership_epoch = membership_epoch_;
    resolveMaster(std::move(joined).value(), std::move(round), std::move(done), std::move(next));
  });
}

void MultiNodeRendezvous::resolveMaster(rendezvous::RoundInfo joined, RoundInfo round,
                                        RoundCallback done, std::function<void()> next) {
  // Every path ends here: the round is this node's once its master is known.
  auto finish = [this, done = std::move(done), next = std::move(next)](
                    StatusOr<RoundInfo> result, uint32_t world_size) mutable {
    if (result.isOk()) {
      agentLog()->info("round {}: group rank {} of {}, world size {}, master {}:{}", result->round,
                       result->group_rank, result->local_world_sizes.size(), world_size,
                       result->master_addr, result->master_port);
      current_round_ = static_cast<uint64_t>(result->round);
      if (!watching_) {
        watching_ = true;
        service_.watch(node_id_, [this](const rendezvous::RoundChange& c) { onChange(c); });
      }
      if (!heartbeating_) {
        heartbeating_ = true;
        scheduleHeartbeat();
      }
    }
    done(std::move(result));
    next();
  };
  const uint32_t world_size = joined.world_size;
  if (options_.static_node_rank >= 0) {
    resolveStaticRanks(
        joined, std::move(round),
        [finish, world_size](StatusOr<RoundInfo> r) mutable { finish(std::move(r), world_size); });
    return;
  }
  if (!joined.master_addr.empty() && joined.master_port != 0) {
    // The round's master is already published. Rank 0 too takes it when it re-joins the same
    // round (the service answers a participant of the completed round with that round, e.g.
    // after a checkpoint stop every node re-forms without a membership change): a new port here
    // would send its workers to another store than the others'.
    round.master_addr = joined.master_addr;
    round.master_port = static_cast<int>(joined.master_port);
    finish(round, world_size);
    return;
  }
  if (joined.group_rank == 0) {
    rendezvous::MasterAddress master{options_.local_addr,
                                     static_cast<uint32_t>(options_.master_port)};
    if (master.port == 0) {
      auto port = findFreePort();
      if (!port.isOk()) {
        finish(port.status(), world_size);
        return;
      }
      master.port = static_cast<uint32_t>(*port);
    }
    round.master_addr = master.addr;
    round.master_port = static_cast<int>(master.port);
    service_.publishMaster(node_id_, joined.round, master,
                           [finish, round, world_size](Status st) mutable {
                             if (!st.isOk()) {
                               finish(st, world_size);
                             } else {
                               finish(round, world_size);
                             }
                           });
    return;
  }
  service_.waitMaster(
      joined.round, options_.join_timeout,
      [finish, round, world_size](StatusOr<rendezvous::MasterAddress> master) mutable {
        if (!master.isOk()) {
          finish(master.status(), world_size);
          return;
        }
        round.master_addr = master->addr;
        round.master_port = static_cast<int>(master->port);
        finish(round, world_size);
      });
}

void MultiNodeRendezvous::resolveStaticRanks(const rendezvous::RoundInfo& joined, RoundInfo round,
                                             RoundCallback done) {
  // Ranks come from --node-rank: learn every participant's, order the nodes by it.
  const std::string prefix = roundKeyPrefix(kStaticRankKeys, joined.round);
  std::vector<std::string> keys;
  std::vector<int> sizes_by_member;
  for (const auto& p : *joined.participants) {
    keys.push_back(prefix + p.node_id);
    sizes_by_member.push_back(static_cast<int>(p.local_world_size));
  }
  service_.kvSet(
      prefix + joined.node_id, std::to_string(options_.static_node_rank), {},
      [this, keys, sizes_by_member, round = std::move(round), done = std::move(done),
       number = joined.round, self = joined.group_rank](Status st) mutable {
        if (!st.isOk()) {
          done(st);
          return;
        }
        static_ranks_.tookPart(number, self);
        service_.kvWait(
            keys, options_.join_timeout, {},
            [this, sizes_by_member, round = std::move(round),
             done = std::move(done)](StatusOr<std::vector<std::string>> values) mutable {
              if (!values.isOk()) {
                Status st = values.status();
                if (st.code() == StatusCode::kDeadlineExceeded) {
                  st = deadlineExceeded(
                      "--node-rank: not every node of round " + std::to_string(round.round) +
                      " said its rank within join_timeout (a node stalled or left, or runs "
                      "another ddprun release, whose keys this one does not read; run one "
                      "release on every node): " +
                      st.message());
                }
                done(st);
                return;
              }
              const size_t n = sizes_by_member.size();
              std::vector<int> sizes(n, -1);
              for (size_t i = 0; i < values->size(); ++i) {
                const std::string& v = (*values)[i];
                auto r = parseInt(v);
                if (!r || *r < 0 || *r >= static_cast<long long>(n) || sizes[*r] != -1) {
                  done(failedPrecondition("--node-rank: the nodes' ranks must be 0.." +
                                          std::to_string(n - 1) + ", each used once; got " + v +
                                          " twice or out of range"));
                  return;
                }
                sizes[*r] = sizes_by_member[i];
              }
              round.local_world_sizes = sizes;
              round.group_rank = options_.static_node_rank;
              round.master_addr = options_.static_master_addr;
              round.master_port = options_.master_port;
              done(round);
            });
      });
}

void MultiNodeRendezvous::onChange(const rendezvous::RoundChange& change) {
  loop_.check();
  if (!change.node_id.empty()) {
    if (change.reason == rendezvous::ChangeReason::kNodeDead ||
        change.reason == rendezvous::ChangeReason::kNodeLeft) {
      gone_.insert(change.node_id);
    } else if (change.reason == rendezvous::ChangeReason::kNodeJoined) {
      gone_.erase(change.node_id);
    }
  }
  if (change.kind == rendezvous::ChangeKind::kSnapshot) {
    // What the run is when the watch begins (or resumes): a round that began forming before, when
    // no kRoundPending could reach this node (a node left just as this one's round completed, or
    // the stream broke while this node's agent stalled). The snapshot says why it opened, as the
    // kRoundPending would have (a server from before that says nothing: a membership change).
    const uint64_t pending = change.status.pending_round;
    if (pending <= current_round_ || pending <= forming_round_) return;
    forming_round_ = pending;
    if (change.reason == rendezvous::ChangeReason::kNone) {
      agentLog()->info("round {} is forming (found when the watch began)", pending);
    } else {
      agentLog()->info("round {} is forming ({} by {}, found when the watch began)", pending,
                       rendezvous::changeReasonName(change.reason), change.node_id);
    }
    tellRoundForming(change.reason, change.node_id);
    return;
  }
  if (change.kind != rendezvous::ChangeKind::kRoundPending) return;
  if (change.round <= current_round_) return;  // about a round this node already holds
  forming_round_ = std::max(forming_round_, change.round);
  agentLog()->info("round {} is forming ({} by {})", change.round,
                   rendezvous::changeReasonName(change.reason), change.node_id);
  tellRoundForming(change.reason, change.node_id);
}

void MultiNodeRendezvous::tellRoundForming(rendezvous::ChangeReason reason,
                                           const std::string& cause) {
  const bool failure = reason == rendezvous::ChangeReason::kFailureReported;
  if (failure || reason == rendezvous::ChangeReason::kRecoveryFailed) {
    if (cause == node_id_) return;  // its own report
    sink_(failure ? PeerEvent::kPeerFailure : PeerEvent::kPeerRecoveryFailed);
    return;
  }
  sink_(reason == rendezvous::ChangeReason::kNodeDead ? PeerEvent::kNodeDeclaredDead
                                                      : PeerEvent::kMembershipChange);
}

void MultiNodeRendezvous::scheduleHeartbeat() {
  heartbeat_timer_.expires_after(options_.run_config.heartbeat_interval);
  heartbeat_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || shut_down_) return;
    if (!node_id_.empty() && !left_) {
      CallPolicy once;
      once.attempt_timeout = options_.run_config.heartbeat_interval;
      once.retry_for = Duration::zero();
      service_.heartbeat(node_id_, once, [this](StatusOr<rendezvous::RunStatus> st) {
        if (st.isOk()) {
          dropped_said_ = false;
          return;
        }
        agentLog()->debug("heartbeat: {}", st.status().toString());
        if (st.status().code() == StatusCode::kNotFound && !left_ && !shut_down_) {
          // Declared dead (e.g. a network cut healed): the others went on; join them again (an
          // agent whose workers finished stays in its exit barrier, which ends as soon as the
          // others finished too or went on to a newer round). Said once: it
          // answers so at every beat until this node joins again.
          if (!dropped_said_) {
            agentLog()->warn("the rendezvous no longer counts this node ({}); re-joining",
                             st.status().message());
          }
          dropped_said_ = true;
          // (A server that lost the run, started again without its state, declared no one dead:
          // the nodes re-form at once.)
          sink_(rendezvous::isRunUnknown(st.status()) ? PeerEvent::kMembershipChange
                                                      : PeerEvent::kNodeDeclaredDead);
        }
      });
    }
    scheduleHeartbeat();
  });
}

void MultiNodeRendezvous::reportFailure(FailureKind kind) {
  loop_.check();
  enqueue([this, kind](std::function<void()> next) {
    service_.reportFailure(
        node_id_, joined_round_, kind, [this, next = std::move(next)](StatusOr<uint64_t> round) {
          if (!round.isOk()) {
            agentLog()->warn("could not report the failure: {}", round.status().toString());
          } else {
            forming_round_ = std::max(forming_round_, *round);  // the round every node joins next
          }
          next();
        });
  });
}

void MultiNodeRendezvous::leave() {
  loop_.check();
  if (left_) return;
  left_ = true;
  // A join in flight would hold the leave behind it: cancel it (its answer is ignored). The
  // leave itself is queued, so it reaches the service before the run is given up.
  service_.cancelAll();
  enqueue([this](std::function<void()> next) {
    if (node_id_.empty()) {
      next();
      return;
    }
    CallPolicy brief;
    brief.retry_for = options_.endgame_retry;
    service_.leave(node_id_, brief, [next = std::move(next)](Status st) {
      if (!st.isOk()) agentLog()->warn("could not leave the run: {}", st.toString());
      next();
    });
  });
}

std::string MultiNodeRendezvous::barrierPrefix() const {
  return roundKeyPrefix(kBarrierKeys, joined_round_);
}

std::vector<std::string> MultiNodeRendezvous::barrierKeys(const std::string& phase) const {
  // A node the service declared dead (or that left) never arrives: waiting for it would only
  // hold this node for the whole barrier timeout.
  std::vector<std::string> keys;
  for (const auto& member : last_members_) {
    if (member == node_id_ || gone_.count(member) == 0) {
      keys.push_back(barrierPrefix() + phase + "/" + member);
    }
  }
  return keys;
}

void MultiNodeRendezvous::waitForMembers(const std::string& phase, TimePoint deadline,
                                         StatusCallback done) {
  const auto now = std::chrono::steady_clock::now();
  // Short slices, so that a member declared gone meanwhile is dropped from the wait.
  const Duration slice = std::clamp<Duration>(deadline - now, std::chrono::milliseconds(1),
                                              std::chrono::milliseconds(500));
  CallPolicy brief;
  brief.retry_for = options_.endgame_retry;
  brief.attempt_timeout = slice + std::chrono::seconds(5);
  std::vector<std::string> keys = barrierKeys(phase);
  service_.kvWait(keys, slice, brief,
                  [this, phase, deadline, keys,
                   done = std::move(done)](StatusOr<std::vector<std::string>> values) mutable {
                    if (values.isOk()) {
                      done(movedOnFrom(keys, *values));
                      return;
                    }
                    if (values.status().code() != StatusCode::kDeadlineExceeded || left_ ||
                        std::chrono::steady_clock::now() >= deadline) {
                      done(barrierError(values.status()));
                      return;
                    }
                    waitForMembers(phase, deadline, std::move(done));
                  });
}

Status MultiNodeRendezvous::movedOnFrom(const std::vector<std::string>& keys,
                                        const std::vector<std::string>& values) const {
  for (size_t i = 0; i < keys.size() && i < values.size(); ++i) {
    if (!startsWith(values[i], kMovedOnMark)) continue;
    const auto round = parseInt(values[i].substr(std::char_traits<char>::length(kMovedOnMark)));
    if (!round || *round <= static_cast<long long>(joined_round_)) continue;
    const std::string member = keys[i].substr(keys[i].rfind('/') + 1);
    if (member == node_id_) continue;
    return roundAbandoned("node " + member +
                          " stopped its workers before they finished and went on to round " +
                          std::to_string(*round));
  }
  return Status::ok();
}

void MultiNodeRendezvous::exitBarrier(Duration timeout, StatusCallback done) {
  loop_.check();
  // Two phases: every node says it arrived and waits (bounded) for the others; later, in
  // shutdown(), every node says it departs and the node that closes the run waits for those, so
  // a node hosting the rendezvous never takes it away from a node still inside the barrier.
  agentLog()->info(
      "local workers finished; waiting up to {:.0f} s for the other nodes to finish (exit "
      "barrier)",
      std::chrono::duration<double>(timeout).count());
  enqueue([this, timeout, done = std::move(done)](std::function<void()> next) mutable {
    const TimePoint deadline = std::chrono::steady_clock::now() + timeout;
    auto finish = [done = std::move(done), next = std::move(next)](Status st) mutable {
      done(st);
      next();
    };
    CallPolicy brief;
    brief.retry_for = options_.endgame_retry;
    service_.kvSet(barrierPrefix() + "arrive/" + node_id_, "1", brief,
                   [this, deadline, finish = std::move(finish)](Status st) mutable {
                     if (!st.isOk()) {
                       finish(barrierError(st));
                       return;
                     }
                     waitForMembers("arrive", deadline, std::move(finish));
                   });
  });
}

void MultiNodeRendezvous::shutdown(bool succeeded, bool left, std::function<void()> done) {
  loop_.check();
  enqueue([this, succeeded, left, done = std::move(done)](std::function<void()> next) mutable {
    auto finish = [this, done = std::move(done), next = std::move(next)]() mutable {
      shut_down_ = true;
      heartbeat_timer_.cancel();
      service_.stopWatch();
      watching_ = false;
      done();
      next();
    };
    if (left || node_id_.empty()) {
      finish();
      return;
    }
    CallPolicy brief;
    brief.retry_for = options_.endgame_retry;
    auto close = [this, brief, finish]() mutable {
      service_.close(brief, [finish](Status st) mutable {
        if (!st.isOk()) agentLog()->debug("close: {}", st.toString());
        finish();
      });
    };
    if (!succeeded) {
      close();
      return;
    }
    const bool closer = !last_members_.empty() && last_members_.front() == node_id_;
    service_.kvSet(barrierPrefix() + "depart/" + node_id_, "1", brief,
                   [this, closer, brief, close, finish](Status st) mutable {
                     if (!closer) {
                       // Done: not dead, and nothing to wait for.
                       service_.leave(node_id_, brief, [finish](Status st) mutable {
                         if (!st.isOk()) agentLog()->debug("leave: {}", st.toString());
                         finish();
                       });
                       return;
                     }
                     if (!st.isOk()) {
                       close();
                       return;
                     }
                     waitForMembers(
                         "depart", std::chrono::steady_clock::now() + options_.departure_timeout,
                         [close](Status all) mutable {
                           if (!all.isOk())
                             agentLog()->debug("exit barrier departures: {}", all.toString());
                           close();
                         });
                   });
  });
}

}  // namespace ddprun::agent
