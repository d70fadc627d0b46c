#!/usr/bin/env python3
# Behaves as PyTorch's test/distributed/launcher/bin/test_script.py (written anew for ddprun):
# prints the launcher's environment, then either fails (--fail) or touches a file named after
# its global RANK in --touch-file-dir, so a test can check that every rank ran.
import argparse
import os
import sys

ENV_VARS = [
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS",
    "TORCHELASTIC_ERROR_FILE",
]


def main():
    parser = argparse.ArgumentParser(description="launcher test script")
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--touch-file-dir", "--touch_file_dir", type=str)
    args = parser.parse_args()
    print("Distributed env vars set by agent:")
    for name in ENV_VARS:
        print(f"{name} = {os.environ.get(name)}")
    print(f"CPU affinity = {sorted(os.sched_getaffinity(0))}")
    if args.fail:
        raise RuntimeError("raising exception since --fail flag was set")
    path = os.path.join(args.touch_file_dir, os.environ["RANK"])
    open(path, "w").close()
    print(f"Success, created {path}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
