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

// A test that leaves its own process no free descriptor (to see what code does out of them) cannot
// run under UBSan: its vptr check probes memory through a pipe, which then fails, and reports
// "object has invalid vptr" in whatever logs meanwhile (fmt's buffer). The sanitizer leg builds
// ASan and UBSan together, so this says it.
inline constexpr bool kNoDescriptorsToSpare = kAddressSanitizer;

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
