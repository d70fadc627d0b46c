// FUZZ_CHECK: an invariant of a fuzz target. A violation prints the condition and aborts, which
// libFuzzer reports as a crash and saves the input (crash-<sha1>) for a regression seed.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "%s:%d: invariant violated: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)
