// TorchProbe: asking a Python interpreter for its torch version, with stand-in interpreters (shell
// scripts) and, where installed, the real ones the e2e tests use.
#include "torch_probe.h"  // agent/src

#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <fstream>

#include "process_helpers.h"

using namespace ddprun::agent;
using namespace std::chrono_literals;
using ddprun::testing::TempDir;

namespace {
std::string fakeInterpreter(const TempDir& dir, const std::string& name, const std::string& body) {
  const std::string path = dir / name;
  std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
  ::chmod(path.c_str(), 0755);
  return path;
}
}  // namespace

TEST_CASE("the torch probe reads the version an interpreter reports", "[agent][torch_probe]") {
  TempDir dir;
  TorchProbe probe(fakeInterpreter(dir, "py", "echo 2.15.0+cu132"));
  const auto v = probe.result(5s);
  REQUIRE(v);
  CHECK(v->major == 2);
  CHECK(v->minor == 15);
  CHECK(probe.result(0ms)->minor == 15);  // decided once
}

TEST_CASE("the torch probe knows nothing of an interpreter without torch, or one that hangs",
          "[agent][torch_probe]") {
  TempDir dir;
  // importlib.metadata.PackageNotFoundError: a traceback on stderr, nothing on stdout, exit 1.
  TorchProbe missing(fakeInterpreter(dir, "nopkg", "echo 'No package metadata' >&2; exit 1"));
  CHECK_FALSE(missing.result(5s));
  TorchProbe garbage(fakeInterpreter(dir, "garbage", "head -c 100000 /dev/zero | tr '\\0' x"));
  CHECK_FALSE(garbage.result(5s));
  TorchProbe absent(dir / "no-such-python");
  CHECK_FALSE(absent.result(5s));
  TorchProbe none("");
  CHECK_FALSE(none.result(5s));
  // One that never answers is given up at the bound and killed.
  const std::string pid_file = dir / "pid";
  TorchProbe hung(fakeInterpreter(dir, "hung", "echo $$ > " + pid_file + "; exec sleep 60"));
  REQUIRE(ddprun::testing::waitUntil([&] { return ddprun::testing::fileExists(pid_file); }, 10s));
  CHECK_FALSE(hung.result(300ms));
  const int pid = std::stoi(ddprun::testing::readFile(pid_file));
  CHECK_FALSE(ddprun::testing::pidAlive(pid));
}

TEST_CASE("the torch probe reads a real interpreter's torch version", "[agent][torch_probe]") {
  const std::string python = ddprun::testing::torchPython();
  if (!ddprun::testing::fileExists(python)) {
    WARN("skipped: no interpreter at " + python);
    return;
  }
  TorchProbe probe(python);
  const auto v = probe.result(30s);
  if (!v) {
    WARN("skipped: " + python + " has no torch");
    return;
  }
  CHECK(v->major >= 1);
}
