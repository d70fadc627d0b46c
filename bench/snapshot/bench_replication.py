#!/usr/bin/python3
"""--snapshot-dir replication on loopback (issue 11). Informational; nothing passes or fails.

Every node is a ddprun agent on its own loopback address (127.0.0.2, .3, ...) with its OWN
snapshot directory, against a standalone ddprun-rendezvous. Three measurements:

  lag      a file of SIZE bytes is completed (temp file + rename) in node 0's directory; time until
           every other node's directory holds it. Against: one plain copy of the same file over
           loopback TCP (send, write, fsync), the issue's yardstick (goal: lag <= 1.5x copy).
           Medians of --reps; the copy's fastest run is shown too: its buffered write and fsync
           of 1 GB took anywhere from 0.85 to 2.9 s on this VM, so a median can flatter. With
           more than 2 nodes, also NODES-1 plain copies at once: all "nodes" here share one disk
           and 2 CPUs, so that is what the host itself needs to put the bytes on every node.
  join     a one-node job (--nnodes=1:2) whose directory holds a SIZE-byte snapshot; a fresh node
           with an empty directory starts; time until its worker runs ("started 1 worker(s)").
           Against: the same without --snapshot-dir (the shared-directory setup, nothing to
           fetch). Goal: <= shared time + one loopback copy (median and fastest of --reps).
  step     `train --timing` (mlp, a snapshot every epoch) on 2 nodes, ms/step of rank 0 with and
           without --snapshot-dir. Goal: <= 2 % overhead. Single runs swing by +-15 % on this
           VM, so --pairs N runs N pairs (without, with; the order alternating from pair to
           pair) and prints the median and mean of the per-pair overheads with a 90 % bootstrap
           interval of the mean. --pin-workers CPU runs every worker on that CPU and the agents
           on the others: a node whose training leaves the agent a core of its own, as GPU
           nodes do (on a 2-core VM the workers otherwise take both cores, and any CPU the
           agents use for replication is taken from them).

Usage: bench_replication.py --build BUILD [--sizes 100M,1G] [--nodes 2,4] [--what lag,join,step]
                            [--reps 3] [--epochs 6] [--pairs 1] [--pin-workers CPU]
                            [--dataset-size 512] [--step-dirs DIR]
"""
import argparse
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time

PY = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def make_file(path, size):
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


class Rendezvous:
    def __init__(self, build, host="127.0.0.1"):
        self.proc = subprocess.Popen([os.path.join(build, "rendezvous", "ddprun-rendezvous"),
                                      "--listen", f"{host}:0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        for line in self.proc.stdout:
            m = re.search(r"listening on \S+:(\d+)", line)
            if m:
                self.endpoint = f"{host}:{m.group(1)}"
                break

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


class Agent:
    def __init__(self, build, rdzv, addr, nnodes, run_id, snapshot_dir, program, log_dir,
                 prefix=()):
        cmd = list(prefix) + [os.path.join(build, "launcher", "ddprun"), f"--nnodes={nnodes}",
               "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv.endpoint}",
               f"--rdzv-id={run_id}", f"--local-addr={addr}", "--max-restarts=3",
               "--rdzv-conf=last_call_timeout=1"]
        if snapshot_dir:
            # Loopback/namespaces only: no token (issue 34 refuses that unless accepted by name).
            cmd += [f"--snapshot-dir={snapshot_dir}", "--snapshot-allow-unauthenticated"]
        self.err_path = os.path.join(log_dir, f"{run_id}-{addr}.err")
        self.out_path = os.path.join(log_dir, f"{run_id}-{addr}.out")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd + program, stdout=open(self.out_path, "w"),
                                     stderr=open(self.err_path, "w"), start_new_session=True,
                                     env=dict(os.environ, PYTHON_EXEC=PY))

    def err(self):
        with open(self.err_path) as f:
            return f.read()

    def out(self):
        with open(self.out_path) as f:
            return f.read()

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def wait_for(pred, bound=600, step=0.001):
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    raise TimeoutError("bench: timed out")


def loopback_copy(src, dst_dir, receiver=3):
    """One plain copy of `src` from 127.0.0.2 to 127.0.0.<receiver> over TCP, written and
    fsynced."""
    srv = socket.socket()
    srv.bind((f"127.0.0.{receiver}", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    done = {}

    def receive():
        conn, _ = srv.accept()
        with open(os.path.join(dst_dir, f"copy{receiver}.bin"), "wb") as f:
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    break
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        done["t"] = time.monotonic()
        conn.close()

    t = threading.Thread(target=receive)
    t.start()
    start = time.monotonic()
    c = socket.socket()
    c.bind(("127.0.0.2", 0))
    c.connect((f"127.0.0.{receiver}", port))
    with open(src, "rb") as f:  # a plain user-space copy (read, send), as cp/scp would do
        while True:
            block = f.read(1 << 20)
            if not block:
                break
            c.sendall(block)
    c.close()
    t.join()
    srv.close()
    os.unlink(os.path.join(dst_dir, f"copy{receiver}.bin"))
    return done["t"] - start


def copies_at_once(src, dst_dir, count):
    """`count` plain copies of `src` at once, each to a receiver of its own (127.0.0.3, .4, ...),
    in processes of their own: the same bytes written to the same disk through the same CPUs as a
    replication to `count` nodes of one host needs, with nothing in between. Seconds until the
    last is fsynced."""
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(count + 1)
    ends = ctx.Queue()

    def one(receiver):
        start.wait()
        begun = time.monotonic()
        ends.put(begun + loopback_copy(src, dst_dir, receiver))

    procs = [ctx.Process(target=one, args=(3 + i,)) for i in range(count)]
    for p in procs:
        p.start()
    start.wait()
    t0 = time.monotonic()
    last = max(ends.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return last - t0


def save_and_wait(src, dirs, size, rep, seen):
    """Saves a copy of `src` as version `rep` (its first 8 bytes) into dirs[0] as a program
    would (temp file + rename); seconds until every other directory holds it. `seen`: receiver
    dir -> inode of the version it held last (updated)."""
    tmp = os.path.join(dirs[0], "snapshot.pt.tmp")
    shutil.copyfile(src, tmp)
    with open(tmp, "rb+") as f:  # each version different content
        f.write(rep.to_bytes(8, "little"))
        os.fsync(f.fileno())
    t0 = time.monotonic()
    os.rename(tmp, os.path.join(dirs[0], "snapshot.pt"))

    # A node holds the new version once a new file of the full size is in place (every version
    # arrives as a new inode, renamed over the old). Its content is checked after the clock
    # stops: reading it while the replaced version's blocks are freed (ext4 with `discard` here)
    # waited for the disk for up to ~20 ms, which is no replication time.
    def everywhere():
        for d in dirs[1:]:
            try:
                st = os.stat(os.path.join(d, "snapshot.pt"))
            except FileNotFoundError:
                return False
            if st.st_size != size or st.st_ino == seen.get(d):
                return False
        return True

    wait_for(everywhere, 600, 0.001)
    lag = time.monotonic() - t0
    for d in dirs[1:]:
        with open(os.path.join(d, "snapshot.pt"), "rb") as f:
            if int.from_bytes(f.read(8), "little") != rep:
                raise RuntimeError(f"bench: {d} holds another version than {rep}")
            seen[d] = os.fstat(f.fileno()).st_ino
    return lag


def bench_lag(build, size, nodes, work, reps):
    rdzv = Rendezvous(build)
    dirs = [tempfile.mkdtemp(dir=work) for _ in range(nodes)]
    run_id = f"lag-{size}-{nodes}"
    agents = [Agent(build, rdzv, f"127.0.0.{2 + i}", str(nodes), run_id, dirs[i],
                    ["--no-python", "/bin/sleep", "3600"], work) for i in range(nodes)]
    try:
        wait_for(lambda: all("started 1 worker(s)" in a.err() for a in agents), 120, 0.05)
        src = os.path.join(work, "payload.bin")
        make_file(src, size)
        lags, copies, at_once = [], [], []
        seen = {}  # receiver dir -> inode of the version it held last
        for rep in range(reps):
            lags.append(save_and_wait(src, dirs, size, rep, seen))
            copies.append(loopback_copy(src, work))  # not into a replicated directory
            if nodes > 2:
                at_once.append(copies_at_once(src, work, nodes - 1))
        floor = statistics.median(at_once) if at_once else None
        return statistics.median(lags), statistics.median(copies), min(copies), floor
    finally:
        if os.environ.get("BENCH_DEBUG"):
            for a in agents:
                print(a.err()[-1500:])
        for a in agents:
            a.stop()
        rdzv.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def bench_join(build, size, work, replicate, reps):
    times = []
    for rep in range(reps):
        rdzv = Rendezvous(build)
        a_dir, b_dir = tempfile.mkdtemp(dir=work), tempfile.mkdtemp(dir=work)
        run_id = f"join-{size}-{int(replicate)}-{rep}"
        prog = ["--no-python", "/bin/sleep", "3600"]
        a = Agent(build, rdzv, "127.0.0.2", "1:2", run_id, a_dir if replicate else "", prog, work)
        b = None
        try:
            wait_for(lambda: "started 1 worker(s)" in a.err(), 120, 0.01)
            make_file(os.path.join(a_dir, "snapshot.pt.tmp"), size)
            os.rename(os.path.join(a_dir, "snapshot.pt.tmp"), os.path.join(a_dir, "snapshot.pt"))
            if replicate:
                wait_for(lambda: "written here" in a.err(), 120, 0.01)
            os.sync()  # a node joins long after the save: the disk is not still writing it back
            b = Agent(build, rdzv, "127.0.0.3", "1:2", run_id, b_dir if replicate else "", prog,
                      work)
            wait_for(lambda: "started 1 worker(s)" in b.err(), 300, 0.002)
            times.append(time.monotonic() - b.started)
            if replicate:
                assert os.path.getsize(os.path.join(b_dir, "snapshot.pt")) == size
        finally:
            for x in (a, b):
                if x:
                    x.stop()
            rdzv.stop()
            shutil.rmtree(a_dir, ignore_errors=True)
            shutil.rmtree(b_dir, ignore_errors=True)
    return statistics.median(times)


def bench_step(build, work, replicate, epochs, pin=None, dataset_size=512, dirs_in=None):
    """ms/step of rank 0 and the snapshot's size. `pin`: the CPU every worker runs on, the
    agents on the others (a node whose training leaves the agent a core, as GPU nodes do).
    `dirs_in`: where the nodes' directories are made (else in `work`)."""
    rdzv = Rendezvous(build)
    dirs = [tempfile.mkdtemp(dir=dirs_in or work) for _ in range(2)]
    run_id = f"step-{int(replicate)}"
    prog = ["--no-python", os.path.join(build, "examples", "train"), str(epochs), "1", "--model",
            "mlp", "--dataset-size", str(dataset_size), "--timing"]
    prefix = ()
    if pin is not None:
        others = sorted(os.sched_getaffinity(0) - {pin})
        prefix = ("taskset", "-c", ",".join(str(c) for c in others))
        prog = ["--no-python", "taskset", "-c", str(pin)] + prog[1:]
    agents = []
    try:
        for i in range(2):
            p = prog if replicate else prog + ["--snapshot-path", os.path.join(dirs[i], "s.pt")]
            agents.append(Agent(build, rdzv, f"127.0.0.{2 + i}", "2", run_id,
                                dirs[i] if replicate else "", p, work, prefix))
        for a in agents:
            a.proc.wait(timeout=1800)
        out = "".join(a.out() for a in agents)
        m = re.search(r"\[RANK 0\] timing: ([0-9.]+) ms/step", out)
        # Rank 0 writes the snapshot; with the c10d rendezvous it may be either node.
        name = "snapshot.pt" if replicate else "s.pt"
        held = [os.path.join(d, name) for d in dirs if os.path.exists(os.path.join(d, name))]
        if not m or not held:
            raise RuntimeError("bench: the step job failed:\n" + "".join(a.err()[-2000:] for a in agents))
        size = os.path.getsize(held[0])
        return float(m.group(1)), size
    finally:
        for a in agents:
            a.stop()
        rdzv.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def bootstrap_mean(values, rounds=10000, seed=1):
    """The 5th and 95th percentiles of the mean of `values` resampled with replacement."""
    rng = random.Random(seed)
    means = sorted(statistics.mean(rng.choices(values, k=len(values))) for _ in range(rounds))
    return means[int(0.05 * rounds)], means[int(0.95 * rounds) - 1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--sizes", default="100M,1G")
    ap.add_argument("--nodes", default="2,4")
    ap.add_argument("--what", default="lag,join,step")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--pin-workers", type=int, default=None,
                    help="step: run every worker on this CPU and the agents on the others")
    ap.add_argument("--dataset-size", type=int, default=512,
                    help="step: samples per epoch (a snapshot every epoch; 64 a step: 2 ranks of 32)")
    ap.add_argument("--step-dirs", default=None,
                    help="step: make the nodes' directories here (e.g. a tmpfs: no shared disk)")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    work = tempfile.mkdtemp(prefix="snapbench_")
    what = args.what.split(",")
    try:
        for size_text in args.sizes.split(","):
            size = parse_size(size_text)
            if "lag" in what:
                for n in (int(x) for x in args.nodes.split(",")):
                    lag, copy, fastest, floor = bench_lag(build, size, n, work, args.reps)
                    print(f"lag  {size_text:>5} {n} nodes: replication {lag:.3f} s, one loopback "
                          f"copy {copy:.3f} s (fastest {fastest:.3f} s), ratio {lag / copy:.2f}x "
                          f"({lag / fastest:.2f}x of the fastest copy) (goal <= 1.5x)", flush=True)
                    if floor:
                        print(f"     {n - 1} plain copies at once on this host (its one disk and "
                              f"CPUs, as the {n} nodes share them): {floor:.3f} s = "
                              f"{floor / copy:.2f}x one copy; replication {lag / floor:.2f}x of "
                              f"that", flush=True)
            if "join" in what:
                rep = bench_join(build, size, work, True, args.reps)
                shared = bench_join(build, size, work, False, args.reps)
                src = os.path.join(work, "payload.bin")
                make_file(src, size)
                copies = [loopback_copy(src, work) for _ in range(args.reps)]
                os.unlink(src)
                copy, fastest = statistics.median(copies), min(copies)
                print(f"join {size_text:>5}: fresh node's worker running after {rep:.3f} s "
                      f"(shared directory {shared:.3f} s, + one copy {copy:.3f} s = "
                      f"{shared + copy:.3f} s goal; with the fastest copy {fastest:.3f} s: "
                      f"{shared + fastest:.3f} s)", flush=True)
        if "step" in what:
            overheads = []
            for pair in range(max(args.pairs, 1)):
                order = (False, True) if pair % 2 == 0 else (True, False)
                ms = {}
                for replicate in order:
                    ms[replicate], size = bench_step(build, work, replicate, args.epochs,
                                                     args.pin_workers, args.dataset_size,
                                                     args.step_dirs)
                overheads.append(100 * (ms[True] / ms[False] - 1))
                pinned = "" if args.pin_workers is None else f", workers on CPU {args.pin_workers}"
                pinned += f", {args.dataset_size // 64} steps an epoch"
                pinned += f", directories in {args.step_dirs}" if args.step_dirs else ""
                print(f"step train mlp, 2 nodes{pinned}, snapshot {size / 1e6:.1f} MB every epoch: "
                      f"{ms[True]:.2f} ms/step with --snapshot-dir, {ms[False]:.2f} without, "
                      f"overhead {overheads[-1]:+.1f} % (goal <= 2 %)", flush=True)
            if len(overheads) > 1:
                low, high = bootstrap_mean(overheads)
                print(f"step overhead over {len(overheads)} pairs: median "
                      f"{statistics.median(overheads):+.2f} %, mean {statistics.mean(overheads):+.2f} "
                      f"% (90 % bootstrap interval of the mean {low:+.2f} .. {high:+.2f} %)",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
