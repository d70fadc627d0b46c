"""Prints torch.utils.data.DistributedSampler index lists for the configurations in a file.

Each input line: size num_replicas rank shuffle seed drop_last epoch.
Each output line: the indices, space separated (an empty line for none).
"""
import sys

from torch.utils.data import DistributedSampler


class Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def main(path):
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            size, replicas, rank, shuffle, seed, drop_last, epoch = (int(x) for x in line.split())
            s = DistributedSampler(Sized(size), num_replicas=replicas, rank=rank, shuffle=bool(shuffle),
                                   seed=seed, drop_last=bool(drop_last))
            s.set_epoch(epoch)
            print(" ".join(str(i) for i in s))


if __name__ == "__main__":
    main(sys.argv[1])
