#!/usr/bin/env bash
# A multi-host test bed on one machine: N "hosts" as Linux network namespaces, each joined to a bridge (in a
# switch namespace of its own) by a veth link shaped with tc, and Horovod jobs started across them through the
# real multi-host launch path (mpirun with a host list; the remote shell is `ip netns exec` instead of ssh).
# Nothing outside the namespaces this script creates (and, with --gloo, their /etc/netns/NS files) is touched; only
# their private addresses are used.
#
#   scripts/testbed.sh up N [--rate 1gbit] [--delay 0.2ms]   create hosts topk-h1..N (10.77.0.1..N) and shape
#   scripts/testbed.sh run N [--rate R] [--delay D] [--gloo] -- CMD...
#                                                   up, run CMD on N workers (1 per host), down; mpirun starts
#                                                   them (Horovod over MPI) or, with --gloo, scripts/testbed_gloo.py
#                                                   (Horovod over Gloo, as horovodrun --gloo starts it)
#   scripts/testbed.sh bytes N                                  bytes each host's link sent and received so far
#   scripts/testbed.sh down                                     remove everything this script created
#
# Shaping: --rate with tbf on each host's link (both directions), --delay with netem when the kernel has it
# (the script says so when it does not). Needs root and iproute2.
#
# What it cannot give: a core per worker. N workers share this machine's cores, and OpenMPI polls while a collective
# waits, so each collective that runs alone costs far more than between real hosts (a one-float hvd.allreduce across
# 4 hosts, idle: median 30 ms; with OMPI_MCA_mpi_yield_when_idle=1 in the environment, which mpirun hands to every
# rank: 12 ms; Gloo between 4 processes on localhost: 1.75 ms). Methods that wait for more collectives in a row pay
# for it here more than on a cluster. With --gloo nothing polls: a one-float allreduce across 4 hosts took 18.5 ms
# and 3.5 MiB at 100 Mbit/s 456 ms, against 772 ms over MPI (benchmarks/bench_collectives.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX=topk
SUBNET=10.77.0
SWITCH=${PREFIX}-sw

die() { echo "testbed: $*" >&2; exit 2; }
log() { echo "testbed: $*" >&2; }

check() {
  [[ $(id -u) -eq 0 ]] || die "needs root (network namespaces); run as root or with sudo"
  command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (ip, tc): apt-get install iproute2"
}

down() {
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-(h[0-9]+|sw)$" || true); do
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
}

shape() {  # shape DEV-IN-NAMESPACE NS RATE DELAY
  local ns=$1 dev=$2 rate=$3 delay=$4
  if [[ -n "$delay" ]]; then
    if ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "$delay" ${rate:+rate "$rate"} 2>/dev/null; then
      return
    fi
    [[ -n "${WARNED_NETEM:-}" ]] || log "this kernel has no netem qdisc: --delay $delay cannot be emulated here; shaping bandwidth only"
    WARNED_NETEM=1
  fi
  if [[ -n "$rate" ]]; then
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" burst 256kb latency 400ms
  fi
}

up() {
  local n=$1 rate=$2 delay=$3
  down
  ip netns add "$SWITCH"
  ip -n "$SWITCH" link add br0 type bridge
  ip -n "$SWITCH" link set br0 up
  for i in $(seq 1 "$n"); do
    local ns=${PREFIX}-h$i
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "${PREFIX}h${i}a" netns "$ns" type veth peer name "h${i}" netns "$SWITCH"
    ip -n "$ns" link set "${PREFIX}h${i}a" name eth0
    ip -n "$ns" addr add "$SUBNET.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$SWITCH" link set "h${i}" master br0
    ip -n "$SWITCH" link set "h${i}" up
    shape "$ns" eth0 "$rate" "$delay"          # what the host sends
    shape "$SWITCH" "h${i}" "$rate" "$delay"   # what the host receives
  done
  log "up: $n hosts ${SUBNET}.1-$n, rate ${rate:-unlimited}, delay ${delay:-none}${WARNED_NETEM:+ (not emulated)}"
}

bytes() {
  local n=$1
  for i in $(seq 1 "$n"); do
    local tx rx
    tx=$(ip netns exec ${PREFIX}-h$i cat /sys/class/net/eth0/statistics/tx_bytes)
    rx=$(ip netns exec ${PREFIX}-h$i cat /sys/class/net/eth0/statistics/rx_bytes)
    echo "host$i tx_bytes=$tx rx_bytes=$rx"
  done
}

launch_gloo() {  # launch_gloo N CMD...: Horovod over Gloo, started as horovodrun --gloo does (scripts/testbed_gloo.py)
  local n=$1; shift
  # Horovod 0.28.1 opens its process sets' Gloo contexts on the address the hostname resolves to, not on
  # HOROVOD_GLOO_IFACE's; the namespaces share this machine's hostname (127.0.0.1 in /etc/hosts), so each host gets
  # an /etc/hosts of its own (ip netns exec mounts /etc/netns/NS/hosts over /etc/hosts), as real hosts have.
  local i
  for i in $(seq 1 "$n"); do
    mkdir -p "/etc/netns/${PREFIX}-h$i"
    printf '127.0.0.1 localhost\n%s %s\n' "$SUBNET.$i" "$(hostname)" >"/etc/netns/${PREFIX}-h$i/hosts"
  done
  ip netns exec ${PREFIX}-h1 env PATH="$PATH" python "$ROOT/scripts/testbed_gloo.py" "$n" "$PREFIX" "$SUBNET" -- "$@"
}

launch_mpi() {  # launch_mpi N CMD...: Horovod over MPI, started by mpirun with a host list
  local n=$1; shift
  local hosts=""
  for i in $(seq 1 "$n"); do hosts+="${hosts:+,}$SUBNET.$i:1"; done
  # mpirun's remote shell: "agent HOST CMD..." runs CMD inside that host's namespace (instead of ssh HOST CMD).
  AGENT=$(mktemp /tmp/topk-testbed-agent.XXXXXX)
  # The namespaces share one file system and one hostname, so every host's orted would build the same OpenMPI
  # session directory (<tmpdir>/ompi.<hostname>.<uid>/pid.<mpirun pid>/...) and the ones that lose the race
  # abort with "ORTE_ERROR_LOG ... session_dir.c ... File exists". Each host's orted (and the ranks it
  # starts) gets a tmpdir of its own, as real hosts have; mpirun keeps the default one. (Set through the
  # environment, not mpirun's --mca, which mpirun would forward to every orted alike.)
  SESSIONS=$(mktemp -d /tmp/topk-testbed-sessions.XXXXXX)
  cat >"$AGENT" <<AGENT
#!/usr/bin/env bash
while [[ "\$1" == -* ]]; do shift; done   # ssh-style options mpirun may pass
host=\${1##*.}; shift
mkdir -p "$SESSIONS/h\$host"
exec ip netns exec ${PREFIX}-h\$host env PATH="\$PATH" OMPI_MCA_orte_tmpdir_base="$SESSIONS/h\$host" \\
  TMPDIR="$SESSIONS/h\$host" sh -c "\$*"
AGENT
  chmod +x "$AGENT"
  trap 'rm -f "$AGENT"; rm -rf "$SESSIONS"; down' EXIT
  # A caller that is itself an MPI process (e.g. after a single-rank hvd.init()) leaks PMIx/OpenMPI variables
  # that would make this mpirun think it is nested in that job.
  local var
  for var in $(compgen -e | grep -E '^(PMIX_|OMPI_|OPAL_|PRTE_)' | grep -v '^OMPI_ALLOW_RUN_AS_ROOT'); do unset "$var"; done
  ip netns exec ${PREFIX}-h1 env PATH="$PATH" mpirun --allow-run-as-root --tag-output -np "$n" -H "$hosts" \
    --mca plm_rsh_agent "$AGENT" --mca oob_tcp_if_include eth0 --mca btl_tcp_if_include eth0 \
    --mca btl self,tcp --bind-to none \
    -x PATH -x VIRTUAL_ENV -x OMP_NUM_THREADS -x TF_USE_LEGACY_KERAS \
    -x HOROVOD_GLOO_IFACE=eth0 -x HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=120 \
    "$@"
}

run() {
  local n=$1 rate=$2 delay=$3 gloo=$4; shift 4
  trap down EXIT
  up "$n" "$rate" "$delay"
  local status=0
  if [[ -n "$gloo" ]]; then launch_gloo "$n" "$@" || status=$?; else launch_mpi "$n" "$@" || status=$?; fi
  bytes "$n"
  return $status
}

parse_shaping() {  # sets RATE DELAY GLOO REST from "--rate R --delay D --gloo [-- ...]"
  RATE=""; DELAY=""; GLOO=""; REST=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --rate) RATE=$2; shift 2 ;;
      --gloo) GLOO=1; shift ;;
      --delay) DELAY=$2; shift 2 ;;
      --) shift; REST=("$@"); return ;;
      *) die "unknown option $1" ;;
    esac
  done
}

cmd=${1:-}; shift || true
case "$cmd" in
  up) check; n=${1:?N}; shift; parse_shaping "$@"; up "$n" "$RATE" "$DELAY" ;;
  run) check; n=${1:?N}; shift; parse_shaping "$@"; [[ ${#REST[@]} -gt 0 ]] || die "run N [...] -- CMD"
       source "$ROOT/scripts/env.sh"; run "$n" "$RATE" "$DELAY" "$GLOO" "${REST[@]}" ;;
  bytes) check; bytes "${1:?N}" ;;
  down) check; down ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
