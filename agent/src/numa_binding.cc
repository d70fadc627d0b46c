#include "ddprun/agent/numa_binding.h"

#include <dirent.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "ddprun/common/strings.h"

namespace ddprun::agent {

namespace {

std::optional<std::string> slurp(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return trim(ss.str());
}

// Entries of `dir` named <prefix><number>, as numbers, ascending.
std::vector<int> numberedEntries(const std::string& dir, const std::string& prefix) {
  std::vector<int> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (!startsWith(name, prefix)) continue;
      if (auto n = parseInt(name.substr(prefix.size())); n && *n >= 0) {
        out.push_back(static_cast<int>(*n));
      }
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Status unreadable(const std::string& path) {
  return failedPrecondition("--numa-binding: cannot read the CPU topology from " + path +
                            " (is /sys mounted? drop --numa-binding to run unbound)");
}

}  // namespace

std::optional<NumaPolicy> parseNumaPolicy(const std::string& text) {
  if (text == "node") return NumaPolicy::kNode;
  if (text == "socket") return NumaPolicy::kSocket;
  if (text == "exclusive") return NumaPolicy::kExclusive;
  if (text == "core-complex" || text == "core_complex") return NumaPolicy::kCoreComplex;
  return std::nullopt;
}

std::optional<std::vector<int>> parseCpuList(const std::string& text) {
  std::vector<int> out;
  if (trim(text).empty()) return out;
  for (const auto& item : split(trim(text), ',')) {
    auto range = split(item, '-');
    auto lo = parseInt(range[0]);
    auto hi = range.size() == 2 ? parseInt(range[1]) : lo;
    if (range.size() > 2 || !lo || !hi || *lo < 0 || *lo > *hi || *hi > 1 << 20) {
      return std::nullopt;
    }
    for (long long c = *lo; c <= *hi; ++c) out.push_back(static_cast<int>(c));
  }
  return out;
}

StatusOr<CpuTopology> readCpuTopology(const std::string& root) {
  CpuTopology topo;
  std::map<int, int> node_of;
  const std::string node_dir = root + "/node";
  for (int node : numberedEntries(node_dir, "node")) {
    const std::string path = node_dir + "/node" + std::to_string(node) + "/cpulist";
    auto text = slurp(path);
    auto cpus = text ? parseCpuList(*text) : std::nullopt;
    if (!cpus) return unreadable(path);
    if (cpus->empty()) continue;  // a memory-only node
    topo.nodes.push_back(node);
    for (int c : *cpus) node_of[c] = node;
  }
  if (node_of.empty()) return unreadable(node_dir + "/node*/cpulist");
  for (const auto& [id, node] : node_of) {
    const std::string cpu = root + "/cpu/cpu" + std::to_string(id);
    CpuInfo info;
    info.id = id;
    info.node = node;
    for (auto [file, field] : {std::pair<const char*, int*>{"physical_package_id", &info.package},
                               std::pair<const char*, int*>{"core_id", &info.core}}) {
      const std::string path = cpu + "/topology/" + file;
      auto text = slurp(path);
      auto v = text ? parseInt(*text) : std::nullopt;
      if (!v) return unreadable(path);
      *field = static_cast<int>(*v);
    }
    if (auto l3 = slurp(cpu + "/cache/index3/shared_cpu_list")) {
      if (auto cpus = parseCpuList(*l3); cpus && !cpus->empty()) info.l3 = cpus->front();
    }
    topo.cpus.push_back(info);
  }
  return topo;
}

StatusOr<std::vector<std::vector<int>>> planNumaBinding(NumaPolicy policy,
                                                        const CpuTopology& topology, int nproc) {
  if (topology.nodes.empty() || nproc <= 0) {
    return failedPrecondition("--numa-binding: no NUMA node with CPUs");
  }
  const int nodes = static_cast<int>(topology.nodes.size());
  std::vector<std::vector<int>> out(static_cast<size_t>(nproc));
  for (int lr = 0; lr < nproc; ++lr) {
    // Contiguous blocks: with 8 ranks on 2 nodes, ranks 0-3 on the first, 4-7 on the second.
    const int node_index = static_cast<int>(static_cast<long long>(lr) * nodes / nproc);
    const int node = topology.nodes[static_cast<size_t>(node_index)];
    // The ranks sharing this node, and this rank's place among them.
    int first = 0;
    while (static_cast<long long>(first) * nodes / nproc < node_index) ++first;
    int count = 0;
    while (first + count < nproc &&
           static_cast<long long>(first + count) * nodes / nproc == node_index) {
      ++count;
    }
    const int slot = lr - first;
    std::vector<const CpuInfo*> on_node;
    for (const auto& c : topology.cpus) {
      if (c.node == node) on_node.push_back(&c);
    }
    auto& cpus = out[static_cast<size_t>(lr)];
    switch (policy) {
      case NumaPolicy::kNode:
        for (const auto* c : on_node) cpus.push_back(c->id);
        break;
      case NumaPolicy::kSocket: {
        const int package = on_node.front()->package;
        for (const auto& c : topology.cpus) {
          if (c.package == package) cpus.push_back(c.id);
        }
        break;
      }
      case NumaPolicy::kExclusive: {
        // Whole cores (hyperthreads together), split as evenly as possible.
        std::vector<std::pair<int, int>> cores;  // (package, core) in CPU order
        for (const auto* c : on_node) {
          if (std::find(cores.begin(), cores.end(), std::make_pair(c->package, c->core)) ==
              cores.end()) {
            cores.emplace_back(c->package, c->core);
          }
        }
        const int n = static_cast<int>(cores.size());
        if (n < count) {
          return failedPrecondition("--numa-binding=exclusive: NUMA node " + std::to_string(node) +
                                    " has " + std::to_string(n) + " cores for " +
                                    std::to_string(count) + " local ranks");
        }
        const int begin = slot * n / count, end = (slot + 1) * n / count;
        for (const auto* c : on_node) {
          auto at = std::find(cores.begin(), cores.end(), std::make_pair(c->package, c->core));
          const int index = static_cast<int>(at - cores.begin());
          if (index >= begin && index < end) cpus.push_back(c->id);
        }
        break;
      }
      case NumaPolicy::kCoreComplex: {
        std::vector<int> domains;  // L3 domains of the node, in CPU order
        for (const auto* c : on_node) {
          if (c->l3 < 0) {
            return failedPrecondition(
                "--numa-binding=core-complex: no L3 cache information for CPU " +
                std::to_string(c->id) + " (cpu" + std::to_string(c->id) +
                "/cache/index3/shared_cpu_list); use node, socket or exclusive");
          }
          if (std::find(domains.begin(), domains.end(), c->l3) == domains.end()) {
            domains.push_back(c->l3);
          }
        }
        const int domain = domains[static_cast<size_t>(slot) % domains.size()];
        for (const auto* c : on_node) {
          if (c->l3 == domain) cpus.push_back(c->id);
        }
        break;
      }
    }
  }
  return out;
}

}  // namespace ddprun::agent
