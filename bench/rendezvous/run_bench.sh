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
echo "## ddprun etcd-v3 rendezvous (one local etcd member started here, simulated agents in one process)"
if [ -x /usr/bin/etcd ]; then
  data=$(mktemp -d)
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  peer=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  /usr/bin/etcd --name bench --data-dir "$data/etcd" \
    --listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "bench=http://127.0.0.1:$peer" >"$data/etcd.log" 2>&1 &
  etcd_pid=$!
  trap 'kill $etcd_pid 2>/dev/null; rm -rf "$data"' EXIT
  for _ in $(seq 100); do
    ETCDCTL_API=3 etcdctl --endpoints="127.0.0.1:$port" endpoint health >/dev/null 2>&1 && break
    sleep 0.1
  done
  DDPRUN_LOG_LEVEL=warn "$build/bench/rendezvous/etcd_bench" --endpoints "127.0.0.1:$port" \
    --sizes 8,64,512 --trials 3
else
  echo "skipped: /usr/bin/etcd is absent (apt-get install etcd-server)"
fi
