// RendezvousDaemon: a standalone ddprun-rendezvous on 127.0.0.1 and a free port, for the
// multi-node e2e suites; `extra` flags (TLS, token). Waits until it listens.
#pragma once

#include <catch2/catch.hpp>
#include <regex>
#include <string>
#include <vector>

#include "process_helpers.h"

namespace ddprun::testing {

inline std::vector<std::string> rendezvousDaemonArgv(std::vector<std::string> extra) {
  std::vector<std::string> argv = {buildDir() + "/rendezvous/ddprun-rendezvous", "--listen",
                                   "127.0.0.1:0"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

struct RendezvousDaemon {
  explicit RendezvousDaemon(std::vector<std::string> extra = {})
      : process(rendezvousDaemonArgv(std::move(extra))) {
    std::smatch m;
    REQUIRE(waitUntil([&] {
      std::string out = process.out();
      if (!std::regex_search(out, m, std::regex(R"(listening on (\S+):(\d+))"))) return false;
      endpoint = "127.0.0.1:" + m[2].str();
      return true;
    }));
  }
  Process process;
  std::string endpoint;
};

}  // namespace ddprun::testing
