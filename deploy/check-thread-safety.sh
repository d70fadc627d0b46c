#!/usr/bin/env bash
# clang's thread-safety analysis (-Wthread-safety -Werror) over the worker SDK's sources that share
# state with threads, as they compile in a clang build's compile_commands.json (a source of a unity
# file, DDPRUN_UNITY, through that file), without generating code (-fsyntax-only): they include
# LibTorch, which the sanitizer leg does not build. What that leg builds (every other component,
# the daemons, their suites: target sanitized_tests) is compiled there with -Wthread-safety and
# -Werror already.
#   deploy/check-thread-safety.sh BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: deploy/check-thread-safety.sh BUILD_DIR (a clang build)}
files=(worker_sdk/src/ddp.cc worker_sdk/src/op_queue.cc worker_sdk/src/nccl_communicator.cc
  worker_sdk/src/nccl_health.cc)
python3 - "$build/compile_commands.json" "$PWD" "${files[@]}" <<'PY'
import concurrent.futures, json, os, shlex, subprocess, sys
commands, root, files = sys.argv[1], sys.argv[2], sys.argv[3:]
entries = {}
for e in json.load(open(commands)):
    entries[e["file"]] = e
    # A unity build's file (DDPRUN_UNITY) stands for the sources it includes.
    if "/Unity/unity_" in e["file"]:
        for line in open(e["file"]):
            if line.startswith('#include "'):
                entries.setdefault(line.split('"')[1], e)


def check(f):
    e = entries.get(f"{root}/{f}")
    if e is None:
        return f, None, f"not in {commands} (not part of this build)"
    args = shlex.split(e["command"]) if "command" in e else e["arguments"]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-o", "-MF", "-MT"):
            skip = True
        elif a != "-MD" and not a.startswith("-fsanitize"):
            out.append(a)
    out += ["-fsyntax-only", "-Wthread-safety", "-Werror"]
    r = subprocess.run(out, cwd=e["directory"], capture_output=True, text=True)
    return f, r.returncode == 0, r.stderr[-4000:]


# Each compile command once: the sources of one unity file pass or fail together, and its
# compiler output is shown once.
groups = {}
for f in files:
    e = entries.get(f"{root}/{f}")
    groups.setdefault(e["file"] if e else f, []).append(f)
with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
    results = list(pool.map(check, [sources[0] for sources in groups.values()]))
failed = checked = 0
for sources, (_, ok, text) in zip(groups.values(), results):
    if ok is None:
        print(f"check-thread-safety: {sources[0]}: {text}")
        continue
    checked += len(sources)
    if not ok:
        failed += len(sources)
        print(text)
        for f in sources:
            print(f"check-thread-safety: {f}: FAILED")
print(f"check-thread-safety: {checked - failed}/{checked} sources pass -Wthread-safety -Werror")
sys.exit(1 if failed or checked == 0 else 0)
PY
