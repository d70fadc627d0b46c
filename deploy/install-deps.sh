#!/usr/bin/env bash
# Installs every Debian 12 package that ddprun's build, tests, examples and benchmarks need, and a
# current PyTorch from PyPI (deploy/requirements-torch2.txt, every package pinned) in the
# project's own virtual environment: .venv/torch2 in this checkout, or DDPRUN_TORCH2_VENV. The
# worker SDK is built and tested against its LibTorch as well as Debian's 1.13, and the PyTorch
# tests run under both. DDPRUN_TORCH2=0 skips it (the test command then says what it skips).
# Idempotent: when everything is already installed it only checks (well under a second).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  # toolchain
  g++ cmake ninja-build pkg-config git clang-format
  # the sanitizer leg (deploy/test-sanitized.sh): clang++ with ASan, UBSan and libFuzzer
  clang libclang-rt-14-dev
  # control plane
  libboost-dev libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev nlohmann-json3-dev
  # worker SDK
  libtorch-dev libgloo-dev libopenblas0-pthread zlib1g-dev
  # the current PyTorch's virtual environment (Debian's python3 is its interpreter)
  python3-venv
  # tests: reference peer (torchrun, PyTorch workers) and the tools the tests drive
  catch2 python3-torch procps iproute2 hostname
  # rendezvous TLS test: a self-signed certificate
  openssl
  # install and packaging (cmake --install, cpack -G DEB; tests/install): man pages from --help,
  # dpkg-shlibdeps, the Kubernetes manifest check
  help2man dpkg-dev file python3-yaml
  # the GPU check's carried launcher (deploy/gpu-prepare.sh)
  patchelf
  # Slurm tests: a real two-node cluster on this machine (tests/slurm/cluster.sh)
  slurm-wlm slurmctld slurmd slurm-client munge
  # etcd-v3 rendezvous: etcd's v3 API protos (generated at build time) and a real etcd for tests
  golang-etcd-server-dev etcd-server etcd-client
  # --print-completion's tests: the shells whose scripts it prints (bash is there already)
  zsh tcsh
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "$(id -u)" -ne 0 ]; then
  SUDO=sudo
else
  SUDO=
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The current PyTorch. The requirements file is copied into the environment once everything in it
# is installed, so an interrupted install is redone and a changed pin reinstalls.
if [ "${DDPRUN_TORCH2:-1}" != 0 ]; then
  venv=${DDPRUN_TORCH2_VENV:-$PWD/.venv/torch2}
  if ! cmp -s deploy/requirements-torch2.txt "$venv/ddprun-requirements.txt" 2>/dev/null; then
    echo "install-deps: installing $(grep -m1 '^torch==' deploy/requirements-torch2.txt) from PyPI" \
      "into $venv (about 5 GB with its CUDA libraries)" >&2
    rm -f "$venv/ddprun-requirements.txt"
    # The environment takes about 5.4 GB, and pip unpacks each wheel in TMPDIR first. Check the
    # room before pip starts, so a full disk is one line naming the folder, not pip's Errno 28
    # halfway through (an interrupted install is redone on the next run anyway).
    mkdir -p "$venv"
    tmp=${TMPDIR:-/tmp}
    need_mb=${DDPRUN_TORCH2_NEED_MB:-6500}
    for dir in "$venv" "$tmp"; do
      free_mb=$(df -Pm "$dir" | awk 'NR == 2 { print $4 }')
      if [ -n "$free_mb" ] && [ "$free_mb" -lt "$need_mb" ]; then
        echo "install-deps: not enough disk space for the current PyTorch: $dir has ${free_mb} MB" \
          "free, the install needs about ${need_mb} MB there (the environment and pip's unpacked" \
          "wheels). Free some space (or point TMPDIR or DDPRUN_TORCH2_VENV elsewhere), or set" \
          "DDPRUN_TORCH2=0 to leave the current PyTorch out." >&2
        exit 1
      fi
    done
    /usr/bin/python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir \
      -r deploy/requirements-torch2.txt
    cp deploy/requirements-torch2.txt "$venv/ddprun-requirements.txt"
  fi
fi
