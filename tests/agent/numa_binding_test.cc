#include "ddprun/agent/numa_binding.h"

#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>

using namespace ddprun;
using namespace ddprun::agent;
using Cpus = std::vector<int>;

namespace {

// Two sockets, one NUMA node each, 4 cores per socket with 2 hyperthreads (CPU i and i+8 share
// a core), and two L3 domains per socket.
CpuTopology twoSockets() {
  CpuTopology t;
  t.nodes = {0, 1};
  for (int id = 0; id < 16; ++id) {
    const int phys = id % 8;
    CpuInfo c;
    c.id = id;
    c.node = phys / 4;
    c.package = phys / 4;
    c.core = phys % 4;
    c.l3 = (phys / 2) * 2;  // {0,1,8,9} share L3 "0", {2,3,10,11} share "2", ...
    t.cpus.push_back(c);
  }
  return t;
}

// A sysfs tree under a temp dir: <root>/node/nodeN/cpulist, <root>/cpu/cpuN/topology/*.
struct FakeSysfs {
  FakeSysfs() {
    char templ[] = "/tmp/ddprun_sysfs_XXXXXX";
    root = mkdtemp(templ);
  }
  ~FakeSysfs() { std::system(("rm -rf " + root).c_str()); }
  void write(const std::string& rel, const std::string& text) {
    std::system(("mkdir -p " + root + "/" + rel.substr(0, rel.rfind('/'))).c_str());
    std::ofstream(root + "/" + rel) << text << "\n";
  }
  void cpu(int id, int package, int core, const std::string& l3 = "") {
    const std::string d = "cpu/cpu" + std::to_string(id);
    write(d + "/topology/physical_package_id", std::to_string(package));
    write(d + "/topology/core_id", std::to_string(core));
    if (!l3.empty()) write(d + "/cache/index3/shared_cpu_list", l3);
  }
  std::string root;
};

}  // namespace

TEST_CASE("cpu lists parse as the kernel writes them", "[agent][numa]") {
  CHECK(*parseCpuList("0-3,8,10-11") == Cpus{0, 1, 2, 3, 8, 10, 11});
  CHECK(parseCpuList("")->empty());
  CHECK_FALSE(parseCpuList("3-1"));
  CHECK_FALSE(parseCpuList("a"));
  CHECK_FALSE(parseCpuList("1-2-3"));
}

TEST_CASE("numa policies parse in torchrun's spellings", "[agent][numa]") {
  CHECK(parseNumaPolicy("node") == NumaPolicy::kNode);
  CHECK(parseNumaPolicy("socket") == NumaPolicy::kSocket);
  CHECK(parseNumaPolicy("exclusive") == NumaPolicy::kExclusive);
  CHECK(parseNumaPolicy("core-complex") == NumaPolicy::kCoreComplex);
  CHECK(parseNumaPolicy("core_complex") == NumaPolicy::kCoreComplex);
  CHECK_FALSE(parseNumaPolicy("Node"));
}

TEST_CASE("node and socket binding give each rank its block's node", "[agent][numa]") {
  auto plan = planNumaBinding(NumaPolicy::kNode, twoSockets(), 4);
  REQUIRE(plan.isOk());
  CHECK((*plan)[0] == Cpus{0, 1, 2, 3, 8, 9, 10, 11});
  CHECK((*plan)[1] == (*plan)[0]);
  CHECK((*plan)[2] == Cpus{4, 5, 6, 7, 12, 13, 14, 15});
  CHECK((*plan)[3] == (*plan)[2]);
  // One socket per node here: socket binding is the same.
  CHECK(*planNumaBinding(NumaPolicy::kSocket, twoSockets(), 4) == *plan);
  // Fewer ranks than nodes: each rank still gets one node.
  CHECK((*planNumaBinding(NumaPolicy::kNode, twoSockets(), 1))[0] == (*plan)[0]);
}

TEST_CASE("exclusive binding splits a node's whole cores among its ranks", "[agent][numa]") {
  auto plan = planNumaBinding(NumaPolicy::kExclusive, twoSockets(), 4);
  REQUIRE(plan.isOk());
  CHECK((*plan)[0] == Cpus{0, 1, 8, 9});  // cores 0 and 1 with their hyperthreads
  CHECK((*plan)[1] == Cpus{2, 3, 10, 11});
  CHECK((*plan)[3] == Cpus{6, 7, 14, 15});
  auto too_many = planNumaBinding(NumaPolicy::kExclusive, twoSockets(), 10);
  REQUIRE_FALSE(too_many.isOk());
  CHECK(too_many.status().message() ==
        "--numa-binding=exclusive: NUMA node 0 has 4 cores for 5 local ranks");
}

TEST_CASE("core-complex binding gives each rank one L3 domain of its node", "[agent][numa]") {
  auto plan = planNumaBinding(NumaPolicy::kCoreComplex, twoSockets(), 4);
  REQUIRE(plan.isOk());
  CHECK((*plan)[0] == Cpus{0, 1, 8, 9});
  CHECK((*plan)[1] == Cpus{2, 3, 10, 11});
  CHECK((*plan)[2] == Cpus{4, 5, 12, 13});
  auto no_l3 = twoSockets();
  no_l3.cpus[5].l3 = -1;
  auto err = planNumaBinding(NumaPolicy::kCoreComplex, no_l3, 4);
  REQUIRE_FALSE(err.isOk());
  CHECK(err.status().message().find("no L3 cache information for CPU 5") != std::string::npos);
}

TEST_CASE("the topology is read from sysfs, with a clear error where it cannot be",
          "[agent][numa]") {
  FakeSysfs fs;
  fs.write("node/node0/cpulist", "0-1");
  fs.write("node/node1/cpulist", "");  // memory only
  fs.cpu(0, 0, 0, "0-1");
  fs.cpu(1, 0, 1, "0-1");
  auto topo = readCpuTopology(fs.root);
  REQUIRE(topo.isOk());
  CHECK(topo->nodes == std::vector<int>{0});
  REQUIRE(topo->cpus.size() == 2);
  CHECK(topo->cpus[1].core == 1);
  CHECK(topo->cpus[1].l3 == 0);
  FakeSysfs empty;
  auto none = readCpuTopology(empty.root);
  REQUIRE_FALSE(none.isOk());
  CHECK(none.status().message() == "--numa-binding: cannot read the CPU topology from " +
                                       empty.root +
                                       "/node/node*/cpulist (is /sys mounted? drop "
                                       "--numa-binding to run unbound)");
  fs.write("node/node0/cpulist", "0-2");  // cpu2 has no topology directory
  auto missing = readCpuTopology(fs.root);
  REQUIRE_FALSE(missing.isOk());
  CHECK(missing.status().message().find(fs.root + "/cpu/cpu2/topology/physical_package_id") !=
        std::string::npos);
  // The machine this runs on: readable, every CPU on some node.
  auto real = readCpuTopology();
  if (real.isOk()) CHECK_FALSE(real->cpus.empty());
}
