#!/usr/bin/env bash
# Configures and builds ddprun into ${DDPRUN_BUILD_DIR:-build}. Extra args go to cmake configure.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${DDPRUN_BUILD_DIR:-build}
JOBS=${DDPRUN_JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
