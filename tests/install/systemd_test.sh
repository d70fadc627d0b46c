#!/usr/bin/env bash
# systemd-analyze verify on ddprun-rendezvous.service, the unit's wiring to /etc/default and the
# daemon's flags; the daemon starts with the default file's listen address (port 0). Skips (77)
# where systemd-analyze is missing.
#   systemd_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
command -v systemd-analyze >/dev/null ||
  { echo "SKIP: systemd-analyze not found (package systemd); unit not verified"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# verify checks the unit against this system (targets, that ExecStart is executable, that `man`
# finds the Documentation page): a copy whose paths point at the built binary, the default file and
# the generated man page.
mkdir -p "$tmp/man/man1"
unit=$tmp/ddprun-rendezvous.service
sed -e "s|^ExecStart=/usr/bin/|ExecStart=$build/rendezvous/|" \
    -e "s|^EnvironmentFile=/etc/default/ddprun-rendezvous|EnvironmentFile=$src/deploy/systemd/ddprun-rendezvous.default|" \
    "$src/deploy/systemd/ddprun-rendezvous.service" >"$unit"
if [ -f "$build/man/ddprun-rendezvous.1" ] && command -v man >/dev/null; then
  cp "$build/man/ddprun-rendezvous.1" "$tmp/man/man1/"
else
  echo "note: no man page or no man(1): the Documentation= line is not checked"
  sed -i '/^Documentation=man:/d' "$unit"
fi
if ! MANPATH=$tmp/man systemd-analyze verify "$unit" >"$tmp/verify.log" 2>&1; then
  cat "$tmp/verify.log"
  echo "FAIL: systemd-analyze verify" >&2
  exit 1
fi
cat "$tmp/verify.log"
echo "systemd-analyze verify: clean"
unit=$src/deploy/systemd/ddprun-rendezvous.service
# Installed disabled: the package enables nothing (no [Install] symlink, no postinst enable).
if grep -q 'systemctl enable\|deb-systemd-helper enable' "$src/deploy/debian/postinst"; then
  echo "FAIL: postinst enables the service" >&2; exit 1
fi
# The flags the unit passes are the daemon's: --listen from the EnvironmentFile's default.
grep -q '^ExecStart=/usr/bin/ddprun-rendezvous --listen ${DDPRUN_RENDEZVOUS_LISTEN} $DDPRUN_RENDEZVOUS_OPTS$' "$unit"
grep -q '^EnvironmentFile=/etc/default/ddprun-rendezvous$' "$unit"
# shellcheck disable=SC1091
. "$src/deploy/systemd/ddprun-rendezvous.default"
# The default listen address is accepted by the daemon's own parser (port 0 here: any free one).
"$build/rendezvous/ddprun-rendezvous" --listen "${DDPRUN_RENDEZVOUS_LISTEN%:*}:0" $DDPRUN_RENDEZVOUS_OPTS \
  >"$tmp/daemon.log" 2>&1 &
pid=$!
for _ in $(seq 100); do grep -q 'listening on' "$tmp/daemon.log" && break; sleep 0.1; done
kill -TERM "$pid"; wait "$pid" || true
grep 'listening on' "$tmp/daemon.log" || { cat "$tmp/daemon.log"; echo "FAIL: daemon did not start" >&2; exit 1; }
echo "OK"
