#!/usr/bin/python3
"""Worker SDK vs PyTorch between two "hosts": network namespaces joined by a shaped veth link.

  sudo /usr/bin/python3 bench/worker_sdk/run_between_hosts.py [--build-dir build] [--rates 1gbit,10gbit]
      [--reps 2] [--out bench/worker_sdk/BETWEEN_HOSTS.md] [--skip allreduce,layout,ddp]
      [--ddp-per-host 1,2]

Creates the rig with deploy/netrig.sh (ddprun-a 10.203.0.1 <-> ddprun-b 10.203.0.2), runs one ddprun
node per namespace (static rendezvous, one worker per node, so every byte of the all-reduce
crosses the link, unless a section says otherwise), and removes the rig afterwards.

1. all-reduce bus bandwidth at 1/16/64/256 MiB (float32 sum): examples/allreduce_bench vs
   torch.distributed.all_reduce on gloo, as a fraction of the link rate;
2. the 4+2 layout (4 workers on a, 2 on b): one leader per host vs the flat ring (DDPRUN_SHM=0);
3. DDP step time of the mlp and cnn models: `train --timing` vs PyTorch DDP (ddp_torch.py), each
   without compression and with bf16 / fp16 compression (PyTorch: default_hooks.*_compress_hook;
   torch 1.13 refuses its bf16 hook without CUDA and NCCL, shown as n/a), with 1 and with 2
   workers per host (--ddp-per-host).

Runs alternate between the SDK and PyTorch, best of --reps. Needs root.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
from run_bench import parse_table, step_ms  # noqa: E402

PY = "/usr/bin/python3"
RIG = os.path.join(ROOT, "deploy", "netrig.sh")
SIDES = (("a", "ddpa"), ("b", "ddpb"))
MASTER = "10.203.0.1"
SIZES = [1 << 20, 16 << 20, 64 << 20, 256 << 20]
_port = [29700]


def rate_bytes_per_s(rate):
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f / 8
    sys.exit(f"cannot read rate {rate}")


def two_nodes(build, prog, env=None, timeout=900, nprocs=(1, 1)):
    """Runs `prog` under ddprun on both namespaces (node 0 on a); returns both nodes' output.

    Both: with the c10d rendezvous (unequal nodes) global rank 0, which prints the results, is on
    whichever node joined first."""
    _port[0] += 2  # the static form also uses MASTER_PORT+1
    procs = []
    for rank, (side, dev) in enumerate(SIDES):
        # Unequal worker counts need the c10d rendezvous (the static form assumes equal nodes).
        rdzv = ([f"--nproc-per-node={nprocs[rank]}"] if nprocs[0] == nprocs[1] else
                [f"--nproc-per-node={nprocs[rank]}", "--rdzv-backend=c10d", f"--rdzv-endpoint={MASTER}:{_port[0] + 1}",
                 "--rdzv-id=between"])
        cmd = [RIG, "exec", side, "env", f"GLOO_SOCKET_IFNAME={dev}", "OMP_NUM_THREADS=1",
               f"PYTHON_EXEC={PY}", os.path.join(build, "launcher", "ddprun"), "--nnodes=2",
               f"--node-rank={rank}", *rdzv, f"--master-addr={MASTER}",
               f"--master-port={_port[0]}", f"--local-addr=10.203.0.{rank + 1}", *prog]
        e = dict(os.environ, **(env or {}))
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        if p.returncode != 0:
            for q in procs:
                q.kill()
            sys.exit(f"benchmark command failed ({p.returncode}): {' '.join(prog)}\n{out[-3000:]}")
        outs.append(out)
    return "".join(outs)


def ddp_section(build, md, a, train, per_host):
    """DDP step time of mlp and cnn, `per_host` workers on each host: the SDK's train vs PyTorch DDP,
    each without compression and with bf16 / fp16, best of a.reps alternating runs."""
    world = 2 * per_host
    how = ("every rank's whole gradient crosses the link" if per_host == 1 else
           "SDK: shared memory within a host and one leader per host across; PyTorch: gloo's flat ring")
    md.append(f"### DDP step time (ms/step, batch 32 per rank, {world} ranks on 2 hosts, {per_host} per host)\n")
    md.append(f"{how}.\n")
    md.append("| model | SDK | SDK bf16 | SDK fp16 | PyTorch DDP | PyTorch bf16 hook | PyTorch fp16 hook | "
              "SDK / PyTorch | SDK bf16 / PyTorch (no compression) |")
    md.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    nprocs = (per_host, per_host)
    for model in ("mlp", "cnn"):
        best = {}
        for _ in range(a.reps):
            for comp in ("none", "bf16", "fp16"):
                with tempfile.TemporaryDirectory() as d:
                    out = two_nodes(build, [train, "2", "0", "--model", model, "--dataset-size",
                                            str(a.dataset_size), "--timing", "--compression", comp,
                                            "--snapshot-path", os.path.join(d, "s.pt")], nprocs=nprocs)
                best[("sdk", comp)] = min(best.get(("sdk", comp), 1e18), step_ms(out))
                out = two_nodes(build, [os.path.join(HERE, "ddp_torch.py"), "--model", model,
                                        "--dataset-size", str(a.dataset_size), "--compression", comp],
                                nprocs=nprocs)
                if "[RANK 0] unsupported:" in out:
                    best[("torch", comp)] = None  # e.g. torch 1.13's bf16 hook on CPU
                else:
                    best[("torch", comp)] = min(best.get(("torch", comp)) or 1e18, step_ms(out))
        s, t = best[("sdk", "none")], best[("torch", "none")]

        def ms(v):
            return "n/a" if v is None else f"{v:.1f}"
        md.append(f"| {model} | {s:.1f} | {ms(best[('sdk', 'bf16')])} | {ms(best[('sdk', 'fp16')])} | "
                  f"{t:.1f} | {ms(best[('torch', 'bf16')])} | {ms(best[('torch', 'fp16')])} | "
                  f"{s / t:.2f}x | {best[('sdk', 'bf16')] / t:.2f}x |")
    md.append("")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dataset-size", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(HERE, "BETWEEN_HOSTS.md"))
    ap.add_argument("--ddp-per-host", default="1,2",
                    help="comma list of workers per host for the DDP step section")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: allreduce,layout,ddp")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run_between_hosts.py: needs root (network namespaces)")
    build = os.path.abspath(a.build_dir)
    skip = set(filter(None, a.skip.split(",")))
    train = os.path.join(build, "examples", "train")
    bench = os.path.join(build, "examples", "allreduce_bench")
    md = ["# Worker SDK between two hosts\n",
          f"Two network namespaces joined by a veth pair shaped with tc (`deploy/netrig.sh`), one ddprun "
          f"node each, one worker per node unless a section says otherwise, OMP_NUM_THREADS=1; best of {a.reps} alternating runs. "
          f"Machine: {os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.2f}. Generated by "
          f"`bench/worker_sdk/run_between_hosts.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n"]
    try:
        for rate in a.rates.split(","):
            rig = subprocess.run([RIG, "up", "--rate", rate, "--delay", "100us"], capture_output=True, text=True)
            if rig.returncode != 0:
                sys.exit(rig.stderr or rig.stdout)
            shaping = rig.stdout.strip().splitlines()[0]
            link = rate_bytes_per_s(rate)
            md.append(f"## Link {rate}\n")
            md.append(f"`{shaping}`\n")
            if "allreduce" not in skip:
                big = {"DDPRUN_BENCH_MAX_BYTES": str(SIZES[-1])}
                sdk, tor = {}, {}
                for _ in range(a.reps):
                    for rows, prog in ((sdk, [bench]), (tor, [os.path.join(HERE, "allreduce_torch.py")])):
                        for size, (us, bw) in parse_table(two_nodes(build, prog, big)).items():
                            if size not in rows or us < rows[size][0]:
                                rows[size] = (us, bw)
                md.append("### All-reduce bus bandwidth (float32, sum, 2 ranks on 2 hosts)\n")
                md.append("| size | SDK ms | SDK GB/s | SDK / link | torch gloo ms | torch GB/s | torch / link | SDK / torch |")
                md.append("|---|---:|---:|---:|---:|---:|---:|---:|")
                for size in SIZES:
                    s, t = sdk.get(size), tor.get(size)
                    if not s or not t:
                        continue
                    md.append(f"| {size >> 20} MiB | {s[0] / 1e3:.1f} | {s[1]:.3f} | {s[1] * 1e9 / link:.2f} | "
                              f"{t[0] / 1e3:.1f} | {t[1]:.3f} | {t[1] * 1e9 / link:.2f} | {s[1] / t[1]:.2f}x |")
                md.append("")
                print("\n".join(md), flush=True)
            if "layout" not in skip:
                # 4 ranks on a, 2 on b: one leader per host vs the flat ring over all six.
                env64 = {"DDPRUN_BENCH_MAX_BYTES": str(64 << 20)}
                lead, flat = {}, {}
                for _ in range(a.reps):
                    for rows, env in ((lead, env64), (flat, dict(env64, DDPRUN_SHM="0"))):
                        for size, (us, bw) in parse_table(two_nodes(build, [bench], env, nprocs=(4, 2))).items():
                            if size not in rows or us < rows[size][0]:
                                rows[size] = (us, bw)
                md.append("### 4+2 layout: leaders vs the flat ring (float32 all-reduce, 6 ranks)\n")
                md.append("| size | leaders ms | flat ring ms | leaders / flat (speed-up) |")
                md.append("|---|---:|---:|---:|")
                for size in (1 << 20, 16 << 20, 64 << 20):
                    if size in lead and size in flat:
                        md.append(f"| {size >> 20} MiB | {lead[size][0] / 1e3:.1f} | {flat[size][0] / 1e3:.1f} | "
                                  f"{flat[size][0] / lead[size][0]:.2f}x |")
                md.append("")
                print("\n".join(md), flush=True)
            if "ddp" not in skip:
                for per_host in (int(v) for v in a.ddp_per_host.split(",")):
                    ddp_section(build, md, a, train, per_host)
                    print("\n".join(md), flush=True)
    finally:
        subprocess.run([RIG, "down"], capture_output=True)
    text = "\n".join(md) + "\n"
    print(text)
    with open(a.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
