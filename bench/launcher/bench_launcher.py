#!/usr/bin/python3
"""ddprun vs torchrun, side by side in one run, on the same no-op workers.

Measures (median of --reps runs each):
  launch   wall time of `--standalone --nproc_per_node=2` with workers that exit at once
  memory   peak RSS (VmHWM) of the launcher process itself while its workers run
  restart  time from `kill -9` of one worker to both replacement workers running

Usage: bench/launcher/bench_launcher.py [--build build] [--reps 5]
Timings are informational; nothing here passes or fails.
"""
import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

TORCHRUN = [os.environ.get("PYTHON_EXEC", "/usr/bin/python3"), "-m", "torch.distributed.run",
            "-r", "9:1", "-t", "9:1", "--monitor_interval=0.1"]


def launchers(build):
    return {"ddprun": [os.path.join(build, "launcher", "ddprun")], "torchrun": TORCHRUN}


def wait_for(pred, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.0005)
    return False


def launch_time(cmd, worker):
    t0 = time.monotonic()
    subprocess.run(cmd + ["--standalone", "--nproc_per_node=2", "--no_python", worker],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.monotonic() - t0


def vm_hwm_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def peak_memory(cmd, worker, state):
    p = subprocess.Popen(cmd + ["--standalone", "--nproc_per_node=2", "--no_python", worker,
                                "--sleep", "600", "--state-dir", state],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ok = wait_for(lambda: all(os.path.exists(os.path.join(state, f"pid.{r}.0")) for r in (0, 1)))
        assert ok, "workers did not start"
        return vm_hwm_kib(p.pid) / 1024.0
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait()


def restart_time(cmd, worker, state):
    p = subprocess.Popen(cmd + ["--standalone", "--nproc_per_node=2", "--max_restarts=1",
                                "--no_python", worker, "--sleep", "600", "--state-dir", state],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first = [os.path.join(state, f"pid.{r}.0") for r in (0, 1)]
        again = [os.path.join(state, f"pid.{r}.1") for r in (0, 1)]
        assert wait_for(lambda: all(os.path.exists(f) for f in first)), "workers did not start"
        victim = int(open(first[1]).read())
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        if not wait_for(lambda: all(os.path.exists(f) for f in again), timeout=120):
            return float("inf")
        return time.monotonic() - t0
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    worker = os.path.join(args.build, "tests", "agent", "ddprun_test_worker")
    if not os.path.exists(worker):
        sys.exit(f"bench: build first ({worker} is missing)")
    results = {}
    for name, cmd in launchers(args.build).items():
        launch, mem, restart = [], [], []
        for _ in range(args.reps):
            launch.append(launch_time(cmd, worker))
            with tempfile.TemporaryDirectory() as d:
                mem.append(peak_memory(cmd, worker, d))
            with tempfile.TemporaryDirectory() as d:
                restart.append(restart_time(cmd, worker, d))
        results[name] = (statistics.median(launch), statistics.median(mem), statistics.median(restart))
        print(f"{name:9s} launch {results[name][0]*1000:8.1f} ms   peak RSS {results[name][1]:7.1f} MiB   "
              f"restart {results[name][2]*1000:8.1f} ms", flush=True)
    d, t = results["ddprun"], results["torchrun"]
    print()
    print("| metric (median of %d) | ddprun | torchrun | ratio ddprun/torchrun | target |" % args.reps)
    print("|---|---|---|---|---|")
    print(f"| launch wall time, --standalone --nproc_per_node=2 | {d[0]*1000:.1f} ms | {t[0]*1000:.1f} ms | {d[0]/t[0]:.3f}x | <= 0.05x |")
    print(f"| launcher peak RSS | {d[1]:.1f} MiB | {t[1]:.1f} MiB | {d[1]/t[1]:.3f}x | <= 0.1x |")
    print(f"| kill -9 of a worker -> both replacements running | {d[2]*1000:.1f} ms | {t[2]*1000:.1f} ms | {d[2]/t[2]:.3f}x | <= 0.1x |")


if __name__ == "__main__":
    main()
