#!/usr/bin/env bash
# The README's first command: installs what is missing, builds, and runs a real local
# data-parallel training job under ddprun (2 workers, gloo, snapshots, one restart allowed).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
deploy/build.sh
BUILD_DIR=${DDPRUN_BUILD_DIR:-build}
work=$(mktemp -d "${TMPDIR:-/tmp}/ddprun_quickstart_XXXXXX")
# The C++ worker SDK's example: the PyTorch DDP tutorial's job, bucketed gloo all-reduce.
echo "== ddprun --standalone --nproc_per_node=2 --max-restarts=1 train 10 5"
"$BUILD_DIR/launcher/ddprun" --standalone --nproc_per_node=2 --max-restarts=1 \
  "$BUILD_DIR/examples/train" 10 5 --snapshot-path "$work/snapshot.pt"
echo "== done; snapshot in $work/snapshot.pt"
echo "== the same job as an unmodified PyTorch script: PYTHON_EXEC=/usr/bin/python3 \\"
echo "   $BUILD_DIR/launcher/ddprun --standalone --nproc_per_node=2 examples/pytorch/ddp_tutorial.py 10 5"
