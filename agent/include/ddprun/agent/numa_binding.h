// --numa-binding (torchrun 2.x): which CPUs each local rank may run on, from the machine's
// topology in sysfs. Reading the topology is the only I/O (readCpuTopology); the plan is a pure
// function of it, tested with hand-made topologies. Thread-compatible value types.
//
// ddprun assigns local ranks to NUMA nodes in contiguous blocks (ranks 0..k-1 to the first node,
// and so on), the way GPUs are usually numbered across sockets; torch reads each GPU's own PCI
// affinity instead, which ddprun does not (it launches no CUDA).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "ddprun/common/status.h"

namespace ddprun::agent {

enum class NumaPolicy {
  kNode,         // every CPU of the rank's NUMA node
  kSocket,       // every CPU of the socket (package) holding the rank's node
  kExclusive,    // the rank's node's cores split into disjoint shares among its ranks
  kCoreComplex,  // one L3 cache domain of the rank's node (disjoint while there are enough)
};

struct CpuInfo {
  int id = 0;
  int node = 0;
  int package = 0;
  int core = 0;  // core_id within the package: hyperthreads of one core share it
  int l3 = -1;   // the first CPU of its L3 cache domain; -1 when unknown
};

struct CpuTopology {
  std::vector<int> nodes;     // NUMA node ids having CPUs, ascending
  std::vector<CpuInfo> cpus;  // online CPUs, ascending id
};

// "node", "socket", "exclusive", "core-complex" (also core_complex); nullopt otherwise.
std::optional<NumaPolicy> parseNumaPolicy(const std::string& text);

// Reads <root>/node/node*/cpulist and <root>/cpu/cpu*/{topology,cache/index3} (root is
// /sys/devices/system). FAILED_PRECONDITION naming the file when it cannot be read.
StatusOr<CpuTopology> readCpuTopology(const std::string& root = "/sys/devices/system");

// The CPUs of each of `nproc` local ranks. FAILED_PRECONDITION when the topology cannot support
// the policy (no L3 information for kCoreComplex, fewer cores than ranks for kExclusive).
StatusOr<std::vector<std::vector<int>>> planNumaBinding(NumaPolicy policy,
                                                        const CpuTopology& topology, int nproc);

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}; nullopt when malformed.
std::optional<std::vector<int>> parseCpuList(const std::string& text);

}  // namespace ddprun::agent
