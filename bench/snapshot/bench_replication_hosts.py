#!/usr/bin/python3
"""--snapshot-dir replication lag between "hosts" with real link limits (issue 11). Informational.

On loopback, all nodes share one disk and two CPUs, so what limits a replication is the host, not
the network. Here every node is a network namespace of its own (ddprun-s1 .. ddprun-sN, addresses
10.204.0.1 .. N) attached to a bridge (ddpsbr, 10.204.0.254, where the rendezvous listens), and
each node's link is shaped by tc in both directions (uplink and downlink RATE each), as a host on
a switch is. Each node replicates a directory of its own.

  lag   a file of SIZE bytes is completed (temp file + rename) in node 1's directory; time until
        every other node's directory holds it. Against: one plain copy of the same file from
        node 1 to node 2 over the same shaped link (read, send, write, fsync). The issue's goal:
        lag <= 1.5x one copy. With N nodes, a writer that sent every node its own copy would take
        (N-1)x one copy through its uplink.
  join  a one-node job (--nnodes=1:2) on node 1 whose directory holds a SIZE-byte snapshot; a
        fresh node 2 with an empty directory starts; time until its worker runs. Against: the same
        job without --snapshot-dir (a shared directory: nothing to fetch) plus one plain copy from
        node 1 to node 2. The issue's goal: join <= that sum.

Needs root (ip, tc). Usage:
  bench_replication_hosts.py --build BUILD [--sizes 100M] [--nodes 2,4] [--rate 1gbit] [--reps 3]
                             [--what lag,join]
The namespaces and the bridge are removed on the way out.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_replication import PY, make_file, parse_size, save_and_wait, wait_for  # noqa: E402
from bench_replication import Rendezvous  # noqa: E402

BRIDGE = "ddpsbr"
BRIDGE_ADDR = "10.204.0.254"


def sh(*args, check=True):
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def ns(i):
    return f"ddprun-s{i}"


def addr(i):
    return f"10.204.0.{i}"


def shape(prefix, dev, rate):
    # A token bucket: this kernel may lack sch_netem. Queue room for bulk transfers.
    sh(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
       "1mbit", "latency", "100ms")


def rig_down(n):
    for i in range(1, n + 1):
        sh("ip", "netns", "del", ns(i), check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


def rig_up(n, rate):
    rig_down(n)
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{BRIDGE_ADDR}/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    for i in range(1, n + 1):
        inner, outer = f"ddps{i}", f"ddps{i}h"
        sh("ip", "netns", "add", ns(i))
        sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        sh("ip", "link", "set", inner, "netns", ns(i))
        sh("ip", "link", "set", outer, "master", BRIDGE)
        sh("ip", "link", "set", outer, "up")
        sh("ip", "netns", "exec", ns(i), "ip", "addr", "add", f"{addr(i)}/24", "dev", inner)
        sh("ip", "netns", "exec", ns(i), "ip", "link", "set", inner, "up")
        sh("ip", "netns", "exec", ns(i), "ip", "link", "set", "lo", "up")
        shape(["ip", "netns", "exec", ns(i)], inner, rate)  # uplink
        shape([], outer, rate)  # downlink


RECEIVER = r"""
import os, socket, sys, time
srv = socket.socket(); srv.bind((sys.argv[1], 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
with open(sys.argv[2], "wb") as f:
    while True:
        data = conn.recv(1 << 20)
        if not data: break
        f.write(data)
    f.flush(); os.fsync(f.fileno())
print(time.monotonic(), flush=True)
"""

SENDER = r"""
import socket, sys, time
c = socket.socket(); c.bind((sys.argv[1], 0))
t0 = time.monotonic()
c.connect((sys.argv[2], int(sys.argv[3])))
with open(sys.argv[4], "rb") as f:
    while True:
        block = f.read(1 << 20)
        if not block: break
        c.sendall(block)
c.close()
print(t0, flush=True)
"""


def plain_copy(src, dst):
    """One copy of `src` from node 1 to node 2 over the shaped link, written and fsynced there:
    seconds from the sender's connect to the receiver's fsync (CLOCK_MONOTONIC is the same in
    every namespace)."""
    recv = subprocess.Popen(["ip", "netns", "exec", ns(2), PY, "-c", RECEIVER, addr(2), dst],
                            stdout=subprocess.PIPE, text=True)
    port = recv.stdout.readline().strip()
    sent = sh("ip", "netns", "exec", ns(1), PY, "-c", SENDER, addr(1), addr(2), port, src)
    done = float(recv.stdout.readline())
    recv.wait()
    os.unlink(dst)
    return done - float(sent.stdout)


class Node:
    def __init__(self, build, i, nnodes, rdzv_endpoint, run_id, snapshot_dir, log_dir):
        cmd = ["ip", "netns", "exec", ns(i), os.path.join(build, "launcher", "ddprun"),
               f"--nnodes={nnodes}", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={run_id}",
               f"--local-addr={addr(i)}", "--rdzv-conf=last_call_timeout=1"]
        if snapshot_dir:
            # Loopback/namespaces only: no token (issue 34 refuses that unless accepted by name).
            cmd += [f"--snapshot-dir={snapshot_dir}", "--snapshot-allow-unauthenticated"]
        cmd += ["--no-python", "/bin/sleep", "3600"]
        self.err_path = os.path.join(log_dir, f"{run_id}-{i}.err")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                     stderr=open(self.err_path, "w"), start_new_session=True,
                                     env=dict(os.environ, PYTHON_EXEC=PY))

    def err(self):
        with open(self.err_path) as f:
            return f.read()

    def stop(self):
        subprocess.run(["pkill", "-KILL", "-s", str(self.proc.pid)], check=False)
        self.proc.wait()


def bench_lag(build, size, n, work, reps):
    rdzv = Rendezvous(build, BRIDGE_ADDR)
    endpoint = rdzv.endpoint
    dirs = [tempfile.mkdtemp(dir=work) for _ in range(n)]
    nodes = []
    try:
        for i in range(n):
            nodes.append(Node(build, i + 1, n, endpoint, f"hosts-{size}-{n}", dirs[i], work))
        wait_for(lambda: all("started 1 worker(s)" in x.err() for x in nodes), 120, 0.05)
        src = os.path.join(work, "payload.bin")
        make_file(src, size)
        lags, copies = [], []
        seen = {}
        for rep in range(reps):
            lags.append(save_and_wait(src, dirs, size, rep, seen))
            time.sleep(0.5)  # the writer's last serving and the receivers' renames settle
            copies.append(plain_copy(src, os.path.join(work, "copy.bin")))
        relays = sum("as it arrives" in x.err() for x in nodes)
        return statistics.median(lags), statistics.median(copies), min(copies), relays
    finally:
        for x in nodes:
            x.stop()
        rdzv.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def join_once(build, size, work, replicate, run_id, endpoint):
    """Node 1 runs a one-node job whose directory holds a SIZE-byte snapshot; seconds from a
    fresh node 2's start to its worker running. Without `replicate`, neither node has
    --snapshot-dir (the shared-directory job: nothing to fetch)."""
    dirs = [tempfile.mkdtemp(dir=work) for _ in range(2)]
    nodes = []
    try:
        nodes.append(Node(build, 1, "1:2", endpoint, run_id, dirs[0] if replicate else "", work))
        wait_for(lambda: "started 1 worker(s)" in nodes[0].err(), 120, 0.01)
        if replicate:
            make_file(os.path.join(dirs[0], "snapshot.pt.tmp"), size)
            os.rename(os.path.join(dirs[0], "snapshot.pt.tmp"),
                      os.path.join(dirs[0], "snapshot.pt"))
            wait_for(lambda: "written here" in nodes[0].err(), 120, 0.01)
        os.sync()  # a node joins long after the save: the disk is not still writing it back
        nodes.append(Node(build, 2, "1:2", endpoint, run_id, dirs[1] if replicate else "", work))
        wait_for(lambda: "started 1 worker(s)" in nodes[1].err(), 300, 0.002)
        took = time.monotonic() - nodes[1].started
        if replicate and os.path.getsize(os.path.join(dirs[1], "snapshot.pt")) != size:
            raise RuntimeError("bench: the fresh node's worker started without the snapshot")
        return took
    finally:
        for x in nodes:
            x.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def bench_join(build, size, work, reps):
    """Medians of --reps: the fresh node's join with --snapshot-dir, the same job without, and
    one plain copy from node 1 to node 2; the reps of the three alternate."""
    rdzv = Rendezvous(build, BRIDGE_ADDR)
    src = os.path.join(work, "payload.bin")
    make_file(src, size)
    joins, shared, copies = [], [], []
    try:
        for rep in range(reps):
            joins.append(join_once(build, size, work, True, f"join-{size}-1-{rep}", rdzv.endpoint))
            shared.append(join_once(build, size, work, False, f"join-{size}-0-{rep}",
                                    rdzv.endpoint))
            copies.append(plain_copy(src, os.path.join(work, "copy.bin")))
    finally:
        rdzv.stop()
        os.unlink(src)
    return statistics.median(joins), statistics.median(shared), statistics.median(copies)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--sizes", default="100M")
    ap.add_argument("--nodes", default="2,4")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--what", default="lag,join")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_replication_hosts: needs root (network namespaces and tc)")
    build = os.path.abspath(args.build)
    counts = [int(x) for x in args.nodes.split(",")]
    work = tempfile.mkdtemp(prefix="snaphosts_")
    try:
        rig_up(max(counts), args.rate)
        for size_text in args.sizes.split(","):
            size = parse_size(size_text)
            for n in counts if "lag" in args.what else []:
                lag, copy, fastest, relays = bench_lag(build, size, n, work, args.reps)
                print(f"lag {size_text:>5} {n} hosts, {args.rate} links: replication {lag:.3f} s, "
                      f"one plain copy {copy:.3f} s (fastest {fastest:.3f} s), ratio "
                      f"{lag / copy:.2f}x (goal <= 1.5x); {relays} node(s) relayed as the "
                      f"version arrived", flush=True)
            if "join" in args.what:
                join, shared, copy = bench_join(build, size, work, args.reps)
                print(f"join {size_text:>5}, {args.rate} links: fresh node's worker running after "
                      f"{join:.3f} s; shared directory {shared:.3f} s + one plain copy "
                      f"{copy:.3f} s = {shared + copy:.3f} s; ratio {join / (shared + copy):.2f}x "
                      f"(goal <= 1x)", flush=True)
    finally:
        rig_down(max(counts))
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
