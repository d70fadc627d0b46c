#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces ddprun-a and ddprun-b joined by a veth pair whose
# both directions are shaped by tc, so that benchmarks and tests between hosts meet a real link
# limit instead of loopback's memcpy. Needs root (ip, tc from iproute2).
#
#   deploy/netrig.sh up [--rate 1gbit] [--delay 100us]   (re)create the rig; idempotent
#   deploy/netrig.sh down                                 remove it; idempotent
#   deploy/netrig.sh status                               what exists, and the qdiscs
#   deploy/netrig.sh exec a|b CMD [ARGS...]               run CMD on host a (10.203.0.1) or b (.2)
#
# Rate shaping: netem (rate + delay) where the kernel has sch_netem; otherwise a token bucket (tbf)
# gives the rate, and the delay cannot be emulated: one line says so. Any benchmark runs "between
# hosts" by starting one node per namespace, e.g.
#   deploy/netrig.sh exec a ddprun --nnodes=2 --node-rank=0 --master-addr=10.203.0.1 ... &
#   deploy/netrig.sh exec b ddprun --nnodes=2 --node-rank=1 --master-addr=10.203.0.1 ...
# (PyTorch's gloo also wants GLOO_SOCKET_IFNAME=ddpa / ddpb, the veth in each namespace).
set -euo pipefail

NS_A=ddprun-a
NS_B=ddprun-b
DEV_A=ddpa
DEV_B=ddpb
ADDR_A=10.203.0.1
ADDR_B=10.203.0.2

die() {
  echo "netrig: $*" >&2
  exit 2
}

need_root() {
  [[ $(id -u) -eq 0 ]] || die "needs root (network namespaces and tc)"
  command -v ip >/dev/null && command -v tc >/dev/null || die "needs ip and tc (apt-get install iproute2)"
}

down() {
  local ns
  for ns in "$NS_A" "$NS_B"; do
    if ip netns list | grep -qw "^$ns"; then ip netns del "$ns"; fi
  done
  # Deleting a namespace deletes the veth end inside it, and with it the peer.
  if ip link show "$DEV_A" >/dev/null 2>&1; then ip link del "$DEV_A"; fi
  return 0
}

# Rate like 1gbit / 10gbit / 500mbit; delay like 100us / 1ms / 0.
shape() {
  local ns=$1 dev=$2 rate=$3 delay=$4
  # Queue room for at least 20 ms at the rate (full-size frames), so bulk transfers never drop.
  if ip netns exec "$ns" tc qdisc replace dev "$dev" root netem delay "$delay" rate "$rate" \
    limit 100000 2>/dev/null; then
    echo "netrig: $ns/$dev: netem rate $rate delay $delay"
    return
  fi
  ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$rate" burst 1mbit latency 100ms ||
    die "tc cannot shape $dev (neither netem nor tbf is available)"
  if [[ $delay != 0 && $delay != 0us && $delay != 0ms ]]; then
    echo "netrig: $ns/$dev: tbf rate $rate; this kernel has no sch_netem, so the $delay delay is" \
      "not emulated (latency stays that of a veth, ~10 us)"
  else
    echo "netrig: $ns/$dev: tbf rate $rate"
  fi
}

up() {
  local rate=1gbit delay=100us
  while [[ $# -gt 0 ]]; do
    case $1 in
    --rate) rate=${2:?--rate needs a value like 1gbit}; shift 2 ;;
    --rate=*) rate=${1#*=}; shift ;;
    --delay) delay=${2:?--delay needs a value like 100us}; shift 2 ;;
    --delay=*) delay=${1#*=}; shift ;;
    *) die "unknown option '$1' (up takes --rate R and --delay D)" ;;
    esac
  done
  [[ $rate =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$ ]] || die "--rate: expected e.g. 1gbit or 500mbit, got '$rate'"
  [[ $delay =~ ^[0-9]+(\.[0-9]+)?(us|ms|s)?$ ]] || die "--delay: expected e.g. 100us or 1ms, got '$delay'"
  down
  trap 'down' ERR
  ip netns add "$NS_A"
  ip netns add "$NS_B"
  ip link add "$DEV_A" type veth peer name "$DEV_B"
  ip link set "$DEV_A" netns "$NS_A"
  ip link set "$DEV_B" netns "$NS_B"
  ip -n "$NS_A" addr add "$ADDR_A/24" dev "$DEV_A"
  ip -n "$NS_B" addr add "$ADDR_B/24" dev "$DEV_B"
  local ns
  for ns in "$NS_A" "$NS_B"; do
    ip -n "$ns" link set lo up
  done
  ip -n "$NS_A" link set "$DEV_A" up
  ip -n "$NS_B" link set "$DEV_B" up
  shape "$NS_A" "$DEV_A" "$rate" "$delay"
  shape "$NS_B" "$DEV_B" "$rate" "$delay"
  trap - ERR
  # Reachability without ping: a connect to a closed port of b must be refused (not time out).
  # The veth's carrier may take a moment to come up: try for up to 5 s.
  local try
  for try in 1 2 3 4 5 6 7 8 9 10; do
    local answer
    answer=$(ip netns exec "$NS_A" timeout 2 bash -c "exec 3<>/dev/tcp/$ADDR_B/9" 2>&1 || true)
    [[ $answer != *refused* ]] || break
    [[ $try -lt 10 ]] || { down; die "the two namespaces cannot reach each other"; }
    sleep 0.5
  done
  echo "netrig: up: $NS_A ($ADDR_A) <-> $NS_B ($ADDR_B)"
}

cmd=${1:-}
[[ -n $cmd ]] || die "usage: netrig.sh up [--rate R] [--delay D] | down | status | exec a|b CMD..."
shift
need_root
case $cmd in
up) up "$@" ;;
down) down; echo "netrig: down" ;;
status)
  for pair in "$NS_A:$DEV_A" "$NS_B:$DEV_B"; do
    ns=${pair%%:*} dev=${pair#*:}
    if ip netns list | grep -qw "^$ns"; then
      echo "$ns: $(ip -n "$ns" -br addr show "$dev" 2>/dev/null)"
      ip netns exec "$ns" tc qdisc show dev "$dev"
    else
      echo "$ns: absent"
    fi
  done
  ;;
exec)
  side=${1:-}
  shift || true
  case $side in
  a) ns=$NS_A ;;
  b) ns=$NS_B ;;
  *) die "exec: expected a or b, got '$side'" ;;
  esac
  [[ $# -gt 0 ]] || die "exec $side: expected a command"
  ip netns list | grep -qw "^$ns" || die "the rig is down (run: deploy/netrig.sh up)"
  exec ip netns exec "$ns" "$@"
  ;;
*) die "unknown command '$cmd' (up, down, status, exec)" ;;
esac
