#!/usr/bin/env bash
# The GPU check: on a machine with NVIDIA GPUs and PyTorch (CUDA), builds the worker SDK, train and
# the SDK's tests against that PyTorch's LibTorch and NCCL, runs the GPU test cases (with the rest
# of the SDK's tests), and runs `train --backend nccl` against PyTorch DDP on the same models, data
# and loop (parameters and step time; mixed precision too). With >= 2 GPUs also allreduce_bench
# nccl against torch.distributed's all-reduce, and a rank killed mid-all-reduce. Prints a table;
# writes it and every log to --out.
#
#   deploy/gpu-check.sh [--prepared DIR] [--out DIR] [--python PY] [--jobs N] [--quick] [--only PART]...
#
#   --prepared DIR  what deploy/gpu-prepare.sh made on a Debian machine: Debian's libraries for a
#                   machine without them (DIR/sysroot), and a ddprun to launch jobs with
#                   (DIR/ddprun). Without it: the machine's own spdlog/fmt/gloo/Catch2, and
#                   ddprun from PATH, else torchrun.
#   --python PY     the interpreter whose torch to build against (default: python3)
#   --quick         fewer configurations (one model and batch size)
#   --only PART     run only these parts: tests, train, env, multi (repeatable; default all)
set -euo pipefail
cd "$(dirname "$0")/.."
prepared="" out=gpu-check-out py=python3 jobs=$(nproc) quick=0 only=()
while [ $# -gt 0 ]; do
  case $1 in
  --prepared) prepared=$(cd "${2:?--prepared needs a directory}" && pwd); shift 2 ;;
  --out) out=${2:?--out needs a directory}; shift 2 ;;
  --python) py=${2:?--python needs an interpreter}; shift 2 ;;
  --jobs) jobs=${2:?--jobs needs a number}; shift 2 ;;
  --quick) quick=1; shift ;;
  --only) only+=(--only "${2:?--only needs tests, train, env or multi}"); shift 2 ;;
  *) echo "gpu-check: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
command -v nvidia-smi >/dev/null && nvidia-smi -L >"$out/gpus.txt" 2>&1 ||
  { echo "gpu-check: no NVIDIA GPU here (nvidia-smi)" >&2; exit 2; }
prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)') ||
  { echo "gpu-check: $py has no torch" >&2; exit 2; }

cmake_args=(-DDDPRUN_SDK_ONLY=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDDPRUN_WERROR=OFF
  -DCMAKE_POLICY_VERSION_MINIMUM=3.5 -DDDPRUN_TORCH2_PYTHON="$(command -v "$py")")
search="$prefix"
if [ -n "$prepared" ]; then
  sysroot=$prepared/sysroot
  # Debian's Gloo CMake file names /usr/lib outright, and dpkg's symlinks may be absolute.
  sed -i "s#\"/usr/lib/#\"$sysroot/usr/lib/#g" "$sysroot"/usr/share/cmake/Gloo/GlooTargets-*.cmake
  find "$sysroot" -type l | while read -r link; do
    target=$(readlink "$link")
    if [[ $target == /* && $target != "$sysroot"* ]]; then ln -sfn "$sysroot$target" "$link"; fi
  done
  search="$search;$sysroot/usr;$sysroot/usr/lib/x86_64-linux-gnu/cmake;$sysroot/usr/share/cmake"
  export LD_LIBRARY_PATH="$sysroot/usr/lib/x86_64-linux-gnu:$sysroot/usr/lib:$sysroot/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
command -v ninja >/dev/null && cmake_args+=(-G Ninja)
echo "== building the worker SDK against $("$py" -c 'import torch; print(torch.__version__)') ($prefix)"
cmake -S . -B build-gpu -DCMAKE_PREFIX_PATH="$search" "${cmake_args[@]}" >"$out/configure.log" 2>&1 ||
  { tail -30 "$out/configure.log"; echo "gpu-check: configure failed ($out/configure.log)" >&2; exit 1; }
grep -E "ddprun|NCCL" "$out/configure.log" || true
cmake --build build-gpu -j "$jobs" >"$out/build.log" 2>&1 ||
  { tail -40 "$out/build.log"; echo "gpu-check: build failed ($out/build.log)" >&2; exit 1; }

launcher=()
if [ -n "$prepared" ] && [ -x "$prepared/ddprun/bin/ddprun" ]; then
  launcher=(--ddprun "$prepared/ddprun/bin/ddprun")
elif command -v ddprun >/dev/null; then
  launcher=(--ddprun "$(command -v ddprun)")
fi
quick_args=()
[ "$quick" = 1 ] && quick_args=(--quick)
exec "$py" bench/worker_sdk/gpu_check.py --build build-gpu --out "$out" --jobs "$jobs" \
  "${launcher[@]}" "${quick_args[@]}" "${only[@]}"
