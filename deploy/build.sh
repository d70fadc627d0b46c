#!/usr/bin/env bash
# Configures and builds ddprun into ${DDPRUN_BUILD_DIR:-build}. Extra args go to cmake configure.
# With the current PyTorch's environment installed (deploy/install-deps.sh), the PyTorch tests
# are registered a second time, running under it (ctest -L torch2).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${DDPRUN_BUILD_DIR:-build}
JOBS=${DDPRUN_JOBS:-$(nproc)}
torch2=()
venv=${DDPRUN_TORCH2_VENV:-$PWD/.venv/torch2}
if [ "${DDPRUN_TORCH2:-1}" != 0 ] && [ -f "$venv/ddprun-requirements.txt" ]; then
  torch2=(-DDDPRUN_TORCH2_PYTHON="$venv/bin/python")
fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${torch2[@]}" "$@" >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
