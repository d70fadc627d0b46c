"""In-place recovery against process restarts (ddprun) and torchrun, side by side in one run
(issue 37's benchmark). One node, 4 workers, train's mlp job over gloo: 6400 samples, batch 32,
50 steps per epoch and a snapshot after every epoch; the last rank is killed with SIGKILL 10 and
40 steps after the snapshot (steps 60 and 90).

  lost time    = (t of the first completion of step K+1 after the kill) - (t of the kill)
                 - (the median step time before the kill): what the failure cost beyond the step
                 that was in flight;
  steps twice  = step numbers rank 0 completed more than once (trained again after the kill).
Informational: nothing here passes or fails. Writes a Markdown table to stdout.

Usage: /usr/bin/python3 bench/recovery/bench_inplace.py --build build [--reps 3]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_once(mode, kill_at, build, python, nproc, epochs):
    d = tempfile.mkdtemp(prefix="bench-inplace-")
    log, snap = os.path.join(d, "steps.log"), os.path.join(d, "snap.pt")
    common = ["--dataset-size", "6400", "--batch-size", "32", "--fail-at-step", str(kill_at),
              "--step-log", log]
    if mode == "torchrun":
        # -r/-t 9:1: torch 1.13's torchrun needs a redirect map to start (as bench/launcher's).
        argv = [python, "-m", "torch.distributed.run", "-r", "9:1", "-t", "9:1", "--standalone",
                f"--nproc_per_node={nproc}",
                "--max_restarts=1", "--monitor_interval=0.1", os.path.join(HERE, "torch_train.py"),
                str(epochs), "--snapshot", snap] + common
    else:
        argv = [os.path.join(build, "launcher/ddprun"), "--standalone",
                f"--nproc-per-node={nproc}", "--max-restarts=1", f"--restart-mode={mode}",
                os.path.join(build, "examples/train"), str(epochs), "1", "--model", "mlp",
                "--snapshot-path", snap] + common
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} exited {p.returncode}:\n{p.stderr[-3000:]}")
    m = re.search(r"killing myself at step (\d+) at ([0-9.]+)", p.stderr + p.stdout)
    t_kill = float(m.group(2))
    steps = [(int(s), float(t)) for s, t in (line.split() for line in open(log))]
    before = [t for s, t in steps if t <= t_kill]
    step_time = statistics.median(b - a for a, b in zip(before[-20:], before[-19:]))
    after = [(s, t) for s, t in steps if t > t_kill]
    t_next = min(t for s, t in after if s == kill_at + 1)
    seen = [s for s, _ in steps]
    twice = len(seen) - len(set(seen))
    phases = re.search(r"in-place recovery, generation .*", p.stdout + p.stderr)
    return t_next - t_kill - step_time, twice, step_time, phases.group(0) if phases else ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--python", default="/usr/bin/python3")
    a = ap.parse_args()
    build = os.path.abspath(a.build)
    modes = ["in-place", "process", "torchrun"]
    rows = {}
    for kill_at in (60, 90):
        for mode in modes:
            runs = []
            for _ in range(a.reps):
                runs.append(run_once(mode, kill_at, build, a.python, a.nproc, epochs=2))
                print(f"{mode} kill at {kill_at}: lost {runs[-1][0]:.3f} s, twice {runs[-1][1]}, "
                      f"step {runs[-1][2] * 1e3:.0f} ms {runs[-1][3]}", file=sys.stderr)
            rows[(mode, kill_at)] = runs
    print(f"| kill -9 at step (after the snapshot at 50) | mode | lost time (median of {a.reps}) "
          "| steps trained twice | step time | lost / in-place |")
    print("|---|---|---|---|---|---|")
    for kill_at in (60, 90):
        base = statistics.median(r[0] for r in rows[("in-place", kill_at)])
        for mode in modes:
            runs = rows[(mode, kill_at)]
            lost = statistics.median(r[0] for r in runs)
            print(f"| {kill_at} ({kill_at - 50} after) | {mode} | {lost:.2f} s | "
                  f"{statistics.median(r[1] for r in runs):.0f} | "
                  f"{statistics.median(r[2] for r in runs) * 1e3:.0f} ms | {lost / base:.1f}× |")
    for kill_at in (60, 90):
        for r in rows[("in-place", kill_at)]:
            print(f"\nin-place, kill at {kill_at}: {r[3]}")


if __name__ == "__main__":
    main()
