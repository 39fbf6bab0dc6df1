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
pair() { # program, arguments of both sides (the client adds the server's address)
  local prog=$1; shift
  port=$((port + 1))
  "${CHAIN[@]}" timeout 120 "$prog" -p "$port" "$@" &
  local server=$!
  sleep 1
  "${CHAIN[@]}" timeout 120 "$prog" -p "$port" "$@" 127.0.0.1
  wait "$server"
}
for t in ib_write_bw ib_read_bw ib_write_lat ib_read_lat ib_send_lat ib_atomic_lat; do
  if ! command -v "$t" >/dev/null; then echo "SKIP: $t is not installed (perftest)"; continue; fi
  size=65536; [ "$t" = ib_atomic_lat ] && size=8
  echo "== $t through libnprdma.so (NP-RDMA user-space mode) over $NAME"
  pair "$t" -n 200 -s "$size"
done
if command -v ibv_rc_pingpong >/dev/null; then
  echo "== ibv_rc_pingpong (data check) through libnprdma.so over $NAME"
  pair ibv_rc_pingpong -g 0 -n 200 -s 4096 -c
else
  echo "SKIP: ibv_rc_pingpong is not installed (ibverbs-utils)"
fi
