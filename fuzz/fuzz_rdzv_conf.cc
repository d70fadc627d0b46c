// libFuzzer target: the --rdzv-conf keys (rendezvous/src/conf.cc, parseRendezvousConf). The
// input is "MIN:MAX|k=v,k=v,..." split the way the launcher splits --rdzv-conf; the parser must
// accept or refuse with one line, and what it accepts must be usable (bounded durations, misses
// >= 1, the --nnodes range kept).
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/conf.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  // Two bytes pick the --nnodes range (0 < MIN <= MAX, as the launcher guarantees).
  const uint32_t min_nodes = 1 + data[0] % 8;
  const uint32_t max_nodes = min_nodes + data[1] % 8;
  const std::string text(reinterpret_cast<const char*>(data + 2), size - 2);
  std::map<std::string, std::string> conf;
  for (const auto& item : ddprun::split(text, ',')) {
    const auto eq = item.find('=');
    if (eq == std::string::npos) continue;
    conf[item.substr(0, eq)] = item.substr(eq + 1);
  }
  auto parsed = ddprun::rendezvous::parseRendezvousConf(conf, min_nodes, max_nodes);
  if (!parsed.isOk()) {
    const std::string& msg = parsed.status().message();
    FUZZ_CHECK(!msg.empty());
    return 0;
  }
  const auto& c = parsed.value();
  FUZZ_CHECK(c.run.min_nodes == min_nodes && c.run.max_nodes == max_nodes);
  FUZZ_CHECK(c.run.heartbeat_interval > ddprun::Duration::zero());
  FUZZ_CHECK(c.run.heartbeat_misses >= 1);
  FUZZ_CHECK(c.run.last_call_timeout >= ddprun::Duration::zero());
  FUZZ_CHECK(c.run.last_call_timeout <= ddprun::seconds(ddprun::kMaxDurationSeconds));
  FUZZ_CHECK(c.join_timeout > ddprun::Duration::zero());
  FUZZ_CHECK(c.join_timeout <= ddprun::seconds(ddprun::kMaxDurationSeconds));
  return 0;
}
