#!/usr/bin/env bash
# The README's test command: installs what is missing, builds, and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
deploy/build.sh
ctest --test-dir "${DDPRUN_BUILD_DIR:-build}" --output-on-failure -j "${DDPRUN_TEST_JOBS:-2}" \
  --timeout 600
