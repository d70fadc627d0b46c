#include "ddprun/rendezvous/client.h"

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <future>
#include <thread>

namespace ddprun::rendezvous {

struct Client::Impl {
  explicit Impl(ClientOptions options)
      : work(boost::asio::make_work_guard(io)),
        async(std::make_unique<AsyncClient>(io, std::move(options))),
        thread([this] { io.run(); }) {}

  ~Impl() {
    // The AsyncClient is destroyed on its io thread, then the thread ends once its last timer
    // or probe was cancelled.
    boost::asio::post(io, [this] { async.reset(); });
    work.reset();
    thread.join();
  }

  // Starts an AsyncClient call with a callback that fulfils a promise, and waits for it.
  template <typename R, typename Start>
  R await(Start start) {
    DDPRUN_CHECK(!io.get_executor().running_in_this_thread(),
                 "a blocking rendezvous Client call from one of its own callbacks");
    std::promise<R> promise;
    std::future<R> result = promise.get_future();
    start([&promise](R r) { promise.set_value(std::move(r)); });
    return result.get();
  }

  boost::asio::io_context io;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work;
  std::unique_ptr<AsyncClient> async;
  std::thread thread;
};

Client::Client(ClientOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Client::~Client() = default;

void Client::cancelAll() { impl_->async->cancelAll(); }

StatusOr<RoundInfo> Client::join(const JoinRequest& req, bool include_participants) {
  return impl_->await<StatusOr<RoundInfo>>(
      [&](auto done) { impl_->async->join(req, std::move(done), {}, include_participants); });
}

StatusOr<RunStatus> Client::heartbeat(const std::string& run_id, const std::string& node_id) {
  return impl_->await<StatusOr<RunStatus>>(
      [&](auto done) { impl_->async->heartbeat(run_id, node_id, std::move(done)); });
}

Status Client::leave(const std::string& run_id, const std::string& node_id) {
  return impl_->await<Status>(
      [&](auto done) { impl_->async->leave(run_id, node_id, std::move(done)); });
}

StatusOr<uint64_t> Client::reportFailure(const std::string& run_id, const std::string& node_id,
                                         uint64_t round, FailureKind kind) {
  return impl_->await<StatusOr<uint64_t>>([&](auto done) {
    impl_->async->reportFailure(run_id, node_id, round, kind, std::move(done));
  });
}

Status Client::close(const std::string& run_id) {
  return impl_->await<Status>([&](auto done) { impl_->async->close(run_id, std::move(done)); });
}

Status Client::publishMaster(const std::string& run_id, const std::string& node_id, uint64_t round,
                             const MasterAddress& master) {
  return impl_->await<Status>([&](auto done) {
    impl_->async->publishMaster(run_id, node_id, round, master, std::move(done));
  });
}

StatusOr<MasterAddress> Client::waitMaster(const std::string& run_id, uint64_t round,
                                           Duration timeout) {
  return impl_->await<StatusOr<MasterAddress>>(
      [&](auto done) { impl_->async->waitMaster(run_id, round, timeout, std::move(done)); });
}

Status Client::kvSet(const std::string& run_id, const std::string& key, const std::string& value) {
  return impl_->await<Status>(
      [&](auto done) { impl_->async->kvSet(run_id, key, value, std::move(done)); });
}

StatusOr<std::string> Client::kvGet(const std::string& run_id, const std::string& key) {
  return impl_->await<StatusOr<std::string>>(
      [&](auto done) { impl_->async->kvGet(run_id, key, std::move(done)); });
}

StatusOr<int64_t> Client::kvAdd(const std::string& run_id, const std::string& key, int64_t delta) {
  return impl_->await<StatusOr<int64_t>>(
      [&](auto done) { impl_->async->kvAdd(run_id, key, delta, std::move(done)); });
}

StatusOr<std::string> Client::kvCompareSet(const std::string& run_id, const std::string& key,
                                           const std::string& expected,
                                           const std::string& desired) {
  return impl_->await<StatusOr<std::string>>([&](auto done) {
    impl_->async->kvCompareSet(run_id, key, expected, desired, std::move(done));
  });
}

StatusOr<std::vector<std::string>> Client::kvWait(const std::string& run_id,
                                                  const std::vector<std::string>& keys,
                                                  Duration timeout) {
  return impl_->await<StatusOr<std::vector<std::string>>>(
      [&](auto done) { impl_->async->kvWait(run_id, keys, timeout, std::move(done)); });
}

StatusOr<bool> Client::kvDelete(const std::string& run_id, const std::string& key) {
  return impl_->await<StatusOr<bool>>(
      [&](auto done) { impl_->async->kvDelete(run_id, key, std::move(done)); });
}

StatusOr<uint64_t> Client::kvDeleteRange(const std::string& run_id, const std::string& from,
                                         const std::string& to) {
  return impl_->await<StatusOr<uint64_t>>(
      [&](auto done) { impl_->async->kvDeleteRange(run_id, from, to, std::move(done)); });
}

std::unique_ptr<Watch> Client::watch(const std::string& run_id, const std::string& node_id,
                                     ChangeCallback on_change, BreakCallback on_break) {
  return impl_->async->watch(run_id, node_id, std::move(on_change), std::move(on_break));
}

}  // namespace ddprun::rendezvous
