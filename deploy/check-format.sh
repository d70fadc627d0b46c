#!/usr/bin/env bash
# Fails (listing the files) when a C++ source is not clang-formatted (.clang-format: Google, 100),
# or when a Catch2 test name starts with '-' (ctest passes the name to the test binary, which then
# reads it as an option and runs nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
if git rev-parse --git-dir >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.cc' '*.h')
else
  mapfile -t files < <(find common agent launcher rendezvous snapshot proto slurm worker_sdk examples tests bench fuzz \
    -name '*.cc' -o -name '*.h' 2>/dev/null)
fi
bad=()
for f in "${files[@]}"; do
  if ! clang-format --dry-run -Werror "$f" >/dev/null 2>&1; then bad+=("$f"); fi
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "not clang-formatted (run: clang-format -i FILE): ${bad[*]}" >&2
  exit 1
fi
# A test name that starts with '-' (Catch2 reads it as an option) or holds ';' (ctest splits the
# name there): either way the test silently runs nothing.
bad_names=$(perl -0ne 'while (/TEST_CASE\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)/g) {
    (my $n = $1) =~ s/"\s*"//g; print "$ARGV: $n\n" if $n =~ /^"-/ || $n =~ /;/ }' "${files[@]}")
if [ -n "$bad_names" ]; then
  echo "test names must not start with '-' or contain ';': $bad_names" >&2
  exit 1
fi
echo "${#files[@]} files clang-formatted"
