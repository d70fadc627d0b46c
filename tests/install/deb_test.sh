#!/usr/bin/env bash
# cpack -G DEB: the package's files and declared dependencies; apt accepts it (simulated); its
# files, extracted into a temp root, train two workers under its ddprun (deploy/container/smoke.sh,
# the check the container build runs after `apt install ./ddprun_*.deb`).
#   deb_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
for tool in cpack dpkg-deb dpkg-shlibdeps; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool not found (deploy/install-deps.sh installs it)"; exit 77; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

(cd "$build" && cpack -G DEB -B "$tmp/out") >"$tmp/cpack.log" 2>&1 || { cat "$tmp/cpack.log"; fail "cpack"; }
debs=("$tmp"/out/ddprun_*.deb)
[ ${#debs[@]} -eq 1 ] && [ -f "${debs[0]}" ] || fail "expected one ddprun_*.deb, got: ${debs[*]}"
deb=${debs[0]}
echo "package: $(basename "$deb") ($(du -h "$deb" | cut -f1))"

dpkg-deb -I "$deb" >"$tmp/info"
cat "$tmp/info"
grep -q '^ Package: ddprun$' "$tmp/info" || fail "package name"
depends=$(sed -n 's/^ Depends: //p' "$tmp/info")
for dep in libc6 libstdc++6 libtorch libgloo libgrpc++ libprotobuf libspdlog; do
  grep -q "$dep" <<<"$depends" || fail "Depends lacks $dep: $depends"
done
dpkg-deb -f "$deb" Recommends | grep libtorch-dev >/dev/null || fail "Recommends lacks libtorch-dev"
dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles | grep -x /etc/default/ddprun-rendezvous >/dev/null ||
  fail "/etc/default/ddprun-rendezvous is not a conffile"

dpkg-deb -c "$deb" | awk '{print $6}' | sed 's|^\./|/|' >"$tmp/files"
for f in /usr/bin/ddprun /usr/bin/ddprun-agent /usr/bin/ddprun-rendezvous /usr/bin/train \
         '/usr/lib/.*libddprun_worker\.so' /usr/include/ddprun/worker/ddp.h \
         /usr/include/ddprun/worker/process_group.h '/usr/lib/.*cmake/ddprun/ddprunConfig\.cmake' \
         '/usr/lib/.*cmake/ddprun/ddprunTargets\.cmake' '/usr/lib/.*pkgconfig/ddprun-worker\.pc' \
         /usr/lib/systemd/system/ddprun-rendezvous.service /etc/default/ddprun-rendezvous \
         /usr/share/ddprun/slurm/train_cpu.sbatch /usr/share/ddprun/slurm/train_gpu.sbatch \
         /usr/share/ddprun/kubernetes/train-job.yaml /usr/share/bash-completion/completions/ddprun \
         /usr/share/man/man1/ddprun.1 /usr/share/man/man1/ddprun-rendezvous.1; do
  grep -qx "$f" "$tmp/files" || fail "not in the package: $f"
done
if grep -E '^/(usr/local|tmp|work|home|root)' "$tmp/files"; then fail "files outside /usr and /etc"; fi

# apt resolves the declared dependencies from this machine's Debian sources (nothing installed).
if command -v apt-get >/dev/null; then
  apt-get install -s -q "$deb" >"$tmp/apt.log" 2>&1 || { cat "$tmp/apt.log"; fail "apt-get install -s $deb"; }
  grep -E '^(Inst|Conf) ddprun ' "$tmp/apt.log" || { cat "$tmp/apt.log"; fail "apt would not install ddprun"; }
fi

# "Installed" into a scratch root, then run.
dpkg-deb -x "$deb" "$tmp/root"
"$src/deploy/container/smoke.sh" "$tmp/root"
echo "OK"
