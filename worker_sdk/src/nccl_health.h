// The life of one NCCL communicator, apart from NCCL and CUDA: a non-blocking init polled with a
// deadline, collectives watched for op_timeout and for NCCL's asynchronous errors, and an abort on
// every way out. The NCCL communicator (nccl_communicator.cc) drives it through NcclComm, a
// wrapper of the few NCCL calls involved; tests drive it through a fake of them, with no GPU.
//
// Threading: NcclHealth is shared by the submitting threads, the communicator's queue thread, the
// threads waiting on Work and the watchdog thread; every method is thread-safe. NCCL calls on the
// communicator go through call() and are serialised with abort(): once aborted, the handle is
// gone and nothing touches it again.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>

#include "ddprun/common/thread_annotations.h"

namespace ddprun::worker {

// What an NCCL call or ncclCommGetAsyncError reported, without NCCL's types.
struct NcclStatus {
  enum class Code { kSuccess, kInProgress, kError };
  Code code = Code::kSuccess;
  std::string error;  // kError: NCCL's text for it

  static NcclStatus success() { return {}; }
  static NcclStatus inProgress() { return {Code::kInProgress, ""}; }
  static NcclStatus failure(std::string text) { return {Code::kError, std::move(text)}; }
};

// The NCCL calls that decide a communicator's fate.
class NcclComm {
 public:
  virtual ~NcclComm() = default;
  // ncclCommGetAsyncError: kInProgress while a non-blocking init or enqueue is under way.
  virtual NcclStatus asyncError() = 0;
  // ncclCommAbort: ends the communicator and every kernel of it still running. NcclHealth calls it
  // at most once, and never together with another call.
  virtual void abort() = 0;
};

class NcclHealth {
 public:
  using Clock = std::chrono::steady_clock;
  using Now = std::function<Clock::time_point()>;
  using Pause = std::function<void(std::chrono::microseconds)>;

  // `now` and `pause` are the clock and the sleep (tests pass a fake clock that a pause advances).
  NcclHealth(NcclComm& comm, std::chrono::milliseconds op_timeout, Now now, Pause pause);
  NcclHealth(const NcclHealth&) = delete;
  NcclHealth& operator=(const NcclHealth&) = delete;

  // Runs `nccl_call` (an NCCL call on the communicator) unless the communicator was aborted; then
  // returns the failure as a status without calling it.
  NcclStatus call(const std::function<NcclStatus()>& nccl_call) EXCLUDES(comm_mu_);

  // Waits until a call that returned `first` is done: an NCCL call on a non-blocking communicator
  // may return kInProgress, and the communicator is usable only once ncclCommGetAsyncError says
  // success. Polls until then; on an error, at `deadline`, or once `cancel` (if set; asked at
  // every poll) gives a reason, aborts the communicator and throws CommError naming `what` and
  // the deadline's `deadline_text` (e.g. "connect_timeout (300000 ms)") or the cancel's reason.
  // (An in-place recovery's init is cancelled when the agent aborts the generation it forms.)
  void settle(NcclStatus first, const std::string& what, Clock::time_point deadline,
              const std::string& deadline_text, const std::function<std::string()>& cancel = {})
      EXCLUDES(mu_, comm_mu_);

  // A collective handed to NCCL at `enqueued`; `done` tells whether the device finished it (a
  // CUDA event query; it must not call NCCL).
  void track(std::string op, Clock::time_point enqueued, std::function<bool()> done) EXCLUDES(mu_);

  // One watchdog pass (the watchdog thread, and threads waiting on work): retires finished
  // collectives; when NCCL reports an asynchronous error, or the oldest collective has outlived
  // op_timeout, aborts the communicator. Returns the failure ("" while healthy). Nobody needs to
  // wait on a collective for it to be aborted.
  std::string check() EXCLUDES(mu_, comm_mu_);

  // Records a failure found elsewhere (an enqueue that failed) and aborts the communicator; the
  // first failure is the one reported from then on.
  void fail(const std::string& reason) EXCLUDES(mu_, comm_mu_);

  // The communicator was destroyed: from now on call() runs nothing (a Work that outlived its
  // communicator must not reach NCCL).
  void retire() EXCLUDES(comm_mu_);

  std::string failure() const EXCLUDES(mu_);
  bool aborted() const EXCLUDES(comm_mu_);
  // Collectives tracked and not yet seen finished.
  std::size_t inFlight() const EXCLUDES(mu_);
  std::chrono::milliseconds opTimeout() const { return op_timeout_; }
  Clock::time_point now() const { return now_(); }
  void pause(std::chrono::microseconds d) const { pause_(d); }

 private:
  struct Op {
    std::string name;
    Clock::time_point enqueued;
    std::function<bool()> done;
  };
  // Sets the failure (the first one wins) and aborts once.
  void abortWith(const std::string& reason) EXCLUDES(mu_, comm_mu_);

  NcclComm& comm_;
  const std::chrono::milliseconds op_timeout_;
  const Now now_;
  const Pause pause_;

  mutable ddprun::Mutex mu_;
  std::deque<Op> in_flight_ GUARDED_BY(mu_);
  std::string failure_ GUARDED_BY(mu_);

  // Serialises NCCL calls with the abort.
  mutable ddprun::Mutex comm_mu_;
  bool aborted_ GUARDED_BY(comm_mu_) = false;
};

}  // namespace ddprun::worker
