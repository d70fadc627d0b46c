#include "ddprun/slurm/scontrol.h"

#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <fstream>

#include "process_helpers.h"

using namespace ddprun;
using namespace ddprun::slurm;
using namespace ddprun::testing;
using namespace std::chrono_literals;

TEST_CASE("NodeAddr is read from scontrol's one-line node records", "[slurm]") {
  const std::string out =
      "NodeName=n1 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=vm Port=6818\n"
      "NodeName=gpu01 Arch=x86_64 NodeAddr=10.1.0.17 NodeHostName=gpu01 Version=22.05.8\n";
  CHECK(parseNodeAddr(out, "gpu01").value() == "10.1.0.17");
  CHECK(parseNodeAddr(out, "n1").value() == "127.0.0.1");
  auto missing = parseNodeAddr(out, "gpu0");
  REQUIRE_FALSE(missing.isOk());
  CHECK(missing.status().message() == "scontrol output has no line for node 'gpu0'");
  auto null_addr = parseNodeAddr("NodeName=x NodeAddr=(null) State=DOWN\n", "x");
  REQUIRE_FALSE(null_addr.isOk());
  CHECK(null_addr.status().message() == "scontrol shows no NodeAddr for node 'x'");
}

TEST_CASE("the scontrol lookup reports a missing, failing or hanging scontrol clearly", "[slurm]") {
  ScontrolOptions missing_opts;
  missing_opts.scontrol = "/nonexistent/scontrol";
  auto missing = scontrolAddressLookup(missing_opts)("n1");
  REQUIRE_FALSE(missing.isOk());
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK(missing.status().message() ==
        "looking up the address of Slurm node 'n1': '/nonexistent/scontrol' not found on PATH");

  TempDir dir;
  auto script = [&](const std::string& name, const std::string& body) {
    const std::string path = dir / name;
    std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
    ::chmod(path.c_str(), 0755);
    return path;
  };
  ScontrolOptions failing_opts;
  failing_opts.scontrol = script("failing", "echo \"Node $4 not found\" >&2; exit 1");
  auto failing = scontrolAddressLookup(failing_opts)("n7");
  REQUIRE_FALSE(failing.isOk());
  CHECK(failing.status().code() == StatusCode::kUnavailable);
  CHECK_THAT(failing.status().message(), Catch::Contains("exited with 1: Node n7 not found"));

  ScontrolOptions hanging_opts;
  hanging_opts.scontrol = script("hanging", "exec sleep 60");  // stands for a hung controller
  hanging_opts.timeout = 300ms;
  const auto start = std::chrono::steady_clock::now();
  auto hanging = scontrolAddressLookup(hanging_opts)("n1");
  REQUIRE_FALSE(hanging.isOk());
  CHECK(hanging.status().code() == StatusCode::kDeadlineExceeded);
  CHECK(std::chrono::steady_clock::now() - start < 30s);

  ScontrolOptions fake_opts;
  fake_opts.scontrol = script("fake", "echo \"NodeName=$4 NodeAddr=10.9.9.9 State=IDLE\"");
  CHECK(scontrolAddressLookup(fake_opts)("n3").value() == "10.9.9.9");
}
