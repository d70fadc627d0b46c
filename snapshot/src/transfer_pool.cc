#include "transfer_pool.h"

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/post.hpp>
#include <system_error>

#include "log.h"

namespace ddprun::snapshot {

namespace {

constexpr int kTransferNice = 10;

// The calling thread as background work: on a busy node the workers' training comes first.
// SCHED_IDLE runs it on the CPU time the workers leave (they wait in collectives often enough: a
// 50 MB snapshot a second still replicated in 0.1-0.5 s); nice 10 where SCHED_IDLE is refused.
// Step-time overhead of `train` (bench_replication.py --what step, medians of 16-18 runs):
// +2.1-2.7 % with SCHED_IDLE, +3.4-3.8 % with nice 10 alone.
void runAsBackground() {
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), kTransferNice);
  struct sched_param idle {};
  (void)::sched_setscheduler(0, SCHED_IDLE, &idle);
}

}  // namespace

TransferPool::TransferPool(boost::asio::io_context& io, Options options)
    : io_(io), options_(options) {}

TransferPool::~TransferPool() {
  alive_.reset();  // no `then` runs from here on
  std::vector<std::thread> threads;
  {
    MutexLock lock(mu_);
    stopping_ = true;
    for (auto& q : queues_) q.waiting.clear();
    threads.swap(threads_);
  }
  wake_.notify_all();
  for (auto& t : threads) t.join();
}

void TransferPool::run(std::function<void()> work, std::function<void()> then, Urgency urgency,
                       Lane lane) {
  loop_.check();
  const size_t q = index(lane, urgency);
  std::string why;
  {
    MutexLock lock(mu_);
    joinEnded();
    Queue& queue = queues_[q];
    queue.waiting.push_back(Work{std::move(work), std::move(then)});
    const size_t bound = lane == Lane::kFetch ? options_.fetch : options_.general;
    const bool more = queue.waiting.size() > queue.idle && queue.threads < bound;
    if (!more || startThread(q, &why) || queue.threads > 0) {
      wake_.notify_all();
      return;  // a thread of its kind takes it in its turn
    }
    work = std::move(queue.waiting.back().work);
    then = std::move(queue.waiting.back().then);
    queue.waiting.pop_back();
  }
  // None of its kind to wait for: done here, on the loop.
  snapLog()->warn("snapshot: cannot start a thread ({}); working on the agent's loop", why);
  work();
  then();
}

bool TransferPool::startThread(size_t q, std::string* why) {
  try {
    threads_.emplace_back([this, q, alive = std::weak_ptr<int>(alive_)] { threadMain(q, alive); });
  } catch (const std::system_error& e) {  // out of threads (ulimit -u, memory)
    *why = e.what();
    return false;
  }
  ++queues_[q].threads;
  return true;
}

void TransferPool::joinEnded() {
  for (const auto& id : ended_) {
    auto it = std::find_if(threads_.begin(), threads_.end(),
                           [&id](const std::thread& t) { return t.get_id() == id; });
    if (it == threads_.end()) continue;
    it->join();  // past its last use of mu_: it is at its end
    threads_.erase(it);
  }
  ended_.clear();
}

bool TransferPool::takeWork(size_t q, Work* out) {
  const size_t lane = q / 2;
  const size_t bound =
      lane == static_cast<size_t>(Lane::kFetch) ? options_.fetch : options_.general;
  Queue& queue = queues_[q];
  if (queue.waiting.empty() || running_[lane] >= bound) return false;
  *out = std::move(queue.waiting.front());
  queue.waiting.pop_front();
  return true;
}

void TransferPool::threadMain(size_t q, std::weak_ptr<int> alive) {
  if (q % 2 == static_cast<size_t>(Urgency::kBackground)) runAsBackground();
  const size_t lane = q / 2;
  mu_.lock();
  while (true) {
    Work w;
    if (takeWork(q, &w)) {
      ++running_[lane];
      mu_.unlock();
      w.work();
      boost::asio::post(io_, [alive, then = std::move(w.then)] {
        if (alive.lock()) then();
      });
      mu_.lock();
      --running_[lane];
      wake_.notify_all();  // work of this lane that waited for room may start
      continue;
    }
    if (stopping_) break;
    ++queues_[q].idle;
    const bool timed_out = wake_.wait_for(mu_, options_.idle) == std::cv_status::timeout;
    --queues_[q].idle;
    if (timed_out && queues_[q].waiting.empty()) break;  // without work for a while
  }
  --queues_[q].threads;
  ended_.push_back(std::this_thread::get_id());
  mu_.unlock();
}

}  // namespace ddprun::snapshot
