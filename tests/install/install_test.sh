#!/usr/bin/env bash
# cmake --install into a temp prefix; the installed files; the public headers need no control-plane
# headers; pkg-config builds a program; examples/consumer configures against the installed package
# only, builds, and runs under the installed ddprun with two workers; bash completion completes.
#   install_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
fail() { echo "FAIL: $*" >&2; exit 1; }

cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install"; }
libdir=$(cd "$prefix" && ls -d lib*/libddprun_worker.so | xargs dirname)
for f in bin/ddprun bin/ddprun-agent bin/ddprun-rendezvous bin/train \
         "$libdir/libddprun_worker.so" include/ddprun/worker/ddp.h include/ddprun/worker/sampler.h \
         "$libdir/cmake/ddprun/ddprunConfig.cmake" "$libdir/cmake/ddprun/ddprunTargets.cmake" \
         "$libdir/pkgconfig/ddprun-worker.pc" lib/systemd/system/ddprun-rendezvous.service \
         etc/default/ddprun-rendezvous share/ddprun/slurm/train_cpu.sbatch \
         share/ddprun/slurm/train_gpu.sbatch share/ddprun/kubernetes/train-job.yaml \
         share/bash-completion/completions/ddprun share/bash-completion/completions/ddprun-rendezvous; do
  [ -e "$prefix/$f" ] || fail "not installed: $f"
done
if command -v help2man >/dev/null; then
  for m in ddprun ddprun-agent ddprun-rendezvous train; do
    [ -s "$prefix/share/man/man1/$m.1" ] || fail "no man page $m.1"
  done
  grep -q 'nproc' "$prefix/share/man/man1/ddprun.1" || fail "ddprun.1 does not document the flags"
else
  echo "note: help2man missing, man pages not checked"
fi
echo "installed: $(cd "$prefix" && find . -type f | wc -l) files"

# Public headers: LibTorch and the standard library only.
if grep -rnE '#include [<"](grpc|google/protobuf|asio|boost|spdlog|ddprun/common|ddprun/(agent|rendezvous|launcher))' \
     "$prefix/include"; then
  fail "an installed header includes a control-plane header"
fi

# pkg-config: the LibTorch-free sampler header, linked against the installed library.
export PKG_CONFIG_PATH=$prefix/$libdir/pkgconfig
pkg-config --validate ddprun-worker || fail "ddprun-worker.pc does not validate"
pc_inc=$(pkg-config --variable=includedir ddprun-worker)
[ "$(realpath "$pc_inc")" = "$(realpath "$prefix/include")" ] || fail "ddprun-worker.pc includedir $pc_inc"
cat >"$tmp/pc.cc" <<'CC'
#include <cstdio>
#include "ddprun/worker/sampler.h"
int main() {
  ddprun::worker::SamplerOptions o;
  o.size = 10; o.num_replicas = 2; o.rank = 1; o.shuffle = false;
  for (auto i : ddprun::worker::DistributedSampler(o).indices()) std::printf("%lld ", static_cast<long long>(i));
  std::printf("\n");
}
CC
# shellcheck disable=SC2046
g++ -std=c++17 "$tmp/pc.cc" -o "$tmp/pc" $(pkg-config --cflags --libs ddprun-worker) || fail "pkg-config build"
out=$(LD_LIBRARY_PATH=$prefix/$libdir "$tmp/pc")
[ "$out" = "1 3 5 7 9 " ] || fail "pkg-config program printed '$out'"
echo "pkg-config program: $out"

# The consumer project, against the installed package only (no package registry, no build tree).
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src/examples/consumer" -B "$tmp/consumer" "${gen[@]}" "${launcher[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF \
  >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; fail "consumer configure"; }
grep -q "ddprun 0.1.0 from $prefix/$libdir/cmake/ddprun" "$tmp/configure.log" ||
  { cat "$tmp/configure.log"; fail "the consumer did not find the installed package"; }
cmake --build "$tmp/consumer" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "consumer build"; }
if grep -rq "$build" "$tmp/consumer/CMakeCache.txt" "$tmp/consumer/build.ninja" 2>/dev/null; then
  fail "the consumer build refers to the build tree $build"
fi
ldd "$tmp/consumer/ddp_consumer" | grep "$prefix/$libdir/libddprun_worker.so" >/dev/null ||
  { ldd "$tmp/consumer/ddp_consumer"; fail "ddp_consumer does not load the installed libddprun_worker"; }

cd "$tmp"
"$prefix/bin/ddprun" --standalone --nproc_per_node=2 "$tmp/consumer/ddp_consumer" >"$tmp/run.log" 2>&1 ||
  { cat "$tmp/run.log"; fail "ddprun ddp_consumer"; }
cat "$tmp/run.log"
line=$(grep '^ddp_consumer: world_size=2 ' "$tmp/run.log") || fail "no result line from rank 0"
[[ "$line" == *params_identical_on_all_ranks* ]] || fail "parameters differ across ranks"
loss=$(sed -E 's/.*final_loss=([0-9.e+-]+).*/\1/' <<<"$line")
awk -v l="$loss" 'BEGIN { exit !(l < 0.01) }' || fail "final loss $loss is not below 0.01"

# Bash completion: the flags come from the installed ddprun's --help.
reply=$(PATH=$prefix/bin:$PATH bash -c '
  source "$1/share/bash-completion/completions/ddprun"
  COMP_WORDS=(ddprun --nproc); COMP_CWORD=1; _ddprun_complete; echo "${COMPREPLY[*]}"
  COMP_WORDS=(ddprun-rendezvous --tls); COMP_CWORD=1; _ddprun_complete; echo "${COMPREPLY[*]}"' _ "$prefix")
echo "completion: $reply"
grep -q -- '--nproc-per-node' <<<"$reply" || fail "completion of ddprun --nproc"
grep -q -- '--tls-cert' <<<"$reply" || fail "completion of ddprun-rendezvous --tls"
echo "OK"
