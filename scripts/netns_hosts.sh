#!/usr/bin/env bash
# Test hosts on this machine: N Linux network namespaces joined by veth pairs to one bridge, each with an address
# from a private test range that exists only inside them, and optionally an egress rate limit (tc tbf) per host.
#
#   scripts/netns_hosts.sh up N [RATE] [PREFIX]   create PREFIX1..PREFIXN (RATE like 2gbit; none: unlimited)
#   scripts/netns_hosts.sh down [PREFIX]          remove them (and the bridge); safe to run twice
#   scripts/netns_hosts.sh link PREFIXk up|down   bring host k's link up or down (a partition)
#   scripts/netns_hosts.sh check                  exit 0 if this machine can make the hosts, else 77 with the reason
#
# NETNS_MTU=9000 in the environment of `up` sets the links' MTU (default 1500): fewer header bytes per payload byte.
#
# Host k is namespace PREFIXk with address 10.77.0.k/24 on its interface eth0; the bridge lives in its own
# namespace PREFIX0, so nothing is added to the machine's own network. Needs root (CAP_NET_ADMIN); without it,
# it says so and exits 77 (the tests skip then).
set -euo pipefail

PREFIX_DEFAULT=refit-h
SUBNET=10.77.0

die() { echo "netns_hosts: $*" >&2; exit 1; }

need_rights() {
    if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
        echo "netns_hosts: needs iproute2 (ip and tc) on PATH" >&2
        exit 77
    fi
    if ! ip netns add refit-probe-$$ 2>/dev/null; then
        echo "netns_hosts: cannot create network namespaces here (needs root / CAP_NET_ADMIN)" >&2
        exit 77
    fi
    ip netns del refit-probe-$$
}

up() {
    local n=$1 rate=${2:-none} prefix=${3:-$PREFIX_DEFAULT}
    [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 50 ]] || die "N must be 1..50, got '$n'"
    need_rights
    down "$prefix" >/dev/null 2>&1 || true
    trap 'down "$prefix" >/dev/null 2>&1' ERR
    ip netns add "${prefix}0"
    ip -n "${prefix}0" link add br0 type bridge
    ip -n "${prefix}0" link set br0 up
    for k in $(seq 1 "$n"); do
        local ns="${prefix}${k}"
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip link add "rh${k}-$$" type veth peer name "rb${k}-$$"
        ip link set "rh${k}-$$" netns "$ns"
        ip link set "rb${k}-$$" netns "${prefix}0"
        ip -n "$ns" link set "rh${k}-$$" name eth0
        ip -n "${prefix}0" link set "rb${k}-$$" name "p${k}"
        ip -n "${prefix}0" link set "p${k}" master br0 up
        ip -n "$ns" addr add "${SUBNET}.${k}/24" dev eth0
        if [[ -n ${NETNS_MTU:-} ]]; then
            ip -n "$ns" link set eth0 mtu "$NETNS_MTU"
            ip -n "${prefix}0" link set "p${k}" mtu "$NETNS_MTU"
        fi
        ip -n "$ns" link set eth0 up
        if [[ $rate != none ]]; then
            # Egress shaping: the host's own sends are limited to RATE (burst a few ms' worth).
            ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 4mb latency 50ms
        fi
    done
    trap - ERR
    echo "netns_hosts: ${n} host(s) ${prefix}1..${prefix}${n} at ${SUBNET}.1..${SUBNET}.${n}, rate ${rate}"
}

down() {
    local prefix=${1:-$PREFIX_DEFAULT}
    local found=0
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^${prefix}[0-9]+$" || true); do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns"
        found=1
    done
    [[ $found == 1 ]] && echo "netns_hosts: removed ${prefix}*" || true
}

link() {
    local ns=$1 state=$2
    [[ $state == up || $state == down ]] || die "link state must be up or down"
    ip -n "$ns" link set eth0 "$state"
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) shift; down "$@" ;;
    link) shift; link "$@" ;;
    check) need_rights ;;
    *) echo "usage: $0 up N [RATE] [PREFIX] | down [PREFIX] | link NS up|down | check" >&2; exit 2 ;;
esac
