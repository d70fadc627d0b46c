// Replicator (replicator.h): the wiring of the shell, and the core's actions carried out one by
// one (carryOut). What each action does to files is the Holdings'; what blocks runs on the pool
// (jobs.h, Announcer); inotify is the DirWatcher's.
#include "ddprun/snapshot/replicator.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>

#include "announcer.h"
#include "convert.h"
#include "ddprun/common/loop_affinity.h"
#include "ddprun/common/round_key.h"
#include "ddprun/common/strings.h"
#include "dir_watcher.h"
#include "holdings.h"
#include "jobs.h"
#include "log.h"
#include "transfer_pool.h"

namespace ddprun::snapshot {

namespace {

// How long a round's sync, and a failed job's end, wait for what the workers wrote to be looked
// at and versioned (Quiet::kVersioned): a checkpoint of 2000 files is hashed in ~6 s here. A
// round's sync waits at most half the holdings timeout, which the other nodes wait for it.
constexpr auto kVersionedWithin = std::chrono::seconds(10);
// Once the holdings timeout passed, the keys are read again in parts (a wait this short answers
// what is there: the store looks as the call comes), and a node's that was not there is awaited in
// waits of kLateWait while the round lasts.
constexpr auto kReadNow = std::chrono::milliseconds(50);
constexpr auto kLateWait = std::chrono::seconds(60);

CoreOptions coreOptions(const SnapshotLimits& limits) {
  CoreOptions o;
  o.replica.max_names_per_holder = static_cast<size_t>(std::max(limits.names_per_peer, 1));
  o.replica.max_pending_names = static_cast<size_t>(std::max(limits.names, 1));
  return o;
}

}  // namespace

std::vector<std::string> holdingsKeys(uint64_t round, const std::vector<int>& ranks) {
  std::vector<std::string> keys;
  const std::string prefix = roundKeyPrefix(kHoldingsKeys, round);
  for (int r : ranks) keys.push_back(prefix + std::to_string(r));
  return keys;
}

Status checkSnapshotDir(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    return invalidArgument("--snapshot-dir: " + dir + " does not exist (" + std::strerror(errno) +
                           "); create it on every node");
  }
  if (!S_ISDIR(st.st_mode)) return invalidArgument("--snapshot-dir: " + dir + " is no directory");
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return invalidArgument("--snapshot-dir: " + dir + " is not writable (" + std::strerror(errno) +
                           ")");
  }
  return Status::ok();
}

StatusOr<ServeFault> parseSnapshotFault(const std::string& text) {
  ServeFault fault;
  if (text.empty()) return fault;
  auto parts = split(text, ':');
  auto count = parts.size() == 2 ? parseInt(parts[1]) : std::nullopt;
  const bool late = !parts.empty() && parts[0] == "late-holdings";
  if (!count || *count < 0 || *count > (late ? 600000 : 1000) ||
      (parts[0] != "in-flight" && parts[0] != "at-source" && parts[0] != "slow" &&
       parts[0] != "slow-hash" && !late)) {
    return invalidArgument("DDPRUN_SNAPSHOT_FAULT: '" + text +
                           "' is not in-flight:N, at-source:N, slow:MS, slow-hash:MS (N and MS up "
                           "to 1000) or late-holdings:MS (up to 600000) (a test hook)");
  }
  fault.kind = parts[0] == "in-flight"   ? ServeFault::Kind::kInFlight
               : parts[0] == "at-source" ? ServeFault::Kind::kAtSource
               : parts[0] == "slow"      ? ServeFault::Kind::kSlow
               : late                    ? ServeFault::Kind::kLateHoldings
                                         : ServeFault::Kind::kSlowHash;
  fault.count = static_cast<int>(*count);
  return fault;
}

StatusOr<size_t> parseSnapshotStreams(const std::string& text) {
  if (text.empty()) return kDefaultFetchStreams;
  auto n = parseInt(text);
  if (!n || *n < 1 || *n > 16) {
    return invalidArgument("DDPRUN_SNAPSHOT_STREAMS: '" + text +
                           "' is not a whole number from 1 to 16 (streams for one large fetch)");
  }
  return static_cast<size_t>(*n);
}

// Everything the replicator is made of. Loop-only but for what the pool and the server touch
// through their own guards.
struct Replicator::Parts {
  Parts(boost::asio::io_context& io, ReplicatorOptions options)
      : io(io),
        options(std::move(options)),
        core(coreOptions(this->options.limits), clock),
        pool(std::make_unique<TransferPool>(io)),
        holdings(this->options.dir, *pool),
        announcer(*pool, this->options.run_id, this->options.security),
        watcher(io, this->options.dir, core, [this] { carryOut(); }),
        timer(io) {}

  Status init();
  void scanExisting();
  Status startServer();
  void stop();

  // The core's actions, carried out in order until it has none left; then the timer is armed
  // for its next deadline.
  void carryOut();
  void act(Action& a);
  void look(const Look& l);
  void hash(const Hash& h);
  void fetch(const Fetch& f);
  void syncDone(const SyncDone& s);
  void armTimer();
  // `then`, unless the replicator is gone by the time it is called.
  template <typename Arg>
  std::function<void(Arg)> whileAliveWith(std::function<void(Arg)> then) {
    return [alive = std::weak_ptr<int>(alive_), then = std::move(then)](Arg arg) {
      if (alive.lock()) then(std::move(arg));
    };
  }

  void syncRound(uint64_t round, int rank, std::vector<int> ranks, HoldingsBoard& board,
                 std::function<void()> done);
  // The holdings did not all come within holdings_timeout: the keys read again in parts
  // (readPart), the round started with those there, and the others awaited (readLate).
  void readSome(HoldingsBoard& board, const std::vector<std::string>& keys, uint64_t generation);
  struct Reading {
    std::vector<std::string> keys;
    uint64_t generation = 0;
    std::vector<std::optional<std::string>> values;
    size_t waits = 0;  // in flight
    Status error = Status(StatusCode::kDeadlineExceeded, "no holdings could be read");
  };
  void readPart(HoldingsBoard& board, const std::shared_ptr<Reading>& reading, size_t begin,
                size_t end);
  void partRead(HoldingsBoard& board, const std::shared_ptr<Reading>& reading, size_t begin,
                size_t end, const StatusOr<std::vector<std::string>>& values);
  // (`failed_before`: the store failed the wait before, and said so.)
  void readLate(HoldingsBoard& board, const std::string& key, size_t index, uint64_t generation,
                bool failed_before = false);
  bool isQuiet(Quiet level) const;
  void whenQuiet(Quiet level, Duration grace, Duration bound, std::function<void()> done);

  boost::asio::io_context& io;
  const ReplicatorOptions options;
  SteadyClock clock;
  ReplicationCore core;
  std::unique_ptr<TransferPool> pool;
  Holdings holdings;
  Announcer announcer;
  DirWatcher watcher;
  std::unique_ptr<SnapshotServer> server;
  std::string endpoint;
  // The fetches under way, by name: what ends each (the agent stopping, or the core: its source
  // not a node of the next round).
  std::map<std::string, std::shared_ptr<FetchCancel>> fetches;
  boost::asio::steady_timer timer;
  std::optional<TimePoint> timer_at;  // when the timer is armed for
  struct Sync {
    uint64_t generation = 0;
    std::function<void()> done;
    TimePoint started;
  };
  std::optional<Sync> sync;  // the round's sync waiting for SyncDone
  bool carrying = false;     // in carryOut
  LoopAffinity loop{"snapshot Replicator"};
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
};

StatusOr<std::unique_ptr<Replicator>> Replicator::start(boost::asio::io_context& io,
                                                        ReplicatorOptions options) {
  DDPRUN_RETURN_IF_ERROR(checkSnapshotDir(options.dir));
  auto parts = std::make_unique<Parts>(io, std::move(options));
  DDPRUN_RETURN_IF_ERROR(parts->init());
  return std::unique_ptr<Replicator>(new Replicator(std::move(parts)));
}

Replicator::Replicator(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}

Replicator::~Replicator() {
  if (parts_) parts_->stop();
}

void Replicator::syncRound(uint64_t round, int group_rank, std::vector<int> ranks,
                           HoldingsBoard& board, std::function<void()> done) {
  parts_->syncRound(round, group_rank, std::move(ranks), board, std::move(done));
}

void Replicator::whenQuiet(Quiet level, Duration grace, Duration bound,
                           std::function<void()> done) {
  parts_->whenQuiet(level, grace, bound, std::move(done));
}

const SnapshotMetrics& Replicator::metrics() const { return parts_->core.metrics(); }

const std::string& Replicator::endpoint() const { return parts_->endpoint; }

Status Replicator::Parts::init() {
  loop.check();
  // Watch first, then scan: a file completed in between is seen twice, never missed.
  DDPRUN_RETURN_IF_ERROR(watcher.init());
  scanExisting();
  DDPRUN_RETURN_IF_ERROR(startServer());
  watcher.start();
  return Status::ok();
}

void Replicator::Parts::scanExisting() {
  const auto table = holdings.readTable();
  std::vector<Existing> existing;
  for (const auto& name : watcher.scan()) {
    const auto slash = name.rfind('/');
    if (startsWith(name.substr(slash == std::string::npos ? 0 : slash + 1), kRecvPrefix)) {
      ::unlink(holdings.path(name).c_str());  // a transfer cut short by a crash
      continue;
    }
    if (!isReplicatedName(name)) {
      watcher.warnIfTooLong(name);
      continue;
    }
    // Regular files only: a symlink is not followed out of the directory, a FIFO does not block.
    const int fd =
        ::open(holdings.path(name).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;
    auto file = std::make_shared<OpenFile>(fd);
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) continue;
    auto crc = crc32OfFile(fd);
    if (!crc.isOk()) continue;
    existing.push_back(Existing{name, crc->first, crc->second, fileIdOf(st)});
    holdings.setOpened(name, std::move(file));
  }
  core.start(table, existing);
  carryOut();
  holdings.clearOpened();
}

Status Replicator::Parts::startServer() {
  const std::string& host = options.local_addr;
  boost::system::error_code ec;
  auto addr = boost::asio::ip::make_address(host, ec);
  std::string listen_host = ec ? "0.0.0.0" : (addr.is_v6() ? "[" + host + "]" : host);
  SnapshotServerOptions so;
  so.listen = listen_host + ":0";
  so.run_id = options.run_id;
  so.security = options.security;
  so.fault = options.fault;
  so.max_streams_per_peer = options.limits.streams_per_peer;
  so.max_streams = options.limits.streams;
  so.max_buffered_bytes = options.limits.buffered_bytes;
  so.lookup = [this](const SnapshotFile& want) { return holdings.lookup(want); };
  // On gRPC threads: posted to the loop (the weak pointer is taken here, on the loop).
  so.on_announce = [this, alive = std::weak_ptr<int>(alive_)](const SnapshotFile& f,
                                                              const std::string& source,
                                                              const std::string& origin) {
    boost::asio::post(io, [this, alive, v = fromWire(f), source, origin] {
      if (!alive.lock()) return;
      core.onAnnounce(v, source, origin);
      carryOut();
    });
  };
  auto started = SnapshotServer::start(std::move(so));
  if (!started.isOk()) return started.status();
  server = std::move(started).value();
  endpoint = hostPort(host, server->port());
  core.setEndpoint(endpoint);
  snapLog()->info("snapshot dir {}: replicated between the nodes; serving at {}{}", options.dir,
                  endpoint, options.security.tls_cert_pem.empty() ? "" : " (TLS)");
  return Status::ok();
}

void Replicator::Parts::stop() {
  alive_.reset();
  const Status stopping(StatusCode::kCancelled, "the agent is stopping");
  for (auto& [name, cancel] : fetches) cancel->cancel(stopping);
  watcher.close();
  timer.cancel();
  pool.reset();  // joins its threads; work still waiting never runs
  // A Fetch stream waiting for a hash or a fetch of it (a CRC-32 pending, bytes still arriving)
  // would hold up the server's shutdown for ever: ended now.
  holdings.stop(stopping);
  server.reset();
}

void Replicator::Parts::carryOut() {
  loop.check();
  if (carrying) return;  // the loop below takes what was added
  carrying = true;
  for (auto actions = core.drain(); !actions.empty(); actions = core.drain()) {
    for (auto& a : actions) act(a);
  }
  carrying = false;
  armTimer();
}

void Replicator::Parts::act(Action& a) {
  std::visit(
      [this](auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, Look>) {
          look(x);
        } else if constexpr (std::is_same_v<T, Hold>) {
          holdings.hold(x);
        } else if constexpr (std::is_same_v<T, Hash>) {
          hash(x);
        } else if constexpr (std::is_same_v<T, Announce>) {
          announcer.announce(x, [this](const Announced& done) {
            core.onAnnounced(done);
            carryOut();
          });
        } else if constexpr (std::is_same_v<T, AnnounceAgain>) {
          announcer.announceAgain(x, [this, again = x](size_t told) {
            core.onAnnouncedAgain(again, told);
            carryOut();
          });
        } else if constexpr (std::is_same_v<T, Fetch>) {
          fetch(x);
        } else if constexpr (std::is_same_v<T, Link>) {
          core.onLinked(Linked{x.transfer, holdings.link(x)});
        } else if constexpr (std::is_same_v<T, Install>) {
          auto placed = holdings.install(x.transfer, x.temp);
          core.onInstalled(
              Installed{x.transfer, x.taken, placed.status(), placed.isOk() ? *placed : FileId{}});
        } else if constexpr (std::is_same_v<T, Discard>) {
          ::unlink(x.temp.c_str());
        } else if constexpr (std::is_same_v<T, Delete>) {
          core.onDeleted(holdings.remove(x));
        } else if constexpr (std::is_same_v<T, DropKept>) {
          holdings.dropKept(x.name);
        } else if constexpr (std::is_same_v<T, CancelFetch>) {
          if (auto it = fetches.find(x.name); it != fetches.end()) it->second->cancel(x.why);
        } else if constexpr (std::is_same_v<T, RecordTable>) {
          holdings.recordTable(x.text);
        } else if constexpr (std::is_same_v<T, SyncDone>) {
          syncDone(x);
        }
      },
      a);
}

// One file at a time, in the order completed (the core asks for the next when this one is done):
// looked at at the agent's priority, hashed in the background.
void Replicator::Parts::look(const Look& l) {
  const auto slow_hash = std::chrono::milliseconds(
      options.fault.kind == ServeFault::Kind::kSlowHash ? options.fault.count : 0);
  auto result = std::make_shared<LookResult>();
  auto tell = [this, result, name = l.name] {
    holdings.setOpened(name, result->file);
    core.onLooked(name, result->looked);
    carryOut();
    holdings.clearOpened();
  };
  pool->run([result, l, path = holdings.path(l.name),
             slow_hash] { *result = lookAt(l, path, slow_hash); },
            [this, result, tell] {
              if (!result->to_hash) return tell();
              pool->run([result] { hashLooked(*result); }, tell);
            },
            TransferPool::Urgency::kPrompt);
}

// A large file announced before its hash: hashed while others fetch it.
void Replicator::Parts::hash(const Hash& h) {
  const ServedFile* served = holdings.served(h.name);
  if (served == nullptr || !served->data || !served->pending_crc ||
      served->file.version != h.version) {
    core.onHashed(h.name, h.version, internalError("it is no longer held"));
    return;
  }
  auto crc = std::make_shared<StatusOr<uint32_t>>(internalError("not hashed"));
  pool->run(
      // Always sets the pending CRC-32: streams waiting for it end either way.
      [crc, file = served->data, pending = served->pending_crc, size = served->file.size] {
        *crc = hashServed(*file, size, *pending);
      },
      [this, crc, h] {
        core.onHashed(h.name, h.version, *crc);
        carryOut();
      });
}

void Replicator::Parts::fetch(const Fetch& f) {
  const SnapshotTransfer& t = f.transfer;
  if (f.prompt) warmHeapForFetches();  // no workers yet
  FetchJob job;
  job.peer = SnapshotPeer{t.source, options.run_id, options.security};
  job.peer.stall_timeout = seconds(options.limits.stall_seconds);
  job.file = toWire(t.file);
  job.dir = options.dir;
  job.temp = holdings.tempFor(t.file.name);
  job.streams = options.fetch_streams;
  job.cancel = std::make_shared<FetchCancel>();
  if (!f.copy_from.empty()) {
    const ServedFile* held = holdings.served(f.copy_from);
    job.local = f.from_kept ? holdings.keptFile(f.copy_from) : held ? held->data : nullptr;
  }
  if (f.serve_arriving) {
    job.arriving = std::make_shared<ArrivingFile>();
    if (t.file.crc_pending) job.pending = std::make_shared<PendingCrc>();
    holdings.serveArriving(t.file, job.pending, job.arriving);
  }
  fetches[t.file.name] = job.cancel;
  auto done = std::make_shared<Fetched>();
  pool->run([job, t, done] { *done = runFetch(job, t); },
            [this, done, cancel = job.cancel, arriving = job.arriving] {
              const std::string name = done->transfer.file.name;
              auto running = fetches.find(name);
              if (running != fetches.end() && running->second == cancel) fetches.erase(running);
              core.onFetched(*done);
              carryOut();
              // After the install: a copy renamed into place is served from there now.
              if (arriving) holdings.stopArriving(name, arriving);
            },
            f.prompt ? TransferPool::Urgency::kPrompt : TransferPool::Urgency::kBackground,
            TransferPool::Lane::kFetch);
}

void Replicator::Parts::syncDone(const SyncDone& s) {
  if (!sync || sync->generation != s.generation) return;
  Sync finished = std::move(*sync);
  sync.reset();
  const double secs = std::chrono::duration<double>(clock.now() - finished.started).count();
  snapLog()->debug("snapshot: directory in sync after {:.3f} s", secs);
  finished.done();
}

void Replicator::Parts::armTimer() {
  const auto due = core.nextDeadline();
  if (!due || due == timer_at) return;
  // Due already while events wait to be read: the read settles them.
  if (*due <= clock.now() && watcher.eventsQueued()) return;
  timer_at = due;
  timer.expires_at(*due);
  timer.async_wait([this, alive = std::weak_ptr<int>(alive_)](const boost::system::error_code& ec) {
    if (ec || !alive.lock()) return;
    timer_at.reset();
    core.tick();
    if (!watcher.eventsQueued()) core.settled();
    carryOut();
  });
}

void Replicator::Parts::syncRound(uint64_t round, int rank, std::vector<int> ranks,
                                  HoldingsBoard& board, std::function<void()> done) {
  loop.check();
  // The core knows the replicating nodes only, in rank order: this node is its index among them.
  const auto at = std::lower_bound(ranks.begin(), ranks.end(), rank);
  DDPRUN_CHECK(std::is_sorted(ranks.begin(), ranks.end()) && at != ranks.end() && *at == rank,
               "syncRound: ranks must be ascending and hold this node's");
  const int self = static_cast<int>(at - ranks.begin());
  const uint64_t generation = core.beginRound(round, self);
  carryOut();  // a previous round's sync still fetching is handed on as it is
  sync = Sync{generation, std::move(done), clock.now()};
  const auto keys = holdingsKeys(round, ranks);
  // What the workers wrote just before the round ended (a checkpoint saved, then a failure) is
  // versioned first, so that the holdings published say so and no node starts without it.
  const Duration versioned_within =
      std::min<Duration>(kVersionedWithin, options.holdings_timeout / 2);
  auto publish = [this, &board, key = keys[static_cast<size_t>(self)], keys, generation] {
    if (generation != core.generation()) return;
    board.put(
        key, core.holdings(), whileAliveWith<Status>([this, &board, keys, generation](Status st) {
          if (generation != core.generation()) return;
          if (!st.isOk()) {
            core.onHoldingsNotPublished(generation, st);
            carryOut();
            return;
          }
          board.waitAll(
              keys, options.holdings_timeout,
              whileAliveWith<StatusOr<std::vector<std::string>>>(
                  [this, &board, keys, generation](StatusOr<std::vector<std::string>> values) {
                    if (generation != core.generation()) return;
                    if (!values.isOk() && values.status().code() == StatusCode::kDeadlineExceeded) {
                      readSome(board, keys, generation);
                      return;
                    }
                    core.onHoldings(generation, values);
                    carryOut();
                  }));
        }));
  };
  if (options.fault.kind == ServeFault::Kind::kLateHoldings) {  // the test hook: as if stalled
    auto late = std::make_shared<boost::asio::steady_timer>(io);
    late->expires_after(std::chrono::milliseconds(options.fault.count));
    late->async_wait([this, late, alive = std::weak_ptr<int>(alive_), versioned_within,
                      publish = std::move(publish)](const boost::system::error_code& ec) mutable {
      if (!ec && alive.lock()) {
        whenQuiet(Quiet::kVersioned, Duration::zero(), versioned_within, std::move(publish));
      }
    });
    return;
  }
  whenQuiet(Quiet::kVersioned, Duration::zero(), versioned_within, std::move(publish));
}

void Replicator::Parts::readSome(HoldingsBoard& board, const std::vector<std::string>& keys,
                                 uint64_t generation) {
  auto reading = std::make_shared<Reading>();
  reading->keys = keys;
  reading->generation = generation;
  reading->values.resize(keys.size());
  readPart(board, reading, 0, keys.size());
}

void Replicator::Parts::readPart(HoldingsBoard& board, const std::shared_ptr<Reading>& reading,
                                 size_t begin, size_t end) {
  // A wait answers all its keys or none: keys are asked in halves, and a half that times out is
  // halved again, so m missing of n keys cost about 2m log2(n/m) short waits, not n (every node of
  // a large job reads at once when one node is late).
  ++reading->waits;
  const auto& keys = reading->keys;
  std::vector<std::string> part(keys.begin() + static_cast<std::ptrdiff_t>(begin),
                                keys.begin() + static_cast<std::ptrdiff_t>(end));
  board.waitAll(part, kReadNow,
                whileAliveWith<StatusOr<std::vector<std::string>>>(
                    [this, &board, reading, begin, end](StatusOr<std::vector<std::string>> values) {
                      partRead(board, reading, begin, end, values);
                    }));
}

void Replicator::Parts::partRead(HoldingsBoard& board, const std::shared_ptr<Reading>& reading,
                                 size_t begin, size_t end,
                                 const StatusOr<std::vector<std::string>>& values) {
  if (values.isOk() && values->size() == end - begin) {
    for (size_t i = begin; i < end; ++i) reading->values[i] = (*values)[i - begin];
  } else if (end - begin > 1 && !values.isOk() &&
             values.status().code() == StatusCode::kDeadlineExceeded) {
    const size_t mid = begin + (end - begin) / 2;
    readPart(board, reading, begin, mid);
    readPart(board, reading, mid, end);
  } else if (!values.isOk() && values.status().code() != StatusCode::kDeadlineExceeded) {
    reading->error = values.status();
  }
  const uint64_t generation = reading->generation;
  if (--reading->waits != 0 || generation != core.generation()) return;
  const auto& got = reading->values;
  if (std::none_of(got.begin(), got.end(), [](const auto& v) { return v.has_value(); })) {
    // Not even this node's own: the store did not answer (the round starts as when it cannot be
    // read at all).
    core.onHoldings(generation, reading->error);
    carryOut();
    return;
  }
  core.onSomeHoldings(generation, got);
  carryOut();
  for (size_t k = 0; k < got.size(); ++k) {
    if (!got[k]) readLate(board, reading->keys[k], k, generation);
  }
}

void Replicator::Parts::readLate(HoldingsBoard& board, const std::string& key, size_t index,
                                 uint64_t generation, bool failed_before) {
  board.waitAll(
      {key}, kLateWait,
      whileAliveWith<StatusOr<std::vector<std::string>>>(
          [this, &board, key, index, generation,
           failed_before](StatusOr<std::vector<std::string>> value) {
            if (generation != core.generation()) return;  // the round is over
            if (value.isOk() && value->size() == 1) {
              core.onLateHoldings(generation, index, (*value)[0]);
              carryOut();
            } else if (!value.isOk() && value.status().code() == StatusCode::kDeadlineExceeded) {
              readLate(board, key, index, generation);
            } else if (!value.isOk() && value.status().code() == StatusCode::kCancelled) {
              return;  // the agent leaves or stops
            } else {   // the store failed (unreachable, a bound): asked again a second later
              if (!failed_before) {
                snapLog()->warn(
                    "snapshot: waiting for the late holdings of replicating node {} in round {}: "
                    "{}; asking again every second",
                    index + 1, core.roundNumber(),
                    value.isOk() ? "a malformed answer" : value.status().message());
              }
              auto pause = std::make_shared<boost::asio::steady_timer>(io);
              pause->expires_after(std::chrono::seconds(1));
              pause->async_wait(
                  [this, pause, &board, key, index, generation,
                   alive = std::weak_ptr<int>(alive_)](const boost::system::error_code& ec) {
                    if (!ec && alive.lock() && generation == core.generation()) {
                      readLate(board, key, index, generation, /*failed_before=*/true);
                    }
                  });
            }
          }));
}

bool Replicator::Parts::isQuiet(Quiet level) const {
  const bool versioned = core.versioned() && !watcher.eventsQueued();
  if (level == Quiet::kVersioned || !versioned) return versioned;
  const bool replicated = core.replicated();
  if (level == Quiet::kReplicated || !replicated) return replicated;
  return server->activeStreams() == 0;
}

void Replicator::Parts::whenQuiet(Quiet level, Duration grace, Duration bound,
                                  std::function<void()> done) {
  auto wait = std::make_shared<boost::asio::steady_timer>(io);  // one per wait: they may overlap
  const auto deadline = clock.now() + bound;
  auto quiet_since = std::make_shared<std::optional<TimePoint>>();
  auto check = std::make_shared<std::function<void()>>();
  *check = [this, level, grace, bound, deadline, quiet_since, wait, done = std::move(done), check] {
    const auto now = clock.now();
    const bool quiet = isQuiet(level);
    if (!quiet) {
      quiet_since->reset();
    } else if (!*quiet_since) {
      *quiet_since = now;
    }
    if ((*quiet_since && now - **quiet_since >= grace) || now >= deadline) {
      if (!quiet) {
        snapLog()->warn(
            level == Quiet::kVersioned
                ? "snapshot: files written here are still being looked at after {:.1f} s; "
                  "going on without waiting for them"
                : "snapshot: stopping with transfers still under way",
            std::chrono::duration<double>(bound).count());
      }
      auto d = done;
      *check = nullptr;  // breaks the cycle
      d();
      return;
    }
    wait->expires_after(std::chrono::milliseconds(20));
    wait->async_wait(
        [check, alive = std::weak_ptr<int>(alive_)](const boost::system::error_code& ec) {
          if (!ec && alive.lock() && *check) (*check)();
        });
  };
  (*check)();
}

}  // namespace ddprun::snapshot
