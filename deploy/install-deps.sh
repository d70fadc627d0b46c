#!/usr/bin/env bash
# Installs every Debian 12 package that ddprun's build, tests, examples and benchmarks need.
# Idempotent: when everything is already installed it only checks (well under a second).
set -euo pipefail

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
  # tests: reference peer (torchrun, PyTorch workers) and the tools the tests drive
  catch2 python3-torch procps iproute2 hostname
  # rendezvous TLS test: a self-signed certificate
  openssl
  # install and packaging (cmake --install, cpack -G DEB; tests/install): man pages from --help,
  # dpkg-shlibdeps, the Kubernetes manifest check
  help2man dpkg-dev file python3-yaml
  # Slurm tests: a real two-node cluster on this machine (tests/slurm/cluster.sh)
  slurm-wlm slurmctld slurmd slurm-client munge
  # etcd-v3 rendezvous: etcd's v3 API protos (generated at build time) and a real etcd for tests
  golang-etcd-server-dev etcd-server etcd-client
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  SUDO=sudo
else
  SUDO=
fi
echo "install-deps: installing ${missing[*]}" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
