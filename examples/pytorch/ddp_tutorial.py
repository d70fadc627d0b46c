"""The PyTorch DDP tutorial's fault-tolerant job (multigpu_torchrun.py), on CPU with gloo.

A linear model on a synthetic dataset of 2048 samples of 20 features; rank 0 writes a snapshot
every SAVE_EVERY epochs; on (re)start every rank resumes from the snapshot. Run it with
`ddprun --standalone --nproc_per_node=2 --max-restarts=3 ddp_tutorial.py 50 10`.
"""
import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, model, loader, optimizer, save_every, snapshot_path, step_delay):
        self.rank = dist.get_rank()
        self.model = model
        self.loader = loader
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.step_delay = step_delay
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot()
        self.ddp = DDP(self.model)

    def _load_snapshot(self):
        snapshot = torch.load(self.snapshot_path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[RANK {self.rank}] Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,
        }
        tmp = self.snapshot_path + ".tmp"
        torch.save(snapshot, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.snapshot_path)  # atomic: a crash never leaves half a snapshot
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, total_epochs):
        for epoch in range(self.epochs_run, total_epochs):
            self.loader.sampler.set_epoch(epoch)
            total, steps = 0.0, 0
            for source, targets in self.loader:
                self.optimizer.zero_grad()
                loss = F.mse_loss(self.ddp(source), targets)
                loss.backward()
                self.optimizer.step()
                total += loss.item()
                steps += 1
                if self.step_delay:
                    time.sleep(self.step_delay)
            mean = torch.tensor([total / steps])
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
            print(f"[RANK {self.rank}] Epoch {epoch} | Batchsize: {self.loader.batch_size} | "
                  f"Steps: {steps} | loss {mean.item():.6f}", flush=True)
            if self.rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)


def main():
    parser = argparse.ArgumentParser(description="DDP tutorial job (CPU, gloo)")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch_size", type=int, default=32)
    # Under ddprun --snapshot-dir, the node-local directory ddprun keeps identical on every node.
    default_dir = os.environ.get("DDPRUN_SNAPSHOT_DIR", "")
    parser.add_argument("--snapshot_path",
                        default=os.path.join(default_dir, "snapshot.pt") if default_dir else
                        "snapshot.pt")
    parser.add_argument("--step_delay", type=float, default=0.0, help="seconds to sleep per step")
    args = parser.parse_args()
    if args.total_epochs < 1 or args.save_every < 1 or args.batch_size < 1:
        parser.error("total_epochs, save_every and batch_size must be >= 1")

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(2048, 20), torch.randn(2048, 1))
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False,
                        sampler=DistributedSampler(dataset))
    Trainer(model, loader, optimizer, args.save_every, args.snapshot_path, args.step_delay).train(
        args.total_epochs)
    # The final parameters, bit for bit, for comparing runs.
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(f"[RANK {dist.get_rank()}] final parameters sha256 {digest.hexdigest()}", flush=True)
    # All ranks tear gloo down together, and rank 0, which hosts the store, outlives the others'
    # teardown by a second: under torch 2.15 a rank whose peer had already destroyed its group and
    # exited (rank 0 takes the store with it) was seen to abort at exit ("terminate called without
    # an active exception"), failing a job that had finished (twice in CI, once after the barrier
    # alone was added).
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        time.sleep(1.0)


if __name__ == "__main__":
    main()
