#!/usr/bin/env bash
# Runs the libibverbs backend's tests (crates/ibverbs-nic: the nic contract and the NP-RDMA
# engine in user-space mode) over a Soft-RoCE (rxe) device instead of libnprdma.so.
#
# Needs root, a kernel with the rdma_rxe module (or RXE_KO=path/to/rdma_rxe.ko, e.g. built
# out of tree as .github/workflows/rxe.yml does on GitHub's runners, whose kernels lack
# it), iproute2's `rdma` tool and rdma-core's libibverbs1 + ibverbs-providers (the rxe
# provider). It cannot run on the project's build machine (no RDMA kernel modules).
#
#   sudo bash scripts/rxe-test.sh [netdev]      # default: the first UP non-loopback netdev
#
# The rxe device is created as in rdma-core's Documentation/rxe.md
# (`rdma link add <name> type rxe netdev <netdev>`) and deleted again on exit if this
# script created it. Then unmodified perftest and ibv_rc_pingpong (server + client on this
# host) run through libnprdma.so in NP-RDMA user-space mode over the device
# (NPRDMA_MODE=nprdma NPRDMA_DEVICE=verbs, the real libibverbs.so.1 as the next library;
# RXE_GID_INDEX picks the device GID the programs see, default 1: rxe's RoCE v2 entry).
set -euo pipefail
cd "$(dirname "$0")/.."

NAME=${RXE_NAME:-rxe_nprdma}
NETDEV=${1:-$(ip -o link show up | awk -F': ' '$2 != "lo" { sub(/@.*/, "", $2); print $2; exit }')}
[ -n "$NETDEV" ] || { echo "no UP netdev for rxe" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "run as root (rdma link add, RLIMIT_MEMLOCK)" >&2; exit 1; }
command -v rdma >/dev/null || { echo "iproute2's rdma tool is missing" >&2; exit 1; }

# A Mellanox HCA's driver beside rxe confuses device selection (rdma-core's rxe.md).
if lsmod | grep -q '^mlx5_ib'; then rmmod mlx5_ib || true; fi
if ! lsmod | grep -q '^rdma_rxe'; then
  if [ -n "${RXE_KO:-}" ]; then insmod "$RXE_KO"; else modprobe rdma_rxe; fi
fi

created=0
if ! rdma link show "$NAME/1" >/dev/null 2>&1; then
  rdma link add "$NAME" type rxe netdev "$NETDEV"
  created=1
fi
cleanup() { [ "$created" -eq 1 ] && rdma link delete "$NAME" || true; }
trap cleanup EXIT

for _ in $(seq 1 50); do
  rdma link show "$NAME/1" | grep -q 'state ACTIVE' && break
  sleep 0.2
done
rdma link show "$NAME/1"

# Registrations pin memory on a real device: lift the limit for the test run.
ulimit -l unlimited

export NPRDMA_TEST_VERBS_LIB=${NPRDMA_TEST_VERBS_LIB:-libibverbs.so.1}
export NPRDMA_VERBS_DEVICE=$NAME
echo "== cargo test -p ibverbs-nic over $NAME ($NETDEV) with $NPRDMA_TEST_VERBS_LIB"
cargo test -p ibverbs-nic --locked -- --test-threads 1

# libnprdma.so in NP-RDMA user-space mode over the rxe device: unmodified programs, whose
# memory is not pinned (only the engine's on-the-fly and cached registrations are).
cargo build -p verbs-shim --locked
CHAIN=(env LD_PRELOAD="$PWD/target/debug/libnprdma.so" NPRDMA_MODE=nprdma NPRDMA_DEVICE=verbs
  NPRDMA_VERBS_LIB=libibverbs.so.1 NPRDMA_VERBS_DEVICE="$NAME"
  NPRDMA_VERBS_GID_INDEX="${RXE_GID_INDEX:-1}" NPRDMA_STATS=1)
port=18700
LOGS=$(mktemp -d)
trap 'cleanup; rm -rf "$LOGS"' EXIT
# A program that is not installed: skipped by hand, a failure in CI (CI=true or
# NPRDMA_REQUIRE_ALL=1, as for the cargo tests: crates/test-support/src/skip.rs).
skipped=()
missing() { # program, package
  if [ "${CI:-}" = true ] || [ "${NPRDMA_REQUIRE_ALL:-}" = 1 ]; then
    echo "FAIL: $1 is not installed ($2)" >&2; exit 1
  fi
  echo "SKIP: $1 is not installed ($2)"; skipped+=("$1")
}
# Counter $2 of a `nprdma-stats: key=value ...` line $1 (empty when absent).
counter() { sed -n "s/.* $2=\([0-9][0-9]*\).*/\1/p" <<<"$1"; }
# One side's output: the data check passed (ibv_*_pingpong print "invalid data" on
# stdout and exit 0 all the same), and NP-RDMA ran: its stats line is there (printed
# at exit by libnprdma.so under NPRDMA_STATS=1 — absent when the library did not
# preload and the program ran on rxe directly), in user-space mode over the device,
# with NP-RDMA operations counted.
check_side() { # log, who
  local log=$1 who=$2 line ops
  if grep -q "invalid data" "$log"; then
    echo "FAIL: $who: the data check failed" >&2; return 1
  fi
  line=$(grep -o 'nprdma-stats: .*' "$log" | tail -1)
  if [ -z "$line" ]; then
    echo "FAIL: $who: no nprdma-stats line (libnprdma.so did not run)" >&2; return 1
  fi
  if [ "$(sed -n 's/^nprdma-stats: mode=\([^ ]*\).*/\1/p' <<<"$line")" != nprdma-verbs ]; then
    echo "FAIL: $who: not NP-RDMA's user-space mode: $line" >&2; return 1
  fi
  # Operations the engine carried: optimistic one-sided (none in user-space mode),
  # two-sided, one-sided under a lease, and requests served for the peer.
  ops=0
  for k in optimistic_ok two_sided leased_ops served; do
    ops=$(( ops + $(counter "$line" "$k" | grep . || echo 0) ))
  done
  if [ "$ops" -eq 0 ]; then
    echo "FAIL: $who: no NP-RDMA operation counted: $line" >&2; return 1
  fi
  echo "$who: $ops NP-RDMA operations ($line)"
}
pair() { # program, arguments of both sides (the client adds the server's address)
  local prog=$1; shift
  port=$((port + 1))
  local slog="$LOGS/$prog.$port.server" clog="$LOGS/$prog.$port.client" src=0 crc=0
  "${CHAIN[@]}" timeout 120 "$prog" -p "$port" "$@" >"$slog" 2>&1 &
  local server=$!
  sleep 1
  "${CHAIN[@]}" timeout 120 "$prog" -p "$port" "$@" 127.0.0.1 >"$clog" 2>&1 || crc=$?
  wait "$server" || src=$?
  echo "---- $prog server (exit $src)"; cat "$slog"
  echo "---- $prog client (exit $crc)"; cat "$clog"
  if [ "$src" -ne 0 ] || [ "$crc" -ne 0 ]; then
    echo "FAIL: $prog: server exit $src, client exit $crc" >&2; exit 1
  fi
  check_side "$slog" "$prog server" || exit 1
  check_side "$clog" "$prog client" || exit 1
}
for t in ib_write_bw ib_read_bw ib_write_lat ib_read_lat ib_send_lat ib_atomic_lat; do
  if ! command -v "$t" >/dev/null; then missing "$t" perftest; continue; fi
  size=65536; [ "$t" = ib_atomic_lat ] && size=8
  echo "== $t through libnprdma.so (NP-RDMA user-space mode) over $NAME"
  pair "$t" -n 200 -s "$size"
done
if command -v ibv_rc_pingpong >/dev/null; then
  echo "== ibv_rc_pingpong (data check) through libnprdma.so over $NAME"
  pair ibv_rc_pingpong -g 0 -n 200 -s 4096 -c
  for side in server client; do
    grep -q "200 iters in" "$LOGS/ibv_rc_pingpong.$port.$side" ||
      { echo "FAIL: ibv_rc_pingpong $side: not 200 iterations" >&2; exit 1; }
  done
else
  missing ibv_rc_pingpong ibverbs-utils
fi
if [ ${#skipped[@]} -gt 0 ]; then
  echo "rxe-test: ${#skipped[@]} skipped: ${skipped[*]}"
fi
