#!/usr/bin/env python3
"""The layering rules of docs/architecture.md, checked over the sources (a test of the suite, as
the format check is), so that no change breaks them silently:

1. The dependency graph is a line: a component includes only components below it
   (common < proto < rendezvous, slurm < snapshot, etcd < agent < launcher); the worker SDK
   includes only common; nothing but programs and tests includes the worker SDK.
2. agent/ includes no gRPC or protobuf header: gRPC lives in the rendezvous, snapshot and etcd
   adapters.
3. Threads start only in the files designated for them (THREAD_FILES): the agent runs on one
   Asio loop; threads are the snapshot shell's pool and transport, the etcd adapter's three, the
   rendezvous server's loop and blocking client, and the worker SDK's op queues and NCCL watchdog.

    check_layering.py SOURCE_DIR     exit 0, or 1 with one line per violation
"""
import os
import re
import sys

LEVEL = {"common": 0, "proto": 1, "rendezvous": 2, "slurm": 2, "snapshot": 3, "etcd": 3,
         "agent": 4, "launcher": 5, "worker": None}
DIRS = {"common": "common", "proto": "proto", "rendezvous": "rendezvous", "slurm": "slurm",
        "snapshot": "snapshot", "etcd": "etcd", "agent": "agent", "launcher": "launcher",
        "worker_sdk": "worker"}
THREAD_FILES = {
    "rendezvous/src/server.cc",       # the server's io thread
    "rendezvous/src/client.cc",       # the blocking client's loop (tests, benchmarks)
    "snapshot/src/transfer_pool.cc",  # the snapshot shell's pool of transfer threads
    "snapshot/src/transfer.cc",       # the transport's hashing helpers
    "etcd/src/txn_worker.cc",         # the etcd adapter: transactions, watch, lease
    "etcd/src/watcher.cc",
    "etcd/src/lease_keeper.cc",
    "worker_sdk/src/op_queue.cc",     # a communicator's op thread
    "worker_sdk/src/op_queue.h",
    "worker_sdk/src/nccl_communicator.cc",  # the NCCL watchdog
    "worker_sdk/src/control_client.cc",     # the agent's control channel reader
    "worker_sdk/src/gloo_mesh.cc",          # a forming Gloo group's watch on the agent's abort
}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
STARTS_THREAD = re.compile(r"\bstd::(?:j?thread)\b(?!::)\s*(?:\w+\s*)?[({]|\bpthread_create\s*\(|"
                           r"\bstd::async\s*\(")
GRPC = re.compile(r"^(grpcpp/|grpc/|google/protobuf/)|\.pb\.h$")


def sources(root, top):
    for dirpath, _, files in os.walk(os.path.join(root, top)):
        for f in files:
            if f.endswith((".cc", ".h")):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, root), open(path, errors="replace").read()


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    problems = []
    for top, me in DIRS.items():
        for rel, text in sources(root, top):
            code = strip_comments(text)
            for inc in INCLUDE.findall(code):
                m = re.match(r"ddprun/(\w+)/", inc)
                if m and not re.match(r"ddprun/\w+/v\d+/", inc):  # generated protos are proto's
                    other = m.group(1)
                    if other == me:
                        continue
                    if other == "worker" or me == "worker":
                        if not (me == "worker" and other == "common"):
                            problems.append(f"{rel}: includes {inc}: the worker SDK and the "
                                            f"control plane share only common/")
                    elif other not in LEVEL:
                        problems.append(f"{rel}: includes {inc}: no component '{other}'")
                    elif LEVEL[other] >= LEVEL[me]:
                        problems.append(f"{rel}: includes {inc}: {me} may include only components "
                                        f"below it, and {other} is not")
                if me == "agent" and GRPC.search(inc):
                    problems.append(f"{rel}: includes {inc}: agent/ includes no gRPC or protobuf "
                                    f"header (that is the adapters' business)")
            if STARTS_THREAD.search(code) and rel not in THREAD_FILES:
                problems.append(f"{rel}: starts a thread; threads live only in "
                                f"{', '.join(sorted(THREAD_FILES))}")
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} layering violation(s)")
        return 1
    print("layering: every component includes only those below it; agent/ has no gRPC; threads "
          "start only in the designated files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
