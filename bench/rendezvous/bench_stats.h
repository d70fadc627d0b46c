// Timing helpers shared by the rendezvous benchmarks (rendezvous_bench, etcd_bench).
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace ddprun::bench_stats {

using BenchClock = std::chrono::steady_clock;

inline double ms(BenchClock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

// The p-quantile (0..1) of `v`, nearest rank; 0 for no samples.
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

}  // namespace ddprun::bench_stats
