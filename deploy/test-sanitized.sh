#!/usr/bin/env bash
# The sanitizer leg of the test command (deploy/test.sh builds it beside the main suite, then runs
# its tests): the pure suites (ctest -L pure: common, the rendezvous state and --rdzv-conf, the
# launcher's command line, Slurm parsing, the worker SDK's NCCL health and loss scale) and the
# agent's unit suite (ctest -L agent: its supervisor, in-place recovery, rendezvous clients and
# control channel against fakes; it links the gRPC adapters, snapshot/ and etcd/) built with
# clang++ and -fsanitize=address,undefined in their own build dir, and the libFuzzer targets of
# fuzz/ (ctest -L fuzz: seeds plus a bounded number of generated inputs).
# Undefined behaviour, a leak or a memory error fails the test that hit it. Everything here is
# compiled with clang's -Wthread-safety -Werror (mutex annotations, common/thread_annotations.h).
#   deploy/test-sanitized.sh [--build-only | --test-only] [cmake configure args...]
# --build-only builds and checks (deploy/test.sh runs it beside the main suite); --test-only runs
# the tests of a build made so.
set -euo pipefail
cd "$(dirname "$0")/.."
phase=all
case ${1:-} in
--build-only) phase=build; shift ;;
--test-only) phase=test; shift ;;
esac
BUILD_DIR=${DDPRUN_SANITIZE_BUILD_DIR:-build-asan}
JOBS=${DDPRUN_JOBS:-$(nproc)}
launcher=()
if command -v ccache >/dev/null 2>&1; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
if [ "$phase" != test ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER=clang++ -DDDPRUN_SANITIZE=address,undefined -DDDPRUN_FUZZ=ON \
    "${launcher[@]}" "$@" >/dev/null
  cmake --build "$BUILD_DIR" -j "$JOBS" --target common_tests rendezvous_state_tests \
    launcher_tests slurm_tests worker_core_test snapshot_core_tests agent_tests fuzz_hostlist \
    fuzz_rdzv_conf fuzz_cli fuzz_nnodes_endpoint fuzz_rendezvous_state fuzz_snapshot_requests fuzz_snapshot_core \
    fuzz_etcd_state_value fuzz_control_protocol ddprun_protos_generated
  # The thread-safety annotations of what this leg does not build (the worker SDK: LibTorch; the
  # daemons and their e2e suites): checked, not built; the protobuf code is generated first.
  deploy/check-thread-safety.sh "$BUILD_DIR"
fi
[ "$phase" != build ] || exit 0
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1} \
  ctest --test-dir "$BUILD_DIR" -L 'pure|fuzz|agent' --output-on-failure -j "${DDPRUN_TEST_JOBS:-2}" \
  --timeout 600
