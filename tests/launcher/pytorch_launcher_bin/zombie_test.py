#!/usr/bin/env python3
# Behaves as PyTorch's bin/zombie_test.py: a worker that starts a child which would outlive it
# (it ignores SIGTERM and sleeps), records the child's pid in --pid-dir, and then fails. The
# launcher must leave no such process behind.
import argparse
import os
import signal
import subprocess
import sys
import time


def main():
    parser = argparse.ArgumentParser(description="zombie test script")
    parser.add_argument("--pid-dir", "--pid_dir", required=True)
    args = parser.parse_args()
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open(os.path.join(args.pid_dir, os.environ["RANK"]), "w") as out:
        out.write(str(child.pid))
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL) if os.environ["RANK"] == "0" else time.sleep(600)


if __name__ == "__main__":
    main()
