#!/usr/bin/env python3
"""The layering check catches each kind of violation (so that its test of the tree can fail):
every case writes a small source tree, runs check_layering.py on it and expects its verdict.

    check_layering_test.py      exit 0, or 1 naming the case that was judged wrongly
"""
import os
import subprocess
import sys
import tempfile

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_layering.py")

# (name, {path: text}, expected exit code, a text the output must hold)
CASES = [
    ("a clean tree passes",
     {"agent/src/a.cc": '#include "ddprun/rendezvous/state.h"\n#include <boost/asio.hpp>\n',
      "snapshot/src/transfer_pool.cc": "void f() { std::thread t([] {}); t.join(); }\n",
      "worker_sdk/src/w.cc": '#include "ddprun/common/log.h"\n'},
     0, "layering: every component"),
    ("agent/ including gRPC fails",
     {"agent/src/a.cc": "#include <grpcpp/grpcpp.h>\n"}, 1, "agent/ includes no gRPC"),
    ("agent/ including a generated protobuf header fails",
     {"agent/src/a.h": '#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"\n'}, 1,
     "agent/ includes no gRPC"),
    ("a thread outside the designated files fails",
     {"agent/src/a.cc": "void f() { std::thread worker([] {}); worker.detach(); }\n"}, 1,
     "agent/src/a.cc: starts a thread"),
    ("std::async counts as a thread",
     {"snapshot/src/holdings.cc": "auto f = std::async(std::launch::async, [] {});\n"}, 1,
     "starts a thread"),
    ("a thread in a comment does not count",
     {"agent/src/a.cc": "// std::thread t(f);\n/* pthread_create(&t, 0, f, 0); */\n"}, 0,
     "layering: every component"),
    ("a component including one above it fails",
     {"rendezvous/src/r.cc": '#include "ddprun/agent/supervisor.h"\n'}, 1,
     "rendezvous may include only components below it"),
    ("components of one level may not include each other",
     {"etcd/src/e.cc": '#include "ddprun/snapshot/core.h"\n'}, 1,
     "etcd may include only components below it"),
    ("the worker SDK including the control plane fails",
     {"worker_sdk/src/w.cc": '#include "ddprun/rendezvous/client.h"\n'}, 1,
     "the worker SDK and the control plane share only common/"),
    ("the control plane including the worker SDK fails",
     {"agent/src/a.cc": '#include "ddprun/worker/ddp.h"\n'}, 1,
     "the worker SDK and the control plane share only common/"),
]


def verdict(files):
    with tempfile.TemporaryDirectory() as root:
        for rel, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w") as f:
                f.write(text)
        r = subprocess.run([sys.executable, CHECK, root], capture_output=True, text=True)
        return r.returncode, r.stdout


def main():
    wrong = 0
    for name, files, code, needle in CASES:
        got, out = verdict(files)
        if got != code or needle not in out:
            wrong += 1
            print(f"FAILED: {name}: exit {got} (expected {code}), output:\n{out}")
    print(f"{len(CASES) - wrong}/{len(CASES)} cases judged as expected")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
