#!/usr/bin/env bash
# Smoke test of an installed ddprun: two workers of the example training program under
# `ddprun --standalone`. The container build runs it on the installed .deb (Dockerfile), and
# tests/install runs it on the .deb's files extracted into a temp dir.
#   smoke.sh [ROOT]   ROOT: where the package's /usr lies (default /, i.e. installed)
set -euo pipefail
root=${1:-/}
bin=$root/usr/bin
if [ "$root" != / ]; then
  export LD_LIBRARY_PATH=$root/usr/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
"$bin/ddprun" --standalone --nproc_per_node=2 "$bin/train" 2 1 --snapshot-path "$work/snap.pt" \
  >"$work/out.log" 2>&1 || { cat "$work/out.log"; echo "smoke: ddprun failed" >&2; exit 1; }
cat "$work/out.log"
grep -q 'Epoch 1' "$work/out.log" || { echo "smoke: no training output" >&2; exit 1; }
echo "smoke: OK"
