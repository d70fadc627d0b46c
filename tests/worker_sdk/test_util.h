// Helpers shared by the worker SDK tests: those of tests/support/process_helpers.h (build/source
// trees, processes, ports, waiting with a bound) under this namespace, plus running a shell command
// and capturing its output, and temp dirs as std::filesystem paths.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>

#include "process_helpers.h"

namespace ddprun::worker::testing {

using ddprun::testing::buildDir;
using ddprun::testing::envOr;
using ddprun::testing::freePort;
using ddprun::testing::Process;
using ddprun::testing::ProcessOptions;
using ddprun::testing::readFile;
using ddprun::testing::sourceDir;
using ddprun::testing::waitUntil;

// The PyTorch the references run under: PYTHON_EXEC (the current PyTorch's interpreter in the
// build against its LibTorch), else Debian's python3-torch.
inline std::string python() { return ddprun::testing::torchPython(); }

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout (stderr too when the command redirects it)
};

// Runs `cmd` through /bin/sh and captures stdout. The caller bounds the runtime with `timeout`.
inline CommandResult run(const std::string& cmd) {
  CommandResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("popen failed: " + cmd);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// A fresh directory under the system temp dir, removed on destruction.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("ddprun-sdk-test-" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace ddprun::worker::testing
