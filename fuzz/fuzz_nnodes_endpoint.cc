// libFuzzer target: the --nnodes and --rdzv-endpoint parsers (launcher/src/cli.cc), reached
// through parseCommandLine as a user reaches them. Input: "<nnodes>\n<endpoint>"; the first byte
// picks the backend (static, c10d, etcd-v3) and --standalone. Checks: accepted ranges are
// 0 < MIN <= MAX, an accepted endpoint is normalised to HOST:PORT with a port in 1..65535 (port 0
// cannot be dialled) and a non-empty host, and refusals are usage errors of one clean line.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ddprun/common/strings.h"
#include "ddprun/launcher/cli.h"
#include "fuzz_check.h"

using namespace ddprun;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t shape = data[0];
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  const auto nl = text.find('\n');
  const std::string nnodes = text.substr(0, nl);
  const std::string endpoint = nl == std::string::npos ? "" : text.substr(nl + 1);
  const char* backends[] = {"static", "c10d", "etcd-v3"};
  std::vector<std::string> args = {"--nnodes=" + nnodes,
                                   std::string("--rdzv-backend=") + backends[shape % 3]};
  if (!endpoint.empty() || (shape & 4) != 0) args.push_back("--rdzv-endpoint=" + endpoint);
  if ((shape & 8) != 0) args.push_back("--standalone");
  args.push_back("--no-python");
  args.push_back("/bin/true");
  launcher::HostFacts host;
  host.sysfs_root = "/nonexistent-ddprun-fuzz";
  auto parsed = launcher::parseCommandLine(args, {}, host);
  if (!parsed.isOk()) {
    FUZZ_CHECK(parsed.status().code() == StatusCode::kInvalidArgument);
    FUZZ_CHECK(isOneCleanLine(parsed.status().message()));
    return 0;
  }
  const agent::AgentConfig& c = parsed.value().config;
  FUZZ_CHECK(c.min_nodes >= 1 && c.min_nodes <= c.max_nodes);
  if (!c.standalone && c.rdzv_backend == agent::RendezvousBackend::kC10d) {
    const std::string& ep = c.rdzv_endpoint;
    const auto colon = ep.rfind(':');
    FUZZ_CHECK(colon != std::string::npos && colon > 0);
    auto port = parseInt(ep.substr(colon + 1));
    FUZZ_CHECK(port && *port >= 1 && *port <= 65535);
  }
  return 0;
}
