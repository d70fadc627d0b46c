#include "gloo_mesh.h"

#include <gloo/transport/context.h>

#include <string>
#include <utility>

#include "ddprun/worker/errors.h"
#include "gloo_abort.h"

namespace ddprun::worker {

namespace {

// A context whose pairs are its own from before they connect.
class MeshContext : public gloo::Context {
 public:
  using gloo::Context::Context;
  void adopt(std::shared_ptr<gloo::transport::Device> device,
             std::shared_ptr<gloo::transport::Context> pairs) {
    device_ = std::move(device);
    transportContext_ = std::move(pairs);
  }
};

}  // namespace

FormingWatch::FormingWatch(KeyValueStore::Cancel cancel) : cancel_(std::move(cancel)) {}

FormingWatch::~FormingWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void FormingWatch::watch(std::shared_ptr<gloo::Context> ctx) {
  if (!active()) return;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    contexts_.push_back(ctx);
    why = fired_;
    if (why.empty() && !thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  if (!why.empty()) failGlooPairs(*ctx, why);
}

std::string FormingWatch::fired() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fired_;
}

void FormingWatch::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    wake_.wait_for(lock, std::chrono::milliseconds(2), [this] { return stop_; });
    if (stop_) return;
    lock.unlock();
    std::string why = cancel_();
    lock.lock();
    if (why.empty()) continue;
    // From now on, watch() fails what it is given itself.
    fired_ = why;
    const auto contexts = contexts_;
    lock.unlock();
    for (const auto& ctx : contexts) failGlooPairs(*ctx, why);
    return;
  }
}

std::shared_ptr<gloo::Context> connectGlooMesh(
    int rank, int size, gloo::rendezvous::Store& store,
    const std::shared_ptr<gloo::transport::Device>& device, std::chrono::milliseconds timeout,
    FormingWatch* watch, const std::function<void()>& published) {
  auto ctx = std::make_shared<MeshContext>(rank, size);
  ctx->setTimeout(timeout);
  std::shared_ptr<gloo::transport::Context> pairs = device->createContext(rank, size);
  pairs->setTimeout(timeout);
  std::vector<char> mine;
  for (int i = 0; i < size; ++i) {
    if (i == rank) continue;
    const std::vector<char> address = pairs->createPair(i)->address().bytes();
    mine.insert(mine.end(), address.begin(), address.end());
  }
  const size_t each = size > 1 ? mine.size() / static_cast<size_t>(size - 1) : 0;
  ctx->adopt(device, pairs);
  if (watch != nullptr) watch->watch(ctx);
  store.set(std::to_string(rank), mine);
  if (published) published();
  for (int i = 0; i < size; ++i) {
    if (i == rank) continue;
    // Rank i's addresses, one per rank but i, in rank order (this rank's is one of them), each
    // the size of this rank's own (the same transport).
    const std::vector<char> theirs = store.get(std::to_string(i));
    if (theirs.size() != mine.size()) {
      throw CommError("rank " + std::to_string(i) + " published " + std::to_string(theirs.size()) +
                      " bytes of pair addresses, not " + std::to_string(size - 1) + " of " +
                      std::to_string(each) + " bytes (is every rank of this group on one Gloo?)");
    }
    const size_t slot = static_cast<size_t>(rank > i ? rank - 1 : rank);
    const std::vector<char> address(
        theirs.begin() + static_cast<std::ptrdiff_t>(slot * each),
        theirs.begin() + static_cast<std::ptrdiff_t>((slot + 1) * each));
    pairs->getPair(i)->connect(address);
  }
  return ctx;
}

}  // namespace ddprun::worker
