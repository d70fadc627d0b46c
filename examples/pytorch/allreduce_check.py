"""All-reduce check: every rank contributes rank+1; the sum must be WORLD_SIZE*(WORLD_SIZE+1)/2.

Runs unchanged under torchrun and ddprun: `ddprun --standalone --nproc_per_node=2 allreduce_check.py`.
"""
import sys

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    ok = t.item() == expected
    print(f"rank {rank}/{world}: all_reduce sum {t.item():.0f} (expected {expected:.0f}) {'OK' if ok else 'WRONG'}",
          flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
