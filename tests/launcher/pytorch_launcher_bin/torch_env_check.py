# A PyTorch worker that checks the environment ddprun gave it against what its own torch reads:
# NCCL's asynchronous error handling switch on under the name this torch reads, none of the names
# this torch reports as deprecated, and the handled signals named as torchrun 2.x names them. Then
# an all_reduce (gloo; `nccl` as the argument: NCCL on cuda:LOCAL_RANK, where torch reads and warns
# about NCCL's variables), so that whatever torch warns about at init reaches stderr.
# Prints "env ok <torch version>" on success; exits 1 naming what is wrong.
import os
import pathlib
import re
import sys

import torch
import torch.distributed as dist

major, minor = (int(x) for x in torch.__version__.split(".")[:2])
problems = []

# torch's own table of renamed variables: {"TORCH_NEW", "OLD"} pairs in ProcessGroupNCCL.hpp
# (ships with pip's torch; torch < 2.2 renamed nothing).
header = pathlib.Path(torch.__file__).parent / (
    "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
deprecated = set()
if header.exists():
    for new, old in re.findall(r'\{\s*"(TORCH_[A-Z_]+)",\s*"([A-Z_]+)"', header.read_text()):
        deprecated.add(old)
elif (major, minor) >= (2, 2):
    problems.append(f"torch {torch.__version__} has no {header}")
for name in sorted(deprecated):
    if name in os.environ:
        problems.append(f"{name} is set, which torch {torch.__version__} reports as deprecated")

switch = "TORCH_NCCL_ASYNC_ERROR_HANDLING" if (major, minor) >= (2, 2) else "NCCL_ASYNC_ERROR_HANDLING"
if os.environ.get(switch) != "1":
    problems.append(f"{switch} is {os.environ.get(switch)!r}, not '1'")
signals = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
if signals != "SIGTERM,SIGINT,SIGHUP,SIGQUIT":
    problems.append(f"TORCHELASTIC_SIGNALS_TO_HANDLE is {signals!r}")

nccl = len(sys.argv) > 1 and sys.argv[1] == "nccl"
device = torch.device("cpu")
if nccl:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if nccl else "gloo")
t = torch.ones(1, device=device)
dist.all_reduce(t)
dist.destroy_process_group()
if t.item() != int(os.environ["WORLD_SIZE"]):
    problems.append(f"all_reduce gave {t.item()}")

if problems:
    print("env check failed: " + "; ".join(problems), file=sys.stderr)
    sys.exit(1)
print(f"env ok {torch.__version__} ({len(deprecated)} renamed variables checked)")
