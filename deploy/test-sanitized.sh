#!/usr/bin/env bash
# The sanitizer leg of the test command (deploy/test.sh builds it beside the main suite, then runs
# its tests), built with clang++ and -fsanitize=address,undefined in its own build dir: every suite
# that needs no LibTorch (ctest -L sanitized, target sanitized_tests, tests/CMakeLists.txt): the
# pure suites (common, the rendezvous state and --rdzv-conf, the launcher's command line, Slurm
# parsing, the snapshot core, the worker SDK's NCCL health and loss scale), the agent's unit suite,
# the rendezvous' gRPC server and clients, the snapshot transport and file helpers, the etcd-v3
# backend against a real etcd, and the hostile-peer e2e suite (a real ddprun agent and
# ddprun-rendezvous, built so too, against a node that is not ddprun); and the libFuzzer targets of
# fuzz/ (ctest -L fuzz: seeds plus a bounded number of generated inputs).
# Undefined behaviour, a leak or a memory error fails the leg: every process writes its report
# under the build dir (log_path: the daemons a suite starts too, whose stderr no test may read),
# and the leg fails, showing them, when there is one. Everything here is compiled with clang's
# -Wthread-safety -Werror (mutex annotations, common/thread_annotations.h).
#   deploy/test-sanitized.sh [--build-only | --test-only] [cmake configure args...]
# --build-only builds and checks (deploy/test.sh runs it beside the main suite); --test-only runs
# the tests of a build made so.
set -euo pipefail
cd "$(dirname "$0")/.."
phase=all
case ${1:-} in
--build-only) phase=build; shift ;;
--test-only) phase=test; shift ;;
esac
BUILD_DIR=${DDPRUN_SANITIZE_BUILD_DIR:-build-asan}
JOBS=${DDPRUN_JOBS:-$(nproc)}
launcher=()
if command -v ccache >/dev/null 2>&1; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
if [ "$phase" != test ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER=clang++ -DDDPRUN_SANITIZE=address,undefined -DDDPRUN_FUZZ=ON \
    "${launcher[@]}" "$@" >/dev/null
  cmake --build "$BUILD_DIR" -j "$JOBS" --target sanitized_tests fuzz_targets
  # The thread-safety annotations of what this leg does not build (the worker SDK: LibTorch):
  # checked, not built.
  deploy/check-thread-safety.sh "$BUILD_DIR"
fi
[ "$phase" != build ] || exit 0
reports="$BUILD_DIR/sanitizer-reports"
rm -rf "$reports"
mkdir -p "$reports"
reports=$(cd "$reports" && pwd)
rc=0
ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}:log_path=$reports/report" \
UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}:log_path=$reports/report" \
  ctest --test-dir "$BUILD_DIR" -L 'sanitized|fuzz' --output-on-failure -j "${DDPRUN_TEST_JOBS:-2}" \
  --timeout 600 || rc=$?
found=$(find "$reports" -type f | sort)
if [ -n "$found" ]; then
  for f in $found; do
    echo "== $f" >&2
    head -c 20000 "$f" >&2
  done
  echo "test-sanitized: $(echo "$found" | wc -l) sanitizer report(s), above (a process of a test," \
    "or one it started, hit undefined behaviour, a leak or a memory error)" >&2
  [ "$rc" != 0 ] || rc=1
fi
exit "$rc"
