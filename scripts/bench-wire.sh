#!/usr/bin/env bash
# RoCEv2 across a veth (issue 35's targets), every figure against a baseline measured
# in the same run on the same veth: two hosts from scripts/wire-ns.sh (nothing shared
# but the veth), then
#   - TCP stream throughput (iperf3, 5 s) vs ib_write_bw / ib_read_bw 64 KiB, pinned
#     and NP-RDMA;
#   - UDP ping-pong round trip (qperf udp_lat, 1 B) vs ib_read_lat 2 B, pinned and
#     NP-RDMA;
#   - ib_write_bw 64 KiB at 1 % loss (the transport's fault injector) vs lossless.
# Needs root, perftest, qperf, iperf3. Usage: sudo bash scripts/bench-wire.sh
set -euo pipefail
cd "$(dirname "$0")/.."
W=scripts/wire-ns.sh
P=nprwb
read -r A4 B4 _ _ < <(bash $W up $P)
trap 'bash $W down $P' EXIT
cargo build --release -q -p verbs-shim
SO=$PWD/target/release/libnprdma.so
N=${N:-2000}

on() { local h=$1; shift; bash $W run "$P-$h" env "$@"; }

# perftest between the hosts: prints the client's result row.
pt() {
  local mode=$1 tool=$2; shift 2
  on b LD_PRELOAD="$SO" NPRDMA_MODE="$mode" "$tool" -x 1 -p 7900 "$@" >/dev/null 2>&1 &
  local s=$!
  sleep 1
  on a LD_PRELOAD="$SO" NPRDMA_MODE="$mode" "$tool" -x 1 -p 7900 "$@" "$B4" 2>/dev/null |
    awk '$1 ~ /^[0-9]+$/ && NF >= 4 { print; exit }'
  wait $s 2>/dev/null || true
}

echo "== TCP stream (iperf3 -t 5) on the veth"
on b iperf3 -s -1 -p 7901 >/dev/null 2>&1 &
sleep 0.5
tcp=$(on a iperf3 -c "$B4" -p 7901 -t 5 -J | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/8e6)')
wait || true
printf 'iperf3 TCP: %.0f MB/s\n' "$tcp"

echo "== UDP ping-pong (qperf udp_lat, 1 B)"
on b qperf -lp 7902 >/dev/null 2>&1 &
sleep 0.5
on a qperf -lp 7902 -t 3 "$B4" udp_lat conf | sed -n 's/^ *latency *= */udp_lat: /p'
pkill -f "qperf -lp 7902" || true

for mode in pinned nprdma; do
  echo "== $mode"
  echo "ib_write_bw 64K: $(pt $mode ib_write_bw -s 65536 -n "$N")"
  echo "ib_read_bw  64K: $(pt $mode ib_read_bw -s 65536 -n "$N")"
  echo "ib_read_lat  2B: $(pt $mode ib_read_lat -s 2 -n "$N")"
done
echo "== pinned ib_write_bw 64K at 1% loss (NPRDMA_WIRE_FAULTS=drop=0.01)"
echo "lossy: $(NPRDMA_WIRE_FAULTS=drop=0.01,seed=1 pt pinned ib_write_bw -s 65536 -n "$N")"
echo "(columns: perftest's #bytes #iterations then BW peak/avg MB/s, or latency min/max/typical/avg us)"
