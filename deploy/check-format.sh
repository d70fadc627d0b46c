#!/usr/bin/env bash
# Fails (listing the files) when a C++ source is not clang-formatted (.clang-format: Google, 100),
# or when a Catch2 test name starts with '-' (ctest passes the name to the test binary, which then
# reads it as an option and runs nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
if git rev-parse --git-dir >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.cc' '*.h')
else
  mapfile -t files < <(find common agent launcher rendezvous proto slurm worker_sdk examples tests bench \
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
dashed=$(grep -nE 'TEST_CASE\(\s*"-' "${files[@]}" || true)
if [ -n "$dashed" ]; then
  echo "test names must not start with '-' (Catch2 reads them as options): $dashed" >&2
  exit 1
fi
echo "${#files[@]} files clang-formatted"
