"""PyTorch DDP with train's mlp job and recovery cadence, for bench_inplace.py's torchrun rows: the
same model (1024-4096-2048-10), dataset size, batch, sampler and SGD; a snapshot (rank 0,
torch.save) after every epoch; a restart resumes from it at the start of the next epoch.

Usage (under torchrun): torch_train.py EPOCHS --dataset-size N --batch-size B --snapshot PATH
  [--fail-at-step K] [--fail-ranks N] [--step-log FILE]
--fail-at-step K: the last rank kills itself (SIGKILL) after global step K on the first attempt;
--fail-ranks N: the last N ranks do (default 1).
--step-log FILE: rank 0 appends "<global step> <unix time>" after every step.
"""
import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "worker_sdk"))
from ddp_torch import Mlp  # noqa: E402  (train's mlp, as the worker SDK benchmark has it)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("epochs", type=int)
    p.add_argument("--dataset-size", type=int, default=6400)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--snapshot", required=True)
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-ranks", type=int, default=1)
    p.add_argument("--step-log", default="")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    inputs = torch.randn(a.dataset_size, 1024, generator=gen)
    targets = torch.randint(0, 10, (a.dataset_size,), generator=gen)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    epoch, step = 0, 0
    if os.path.exists(a.snapshot):
        snap = torch.load(a.snapshot)
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        epoch, step = snap["epoch"], snap["global_step"]
    ddp = DDP(model)
    sampler = DistributedSampler(range(a.dataset_size), num_replicas=world, rank=rank, seed=0)
    inject = (a.fail_at_step > 0 and rank >= world - a.fail_ranks
              and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")
    log = open(a.step_log, "a") if a.step_log and rank == 0 else None
    for e in range(epoch, a.epochs):
        sampler.set_epoch(e)
        index = torch.tensor(list(iter(sampler)))
        for first in range(0, len(index), a.batch_size):
            batch = index[first:first + a.batch_size]
            opt.zero_grad()
            F.cross_entropy(ddp(inputs[batch]), targets[batch]).backward()
            opt.step()
            step += 1
            if log:
                log.write(f"{step} {time.time():.6f}\n")
                log.flush()
            if inject and step == a.fail_at_step:
                print(f"train: fault injection: killing myself at step {step} at {time.time():.6f}",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0:
            tmp = a.snapshot + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "epoch": e + 1, "global_step": step}, tmp)
            os.replace(tmp, a.snapshot)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
