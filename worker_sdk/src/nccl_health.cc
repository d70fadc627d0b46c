#include "nccl_health.h"

#include <algorithm>
#include <utility>

#include "ddprun/worker/errors.h"

namespace ddprun::worker {

NcclHealth::NcclHealth(NcclComm& comm, std::chrono::milliseconds op_timeout, Now now, Pause pause)
    : comm_(comm), op_timeout_(op_timeout), now_(std::move(now)), pause_(std::move(pause)) {}

NcclStatus NcclHealth::call(const std::function<NcclStatus()>& nccl_call) {
  {
    ddprun::MutexLock lock(comm_mu_);
    if (!aborted_) return nccl_call();
  }
  const std::string why = failure();
  return NcclStatus::failure(why.empty() ? "the communicator was aborted" : why);
}

void NcclHealth::settle(NcclStatus status, const std::string& what, Clock::time_point deadline,
                        const std::string& deadline_text,
                        const std::function<std::string()>& cancel) {
  auto pause = std::chrono::microseconds(10);
  while (status.code == NcclStatus::Code::kInProgress) {
    std::string reason;
    if (now_() >= deadline) {
      reason = "nccl " + what + " did not complete within " + deadline_text +
               "; the communicator was aborted";
    } else if (cancel) {
      if (const std::string why = cancel(); !why.empty()) {
        reason = "nccl " + what + " given up: " + why + "; the communicator was aborted";
      }
    }
    if (!reason.empty()) {
      abortWith(reason);
      throw CommError(reason);
    }
    pause_(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(10));
    status = call([this] { return comm_.asyncError(); });
  }
  if (status.code == NcclStatus::Code::kError) {
    const std::string reason =
        "nccl " + what + " failed: " + status.error + "; the communicator was aborted";
    abortWith(reason);
    throw CommError(failure());
  }
}

void NcclHealth::track(std::string op, Clock::time_point enqueued, std::function<bool()> done) {
  ddprun::MutexLock lock(mu_);
  in_flight_.push_back(Op{std::move(op), enqueued, std::move(done)});
}

std::string NcclHealth::check() {
  std::string overdue;
  {
    ddprun::MutexLock lock(mu_);
    if (!failure_.empty()) return failure_;
    // Collectives finish in submission order on the communicator's stream.
    while (!in_flight_.empty() && in_flight_.front().done()) in_flight_.pop_front();
    if (!in_flight_.empty() && now_() - in_flight_.front().enqueued > op_timeout_) {
      overdue = "nccl " + in_flight_.front().name + " did not complete within op_timeout (" +
                std::to_string(op_timeout_.count()) +
                " ms): a peer is gone or stuck; the communicator was aborted";
    }
  }
  if (overdue.empty()) {
    const NcclStatus async = call([this] { return comm_.asyncError(); });
    if (async.code != NcclStatus::Code::kError) return "";
    overdue =
        "nccl reported an asynchronous error: " + async.error + "; the communicator was aborted";
  }
  abortWith(overdue);
  return failure();
}

void NcclHealth::fail(const std::string& reason) { abortWith(reason); }

void NcclHealth::abortWith(const std::string& reason) {
  {
    ddprun::MutexLock lock(mu_);
    if (failure_.empty()) failure_ = reason;
  }
  ddprun::MutexLock lock(comm_mu_);
  if (aborted_) return;
  aborted_ = true;
  comm_.abort();
}

void NcclHealth::retire() {
  ddprun::MutexLock lock(comm_mu_);
  aborted_ = true;
}

std::string NcclHealth::failure() const {
  ddprun::MutexLock lock(mu_);
  return failure_;
}

bool NcclHealth::aborted() const {
  ddprun::MutexLock lock(comm_mu_);
  return aborted_;
}

std::size_t NcclHealth::inFlight() const {
  ddprun::MutexLock lock(mu_);
  return in_flight_.size();
}

}  // namespace ddprun::worker
