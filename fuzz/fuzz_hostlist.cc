// libFuzzer target: Slurm hostlist expressions (slurm/src/hostlist.cc). Checks beyond "no crash":
// an accepted expression expands to 1..max_hosts non-empty names, firstHost agrees with the
// expansion, and an expression refused once is refused again with the same message.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ddprun/slurm/hostlist.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view expr(reinterpret_cast<const char*>(data), size);
  ddprun::slurm::HostlistOptions options;
  options.max_hosts = 4096;  // keeps each input fast; the bound itself is under test
  auto hosts = ddprun::slurm::expandHostlist(expr, options);
  auto first = ddprun::slurm::firstHost(expr, options);
  FUZZ_CHECK(hosts.isOk() == first.isOk());
  if (!hosts.isOk()) {
    FUZZ_CHECK(isOneCleanLine(hosts.status().message()));
    FUZZ_CHECK(hosts.status().message() == first.status().message());
    return 0;
  }
  FUZZ_CHECK(!hosts.value().empty());
  FUZZ_CHECK(hosts.value().size() <= options.max_hosts);
  for (const auto& h : hosts.value()) FUZZ_CHECK(!h.empty());
  FUZZ_CHECK(first.value() == hosts.value().front());
  return 0;
}
