#!/usr/bin/env python3
# Behaves as PyTorch's bin/test_script_init_method.py: joins a gloo process group through
# --init-method (env:// or tcp://HOST:PORT, with RANK and WORLD_SIZE from the launcher), sums a
# tensor of ones over all ranks and checks that the sum is WORLD_SIZE.
import argparse
import os

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser(description="init_method test script")
    parser.add_argument("--init-method", "--init_method", required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend="gloo", init_method=args.init_method, rank=rank,
                            world_size=world_size)
    t = torch.ones(1)
    dist.all_reduce(t)
    if int(t.item()) != world_size:
        raise RuntimeError(f"all_reduce sum {t.item()}, expected {world_size}")
    print(f"rank {rank}: all_reduce sum {int(t.item())} OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
