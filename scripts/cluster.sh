#!/usr/bin/env bash
# A two-node Slurm cluster on this one machine, for tests/test_several_machines.py (root only).
#
#   scripts/cluster.sh up           # install slurm-wlm and munge if missing, start the cluster
#   scripts/cluster.sh exec CMD...  # run CMD on node1 (sbatch, srun, sinfo reach the cluster from there)
#   scripts/cluster.sh down         # stop everything, remove every namespace, interface and file
#
# Two network namespaces are the two hosts: each has its own hostname (node1, node2), its own
# /etc/hosts, and one end of a veth pair named cluster0 (10.213.0.1 and 10.213.0.2), so the nodes
# talk over a real network interface. Both see the host's filesystem: the repository is at the same
# path on both, as on a cluster's shared filesystem. `up` and `down` are idempotent, and `down`
# leaves nothing behind whatever state a failed `up` or test left. $STATE_DIR/node-local is the one
# folder the nodes do not share (a node's local disk), for the test of an unshared output folder.
set -Eeuo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
STATE_DIR=${CLUSTER_STATE_DIR:-/tmp/distributed-nlp-test-cluster}
NODES=(node1 node2)
declare -A ADDRESS=([node1]=10.213.0.1 [node2]=10.213.0.2)
INTERFACE=cluster0            # the veth end inside each namespace: GLOO_SOCKET_IFNAME=cluster0
NAMESPACE_PREFIX=suite-cluster-  # namespaces suite-cluster-node1 and suite-cluster-node2
SLURM_VERSION_NOTE="Debian 12's slurm-wlm 22.05"

die() { echo "error: $*" >&2; exit 2; }

require_root() {
    [[ $(id -u) == 0 ]] || die "scripts/cluster.sh needs root (network namespaces, daemons); run it with sudo"
}

install_packages() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return
    command -v apt-get >/dev/null || die "slurm-wlm and munge are missing and there is no apt-get to install them"
    echo "installing slurm-wlm and munge ($SLURM_VERSION_NOTE) with apt-get"
    # A fresh machine or container may have no package lists yet.
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null
}

# Run a command inside a node: its network namespace, plus a fresh UTS namespace (its hostname) and
# mount namespace (its own /etc/hosts, and its own node-local folder: $STATE_DIR/node-local holds
# different files on each node, like a node's local disk). Not `ip netns exec`: that remounts /sys,
# which hides the host's cgroup mounts, and slurmd then refuses to start.
on_node() {
    local node=$1; shift
    nsenter --net="/run/netns/$NAMESPACE_PREFIX$node" unshare --uts --mount sh -c \
        'hostname "$0" && mount --bind "$1/hosts" /etc/hosts && mount --bind "$1/$0-local" "$1/node-local" &&
         shift && exec "$@"' "$node" "$STATE_DIR" "$@"
}

create_network() {
    printf '127.0.0.1 localhost\n10.213.0.1 node1\n10.213.0.2 node2\n' >"$STATE_DIR/hosts"
    for node in "${NODES[@]}"; do
        ip netns add "$NAMESPACE_PREFIX$node"
        ip -n "$NAMESPACE_PREFIX$node" link set lo up
    done
    # Created in the host namespace under temporary names, then each end moved into its node.
    ip link add suite-veth1 type veth peer name suite-veth2
    for node in "${NODES[@]}"; do
        local end=suite-veth${node#node} namespace=$NAMESPACE_PREFIX$node
        ip link set "$end" netns "$namespace"
        ip -n "$namespace" link set "$end" name "$INTERFACE"
        ip -n "$namespace" addr add "${ADDRESS[$node]}/24" dev "$INTERFACE"
        ip -n "$namespace" link set "$INTERFACE" up
    done
}

start_daemons() {
    mkdir -p "$STATE_DIR/munge" "$STATE_DIR/slurmctld" "$STATE_DIR/node-local"
    for node in "${NODES[@]}"; do mkdir -p "$STATE_DIR/$node" "$STATE_DIR/$node-local"; done
    # slurmctld runs it as each job ends (slurm.conf's EpilogSlurmctld): $STATE_DIR/ended/<job id>.
    mkdir -p "$STATE_DIR/ended"
    printf '#!/bin/sh\ntouch "%s/ended/$SLURM_JOB_ID"\n' "$STATE_DIR" >"$STATE_DIR/job-ended.sh"
    chmod 755 "$STATE_DIR/job-ended.sh"
    # The cluster's own munge key: a job is only accepted from this cluster's own daemons.
    (umask 077 && head -c 1024 /dev/urandom >"$STATE_DIR/munge/munge.key")
    munged --force --socket="$STATE_DIR/munge/munge.socket" --key-file="$STATE_DIR/munge/munge.key" \
        --pid-file="$STATE_DIR/munge/munged.pid" --log-file="$STATE_DIR/munge/munged.log" \
        --seed-file="$STATE_DIR/munge/munged.seed"
    sed "s|@STATE_DIR@|$STATE_DIR|g" "$REPO/slurm/test-cluster/slurm.conf.in" >"$STATE_DIR/slurm.conf"
    on_node node1 env SLURM_CONF="$STATE_DIR/slurm.conf" slurmctld
    for node in "${NODES[@]}"; do
        on_node "$node" env SLURM_CONF="$STATE_DIR/slurm.conf" slurmd -N "$node"
    done
}

wait_until_idle() {
    for _ in $(seq 60); do
        if [[ $(run_on_node1 sinfo --noheader --states=idle --format=%D 2>/dev/null) == 2 ]]; then
            echo "cluster up: node1 ${ADDRESS[node1]}, node2 ${ADDRESS[node2]} on $INTERFACE, state in $STATE_DIR"
            return
        fi
        sleep 1
    done
    die "the two nodes did not come up idle within 60 s: see the logs under $STATE_DIR"
}

# Commands for the cluster run on node1, inside slurmctld's namespaces, in the caller's folder.
run_on_node1() {
    local pid
    pid=$(cat "$STATE_DIR/slurmctld/slurmctld.pid" 2>/dev/null) || die "the cluster is not up: scripts/cluster.sh up"
    nsenter -t "$pid" --net --uts --mount env SLURM_CONF="$STATE_DIR/slurm.conf" \
        sh -c 'cd "$0" && exec "$@"' "$PWD" "$@"
}

stop_pid_file() {
    local pid
    [[ -f $1 ]] && pid=$(cat "$1") && kill "$pid" 2>/dev/null || true
}

down() {
    for node in "${NODES[@]}"; do stop_pid_file "$STATE_DIR/$node/slurmd.pid"; done
    stop_pid_file "$STATE_DIR/slurmctld/slurmctld.pid"
    stop_pid_file "$STATE_DIR/munge/munged.pid"
    # Whatever still runs in a node (job steps, a daemon that ignored SIGTERM) goes with it.
    for node in "${NODES[@]}"; do
        local namespace=$NAMESPACE_PREFIX$node
        [[ -e /run/netns/$namespace ]] || continue
        local pids
        pids=$(ip netns pids "$namespace")
        # shellcheck disable=SC2086  # one pid per word
        [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
        ip netns del "$namespace"
    done
    # A veth pair dies with either end's namespace; a failed `up` may have left it in the host's.
    ip link del suite-veth1 2>/dev/null || true
    sleep 1
    rm -rf "$STATE_DIR"
}

case ${1:-} in
    up)
        require_root
        install_packages
        [[ -e /run/netns/${NAMESPACE_PREFIX}node1 ]] && { wait_until_idle; exit; }
        mkdir -p "$STATE_DIR" && chmod 700 "$STATE_DIR"
        trap 'echo "error: cluster start-up failed; cleaning up" >&2; down' ERR
        create_network
        start_daemons
        trap - ERR
        wait_until_idle ;;
    exec) shift; require_root; run_on_node1 "$@" ;;
    down) require_root; down ;;
    *) die "usage: scripts/cluster.sh up|exec COMMAND...|down" ;;
esac
