// FUZZ_CHECK: an invariant of a fuzz target. A violation prints the condition and aborts, which
// libFuzzer reports as a crash and saves the input (crash-<sha1>) for a regression seed.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

// An error line for a user: one line, and no control byte that could drive a terminal.
inline bool isOneCleanLine(const std::string& msg) {
  if (msg.empty()) return false;
  for (char c : msg) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return false;
  }
  return true;
}

#define FUZZ_CHECK(cond)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "%s:%d: invariant violated: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)
