// The keys a node publishes for a round in the run's key-value store (its job identity, its
// snapshot holdings, its --node-rank, its exit barrier's marks): "<kind>/<round, 20 digits>/..."
// (a rank, a node id, a phase). The round is zero-padded, so every key
// of a round below r sorts below roundKeyPrefix(kind, r), and one range deletes them all
// (agent/include/ddprun/agent/round_keys.h). Pure.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace ddprun {

// "<kind>/<round, 20 digits>/".
inline std::string roundKeyPrefix(std::string_view kind, uint64_t round) {
  char digits[24];
  std::snprintf(digits, sizeof(digits), "%020llu", static_cast<unsigned long long>(round));
  std::string prefix(kind);
  prefix += '/';
  prefix += digits;
  prefix += '/';
  return prefix;
}

}  // namespace ddprun
