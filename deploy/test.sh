#!/usr/bin/env bash
# The README's test command: installs what is missing, builds, and runs the whole test suite:
#   1. the full build against Debian's LibTorch 1.13 (build/), its tests; the PyTorch tests run
#      under Debian's torch 1.13 and again under the current PyTorch ("torch2: ..." cases);
#   2. the worker SDK, its examples and tests built against the current PyTorch's LibTorch
#      (build-torch2/, deploy/build-torch2.sh), its tests, with the current PyTorch as reference;
#   3. the sanitizer leg (deploy/test-sanitized.sh: clang++, ASan+UBSan, every suite that needs no
#      LibTorch and the fuzz targets); DDPRUN_SANITIZED_TESTS=0 skips it.
# The builds of 2 and 3 run while 1's tests do, at idle priority (below).
# DDPRUN_TORCH2=0 leaves out the current PyTorch (and says so). Every part runs; the exit code is
# that of the first part that failed.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each part's wall time on stderr at its end, so a slow CI run shows where the time went.
started=$SECONDS
took() { echo "test: $1 took $((SECONDS - started)) s" >&2; started=$SECONDS; }
deploy/install-deps.sh
took "install-deps"
deploy/build.sh
took "the build"
torch2=1
if [ "${DDPRUN_TORCH2:-1}" = 0 ]; then
  torch2=0
  echo "test: DDPRUN_TORCH2=0: the worker SDK is not built against the current PyTorch, and the" \
    "PyTorch tests run under Debian's torch 1.13 only" >&2
fi
sanitized=1
[ "${DDPRUN_SANITIZED_TESTS:-1}" != 0 ] || sanitized=0

# The other legs' builds run beside the main suite, at idle priority (SCHED_IDLE, else nice 19):
# they take only the CPU the tests leave (a quarter of it on a 2-core machine: the tests wait on
# processes, sockets and timers), never the tests' own share. Their logs: $logs.
logs=${DDPRUN_BUILD_DIR:-build}/test-logs
mkdir -p "$logs"
rm -f "$logs"/*.rc
idle() { if chrt -i 0 true 2>/dev/null; then chrt -i 0 "$@"; else nice -n 19 "$@"; fi; }
(
  if [ "$torch2" = 1 ]; then
    r=0
    idle deploy/build-torch2.sh >"$logs/build-torch2.log" 2>&1 || r=$?
    echo "$r" >"$logs/build-torch2.rc"
  fi
  if [ "$sanitized" = 1 ]; then
    r=0
    idle deploy/test-sanitized.sh --build-only >"$logs/build-asan.log" 2>&1 || r=$?
    echo "$r" >"$logs/build-asan.rc"
  fi
) &
builds=$!
# await NAME WHAT: waits for the background build NAME; 0 when it succeeded, else its log's end.
await() {
  while [ ! -f "$logs/$1.rc" ] && kill -0 "$builds" 2>/dev/null; do sleep 1; done
  local r
  r=$(cat "$logs/$1.rc" 2>/dev/null || echo 1)
  took "waiting for $2 (built beside the main suite)"
  if [ "$r" != 0 ]; then
    tail -n 80 "$logs/$1.log" >&2 || true
    echo "test: $2 failed (exit $r); its log: $logs/$1.log" >&2
    return 1
  fi
}

rc=0
failed() { [ "$rc" != 0 ] || rc=$1; }  # the exit code is the first failure's
ctest --test-dir "${DDPRUN_BUILD_DIR:-build}" --output-on-failure -j "${DDPRUN_TEST_JOBS:-2}" \
  --timeout 600 || failed $?
took "the main suite"
if [ "$torch2" = 1 ]; then
  if await build-torch2 "the build against the current PyTorch"; then
    # train's multi-process tests launch it with this build's ddprun.
    DDPRUN_TEST_DDPRUN="$PWD/${DDPRUN_BUILD_DIR:-build}/launcher/ddprun" \
      ctest --test-dir "${DDPRUN_TORCH2_BUILD_DIR:-build-torch2}" --output-on-failure \
      -j "${DDPRUN_TEST_JOBS:-2}" --timeout 600 || failed $?
    took "the suite against the current PyTorch"
  else
    failed 1
  fi
fi
if [ "$sanitized" = 1 ]; then
  if await build-asan "the sanitizer leg's build"; then
    deploy/test-sanitized.sh --test-only || failed $?
    took "the sanitizer leg's tests"
  else
    failed 1
  fi
fi
wait "$builds" || true
exit "$rc"
