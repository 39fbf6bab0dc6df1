#!/usr/bin/env bash
# Two hosts on one machine for the RoCEv2 transport (issue 35): network namespaces
# joined by a veth pair, and each command run in its own PID and mount namespaces
# with a private /dev/shm and /proc, so the two processes share nothing but the veth
# (no segment directory, no /proc/<pid>/fd of the other).
#
#   scripts/wire-ns.sh up [PREFIX]          create PREFIX-a (10.77.x.1, fd77::1) and PREFIX-b (.2 / ::2)
#   scripts/wire-ns.sh run PREFIX-a CMD...  run CMD on host a (private /dev/shm, /proc, PIDs)
#   scripts/wire-ns.sh down [PREFIX]        remove them
#   scripts/wire-ns.sh link PREFIX up|down  take the veth down or up (link failure)
#
# Needs root (ip netns, unshare). PREFIX defaults to "nprw"; the third octet of the
# IPv4 subnet is derived from it so parallel test runs can use distinct prefixes.
set -euo pipefail

cmd=${1:?usage: wire-ns.sh up|down|run|link ...}
shift || true

octet() { printf '%d' $(( $(printf '%s' "$1" | cksum | cut -d' ' -f1) % 200 + 20 )); }

case "$cmd" in
up)
    p=${1:-nprw}
    o=$(octet "$p")
    for h in a b; do
        ip netns del "$p-$h" 2>/dev/null || true
        ip netns add "$p-$h"
        ip -n "$p-$h" link set lo up
    done
    ip link add "$p-va" netns "$p-a" type veth peer name "$p-vb" netns "$p-b"
    ip -n "$p-a" addr add "10.77.$o.1/24" dev "$p-va"
    ip -n "$p-b" addr add "10.77.$o.2/24" dev "$p-vb"
    ip -n "$p-a" addr add "fd77:$o::1/64" dev "$p-va" nodad
    ip -n "$p-b" addr add "fd77:$o::2/64" dev "$p-vb" nodad
    ip -n "$p-a" link set "$p-va" up
    ip -n "$p-b" link set "$p-vb" up
    # Static neighbours: no ARP / neighbour discovery to wait for (IPv6's needs the
    # link-local addresses, tentative for a second or two after the link comes up).
    ma=$(ip -n "$p-a" -o link show "$p-va" | sed -n 's/.*link\/ether \([0-9a-f:]*\).*/\1/p')
    mb=$(ip -n "$p-b" -o link show "$p-vb" | sed -n 's/.*link\/ether \([0-9a-f:]*\).*/\1/p')
    ip -n "$p-a" neigh replace "10.77.$o.2" lladdr "$mb" dev "$p-va" nud permanent
    ip -n "$p-b" neigh replace "10.77.$o.1" lladdr "$ma" dev "$p-vb" nud permanent
    ip -n "$p-a" neigh replace "fd77:$o::2" lladdr "$mb" dev "$p-va" nud permanent
    ip -n "$p-b" neigh replace "fd77:$o::1" lladdr "$ma" dev "$p-vb" nud permanent
    echo "10.77.$o.1 10.77.$o.2 fd77:$o::1 fd77:$o::2"
    ;;
down)
    p=${1:-nprw}
    ip netns del "$p-a" 2>/dev/null || true
    ip netns del "$p-b" 2>/dev/null || true
    ;;
link)
    p=${1:?prefix}
    ip -n "$p-a" link set "$p-va" "${2:?up|down}"
    ;;
run)
    ns=${1:?namespace}
    shift
    exec ip netns exec "$ns" unshare --mount --pid --fork --kill-child --mount-proc \
        sh -c 'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"' wire-ns "$@"
    ;;
*)
    echo "wire-ns.sh: unknown command $cmd" >&2
    exit 2
    ;;
esac
