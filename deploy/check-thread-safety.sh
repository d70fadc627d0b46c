#!/usr/bin/env bash
# clang's thread-safety analysis (-Wthread-safety -Werror) over the worker SDK's sources that
# share state with threads, as they compile in a clang build's compile_commands.json, without
# generating code (-fsyntax-only: these include LibTorch, which the sanitizer leg does not build).
# The control plane's annotated sources are checked by that leg's own compilation.
#   deploy/check-thread-safety.sh BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: deploy/check-thread-safety.sh BUILD_DIR (a clang build)}
files=(worker_sdk/src/ddp.cc worker_sdk/src/op_queue.cc worker_sdk/src/nccl_communicator.cc
  worker_sdk/src/nccl_health.cc)
python3 - "$build/compile_commands.json" "$PWD" "${files[@]}" <<'PY'
import json, shlex, subprocess, sys
commands, root, files = sys.argv[1], sys.argv[2], sys.argv[3:]
entries = {e["file"]: e for e in json.load(open(commands))}
failed = 0
for f in files:
    e = entries.get(f"{root}/{f}")
    if e is None:
        print(f"check-thread-safety: {f}: not in {commands} (not part of this build)")
        continue
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
    if r.returncode != 0:
        failed += 1
        print(r.stderr[-4000:])
    print(f"check-thread-safety: {f}: {'ok' if r.returncode == 0 else 'FAILED'}")
sys.exit(1 if failed else 0)
PY
