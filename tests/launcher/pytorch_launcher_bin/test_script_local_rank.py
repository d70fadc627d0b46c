#!/usr/bin/env python3
# Behaves as PyTorch's bin/test_script_local_rank.py: a script written for
# torch.distributed.launch, which requires the --local-rank argument and checks it against
# LOCAL_RANK. --spelling narrows what it accepts (local_rank: a torch 1.x script that declares
# only --local_rank; local-rank: only the torch 2.x spelling).
import argparse
import os
import sys


def main():
    spelling = "both"
    argv = sys.argv[1:]
    for a in list(argv):
        if a.startswith("--spelling="):
            spelling = a.split("=", 1)[1]
            argv.remove(a)
    names = {"both": ["--local-rank", "--local_rank"], "local_rank": ["--local_rank"],
             "local-rank": ["--local-rank"]}[spelling]
    parser = argparse.ArgumentParser(description="local rank test script")
    parser.add_argument(*names, dest="local_rank", type=int, required=True)
    args = parser.parse_args(argv)
    expected = int(os.environ["LOCAL_RANK"])
    if expected != args.local_rank:
        raise RuntimeError(f"LOCAL_RANK {expected} but --local-rank {args.local_rank}")
    print(f"Finished execution with local_rank: {args.local_rank}")


if __name__ == "__main__":
    main()
