"""torch.distributed.all_reduce: the reference for examples/allreduce_bench.

  allreduce_torch.py         gloo on CPU tensors, 1 KiB - 64 MiB (DDPRUN_BENCH_MAX_BYTES)
  allreduce_torch.py nccl    NCCL on cuda:LOCAL_RANK, 1 KiB - 256 MiB

Run under torchrun/ddprun (env://). Rank 0 prints "bytes time_us busbw_GBps" per size.
"""
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    nccl = len(sys.argv) > 1 and sys.argv[1] == "nccl"
    device = torch.device("cpu")
    if nccl:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo")
    n = dist.get_world_size()
    rank = dist.get_rank()
    if rank == 0:
        print(f"{'bytes':>12} {'time_us':>12} {'busbw_GBps':>12}", flush=True)

    def sync():
        if nccl:
            torch.cuda.synchronize(device)

    size = 1024
    max_bytes = int(os.environ.get("DDPRUN_BENCH_MAX_BYTES", (256 if nccl else 64) << 20))
    while size <= max_bytes:
        t = torch.ones(size // 4, dtype=torch.float32, device=device)
        iters = max(5, min(200, (256 << 20) // size))
        for _ in range(3):
            dist.all_reduce(t)
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        sync()
        us = (time.perf_counter() - start) / iters * 1e6
        busbw = size / (us * 1e-6) * 2.0 * (n - 1) / n / 1e9
        if rank == 0:
            print(f"{size:>12} {us:>12.1f} {busbw:>12.3f}", flush=True)
        size *= 4
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
