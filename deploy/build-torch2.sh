#!/usr/bin/env bash
# Builds the worker SDK, its examples and their tests (DDPRUN_SDK_ONLY) against the current
# PyTorch's LibTorch (the environment deploy/install-deps.sh installs) into
# ${DDPRUN_TORCH2_BUILD_DIR:-build-torch2}. Extra args go to cmake configure. The same recipe builds
# against any pip torch: CMAKE_PREFIX_PATH=$(python -c 'import torch;
# print(torch.utils.cmake_prefix_path)'); see docs/libtorch.md.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${DDPRUN_TORCH2_BUILD_DIR:-build-torch2}
JOBS=${DDPRUN_JOBS:-$(nproc)}
venv=${DDPRUN_TORCH2_VENV:-$PWD/.venv/torch2}
if [ ! -x "$venv/bin/python" ]; then
  echo "build-torch2: no PyTorch environment at $venv (run deploy/install-deps.sh)" >&2
  exit 2
fi
prefix=$("$venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDDPRUN_SDK_ONLY=ON \
  -DCMAKE_PREFIX_PATH="$prefix" -DDDPRUN_TORCH2_PYTHON="$venv/bin/python" "$@" >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
