#!/usr/bin/env bash
# rdma_cm benchmarks of libnprdma.so (issue 33), both modes, one run of each, the
# machine's cross-core round trip printed before and after (two-process figures
# depend on it):
#  1. connection set-up, rdmacm-utils' cmtime: one connection per process, ROUNDS
#     times (its first connection: the device opens inside rdma_resolve_addr), and
#     CONNS connections at once from one process; resolve_addr -> ESTABLISHED per
#     connection = resolve addr + resolve route + create qp + connect.
#  2. the data path with and without rdma_cm: perftest -R vs the same test over its
#     own socket, in the same run (ib_write_lat / ib_read_lat 2 B typical µs,
#     ib_write_bw 64 KiB average MB/s).
# Usage: scripts/bench-cm.sh (after cargo build --release -p verbs-shim -p nprdma-cli).
set -uo pipefail
cd "$(dirname "$0")/.."
L=$PWD/target/release/libnprdma.so
ROUNDS=${ROUNDS:-20} CONNS=${CONNS:-100}
port=23000
next() { port=$((port + 1)); }
echo "before: $(target/release/nprdma machine)"
for m in pinned nprdma; do
  # cmtime's "us / conn" column per step; one connection per run.
  first=()
  for i in $(seq 1 "$ROUNDS"); do
    next
    # (cmtime's server runs until it is stopped.)
    LD_PRELOAD=$L NPRDMA_MODE=$m timeout 20 cmtime -p $port -c 1 >/dev/null 2>&1 &
    srv=$!
    sleep 0.3
    t=$(LD_PRELOAD=$L NPRDMA_MODE=$m timeout 20 cmtime -p $port -c 1 -s 127.0.0.1 2>/dev/null |
      awk '/resolve addr|resolve route|create qp|connect  *:/ {s += $NF} END {print s}')
    kill $srv 2>/dev/null; wait $srv 2>/dev/null
    first+=("$t")
  done
  sorted=$(printf '%s\n' "${first[@]}" | sort -n)
  med=$(echo "$sorted" | awk -v n="$ROUNDS" 'NR == int((n + 1) / 2)')
  p99=$(echo "$sorted" | tail -1)
  next
  LD_PRELOAD=$L NPRDMA_MODE=$m timeout 60 cmtime -p $port -c "$CONNS" >/dev/null 2>&1 &
  srv=$!
  sleep 0.3
  burst=$(LD_PRELOAD=$L NPRDMA_MODE=$m timeout 60 cmtime -p $port -c "$CONNS" -s 127.0.0.1 2>/dev/null |
    awk '/resolve addr|resolve route|create qp|connect  *:/ {s += $NF; if ($1 == "connect") mx = $4} END {printf "%.0f us/conn, connect max %s ms", s, mx}')
  kill $srv 2>/dev/null; wait $srv 2>/dev/null
  echo "$m: first connection of a process resolve_addr->ESTABLISHED median ${med} us, max of $ROUNDS ${p99} us; $CONNS at once: $burst"
  for t in ib_write_lat ib_read_lat ib_write_bw; do
    size=2; [ "$t" = ib_write_bw ] && size=65536
    declare -A got=()
    # Alternated, three rounds each (the machine's state flips within seconds).
    for round in 1 2 3; do
      for R in "" -R; do
        for try in 1 2 3 4 5 6; do
          next
          LD_PRELOAD=$L NPRDMA_MODE=$m timeout 30 $t $R -p $port -n 5000 -s $size >/dev/null 2>&1 &
          srv=$!
          sleep 0.4
          out=$(LD_PRELOAD=$L NPRDMA_MODE=$m timeout 30 $t $R -p $port -n 5000 -s $size 127.0.0.1 2>&1)
          sleep 0.2; kill $srv 2>/dev/null; wait $srv 2>/dev/null
          # perftest's own -R race (REJECTED 8): again.
          echo "$out" | grep -q "REJECTED; error: 8" || break
        done
        if [ "$t" = ib_write_bw ]; then
          v=$(echo "$out" | awk -v s=$size '$1 == s {print $4}')
        else
          v=$(echo "$out" | awk -v s=$size '$1 == s {print $5}')
        fi
        got[${R:-sock}]="${got[${R:-sock}]:-} ${v:-failed}"
      done
    done
    unit="us typical"; [ "$t" = ib_write_bw ] && unit="MB/s average"
    echo "$m: $t ($unit): own socket${got[sock]} | -R${got[-R]}"
    unset got
  done
done
echo "after: $(target/release/nprdma machine)"
