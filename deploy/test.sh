#!/usr/bin/env bash
# The README's test command: installs what is missing, builds, and runs the whole test suite:
#   1. the full build against Debian's LibTorch 1.13 (build/), its tests; the PyTorch tests run
#      under Debian's torch 1.13 and again under the current PyTorch ("torch2: ..." cases);
#   2. the worker SDK, its examples and tests built against the current PyTorch's LibTorch
#      (build-torch2/, deploy/build-torch2.sh), its tests, with the current PyTorch as reference;
#   3. the sanitizer leg (clang++, ASan+UBSan, pure suites and fuzz targets); DDPRUN_SANITIZED_TESTS=0
#      skips it.
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
[ "$torch2" = 0 ] || { deploy/build-torch2.sh; took "the build against the current PyTorch"; }

rc=0
ctest --test-dir "${DDPRUN_BUILD_DIR:-build}" --output-on-failure -j "${DDPRUN_TEST_JOBS:-2}" \
  --timeout 600 || rc=$?
took "the main suite"
if [ "$torch2" = 1 ]; then
  # train's multi-process tests launch it with this build's ddprun.
  DDPRUN_TEST_DDPRUN="$PWD/${DDPRUN_BUILD_DIR:-build}/launcher/ddprun" \
    ctest --test-dir "${DDPRUN_TORCH2_BUILD_DIR:-build-torch2}" --output-on-failure \
    -j "${DDPRUN_TEST_JOBS:-2}" --timeout 600 || { r=$?; [ "$rc" != 0 ] || rc=$r; }
  took "the suite against the current PyTorch"
fi
if [ "${DDPRUN_SANITIZED_TESTS:-1}" != 0 ]; then
  deploy/test-sanitized.sh || { r=$?; [ "$rc" != 0 ] || rc=$r; }
  took "the sanitizer leg"
fi
exit "$rc"
