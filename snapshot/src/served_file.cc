// The transport's thread-safe pieces a fetch and the server share: open files, CRC-32s still
// being computed, versions still arriving, and fetch cancellation (transfer.h).
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "ddprun/snapshot/transfer.h"

namespace ddprun::snapshot {

OpenFile::~OpenFile() {
  if (fd_ >= 0) ::close(fd_);
}

void PendingCrc::set(StatusOr<uint32_t> crc) {
  std::vector<std::function<void(const StatusOr<uint32_t>&)>> waiters;
  {
    MutexLock lock(mu_);
    if (value_) return;
    value_ = crc;
    waiters.swap(waiters_);
  }
  for (auto& w : waiters) w(crc);  // value_ never changes once set
}

void PendingCrc::whenKnown(std::function<void(const StatusOr<uint32_t>&)> then) {
  std::optional<StatusOr<uint32_t>> value;
  {
    MutexLock lock(mu_);
    if (!value_) {
      waiters_.push_back(std::move(then));
      return;
    }
    value = value_;
  }
  then(*value);
}

void ArrivingFile::setData(std::shared_ptr<const OpenFile> data) {
  MutexLock lock(mu_);
  data_ = std::move(data);
}

void ArrivingFile::addRange(uint64_t begin, uint64_t end) {
  MutexLock lock(mu_);
  ranges_[begin] = Range{end, begin};
}

void ArrivingFile::advance(uint64_t begin, uint64_t reached) {
  std::vector<Waiter> ready;
  {
    MutexLock lock(mu_);
    auto it = ranges_.find(begin);
    if (it == ranges_.end() || reached <= it->second.reached) return;
    it->second.reached = std::min(reached, it->second.end);
    ready = takeReadyLocked();
  }
  for (auto& w : ready) w.then(Status::ok());
}

void ArrivingFile::fail(const Status& why) {
  std::vector<Waiter> ready;
  {
    MutexLock lock(mu_);
    if (failed_) return;
    failed_ = why;
    ready = takeReadyLocked();
  }
  for (auto& w : ready) w.then(why);
}

void ArrivingFile::whenAvailable(uint64_t offset, uint64_t n,
                                 std::function<void(const Status&)> then) {
  Status now;
  {
    MutexLock lock(mu_);
    if (failed_) {
      now = *failed_;
    } else if (!availableLocked(offset, offset + n)) {
      waiters_.push_back(Waiter{offset, offset + n, std::move(then)});
      return;
    }
  }
  then(now);
}

std::shared_ptr<const OpenFile> ArrivingFile::data() const {
  MutexLock lock(mu_);
  return data_;
}

bool ArrivingFile::availableLocked(uint64_t offset, uint64_t end) const {
  if (!data_) return false;
  // The ranges that cover [offset, end), each far enough.
  auto it = ranges_.upper_bound(offset);
  if (it == ranges_.begin()) return false;
  --it;
  while (offset < end) {
    if (it == ranges_.end() || it->first > offset) return false;  // a gap: no range holds it
    if (it->second.reached < std::min(end, it->second.end)) return false;
    offset = it->second.end;
    ++it;
  }
  return true;
}

std::vector<ArrivingFile::Waiter> ArrivingFile::takeReadyLocked() {
  std::vector<Waiter> ready;
  std::vector<Waiter> waiting;
  for (auto& w : waiters_) {
    (failed_ || availableLocked(w.offset, w.end) ? ready : waiting).push_back(std::move(w));
  }
  waiters_ = std::move(waiting);
  return ready;
}

// Subscribers run under mu_, so none runs after unsubscribe() returned (FetchAbort's lock is
// only ever taken inside this one, never the other way round).
void FetchCancel::cancel(Status why) {
  MutexLock lock(mu_);
  if (cancelled_.load()) return;
  why_ = std::move(why);
  cancelled_ = true;
  for (auto& [id, on_cancel] : subscribers_) on_cancel();
}

Status FetchCancel::why() const {
  MutexLock lock(mu_);
  return why_;
}

uint64_t FetchCancel::subscribe(std::function<void()> on_cancel) {
  MutexLock lock(mu_);
  if (cancelled_.load()) on_cancel();
  subscribers_[++next_id_] = std::move(on_cancel);
  return next_id_;
}

void FetchCancel::unsubscribe(uint64_t id) {
  MutexLock lock(mu_);
  subscribers_.erase(id);
}
}  // namespace ddprun::snapshot
