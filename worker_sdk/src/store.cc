#include "ddprun/worker/store.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <optional>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "ddprun/common/strings.h"
#include "ddprun/worker/errors.h"
#include "peer_wait.h"

namespace ddprun::worker {

struct KeyValueStore::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  int port = 0;
  std::mutex cancel_mu;
  Cancel cancel;  // guarded by cancel_mu
};

namespace {

// True once a TCP connection to host:port succeeds within `wait` (a non-blocking connect).
bool accepts(const addrinfo& a, std::chrono::milliseconds wait) {
  const int fd = ::socket(a.ai_family, a.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a.ai_protocol);
  if (fd < 0) return false;
  bool ok = ::connect(fd, a.ai_addr, a.ai_addrlen) == 0;
  if (!ok && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, static_cast<int>(wait.count())) == 1) {
      int err = 0;
      socklen_t len = sizeof(err);
      ok = ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
    }
  }
  ::close(fd);
  return ok;
}

// c10d's client waits about a second after each refused connection, and a new rank 0 (the group
// re-formed in place) opens its store moments after the others learn its port: wait here, trying
// every 10 ms for the first second, then backing off (doubling, up to 250 ms, so many ranks
// waiting on a rank 0 that is slow to come do not flood it), until the port accepts or `timeout`
// passes (then c10d gives the error), or until `cancel` gives a reason (then it throws).
void awaitListening(const std::string& host, int port, std::chrono::milliseconds timeout,
                    const KeyValueStore::Cancel& cancel) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  auto pause = std::chrono::milliseconds(10);
  bool up = false;
  while (!up && std::chrono::steady_clock::now() < deadline) {
    if (cancel) {
      if (std::string why = cancel(); !why.empty()) {
        ::freeaddrinfo(found);
        throw CommError("gave up connecting to the rendezvous store at " + host + ":" +
                        std::to_string(port) + ": " + why);
      }
    }
    for (const addrinfo* a = found; a != nullptr && !up; a = a->ai_next) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      up = accepts(*a,
                   std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(500)));
    }
    if (up) break;
    std::this_thread::sleep_for(pause);
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(1)) {
      pause = std::min(pause * 2, std::chrono::milliseconds(250));
    }
  }
  ::freeaddrinfo(found);
}

}  // namespace

KeyValueStore::KeyValueStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KeyValueStore::~KeyValueStore() = default;

std::shared_ptr<KeyValueStore> KeyValueStore::tcpServer(const std::string& host, int port,
                                                        std::chrono::milliseconds timeout) {
  if (port < 0 || port > 65535)
    throw ConfigError("store port " + std::to_string(port) + " is outside [0, 65535]");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = true;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  auto impl = std::make_unique<Impl>();
  try {
    auto tcp = c10::make_intrusive<c10d::TCPStore>(host, opts);
    impl->port = tcp->getPort();
    impl->store = tcp;
  } catch (const std::exception& e) {
    throw CommError("cannot host the rendezvous store on " + host + ":" + std::to_string(port) +
                    ": " + e.what());
  }
  return std::shared_ptr<KeyValueStore>(new KeyValueStore(std::move(impl)));
}

std::shared_ptr<KeyValueStore> KeyValueStore::tcpClient(const std::string& host, int port,
                                                        std::chrono::milliseconds timeout,
                                                        const Cancel& cancel) {
  if (port <= 0 || port > 65535)
    throw ConfigError("store port " + std::to_string(port) + " is outside [1, 65535]");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  auto impl = std::make_unique<Impl>();
  awaitListening(host, port, timeout, cancel);
  try {
    impl->store = c10::make_intrusive<c10d::TCPStore>(host, opts);
    impl->port = port;
  } catch (const std::exception& e) {
    throw CommError("cannot reach the rendezvous store at " + host + ":" + std::to_string(port) +
                    " within " + std::to_string(timeout.count()) +
                    " ms (is rank 0 running? check MASTER_ADDR/MASTER_PORT): " +
                    ddprun::trim(e.what()).substr(0, 300));
  }
  return std::shared_ptr<KeyValueStore>(new KeyValueStore(std::move(impl)));
}

std::shared_ptr<KeyValueStore> KeyValueStore::inMemory(std::chrono::milliseconds timeout) {
  auto impl = std::make_unique<Impl>();
  impl->store = c10::make_intrusive<c10d::HashStore>();
  impl->store->setTimeout(timeout);
  return std::shared_ptr<KeyValueStore>(new KeyValueStore(std::move(impl)));
}

void KeyValueStore::set(const std::string& key, const std::vector<char>& value) {
  try {
    impl_->store->set(key, std::vector<std::uint8_t>(value.begin(), value.end()));
  } catch (const std::exception& e) {
    throw CommError("store set('" + key + "') failed: " + e.what());
  }
}

std::vector<char> KeyValueStore::get(const std::string& key) {
  try {
    std::vector<std::uint8_t> v = impl_->store->get(key);
    return std::vector<char>(v.begin(), v.end());
  } catch (const std::exception& e) {
    throw CommError("store get('" + key + "') failed: " + e.what());
  }
}

std::int64_t KeyValueStore::add(const std::string& key, std::int64_t delta) {
  try {
    return impl_->store->add(key, delta);
  } catch (const std::exception& e) {
    throw CommError("store add('" + key + "') failed: " + e.what());
  }
}

void KeyValueStore::setCancel(Cancel cancel) {
  std::lock_guard<std::mutex> lock(impl_->cancel_mu);
  impl_->cancel = std::move(cancel);
}

KeyValueStore::Cancel KeyValueStore::cancel() const {
  std::lock_guard<std::mutex> lock(impl_->cancel_mu);
  return impl_->cancel;
}

void KeyValueStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  Cancel cancel;
  {
    std::lock_guard<std::mutex> lock(impl_->cancel_mu);
    cancel = impl_->cancel;
  }
  auto timedOut = [&](const std::string& why) {
    return CommError("timed out after " + std::to_string(timeout.count()) +
                     " ms waiting for store keys [" + ddprun::join(keys, ", ") +
                     "] (a peer rank did not arrive): " + ddprun::trim(why).substr(0, 300));
  };
  // A wait that lasts kMarkAfter waits for its peers (a group formed after the first step): the
  // heartbeat file says so, for the agent's hang check (peer_wait.h).
  std::optional<WaitingForPeers> waiting;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  // c10d's blocking wait cannot be interrupted (and one given up on its own timeout leaves the
  // connection out of step on LibTorch 1.13): ask whether the keys are there, 1 ms apart at
  // first, then up to 5 ms apart (a loopback round trip is about 0.1 ms), 50 ms after a second.
  // Without a cancel, only until the wait is marked; then c10d's wait, which asks the store once.
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    bool there = false;
    try {
      there = impl_->store->check(keys);
    } catch (const std::exception& e) {
      throw CommError("store check of keys [" + ddprun::join(keys, ", ") +
                      "] failed: " + ddprun::trim(e.what()).substr(0, 300));
    }
    if (there) return;
    if (cancel) {
      if (std::string why = cancel(); !why.empty()) {
        throw CommError("gave up waiting for store keys [" + ddprun::join(keys, ", ") +
                        "]: " + why);
      }
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) throw timedOut("no such keys yet");
    if (!waiting && now >= start + kMarkAfter) {
      waiting.emplace();
      if (!cancel) break;
    }
    std::this_thread::sleep_for(pause);
    // Up to 5 ms apart for a second, then 50 ms: a long wait with a cancel (a group's, under
    // --restart-mode=in-place) asks the store 20 times a second, not 200.
    pause =
        std::min(pause * 2, now - start < std::chrono::seconds(1) ? std::chrono::milliseconds(5)
                                                                  : std::chrono::milliseconds(50));
  }
  try {
    // (At least 1 ms: c10d reads 0 as no timeout at all.)
    impl_->store->wait(keys, std::max(std::chrono::milliseconds(1),
                                      std::chrono::duration_cast<std::chrono::milliseconds>(
                                          deadline - std::chrono::steady_clock::now())));
  } catch (const std::exception& e) {
    throw timedOut(e.what());
  }
}

int KeyValueStore::port() const { return impl_->port; }

}  // namespace ddprun::worker
