#!/usr/bin/env bash
# Prepares, on this Debian 12 machine, what deploy/gpu-check.sh needs on a GPU machine that has
# PyTorch but not Debian's packages (no network there): one folder to copy along.
#
#   deploy/gpu-prepare.sh DIR
#
#   DIR/sysroot/   Debian's libraries and headers the worker SDK builds with (spdlog, fmt, gloo,
#                  Catch2, zlib, and what libgloo loads), unpacked from their .debs.
#   DIR/ddprun/    the launcher built here (build/launcher/ddprun) with the shared libraries it
#                  loads, its RPATH set to them, so the GPU check runs jobs under ddprun as well.
#
# Then, on the GPU machine: deploy/gpu-check.sh --prepared DIR. Needs apt-get (downloads only) and
# patchelf (deploy/install-deps.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: deploy/gpu-prepare.sh DIR}
command -v patchelf >/dev/null || { echo "gpu-prepare: needs patchelf (apt-get install patchelf)" >&2; exit 2; }
[ -x build/launcher/ddprun ] || { echo "gpu-prepare: build ddprun first (deploy/build.sh)" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -rf "$out/sysroot" "$out/ddprun" "$out/debs"
mkdir -p "$out/sysroot" "$out/ddprun/bin" "$out/ddprun/lib" "$out/debs"

# 1. The SDK's build dependencies from Debian.
packages=(libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 catch2 libgloo-dev libgloo0
  libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200 zlib1g-dev)
(cd "$out/debs" && apt-get download "${packages[@]}" >/dev/null)
for deb in "$out"/debs/*.deb; do dpkg -x "$deb" "$out/sysroot"; done
rm -rf "$out/debs"
# (gpu-check.sh points Gloo's CMake file and dpkg's absolute symlinks at wherever DIR lands.)

# 2. ddprun and the libraries it loads, except the C and C++ runtimes every machine has.
cp build/launcher/ddprun "$out/ddprun/bin/"
strip --strip-debug "$out/ddprun/bin/ddprun"  # RelWithDebInfo: ~95 MB of debug info
ldd build/launcher/ddprun | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
  case $(basename "$lib") in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
    *) cp -L "$lib" "$out/ddprun/lib/" ;;
  esac
done
patchelf --force-rpath --set-rpath '$ORIGIN/../lib' "$out/ddprun/bin/ddprun"
for lib in "$out"/ddprun/lib/*; do patchelf --force-rpath --set-rpath '$ORIGIN' "$lib"; done
echo "gpu-prepare: $out ($(du -sh "$out" | cut -f1)): sysroot/ and ddprun/ for deploy/gpu-check.sh --prepared $out"
