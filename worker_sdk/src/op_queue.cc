#include "op_queue.h"

#include "ddprun/worker/errors.h"

namespace ddprun::worker {

void OpWork::wait() {
  ddprun::MutexLock lock(mu_);
  while (!done_) cv_.wait(mu_);
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
  {
    ddprun::MutexLock lock(mu_);
    queue_.emplace_back(std::move(op), work);
  }
  cv_.notify_one();
  return work;
}

void OpQueue::run() {
  for (;;) {
    std::pair<std::function<void()>, std::shared_ptr<OpWork>> item;
    {
      ddprun::MutexLock lock(mu_);
      while (!stopping_ && queue_.empty()) cv_.wait(mu_);
      if (queue_.empty()) return;
      item = std::move(queue_.front());
      queue_.pop_front();
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
