"""In-place recovery against process restarts (ddprun) and torchrun, side by side in one run
(issue 37's benchmark). 4 workers (one node, or --nodes 2: two agents on 127.0.0.2 and 127.0.0.3
with 2 workers each, as two torchruns with one c10d rendezvous), train's mlp job over gloo: 6400
samples, batch 32, 50 steps per epoch and a snapshot after every epoch; the last rank is killed
with SIGKILL 10 and 40 steps after the snapshot (steps 60 and 90).

  lost time    = (t of the first completion of step K+1 after the kill) - (t of the kill)
                 - (the median step time before the kill): what the failure cost beyond the step
                 that was in flight;
  steps twice  = step numbers rank 0 completed more than once (trained again after the kill).
For in-place runs it also splits the lost time: the kernel's teardown of the killed process (kill
-> the agent sees it), the replacement's own start-up (spawn -> its Trainer exists, from the
agent's "ready"), and the rest, which is the recovery's own (issue 37's goal: at most 100 ms).
Informational: nothing here passes or fails. Writes a Markdown table to stdout.

--fault leave (with --nodes 2, every launcher at --nnodes=1:2): instead of the kill, the second
node's launcher gets SIGTERM (a spot notice) once rank 0 logged step 60 or 90, and the first node
trains on alone. Its lost time is the longest pause between two steps rank 0 completed after the
signal, less the median step time before it.

--fail-ranks N (with the kill): the last N ranks kill themselves at that step, a few ms apart (a
fault that takes several processes at once); the lost time counts from the first kill. For
in-place runs the split below is one node's line: the first that names a replacement.

Usage: /usr/bin/python3 bench/recovery/bench_inplace.py --build build [--reps 3] [--nodes 2]
         [--fault kill|leave] [--fail-ranks N]
"""
import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launchers(mode, build, python, nproc, nodes, nnodes):
    """One argv per node, each ending where the program's arguments begin."""
    per = nproc // nodes
    port = free_port()
    out = []
    for i in range(nodes):
        if mode == "torchrun":
            # -r/-t 9:1: torch 1.13's torchrun needs a redirect map to start (as bench/launcher's).
            argv = [python, "-m", "torch.distributed.run", "-r", "9:1", "-t", "9:1",
                    f"--nproc_per_node={per}", "--max_restarts=1", "--monitor_interval=0.1"]
            argv += (["--standalone"] if nodes == 1 else
                     [f"--nnodes={nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                      f"--rdzv_id=bench{port}", f"--rdzv_conf=is_host={int(i == 0)}"])
            out.append(argv + [os.path.join(HERE, "torch_train.py")])
            continue
        argv = [os.path.join(build, "launcher/ddprun"), f"--nproc-per-node={per}", "--max-restarts=1",
                f"--restart-mode={mode}"]
        argv += (["--standalone"] if nodes == 1 else
                 [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                  f"--rdzv-id=bench{port}", f"--local-addr=127.0.0.{2 + i}",
                  f"--rdzv-conf=is_host={int(i == 0)}"])
        out.append(argv + [os.path.join(build, "examples/train")])
    return out


def logged_steps(log):
    try:
        with open(log) as f:
            return [(int(s), float(t)) for s, t in (line.split() for line in f if line.endswith("\n"))]
    except FileNotFoundError:
        return []


def run_once(mode, kill_at, build, python, nproc, epochs, nodes, fault="kill", fail_ranks=1):
    # Each run's step log and snapshots (about 50 MB) go with it, whatever happens.
    with tempfile.TemporaryDirectory(prefix="bench-inplace-") as d:
        return run_in(d, mode, kill_at, build, python, nproc, epochs, nodes, fault, fail_ranks)


def run_in(d, mode, kill_at, build, python, nproc, epochs, nodes, fault, fail_ranks):
    log, snap = os.path.join(d, "steps.log"), os.path.join(d, "snap.pt")
    common = ["--dataset-size", "6400", "--batch-size", "32", "--step-log", log]
    if fault == "kill":
        common += ["--fail-at-step", str(kill_at), "--fail-ranks", str(fail_ranks)]
    program = ([str(epochs), "--snapshot", snap] if mode == "torchrun" else
               [str(epochs), "1", "--model", "mlp", "--snapshot-path", snap]) + common
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nnodes = f"1:{nodes}" if fault == "leave" else str(nodes)
    procs = [subprocess.Popen(argv + program, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for argv in launchers(mode, build, python, nproc, nodes, nnodes)]
    t_kill = None
    if fault == "leave":
        # The spot notice: SIGTERM to the second node's launcher once rank 0 logged step kill_at.
        while not any(s >= kill_at for s, _ in logged_steps(log)):
            if procs[0].poll() is not None:
                break
            time.sleep(0.002)
        t_kill = time.time()
        procs[1].send_signal(15)
    outs = [p.communicate(timeout=900) for p in procs]
    text = "".join(o + e for o, e in outs)
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0 and not (fault == "leave" and i == 1):
            raise RuntimeError(f"{mode} exited {p.returncode}:\n{err[-3000:]}")
    if t_kill is None:
        # The first of the ranks killed (--fail-ranks: several, a few ms apart).
        t_kill = min(float(t) for t in re.findall(r"killing myself at step \d+ at ([0-9.]+)", text))
    steps = logged_steps(log)
    before = [t for s, t in steps if t <= t_kill]
    step_time = statistics.median(b - a for a, b in zip(before[-20:], before[-19:]))
    after = [(s, t) for s, t in steps if t > t_kill]
    if fault == "leave":
        times = [t_kill] + [t for _, t in after]
        t_next = t_kill + max(b - a for a, b in zip(times, times[1:]))
    else:
        t_next = min(t for s, t in after if s == kill_at + 1)
    seen = [s for s, _ in steps]
    twice = len(seen) - len(set(seen))
    # The agent of the node that lost the worker (the one whose line names a replacement).
    phases = (re.search(r"in-place recovery, generation .*replacement said hello.*", text) or
              re.search(r"in-place recovery, generation .*", text))
    line = phases.group(0) if phases else ""
    # A node that did not recover in place (it restarted its workers): what its agent said.
    fallbacks = re.findall(r"(?:no in-place recovery this time|in-place recovery failed|"
                           r"did not announce in-place support|restarting this node's workers)"
                           r"[^\n]*", text)
    if mode == "in-place" and fallbacks:
        line += " [not in place on a node: " + fallbacks[0][:300] + "]"
    # The start-up it had to wait for: the kernel's teardown of the killed process (kill -> the
    # failure first seen there: the agent's SIGCHLD, or a collective that failed first), then the
    # replacement's own start-up (spawn -> its Trainer exists: exec, LibTorch, its model and
    # data). The rest of the lost time is the recovery's own.
    # The phases count from the failure first seen on that node: a worker's collective may have
    # failed before the agent reaped the killed rank ("..., N ms earlier"); the agent spawned the
    # replacement when it saw the exit, N ms after that.
    seen = re.search(
        r"seen at unix time ([0-9.]+)(?:: .*? failed first \(\w+\), (\d+) ms earlier)?", line)
    ready = re.search(r"ready (\d+) ms", line)
    agent_saw = int(seen.group(2)) / 1e3 if seen and seen.group(2) else 0.0
    teardown = float(seen.group(1)) + agent_saw - t_kill if seen else None
    startup = int(ready.group(1)) / 1e3 - agent_saw if ready else None
    return t_next - t_kill - step_time, twice, step_time, line, teardown, startup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=1, choices=[1, 2])
    ap.add_argument("--modes", default="in-place,process,torchrun",
                    help="comma-separated: in-place, process, torchrun (the first is the base)")
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--fault", default="kill", choices=["kill", "leave"],
                    help="kill: the last rank SIGKILLs itself; leave: SIGTERM to node 2's launcher")
    ap.add_argument("--fail-ranks", type=int, default=1,
                    help="with --fault kill: the last N ranks kill themselves at that step")
    a = ap.parse_args()
    if a.fault == "leave" and a.nodes != 2:
        ap.error("--fault leave needs --nodes 2")
    build = os.path.abspath(a.build)
    modes = a.modes.split(",")
    rows = {}
    for kill_at in (60, 90):
        for mode in modes:
            runs = []
            for _ in range(a.reps):
                runs.append(run_once(mode, kill_at, build, a.python, a.nproc, 2, a.nodes, a.fault,
                                     a.fail_ranks))
                print(f"{mode} {a.fault} at {kill_at}: lost {runs[-1][0]:.3f} s, twice {runs[-1][1]}, "
                      f"step {runs[-1][2] * 1e3:.0f} ms {runs[-1][3]}", file=sys.stderr)
            rows[(mode, kill_at)] = runs
    killed = f", the last {a.fail_ranks} ranks killed at once" if a.fail_ranks > 1 else ""
    print(f"{a.nodes} node(s) x {a.nproc // a.nodes} workers{killed}\n")
    what = "kill -9" if a.fault == "kill" else "SIGTERM to node 2"
    print(f"| {what} at step (after the snapshot at 50) | mode | lost time (median of {a.reps}) "
          "| steps trained twice | step time | lost / in-place |")
    print("|---|---|---|---|---|---|")
    for kill_at in (60, 90):
        base = statistics.median(r[0] for r in rows[(modes[0], kill_at)])
        for mode in modes:
            runs = rows[(mode, kill_at)]
            lost = statistics.median(r[0] for r in runs)
            print(f"| {kill_at} ({kill_at - 50} after) | {mode} | {lost:.2f} s | "
                  f"{statistics.median(r[1] for r in runs):.0f} | "
                  f"{statistics.median(r[2] for r in runs) * 1e3:.0f} ms | {lost / base:.1f}× |")
    inplace = [(k, r) for k in (60, 90) for r in rows.get(("in-place", k), [])
               if r[4] is not None and r[5] is not None]
    if inplace:
        print("\n| kill -9 at step | lost time | kill → agent sees it | replacement start-up "
              "(spawn → ready) | lost − both (the recovery's own) |")
        print("|---|---|---|---|---|")
        for kill_at in (60, 90):
            runs = [r for k, r in inplace if k == kill_at]
            if not runs:
                continue
            med = lambda i: statistics.median(r[i] for r in runs)  # noqa: E731
            own = [r[0] - r[4] - r[5] for r in runs]
            print(f"| {kill_at} | {med(0) * 1e3:.0f} ms | {med(4) * 1e3:.0f} ms | "
                  f"{med(5) * 1e3:.0f} ms | {statistics.median(own) * 1e3:.0f} ms "
                  f"(max {max(own) * 1e3:.0f}) |")
    left_out = sum(1 for k in (60, 90) for r in rows.get(("in-place", k), [])
                   if r[4] is None or r[5] is None)
    if inplace and left_out:
        print(f"\n{left_out} in-place run(s) left out of the split: no agent line names a "
              "replacement's start-up (see the lines below)")
    for kill_at in (60, 90):
        for r in rows.get(("in-place", kill_at), []):
            print(f"\nin-place, kill at {kill_at}: {r[3]}")


if __name__ == "__main__":
    main()
