#!/usr/bin/env bash
# The README's test command: installs what is missing, builds, and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
deploy/build.sh
ctest --test-dir "${DDPRUN_BUILD_DIR:-build}" --output-on-failure -j "${DDPRUN_TEST_JOBS:-2}" \
  --timeout 600
# The sanitizer leg (clang++, ASan+UBSan, pure suites and fuzz targets); DDPRUN_SANITIZED_TESTS=0
# skips it.
if [ "${DDPRUN_SANITIZED_TESTS:-1}" != 0 ]; then
  deploy/test-sanitized.sh
fi
