#include "op_queue.h"

#include <optional>

#include "ddprun/worker/errors.h"
#include "peer_wait.h"

namespace ddprun::worker {

void OpWork::wait() {
  std::optional<WaitingForPeers> waiting;  // a wait that lasts: the agent's hang check reads it
  ddprun::MutexLock lock(mu_);
  const auto mark_at = std::chrono::steady_clock::now() + kMarkAfter;
  while (!done_) {
    if (waiting) {
      cv_.wait(mu_);
    } else if (cv_.wait_until(mu_, mark_at) == std::cv_status::timeout) {
      waiting.emplace();
    }
  }
  if (!error_.empty()) throw CommError(error_);
}

bool OpWork::isCompleted() {
  ddprun::MutexLock lock(mu_);
  return done_;
}

void OpWork::complete(std::string error) {
  {
    ddprun::MutexLock lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

OpQueue::OpQueue(std::string name) : name_(std::move(name)), thread_([this] { run(); }) {}

OpQueue::~OpQueue() {
  {
    ddprun::MutexLock lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::shared_ptr<Work> OpQueue::submit(std::function<void()> op) {
  auto work = std::make_shared<OpWork>();
  std::string aborted;
  {
    ddprun::MutexLock lock(mu_);
    if (aborted_.empty()) queue_.emplace_back(std::move(op), work);
    aborted = aborted_;
  }
  if (!aborted.empty()) {
    work->complete(aborted);
    return work;
  }
  cv_.notify_all();
  return work;
}

void OpQueue::abort(const std::string& reason) {
  std::deque<std::pair<std::function<void()>, std::shared_ptr<OpWork>>> dropped;
  std::string message;
  {
    ddprun::MutexLock lock(mu_);
    if (aborted_.empty())
      aborted_ = name_ + ": aborted (" + (reason.empty() ? "no reason" : reason) + ")";
    message = aborted_;
    dropped.swap(queue_);
  }
  // Completed outside the lock: a waiter may submit again from its wake-up.
  for (auto& item : dropped) item.second->complete(message);
  cv_.notify_all();
}

bool OpQueue::waitIdle(std::chrono::milliseconds timeout) {
  ddprun::MutexLock lock(mu_);
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (running_ || !queue_.empty()) {
    if (cv_.wait_until(mu_, until) == std::cv_status::timeout) return !running_ && queue_.empty();
  }
  return true;
}

void OpQueue::run() {
  for (;;) {
    std::pair<std::function<void()>, std::shared_ptr<OpWork>> item;
    {
      ddprun::MutexLock lock(mu_);
      running_ = false;
      cv_.notify_all();  // waitIdle()
      while (!stopping_ && queue_.empty()) cv_.wait(mu_);
      if (queue_.empty()) return;
      item = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    if (!broken_.empty()) {
      item.second->complete(broken_);
      continue;
    }
    std::string error;
    try {
      item.first();
    } catch (const std::exception& e) {
      error = name_ + ": " + e.what();
    } catch (...) {
      error = name_ + ": unknown failure";
    }
    if (!error.empty()) broken_ = error;
    item.second->complete(std::move(error));
  }
}

}  // namespace ddprun::worker
