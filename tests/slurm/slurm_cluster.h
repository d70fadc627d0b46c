// A real two-node Slurm cluster (n1, n2 on this host) for one test, started by
// tests/slurm/cluster.sh in a fresh temp dir and always stopped by the destructor. When the
// machine cannot run one (not root, slurm-wlm or munge missing) `up()` is false and `why()` says
// why, so the test can skip with a WARN; any other start failure is a test failure.
// Used from the test's own thread.
#pragma once

#include <catch2/catch.hpp>

#include "process_helpers.h"

namespace ddprun::testing {

class SlurmCluster {
 public:
  SlurmCluster() {
    auto started = run({script(), "start", dir_.path()}, {}, std::chrono::seconds(120));
    if (started.exit_code == 3) {
      why_ = started.err;
      return;
    }
    if (started.exit_code != 0) {
      // A half-started cluster is stopped before the failure is reported (REQUIRE throws, and a
      // constructor that throws runs no destructor).
      run({script(), "stop", dir_.path()}, {}, std::chrono::seconds(120));
      FAIL("cluster.sh start failed (" << started.exit_code << "): " << started.out << started.err);
    }
    up_ = true;
  }
  ~SlurmCluster() { run({script(), "stop", dir_.path()}, {}, std::chrono::seconds(120)); }
  SlurmCluster(const SlurmCluster&) = delete;
  SlurmCluster& operator=(const SlurmCluster&) = delete;

  bool up() const { return up_; }
  const std::string& why() const { return why_; }
  const TempDir& dir() const { return dir_; }
  // The environment that points Slurm's clients at this cluster.
  std::map<std::string, std::string> env(std::map<std::string, std::string> extra = {}) const {
    extra["SLURM_CONF"] = dir_ / "slurm.conf";
    return extra;
  }

  static std::string script() { return sourceDir() + "/tests/slurm/cluster.sh"; }

 private:
  TempDir dir_;
  bool up_ = false;
  std::string why_;
};

// Skips the calling test (with a WARN) when no cluster could be started.
#define DDPRUN_REQUIRE_SLURM(cluster)                               \
  do {                                                              \
    if (!(cluster).up()) {                                          \
      WARN("skipped: no local Slurm cluster: " << (cluster).why()); \
      return;                                                       \
    }                                                               \
  } while (0)

}  // namespace ddprun::testing
