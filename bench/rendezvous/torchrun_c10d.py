#!/usr/bin/env python3
"""Measures torchrun's c10d rendezvous (the reference) with N agents on 127.0.0.1.

Starts N `torchrun` agents (python3 -m torch.distributed.run, fixed --nnodes=N, a no-op worker)
and timestamps each agent's log lines as they arrive:
  join       = "[default] Rendezvous'ing worker group"
  rank held  = "[default] Rendezvous complete for workers"
and reports last join -> all ranks held and first join -> all ranks held, as rendezvous_bench
does for ddprun. Needs only the Debian python3-torch package (run with /usr/bin/python3's torch;
this script itself needs no torch).

usage: torchrun_c10d.py [--sizes 2,4,8] [--trials 3] [--python /usr/bin/python3]
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

JOIN = "Rendezvous'ing worker group"
DONE = "Rendezvous complete for workers"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_round(python, n, trial):
    port = free_port()
    env = dict(os.environ, LOGLEVEL="INFO")
    cmd = [python, "-u", "-m", "torch.distributed.run", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=bench-{n}-{trial}",
           f"--nnodes={n}", "--nproc_per_node=1", "-r", "9:1", "-t", "9:1",
           "--monitor_interval=0.1", "--no_python", "/bin/true"]
    joins, dones = [None] * n, [None] * n
    procs = []

    def reader(i, stream):
        for line in iter(stream.readline, ""):
            now = time.monotonic()
            if JOIN in line and joins[i] is None:
                joins[i] = now
            elif DONE in line and dones[i] is None:
                dones[i] = now

    threads = []
    for i in range(n):
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=env)
        procs.append(p)
        t = threading.Thread(target=reader, args=(i, p.stderr), daemon=True)
        t.start()
        threads.append(t)
    for p in procs:
        p.wait(timeout=300)
    for t in threads:
        t.join(timeout=10)
    if None in joins or None in dones or any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"torchrun N={n} trial {trial} failed: joins={joins} dones={dones} "
                           f"rc={[p.returncode for p in procs]}")
    return (max(dones) - max(joins)) * 1000, (max(dones) - min(joins)) * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--python", default="/usr/bin/python3")
    args = ap.parse_args()
    print(f"| N | torchrun c10d: last join -> all ranks held (ms, median of {args.trials}) "
          "| first join -> all held (ms) | all trials, last join -> all held (ms) |")
    print("|---|---|---|---|")
    for n in [int(s) for s in args.sizes.split(",")]:
        last, first = [], []
        for trial in range(args.trials):
            a, b = one_round(args.python, n, trial)
            last.append(a)
            first.append(b)
        print(f"| {n} | {statistics.median(last):.1f} | {statistics.median(first):.1f} | "
              f"{', '.join(f'{x:.0f}' for x in last)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
