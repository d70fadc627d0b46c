"""Python DDP on the same models, data, sampler and loop as `train`: the reference for step time
(`train --timing`) and for the parameters (`train --dump-params`).

Usage (under torchrun/ddprun): ddp_torch.py --model mlp|cnn [--bucket-cap-mb 25] [--epochs 2]
  [--dataset-size 1024] [--batch-size 32] [--compression none|fp16|bf16] [--backend gloo|nccl]
  [--lr 1e-3] [--accumulate N] [--amp none|bf16|fp16] [--dump-params FILE]
--backend nccl trains on cuda:LOCAL_RANK. --accumulate N: N micro-batches of --batch-size per
optimizer step, all but the last under no_sync, each micro-batch's loss weighted by its share of the
step's samples (1/N for a full step), as `train --accumulate`. --amp: autocast around forward and
loss (bf16), with a GradScaler (fp16), as `train --amp`.
Rank 0 prints "[RANK 0] timing: X ms/step over N steps (after 5 warm-up steps)" (optimizer steps).
"""
import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(1024, 4096)
        self.fc2 = torch.nn.Linear(4096, 2048)
        self.fc3 = torch.nn.Linear(2048, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 64, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(64, 128, 3, padding=1)
        self.fc1 = torch.nn.Linear(128 * 8 * 8, 1280)
        self.fc2 = torch.nn.Linear(1280, 10)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


class Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--dataset-size", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none")
    p.add_argument("--dump-params")
    a = p.parse_args()
    device = torch.device("cpu")
    if a.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator()
    g.manual_seed(1234)
    if a.model == "mlp":
        model = Mlp()
        x = torch.randn(a.dataset_size, 1024, generator=g)
    else:
        model = Cnn()
        x = torch.randn(a.dataset_size, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (a.dataset_size,), generator=g)
    model, x, y = model.to(device), x.to(device), y.to(device)
    ddp = DDP(model, bucket_cap_mb=a.bucket_cap_mb)
    if a.compression != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        hook = default_hooks.fp16_compress_hook if a.compression == "fp16" else default_hooks.bf16_compress_hook
        try:
            ddp.register_comm_hook(None, hook)
        except TypeError as e:  # torch 1.13: the bf16 hook needs CUDA 11+ and NCCL 2.10+
            if rank == 0:
                print(f"[RANK 0] unsupported: {e}", flush=True)
            dist.destroy_process_group()
            return
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.amp)
    scaler = None
    if a.amp == "fp16":
        scaler = (torch.amp.GradScaler(device.type) if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler")
                  else torch.cuda.amp.GradScaler())

    def autocast():
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=amp_dtype)

    sampler = DistributedSampler(Sized(a.dataset_size), num_replicas=world, rank=rank, shuffle=True, seed=0)
    stamps = []
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(iter(sampler)), dtype=torch.long, device=device)
        micro = [idx[b:b + a.batch_size] for b in range(0, len(idx), a.batch_size)]
        for first in range(0, len(micro), a.accumulate):
            group = micro[first:first + a.accumulate]
            samples = sum(len(m) for m in group)
            opt.zero_grad()
            for i, batch in enumerate(group):
                xb, yb = x.index_select(0, batch), y.index_select(0, batch)
                sync = i == len(group) - 1
                with (contextlib.nullcontext() if sync else ddp.no_sync()):
                    with autocast():
                        loss = F.cross_entropy(ddp(xb), yb) * (len(batch) / samples)
                    (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            loss.item()
            stamps.append(time.perf_counter())
    warm = 5
    steps = len(stamps) - 1 - warm
    ms = (stamps[-1] - stamps[warm]) / steps * 1e3 if steps > 0 else 0.0
    if rank == 0:
        print(f"[RANK 0] timing: {ms:.3f} ms/step over {steps} steps (after {warm} warm-up steps)", flush=True)
        if a.dump_params:
            with open(a.dump_params, "wb") as f:
                for p in model.parameters():
                    f.write(p.detach().float().cpu().contiguous().numpy().tobytes())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
