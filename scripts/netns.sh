#!/usr/bin/env bash
# Two network namespaces joined by a veth pair, for the tests that connect processes
# by the namespaces' own addresses (crates/verbs-shim/tests/netns.rs):
#   nprdma-a: veth nprdma-va, 10.77.0.1/24, fd77::1/64
#   nprdma-b: veth nprdma-vb, 10.77.0.2/24, fd77::2/64
# Usage: netns.sh up | down | check. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN); touches
# nothing outside the two namespaces it creates (and removes them on `down`).
set -euo pipefail
A=nprdma-a B=nprdma-b
case "${1:-}" in
  up)
    "$0" down >/dev/null 2>&1 || true
    ip netns add "$A"
    ip netns add "$B"
    ip link add nprdma-va netns "$A" type veth peer name nprdma-vb netns "$B"
    ip -n "$A" addr add 10.77.0.1/24 dev nprdma-va
    ip -n "$B" addr add 10.77.0.2/24 dev nprdma-vb
    ip -n "$A" addr add fd77::1/64 dev nprdma-va nodad
    ip -n "$B" addr add fd77::2/64 dev nprdma-vb nodad
    for n in "$A" "$B"; do
      ip -n "$n" link set lo up
    done
    ip -n "$A" link set nprdma-va up
    ip -n "$B" link set nprdma-vb up
    "$0" check
    ;;
  down)
    ip netns del "$A" 2>/dev/null || true
    ip netns del "$B" 2>/dev/null || true
    ;;
  check)
    # Each side routes to the other over the veth (the tests exchange data on it).
    ip -n "$A" route get 10.77.0.2 | grep -q nprdma-va
    ip -n "$B" route get 10.77.0.1 | grep -q nprdma-vb
    ;;
  *)
    echo "usage: $0 up|down|check" >&2
    exit 2
    ;;
esac
