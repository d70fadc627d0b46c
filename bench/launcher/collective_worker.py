"""Benchmark worker: joins the gloo group, drops a marker file, then all-reduces every 10 ms.

Markers are `<dir>/started.<RANK>.<n>` with n the wall time in ns, so a benchmark can see when a
replacement worker is up again (after its process group formed).
"""
import os
import sys
import time

import torch
import torch.distributed as dist

marker_dir = sys.argv[1]
dist.init_process_group("gloo")
with open(os.path.join(marker_dir, f"started.{dist.get_rank()}.{time.time_ns()}"), "w") as f:
    f.write(str(os.getpid()))
t = torch.ones(1)
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    dist.all_reduce(t)
    time.sleep(0.01)
