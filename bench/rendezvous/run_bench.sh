#!/usr/bin/env bash
# Runs the rendezvous benchmark and, side by side, torchrun's c10d rendezvous.
# usage: bench/rendezvous/run_bench.sh [BUILD_DIR]   (build rendezvous_bench and etcd_bench first)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build}
echo "## ddprun gRPC rendezvous (embedded server, simulated agents on 127.0.0.1)"
"$build/bench/rendezvous/rendezvous_bench" --sizes 2,4,8,64,512,4096 --trials 3
echo
echo "## torchrun c10d rendezvous (torch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)' 2>/dev/null), one process per agent)"
python3 "$here/torchrun_c10d.py" --sizes 2,4,8 --trials 3
echo
# One local etcd member with its data dir under $1 (a disk: every commit waits for an fsync;
# /dev/shm: the same member without a real fsync), etcd's own read and commit times (--probe),
# then the rendezvous over it.
etcd_bench() {
  local label=$1 base=$2 data port peer
  echo "## ddprun etcd-v3 rendezvous, etcd data dir on $label (one local member, simulated agents in one process)"
  data=$(mktemp -d -p "$base")
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  peer=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  /usr/bin/etcd --name bench --data-dir "$data/etcd" \
    --listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "bench=http://127.0.0.1:$peer" >"$data/etcd.log" 2>&1 &
  etcd_pid=$!
  for _ in $(seq 100); do
    ETCDCTL_API=3 etcdctl --endpoints="127.0.0.1:$port" endpoint health >/dev/null 2>&1 && break
    sleep 0.1
  done
  DDPRUN_LOG_LEVEL=warn "$build/bench/rendezvous/etcd_bench" --endpoints "127.0.0.1:$port" \
    --probe 200 --sizes "${ETCD_SIZES:-8,64,512}" --trials 3 2>/dev/null || true
  kill "$etcd_pid" 2>/dev/null || true
  wait "$etcd_pid" 2>/dev/null || true
  rm -rf "$data"
  echo
}
etcd_pid=
trap '[ -n "$etcd_pid" ] && kill "$etcd_pid" 2>/dev/null || true' EXIT
if [ -x /usr/bin/etcd ]; then
  etcd_bench "the disk (${TMPDIR:-/tmp})" "${TMPDIR:-/tmp}"
  if [ -d /dev/shm ] && [ -w /dev/shm ]; then etcd_bench "tmpfs (/dev/shm)" /dev/shm; fi
else
  echo "## ddprun etcd-v3 rendezvous: skipped, /usr/bin/etcd is absent (apt-get install etcd-server)"
fi
