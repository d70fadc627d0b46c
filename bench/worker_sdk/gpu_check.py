"""The GPU check's runs, after deploy/gpu-check.sh built the worker SDK (build-gpu/) against this
machine's PyTorch. Prints a table and writes it, with every log, to --out.

1. The SDK's test suite (ctest), and the GPU test cases one by one (worker_gpu_test: DDP over NCCL
   against a single-process reference, snapshots on CUDA, train --backend nccl to the end, buckets
   overlapping backward; worker_nccl_test's GPU cases).
2. `train --backend nccl` against PyTorch DDP (bench/worker_sdk/ddp_torch.py) on the same models,
   data, sampler and loop: the parameters after 3 epochs (max abs difference) and the step time,
   alternating runs, best of each; also with --accumulate 4 (no_sync) and --amp bf16 / fp16 where
   this train has them.
3. A PyTorch NCCL worker under ddprun (when there is a ddprun): NCCL's switch under its torch's
   name and no deprecation warning (tests/launcher/pytorch_launcher_bin/torch_env_check.py).
4. With >= 2 GPUs: allreduce_bench nccl against torch.distributed.all_reduce, and a rank killed
   mid-all-reduce (train --fail-at-step under the launcher with one restart).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


def run(cmd, log, env=None, timeout=900, cwd=None):
    """Runs cmd, appending its output to log; returns (exit code, output)."""
    start = time.time()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           timeout=timeout, cwd=cwd)
        code, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        code, out = 124, (e.stdout or b"").decode(errors="replace") + f"\n(timed out after {timeout} s)"
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{out}\n(exit {code}, {time.time() - start:.1f} s)\n\n")
    return code, out


class Check:
    def __init__(self, args):
        self.a = args
        self.rows = []  # (section, what, result)
        self.results = {}
        self.gpus = torch.cuda.device_count()
        self.world = min(self.gpus, 8)
        self.train = os.path.join(args.build, "examples", "train")
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON_EXEC=sys.executable)

    def row(self, section, what, result):
        self.rows.append((section, what, result))
        print(f"[{section}] {what}: {result}", flush=True)

    def log(self, name):
        return os.path.join(self.a.out, name)

    def launcher(self, n, program_is_python):
        if self.a.ddprun:
            cmd = [self.a.ddprun, "--standalone", f"--nproc_per_node={n}"]
            return cmd if program_is_python else cmd + ["--no-python"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
        return cmd if program_is_python else cmd + ["--no-python"]

    # 1 -----------------------------------------------------------------------------------------
    def tests(self):
        env = dict(self.env)
        if self.a.ddprun:
            env["DDPRUN_TEST_DDPRUN"] = self.a.ddprun
        code, out = run(["ctest", "--test-dir", self.a.build, "-j", str(max(2, self.a.jobs // 2)),
                         "--output-on-failure", "--timeout", "300"], self.log("ctest.log"), env=env,
                        timeout=600)
        m = re.search(r"(\d+)% tests passed, (\d+) tests? failed out of (\d+)", out)
        summary = f"{int(m.group(3)) - int(m.group(2))}/{m.group(3)} passed" if m else f"no summary (exit {code})"
        failed = re.findall(r"^\s*\d+ - (.*) \(Failed\)", out, re.M)
        self.row("tests", "worker SDK test suite (ctest, build-gpu)", summary + (
            "; failed: " + "; ".join(failed) if failed else ""))
        self.results["ctest"] = {"summary": summary, "failed": failed}
        for binary in ["worker_gpu_test", "worker_nccl_test"]:
            path = os.path.join(self.a.build, "tests", "worker_sdk", binary)
            if not os.path.exists(path):
                self.row("tests", binary, "not built (no NCCL in this build)")
                continue
            code, out = run([path, "--durations", "yes"], self.log(binary + ".log"), env=env, timeout=300)
            cases = re.findall(r"^\s*([0-9.]+) s: (.+)$", out, re.M)
            skipped = out.count("skipped:")
            verdict = "passed" if code == 0 else f"FAILED (exit {code})"
            self.row("tests", f"{binary}: {len(cases)} cases", f"{verdict}, {skipped} skipped")
            for secs, name in cases:
                self.results.setdefault("gpu_cases", []).append({"binary": binary, "case": name,
                                                                 "seconds": float(secs)})

    # 2 -----------------------------------------------------------------------------------------
    def help_has(self, flag):
        code, out = run([self.train, "--help"], self.log("train-help.log"))
        return flag in out

    def compare(self, model, batch, extra_train=(), extra_torch=(), label="", repeats=2):
        epochs = 3
        dataset = max(2048, batch * self.world * 16)
        work = tempfile.mkdtemp(prefix="gpu-check-")
        ours_ms, theirs_ms = [], []
        for i in range(repeats):
            mine = os.path.join(work, "ours.bin")
            code, out = run(self.launcher(self.world, False) + [
                self.train, str(epochs), "0", "--model", model, "--batch-size", str(batch),
                "--dataset-size", str(dataset), "--backend", "nccl", "--timing", "--dump-params", mine,
                "--snapshot-path", os.path.join(work, f"snap{i}.pt")] + list(extra_train),
                self.log("train-vs-ddp.log"), env=self.env, cwd=work, timeout=180)
            t = re.search(r"\[RANK 0\] timing: ([0-9.]+) ms/step", out)
            if code != 0 or not t:
                shutil.rmtree(work, ignore_errors=True)
                return f"train FAILED (exit {code}; see train-vs-ddp.log)"
            ours_ms.append(float(t.group(1)))
            ref = os.path.join(work, "torch.bin")
            code, out = run(self.launcher(self.world, True) + [
                os.path.join(HERE, "ddp_torch.py"), "--backend", "nccl", "--model", model, "--epochs",
                str(epochs), "--batch-size", str(batch), "--dataset-size", str(dataset),
                "--dump-params", ref] + list(extra_torch), self.log("train-vs-ddp.log"), env=self.env,
                cwd=work, timeout=180)
            t = re.search(r"\[RANK 0\] timing: ([0-9.]+) ms/step", out)
            if code != 0 or not t:
                shutil.rmtree(work, ignore_errors=True)
                return f"PyTorch DDP FAILED (exit {code}; see train-vs-ddp.log)"
            theirs_ms.append(float(t.group(1)))
        a, b = np.fromfile(mine, dtype=np.float32), np.fromfile(ref, dtype=np.float32)
        shutil.rmtree(work, ignore_errors=True)
        if a.shape != b.shape:
            return f"parameter counts differ ({a.size} vs {b.size})"
        diff = float(np.max(np.abs(a - b)))
        ours, theirs = min(ours_ms), min(theirs_ms)
        key = f"{model} b{batch}{label}"
        self.results.setdefault("train_vs_ddp", {})[key] = {
            "max_abs_param_diff": diff, "ours_ms": ours, "torch_ms": theirs, "ratio": ours / theirs,
            "world": self.world, "dataset": dataset, "epochs": epochs}
        return (f"params max |diff| {diff:.2e}; {ours:.2f} vs {theirs:.2f} ms/step = "
                f"{ours / theirs:.2f}x PyTorch")

    def train_vs_ddp(self):
        configs = [("mlp", 256)] if self.a.quick else [("mlp", 32), ("mlp", 256), ("cnn", 32), ("cnn", 256)]
        for model, batch in configs:
            self.row("train vs PyTorch DDP", f"{model}, batch {batch}, nccl, {self.world} GPU(s)",
                     self.compare(model, batch))
        if self.help_has("--accumulate"):
            self.row("train vs PyTorch DDP", f"mlp, batch 64, --accumulate 4 (no_sync), {self.world} GPU(s)",
                     self.compare("mlp", 64, ["--accumulate", "4"], ["--accumulate", "4"], " acc4", repeats=1))
        else:
            self.row("train vs PyTorch DDP", "--accumulate 4", "not measured: this train has no --accumulate")
        if self.help_has("--amp"):
            for amp in ["bf16", "fp16"]:
                for model in (["mlp"] if self.a.quick else ["mlp", "cnn"]):
                    self.row("train vs PyTorch AMP", f"{model}, batch 256, --amp {amp}, {self.world} GPU(s)",
                             self.compare(model, 256, ["--amp", amp], ["--amp", amp], f" amp-{amp}",
                                          repeats=1))
        else:
            self.row("train vs PyTorch AMP", "--amp bf16|fp16", "not measured: this train has no --amp")

    # 3 -----------------------------------------------------------------------------------------
    def torch_env(self):
        if not self.a.ddprun:
            self.row("worker contract", "PyTorch NCCL worker under ddprun", "not run: no ddprun (--prepared)")
            return
        env = dict(self.env, PYTHON_EXEC=sys.executable)
        code, out = run([self.a.ddprun, "--standalone", f"--nproc_per_node={self.world}",
                         os.path.join(ROOT, "tests/launcher/pytorch_launcher_bin/torch_env_check.py"), "nccl"],
                        self.log("torch-env.log"), env=env)
        ok = code == 0 and out.count("env ok") == self.world
        warned = "deprecated" in out
        self.row("worker contract", f"PyTorch {torch.__version__} NCCL worker under ddprun",
                 ("env ok" if ok else f"FAILED (exit {code})") + ("; 'deprecated' in its output" if warned
                                                                    else "; no deprecation warning"))
        code, out = run([self.a.ddprun, "--standalone", f"--nproc_per_node={self.world}", self.train, "2", "1",
                         "--backend", "nccl", "--model", "mlp", "--snapshot-path",
                         os.path.join(tempfile.mkdtemp(prefix="gpu-check-"), "s.pt")],
                        self.log("ddprun-train.log"), env=self.env)
        self.row("worker contract", f"ddprun --standalone --nproc_per_node={self.world} train --backend nccl",
                 "finished (exit 0)" if code == 0 else f"FAILED (exit {code})")
        # In-place recovery on NCCL: the last rank SIGKILLs itself at step 20; only it is replaced.
        # With 2+ GPUs the survivors abort NCCL, re-form and hand the newcomer the live state; with
        # one GPU the replacement forms generation 2 alone and resumes from the snapshot.
        code, out = run([self.a.ddprun, "--standalone", f"--nproc_per_node={self.world}", "--max-restarts=1",
                         "--restart-mode=in-place", "--no-python", self.train, "3", "1", "--backend", "nccl",
                         "--model", "mlp", "--fail-at-step", "20", "--snapshot-path",
                         os.path.join(tempfile.mkdtemp(prefix="gpu-check-"), "s.pt")],
                        self.log("inplace.log"), env=self.env)
        survivors = len(re.findall(r"going on after step", out))
        ok = code == 0 and "joined generation 2" in out and survivors == self.world - 1
        self.row("worker contract", f"--restart-mode=in-place, a rank SIGKILLed at step 20 ({self.world} GPU(s))",
                 (f"recovered in place ({survivors} survivor(s) kept their process)" if ok
                  else f"FAILED (exit {code}, {survivors} survivor(s) re-formed)"))

    # 4 -----------------------------------------------------------------------------------------
    def multi_gpu(self):
        if self.gpus < 2:
            self.row("2+ GPUs", "allreduce_bench nccl vs torch; a rank killed mid-all-reduce",
                     f"not run: {self.gpus} GPU (NCCL puts no two ranks on one GPU)")
            return
        bench = os.path.join(self.a.build, "examples", "allreduce_bench")
        _, ours = run(self.launcher(self.world, False) + [bench, "nccl"], self.log("allreduce.log"), env=self.env)
        _, theirs = run(self.launcher(self.world, True) + [os.path.join(HERE, "allreduce_torch.py"), "nccl"],
                        self.log("allreduce.log"), env=self.env)
        parse = lambda out: {int(m.group(1)): float(m.group(3)) for m in re.finditer(
            r"^\s*(\d+)\s+([0-9.]+)\s+([0-9.]+)\s*$", out, re.M)}
        o, t = parse(ours), parse(theirs)
        for size in sorted(set(o) & set(t)):
            if size in (1 << 20, 16 << 20, 256 << 20):
                self.row("2+ GPUs", f"all-reduce {size >> 20} MiB bus bandwidth, {self.world} GPUs",
                         f"{o[size]:.1f} vs {t[size]:.1f} GB/s = {o[size] / t[size]:.2f}x torch")
        self.results["allreduce"] = {"ours": o, "torch": t}
        work = tempfile.mkdtemp(prefix="gpu-check-")
        start = time.time()
        cmd = ([self.a.ddprun, "--standalone", f"--nproc_per_node={self.world}", "--max-restarts=1", "--no-python"]
               if self.a.ddprun else self.launcher(self.world, False)[:-1] + ["--max_restarts=1", "--no-python"])
        code, out = run(cmd + [self.train, "3", "1", "--backend", "nccl", "--model", "mlp", "--fail-at-step", "20",
                               "--snapshot-path", os.path.join(work, "s.pt")], self.log("kill.log"),
                        env=self.env, timeout=900)
        self.row("2+ GPUs", "a rank SIGKILLed mid-training (train --fail-at-step 20, one restart)",
                 (f"job finished after the restart (exit 0, {time.time() - start:.1f} s)"
                  if code == 0 and "Resuming" in out else f"FAILED (exit {code})"))

    def table(self):
        lines = [f"# GPU check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
                 f"- GPUs: {', '.join(open(self.log('gpus.txt')).read().split(chr(10))[:self.gpus])}",
                 f"- PyTorch {torch.__version__}, CUDA {torch.version.cuda}, NCCL "
                 f"{'.'.join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, 'nccl') else '?'}",
                 f"- launcher: {'ddprun ' + self.a.ddprun if self.a.ddprun else 'torchrun'}", "",
                 "| section | what | result |", "|---|---|---|"]
        lines += [f"| {s} | {w} | {r} |" for s, w, r in self.rows]
        text = "\n".join(lines) + "\n"
        with open(self.log("gpu-check.md"), "w") as f:
            f.write(text)
        with open(self.log("results.json"), "w") as f:
            json.dump(self.results, f, indent=1)
        print("\n" + text)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--ddprun")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=["tests", "train", "env", "multi"], action="append")
    a = p.parse_args()
    a.build = os.path.abspath(a.build)  # the runs change directory
    a.out = os.path.abspath(a.out)
    if not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device", file=sys.stderr)
        sys.exit(2)
    c = Check(a)
    steps = {"tests": c.tests, "train": c.train_vs_ddp, "env": c.torch_env, "multi": c.multi_gpu}
    for name, step in steps.items():
        if not a.only or name in a.only:
            try:
                step()
            except Exception as e:  # one broken part must not hide the others' results
                c.row(name, "error", f"{type(e).__name__}: {e}")
    c.table()
    failed = [r for r in c.rows if "FAILED" in r[2]]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
