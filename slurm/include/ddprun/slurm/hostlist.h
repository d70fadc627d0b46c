// Slurm hostlist expressions (SLURM_JOB_NODELIST, SLURM_STEP_NODELIST, `scontrol show hostnames`):
// "gpu[01-04,07],cpu-a[1-2],login" -> gpu01 gpu02 gpu03 gpu04 gpu07 cpu-a1 cpu-a2 login.
// Pure functions, no state; safe from any thread.
//
// Syntax, as Slurm's hostlist.c reads it:
//  - entries are separated by commas (or whitespace) outside brackets;
//  - an entry is text with any number of bracket groups: "r[1-2]n[01-02]" expands to
//    r1n01 r1n02 r2n01 r2n02 (the leftmost group varies slowest, as Slurm prints them);
//  - a group is a comma-separated list of numbers N or ranges LO-HI with LO <= HI;
//  - zero padding: numbers take the width of LO as written ("[008-010]" -> 008 009 010; "[8-10]"
//    -> 8 9 10);
//  - order and duplicates are kept as written; empty entries ("a,,b", "a,") are skipped.
// Anything else (no hosts at all, empty brackets, unbalanced or nested brackets, descending
// ranges, non-digits in a group, an expansion past `max_hosts`) is INVALID_ARGUMENT naming the
// problem and its 1-based character position. Text after a group ("n[1-2]-ib") is accepted,
// although Slurm 22.05's scontrol rejects it: the expansion is unambiguous.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/common/status.h"

namespace ddprun::slurm {

struct HostlistOptions {
  // Largest expansion accepted; a bigger one is an error, not an allocation of millions of
  // strings. Slurm's own limit per range is 2^20; real clusters stay far below 100k nodes.
  size_t max_hosts = 100000;
};

StatusOr<std::vector<std::string>> expandHostlist(std::string_view expr,
                                                  const HostlistOptions& options = {});

// The first host of `expr` (the whole expression is still validated).
StatusOr<std::string> firstHost(std::string_view expr, const HostlistOptions& options = {});

}  // namespace ddprun::slurm
