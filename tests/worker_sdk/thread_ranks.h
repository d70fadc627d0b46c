// Runs W ranks as threads over one in-memory store. Each rank's body runs on its own thread; an
// exception there is captured and rethrown on the calling thread (Catch2 assertions are not
// thread-safe, so bodies return data and the test asserts afterwards).
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "ddprun/worker/process_group.h"

namespace ddprun::worker::testing {

inline ProcessGroupOptions fastOptions() {
  ProcessGroupOptions o;
  o.connect_timeout = std::chrono::seconds(30);
  o.op_timeout = std::chrono::seconds(60);
  o.local_address = "127.0.0.1";
  return o;
}

// Rank r's group gets options_of(r) (e.g. a simulated host per rank).
inline void runRanks(int world, const std::function<void(ProcessGroup&)>& body,
                     const std::function<ProcessGroupOptions(int)>& options_of) {
  auto store = KeyValueStore::inMemory(options_of(0).connect_timeout);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto pg = ProcessGroup::create(r, world, store, options_of(r));
        body(*pg);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

inline void runRanks(int world, const std::function<void(ProcessGroup&)>& body,
                     const ProcessGroupOptions& options = fastOptions()) {
  runRanks(world, body, [&](int) { return options; });
}

}  // namespace ddprun::worker::testing
