#!/usr/bin/env bash
# UCX and MPI benchmarks of libnprdma.so (issue 34), pinned vs NP-RDMA in the same run,
# alternated over ROUNDS rounds (the machine's cross-core latency flips within seconds),
# the cross-core round trip printed before and after (two-process figures depend on it):
#  1. ucx_perftest over rc_verbs: UCT put_bw and get (zero-copy, 64 KiB, MB/s) and UCP
#     tag_lat (8 B, median µs); the median over rounds of each mode and NP/pinned.
#  2. Open MPI over UCX (rc_verbs): ping-pong latency at 4 KiB and 1 MiB
#     (tests/mpi/latency.c: median one-way time), pinned and NP-RDMA alternated; and
#     each rank's peak resident memory (VmHWM) in
#     tests/mpi/collectives.c (four 32 MiB buffers per rank, mostly never touched),
#     pinned, NP-RDMA, and NP-RDMA with a 16 MiB budget.
# Usage: scripts/bench-ucx.sh (after cargo build --release -p verbs-shim -p nprdma-cli;
# needs ucx-utils, openmpi-bin, libopenmpi-dev).
set -uo pipefail
cd "$(dirname "$0")/.."
L=$PWD/target/release/libnprdma.so
ROUNDS=${ROUNDS:-5}
port=24000
echo "before: $(target/release/nprdma machine)"

# One ucx_perftest pair: prints the client's Final line.
perf() { # mode test args...
  local m=$1 t=$2; shift 2
  port=$((port + 1))
  local uct=()
  case $t in put_bw|get) uct=(-x rc_verbs -d nprdma0:1) ;; esac
  LD_PRELOAD=$L NPRDMA_MODE=$m UCX_TLS=rc_v,self timeout 60 ucx_perftest -p $port "${uct[@]}" >/dev/null 2>&1 &
  local srv=$!
  sleep 0.4
  LD_PRELOAD=$L NPRDMA_MODE=$m UCX_TLS=rc_v,self timeout 60 ucx_perftest -p $port "${uct[@]}" \
    127.0.0.1 -t "$t" "$@" 2>/dev/null | grep Final
  wait $srv 2>/dev/null
}

median() { sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

declare -A got=()
for round in $(seq 1 "$ROUNDS"); do
  for m in pinned nprdma; do
    # Final: iters 50%ile average overall bw-average bw-overall ...
    got[$m.tag_lat]+="$(perf $m tag_lat -n 20000 -s 8 | awk '{print $3}') "
    got[$m.put_bw]+="$(perf $m put_bw -n 3000 -s 65536 -D zcopy | awk '{print $7}') "
    got[$m.get]+="$(perf $m get -n 3000 -s 65536 -D zcopy | awk '{print $7}') "
  done
done
for t in tag_lat put_bw get; do
  p=$(echo ${got[pinned.$t]} | tr ' ' '\n' | median)
  n=$(echo ${got[nprdma.$t]} | tr ' ' '\n' | median)
  unit=MB/s; [ $t = tag_lat ] && unit=us
  echo "$t: pinned $p $unit, NP-RDMA $n $unit, NP/pinned $(echo "scale=2; $n / $p" | bc) (medians of $ROUNDS; pinned rounds: ${got[pinned.$t]}; NP: ${got[nprdma.$t]})"
done

dir=$(mktemp -d)
mpicc -O2 -o "$dir/latency" crates/verbs-shim/tests/mpi/latency.c
declare -A lat=()
for round in $(seq 1 "$ROUNDS"); do
  for m in pinned nprdma; do
    out=$(timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 --mca pml ucx \
      -x LD_PRELOAD=$L -x NPRDMA_MODE=$m -x UCX_TLS=rc_v,self "$dir/latency" 2>/dev/null)
    lat[$m.4k]+="$(echo "$out" | awk '/latency 4096 B/ {print $5}') "
    lat[$m.1m]+="$(echo "$out" | awk '/latency 1048576 B/ {print $5}') "
  done
done
for s in 4k 1m; do
  p=$(echo ${lat[pinned.$s]} | tr ' ' '\n' | median)
  n=$(echo ${lat[nprdma.$s]} | tr ' ' '\n' | median)
  echo "MPI ping-pong $s one-way: pinned $p us, NP-RDMA $n us, NP/pinned $(echo "scale=2; $n / $p" | bc) (medians of $ROUNDS; pinned: ${lat[pinned.$s]}; NP: ${lat[nprdma.$s]})"
done
exe=$dir/collectives
mpicc -O2 -o "$exe" crates/verbs-shim/tests/mpi/collectives.c
for run in "pinned" "nprdma" "nprdma NPRDMA_BUDGET_MB=16"; do
  set -- $run
  m=$1; extra=()
  [ $# -gt 1 ] && extra=(-x "$2")
  hwm=$(timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 --mca pml ucx \
    -x LD_PRELOAD=$L -x NPRDMA_MODE=$m -x UCX_TLS=rc_v,self "${extra[@]}" "$exe" 2>&1 |
    awk '/VmHWM/ {printf "%s%d MiB", sep, $4 / 1024; sep = ", "}')
  echo "MPI collectives ($run): peak resident per rank: $hwm"
done
echo "after: $(target/release/nprdma machine)"
