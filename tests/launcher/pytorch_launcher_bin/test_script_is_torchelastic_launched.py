#!/usr/bin/env python3
# Behaves as PyTorch's bin/test_script_is_torchelastic_launched.py: writes what
# torch.distributed.is_torchelastic_launched() says to --out-file.
import argparse

import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser(description="is_torchelastic_launched test script")
    parser.add_argument("--out-file", "--out_file", required=True)
    args = parser.parse_args()
    with open(args.out_file, "w") as out:
        out.write(str(dist.is_torchelastic_launched()))


if __name__ == "__main__":
    main()
