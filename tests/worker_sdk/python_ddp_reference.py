"""Reference run of PyTorch's DistributedDataParallel (gloo, 2 processes) for the SDK comparison test.

Writes to OUTDIR: init.bin (initial parameters), x.bin / y.bin (data, STEPS x 16 x 20 / x 4) and
final.bin (rank 0's parameters after STEPS SGD steps), all raw little-endian float32.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from free_ports import free_ports  # noqa: E402

WORLD = 2
BATCH = 16


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def worker(rank, port, outdir, steps, state, x, y):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    model = make_model()
    model.load_state_dict(state)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    shard = BATCH // WORLD
    for s in range(steps):
        opt.zero_grad()
        out = ddp(x[s, rank * shard:(rank + 1) * shard])
        loss = torch.nn.functional.mse_loss(out, y[s, rank * shard:(rank + 1) * shard])
        loss.backward()
        opt.step()
    if rank == 0:
        flat(model).numpy().tofile(os.path.join(outdir, "final.bin"))
    # Both ranks tear gloo down together: under torch 2.15 a rank whose peer had already destroyed
    # its group and exited was once seen to abort ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def main():
    outdir, steps = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = make_model()
    x = torch.randn(steps, BATCH, 20)
    y = torch.randn(steps, BATCH, 4)
    flat(model).numpy().tofile(os.path.join(outdir, "init.bin"))
    x.numpy().tofile(os.path.join(outdir, "x.bin"))
    y.numpy().tofile(os.path.join(outdir, "y.bin"))
    # Rank 0 binds it seconds later (after spawn): a port from below the ephemeral range.
    port = free_ports(1, 8192, 12288)[0]
    mp.spawn(worker, args=(port, outdir, steps, model.state_dict(), x, y), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
