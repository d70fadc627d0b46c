#!/usr/bin/python3
"""Multi-node recovery, ddprun vs torchrun side by side, two nodes on loopback addresses.

Each launcher runs two agents (ddprun's on 127.0.0.2 and 127.0.0.3, --nnodes=1:2, one PyTorch gloo worker
each, c10d backend on 127.0.0.1). Then node B goes away and we time until node A's replacement
worker has re-joined its process group:
  hard   kill -9 of B's agent and its workers (a node that dies without a word)
  leave  SIGTERM to B's agent (a spot notice: it leaves gracefully)
Same rendezvous settings for both (last_call_timeout=1); torchrun gets --max_restarts=3 because
its survivors only recover through a charged restart. Informational; nothing passes or fails.
"""
import argparse
import glob
import os
import signal
import socket
import subprocess
import tempfile
import time

PY = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "collective_worker.py")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def worker_cmd(worker, build, marker_dir):
    if worker == "python":
        return [WORKER, marker_dir]
    # A C++ worker that starts in milliseconds, so the launcher's own share shows.
    return ["--no_python", os.path.join(build, "tests", "agent", "ddprun_test_worker"),
            "--sleep", "600", "--state-dir", marker_dir]


def agents(kind, build, port, run_id, marker_dir, worker):
    common = ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d",
              f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={run_id}", "--max_restarts=3",
              "--rdzv_conf=last_call_timeout=1"]
    if kind == "ddprun":
        cmd = [os.path.join(build, "launcher", "ddprun")] + common
    else:
        cmd = [PY, "-m", "torch.distributed.run", "-r", "9:1", "-t", "9:1",
               "--monitor_interval=0.1"] + common
    env = dict(os.environ, PYTHON_EXEC=PY)
    procs = []
    for addr in ("127.0.0.2", "127.0.0.3"):
        # torchrun 1.13 has no --local_addr: its agents advertise the host name.
        local = [f"--local_addr={addr}"] if kind == "ddprun" else []
        procs.append(subprocess.Popen(cmd + local + worker_cmd(worker, build, marker_dir), env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
        time.sleep(0.3)  # the first one hosts the rendezvous
    return procs


def markers(d, rank):
    """What identifies the running worker(s) of RANK: python markers, or the C++ worker's pid."""
    found = sorted(glob.glob(os.path.join(d, f"started.{rank}.*")))
    for path in glob.glob(os.path.join(d, f"pid.{rank}.*")):
        try:
            found.append(path + "=" + open(path).read())
        except OSError:
            pass
    return found


def wait_for(pred, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.002)
    return False


def measure(kind, build, how, timeout, worker):
    with tempfile.TemporaryDirectory() as d:
        procs = agents(kind, build, free_port(), f"bench{how}{time.time_ns()}", d, worker)
        try:
            if not wait_for(lambda: markers(d, 0) and markers(d, 1), 120):
                return None
            time.sleep(1.0)  # steady state
            # Which agent is group rank 0 does not matter: the survivor is A (index 0).
            before = set(markers(d, 0)) | set(markers(d, 1))
            victim = procs[1]
            t0 = time.monotonic()
            if how == "hard":
                os.killpg(victim.pid, signal.SIGKILL)  # agent and its workers: the node is gone
            else:
                victim.send_signal(signal.SIGTERM)
            ok = wait_for(lambda: any(m not in before for m in markers(d, 0)), timeout)
            return time.monotonic() - t0 if ok else float("inf")
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=90)
    ap.add_argument("--worker", choices=["python", "cpp"], default="python",
                    help="python: PyTorch gloo workers; cpp: a C++ worker with no collectives")
    args = ap.parse_args()
    rows = {}
    for how in ("hard", "leave"):
        for kind in ("ddprun", "torchrun"):
            times = [measure(kind, args.build, how, args.timeout, args.worker)
                     for _ in range(args.reps)]
            times = sorted(t for t in times if t is not None)
            rows[(how, kind)] = times[len(times) // 2] if times else None
            print(kind, how, ["%.3f" % t for t in times], flush=True)

    def fmt(t):
        if t is None:
            return "did not start"
        return f"did not recover within {args.timeout:.0f} s" if t == float("inf") else f"{t:.2f} s"

    print()
    print(f"| node B goes away ({args.worker} workers, median of {args.reps}) | ddprun | torchrun | target (ddprun) |")
    print("|---|---|---|---|")
    print(f"| kill -9 of B's agent + workers -> A's worker running again | {fmt(rows[('hard', 'ddprun')])} | {fmt(rows[('hard', 'torchrun')])} | < 2 s |")
    print(f"| SIGTERM to B's agent -> A's worker running again | {fmt(rows[('leave', 'ddprun')])} | {fmt(rows[('leave', 'torchrun')])} | < 0.5 s |")


if __name__ == "__main__":
    main()
