#!/usr/bin/env bash
# Runs the rendezvous benchmark and, side by side, torchrun's c10d rendezvous.
# usage: bench/rendezvous/run_bench.sh [BUILD_DIR]   (build the rendezvous_bench target first)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build}
echo "## ddprun gRPC rendezvous (embedded server, simulated agents on 127.0.0.1)"
"$build/bench/rendezvous/rendezvous_bench" --sizes 2,4,8,64,512,4096 --trials 3
echo
echo "## torchrun c10d rendezvous (torch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)' 2>/dev/null), one process per agent)"
python3 "$here/torchrun_c10d.py" --sizes 2,4,8 --trials 3
