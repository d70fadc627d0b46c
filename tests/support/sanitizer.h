// Whether this build runs under AddressSanitizer (deploy/test-sanitized.sh: clang++, whose
// __has_feature says it, or g++, whose __SANITIZE_ADDRESS__ does). Its allocator is not the
// program's: it holds freed memory back (its quarantine, 256 MiB by default), and a test that
// counts resident memory or page faults measures that, not the program.
#pragma once

#include <cstdlib>
#include <string>

namespace ddprun::testing {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

// ASAN_OPTIONS for a process whose resident memory a test bounds: the environment's, with the
// quarantine held to `mb` MiB (a use after free older than that goes unseen in it). Empty where
// this build has no ASan.
inline std::string asanOptionsWithQuarantine(int mb) {
  if (!kAddressSanitizer) return "";
  const char* own = std::getenv("ASAN_OPTIONS");
  std::string options = own != nullptr ? own : "";
  if (!options.empty()) options += ":";
  return options + "quarantine_size_mb=" + std::to_string(mb);
}

}  // namespace ddprun::testing
