# shellcheck shell=bash
# Several SLURM nodes on one machine, each in its own namespaces: sourced by
# scripts/slurm-local for `--nodes N` (N >= 2), `--down` and `--status`.
#
# Layout (all names fixed, so tests and --down find them without any other record):
#   - a bridge $BRIDGE with $SUBNET.1/24 in the host; node K (1..N) is "${PREFIX}K" with a
#     network namespace of that name (/run/netns/${PREFIX}K), a veth pair "${VETH}K" <->
#     eth0 in the namespace, address $SUBNET.(10+K)/24, loopback up, no default route and
#     no forwarding: a node reaches only the other nodes and the host's bridge address;
#   - UTS and mount namespaces bound to files $MULTI/ns/${PREFIX}K.{uts,mnt} (the
#     directory is a private bind mount, as unshare requires), so a restarted slurmd
#     re-enters the same namespaces: hostname ${PREFIX}K, and the node's own directory
#     $MULTI/nodes/${PREFIX}K/local bind-mounted over $LOCAL_DISK (the node-local disk:
#     the same path on every node, a different directory behind it);
#   - slurmctld in the host, `slurmd -N ${PREFIX}K` in node K's namespaces, with their own
#     configuration $MULTI/slurm.conf (cluster "shardcache-nodes", ports 16817/16818), so
#     the one-node cluster of /etc/slurm/slurm.conf keeps running beside it;
#   - logs in $MULTI/log, state in $MULTI/state, spool in $MULTI/nodes/<node>/spool.
# Why not a private /tmp per node: a test (and a user's job) hands files to its tasks
# under /tmp (pytest's tmp_path, a clone of the repository); the node-local disk is a
# directory of its own instead, as on clusters that have /local or /scratch.

MULTI="$STATE_DIR/nodes"
MULTI_CONF="$MULTI/slurm.conf"
PREFIX="scnode"
BRIDGE="scbr0"
VETH="scveth"
SUBNET="${SLURM_LOCAL_SUBNET:-10.216.16}"
CTLD_PORT=16817
SLURMD_PORT=16818
NODE_CPUS=4 # per node, whatever the machine has (config_overrides): `srun -N 2 -n 8` fits

node_names() { # the names of nodes 1..$1
    local k
    for k in $(seq "$1"); do echo "$PREFIX$k"; done
}

# Nodes that exist now (from their network namespaces), whatever N was asked for.
existing_nodes() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX[0-9]+$" | sort -V || true
}

multi_sinfo() { # node state lines "name state"
    SLURM_CONF="$MULTI_CONF" timeout 10 sinfo --noheader --Node --format='%N %t' 2>/dev/null
}

multi_usable() { # every node of $1 usable
    local states node state
    states="$(multi_sinfo)" || return 1
    for node in $(node_names "$1"); do
        state="$(awk -v n="$node" '$1 == n {print $2}' <<<"$states" | head -n 1)"
        case "$state" in
        idle | mix | alloc) ;;
        *) return 1 ;; # "comp" too: a job still ending (end_stuck_jobs if it is stuck)
        esac
    done
}

multi_conf_text() { # the slurm.conf for $1 nodes
    local n="$1" k names
    names="$(node_names "$n" | paste -sd, -)"
    cat <<EOF
$MARKER: $n nodes in network namespaces
# on the bridge $BRIDGE ($SUBNET.0/24), for tests and demos; see scripts/lib/slurm-nodes.sh.
ClusterName=shardcache-nodes
SlurmctldHost=$HOST_NAME($SUBNET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$MULTI/state
SlurmdSpoolDir=$MULTI/nodes/%n/spool
SlurmctldLogFile=$MULTI/log/slurmctld.log
SlurmdLogFile=$MULTI/log/slurmd-%n.log
SlurmctldPidFile=$MULTI/run/slurmctld.pid
SlurmdPidFile=$MULTI/run/slurmd-%n.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=5
MinJobAge=60
SlurmdParameters=config_overrides
EOF
    for k in $(seq "$n"); do
        echo "NodeName=$PREFIX$k NodeAddr=$SUBNET.$((10 + k)) NodeHostname=$PREFIX$k CPUs=$NODE_CPUS RealMemory=2000 State=UNKNOWN"
    done
    echo "PartitionName=nodes Nodes=$names Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8"
}

# The file-bound namespaces of node $1 are mounted (exist).
ns_bound() { findmnt -rn --mountpoint "$MULTI/ns/$1.mnt" >/dev/null 2>&1 && findmnt -rn --mountpoint "$MULTI/ns/$1.uts" >/dev/null 2>&1; }

in_node() { # node cmd...: run in the node's network, UTS and mount namespaces
    local node="$1"
    shift
    nsenter --net="/run/netns/$node" --mount="$MULTI/ns/$node.mnt" --uts="$MULTI/ns/$node.uts" -- "$@"
}

make_network() { # node k
    local node="$1" k="$2"
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
    fi
    ip addr replace "$SUBNET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    if ! ip netns list | awk '{print $1}' | grep -qx "$node"; then
        ip netns add "$node"
    fi
    if ! ip -n "$node" link show eth0 >/dev/null 2>&1; then
        # A host-side veth left from a namespace deleted a moment ago: remove it first.
        ip link del "$VETH$k" >/dev/null 2>&1 || true
        ip link add "$VETH$k" type veth peer name eth0 netns "$node"
    fi
    ip link set "$VETH$k" master "$BRIDGE" up
    ip -n "$node" link set lo up
    ip -n "$node" addr replace "$SUBNET.$((10 + k))/24" dev eth0
    ip -n "$node" link set eth0 up
}

make_node_namespaces() { # node
    local node="$1"
    install -d -m 0755 "$MULTI/nodes/$node/spool"
    install -d -m 1777 "$MULTI/nodes/$node/local"
    install -d -m 0755 "$LOCAL_DISK"
    ns_bound "$node" && return 0
    umount "$MULTI/ns/$node.mnt" "$MULTI/ns/$node.uts" >/dev/null 2>&1 || true
    : >"$MULTI/ns/$node.mnt"
    : >"$MULTI/ns/$node.uts"
    unshare --mount="$MULTI/ns/$node.mnt" --uts="$MULTI/ns/$node.uts" --propagation private \
        sh -ec 'hostname "$1"; mount --bind "$2" "$3"' sh \
        "$node" "$MULTI/nodes/$node/local" "$LOCAL_DISK" ||
        die "could not make the UTS and mount namespaces of node $node."
}

stop_pid() { # pid: TERM, wait (bounded), KILL
    local pid="$1"
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 100); do
        [ -d "/proc/$pid" ] || return 0
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
}

multi_down() {
    local node pid k target
    for node in $(existing_nodes); do
        if pid="$(running_pid "$MULTI/run/slurmd-$node.pid" slurmd)"; then
            say "stopping slurmd of $node (pid $pid)"
            stop_pid "$pid"
        fi
        if ns_bound "$node"; then
            # FUSE mounts a test left inside the node (JuiceFS): lazily unmounted.
            for target in $(nsenter --mount="$MULTI/ns/$node.mnt" -- findmnt -rn -t fuse,fuse.juicefs -o TARGET 2>/dev/null || true); do
                nsenter --mount="$MULTI/ns/$node.mnt" -- umount -l "$target" 2>/dev/null || true
            done
        fi
        umount "$MULTI/ns/$node.mnt" "$MULTI/ns/$node.uts" >/dev/null 2>&1 || true
        rm -f "$MULTI/ns/$node.mnt" "$MULTI/ns/$node.uts"
        ip netns del "$node" 2>/dev/null || true
        k="${node#"$PREFIX"}"
        ip link del "$VETH$k" >/dev/null 2>&1 || true
    done
    if pid="$(running_pid "$MULTI/run/slurmctld.pid" slurmctld)"; then
        say "stopping the nodes' slurmctld (pid $pid)"
        stop_pid "$pid"
    fi
    ip link del "$BRIDGE" >/dev/null 2>&1 || true
    if findmnt -rn --mountpoint "$MULTI/ns" >/dev/null 2>&1; then umount "$MULTI/ns" || umount -l "$MULTI/ns"; fi
    # The host-side veths go away with their namespaces, asynchronously: wait (bounded).
    for _ in $(seq 50); do
        ip -br link 2>/dev/null | grep -qE "^($VETH[0-9]+|$BRIDGE)[@ ]" || break
        sleep 0.1
    done
}

multi_status() {
    local node
    echo "nodes' slurmctld: $(running_pid "$MULTI/run/slurmctld.pid" slurmctld || echo 'not running')"
    for node in $(existing_nodes); do
        echo "$node: slurmd $(running_pid "$MULTI/run/slurmd-$node.pid" slurmd || echo 'not running'), $(ns_bound "$node" && echo namespaces bound || echo 'namespaces missing')"
    done
    [ -f "$MULTI_CONF" ] && multi_sinfo | sed 's/^/  sinfo: /' || true
}

# Lines for the caller (tests parse them): the configuration and each node's namespaces.
multi_report() {
    local k node
    echo "SLURM_CONF=$MULTI_CONF"
    echo "LOCAL_DISK=$LOCAL_DISK"
    echo "HOST_ADDR=$SUBNET.1"
    for k in $(seq "$1"); do
        node="$PREFIX$k"
        echo "NODE=$node addr=$SUBNET.$((10 + k)) net=/run/netns/$node mnt=$MULTI/ns/$node.mnt uts=$MULTI/ns/$node.uts local=$MULTI/nodes/$node/local"
    done
}

multi_fast_path() { # $1 nodes: true when everything is up as asked
    local node
    [ -f "$MULTI_CONF" ] && [ "$(cat "$MULTI_CONF")" = "$(multi_conf_text "$1")" ] || return 1
    [ "$(existing_nodes | paste -sd' ' -)" = "$(node_names "$1" | paste -sd' ' -)" ] || return 1
    running_pid "$MULTI/run/slurmctld.pid" slurmctld >/dev/null || return 1
    for node in $(node_names "$1"); do
        ns_bound "$node" || return 1
        running_pid "$MULTI/run/slurmd-$node.pid" slurmd >/dev/null || return 1
    done
    multi_usable "$1"
}

multi_up() { # $1 nodes
    local n="$1" k node new_conf deadline last_resume=-10 pid
    new_conf="$(multi_conf_text "$n")"
    if [ -f "$MULTI_CONF" ] && [ "$(cat "$MULTI_CONF")" != "$new_conf" ] ||
        [ "$(existing_nodes | paste -sd' ' -)" != "$(node_names "$n" | paste -sd' ' -)" ]; then
        if [ -n "$(existing_nodes)" ] || running_pid "$MULTI/run/slurmctld.pid" slurmctld >/dev/null; then
            say "the running nodes differ from the $n asked for: taking them down first"
            multi_down
        fi
    fi
    install -d -m 0755 "$MULTI" "$MULTI/state" "$MULTI/log" "$MULTI/run" "$MULTI/ns"
    if ! findmnt -rn --mountpoint "$MULTI/ns" >/dev/null 2>&1; then
        mount --bind "$MULTI/ns" "$MULTI/ns"
    fi
    mount --make-private "$MULTI/ns"
    printf '%s\n' "$new_conf" >"$MULTI_CONF.tmp.$$"
    chmod 0644 "$MULTI_CONF.tmp.$$"
    mv -f "$MULTI_CONF.tmp.$$" "$MULTI_CONF"

    for k in $(seq "$n"); do
        node="$PREFIX$k"
        make_network "$node" "$k"
        make_node_namespaces "$node"
    done
    if ! running_pid "$MULTI/run/slurmctld.pid" slurmctld >/dev/null; then
        say "starting the nodes' slurmctld (port $CTLD_PORT)"
        slurmctld -f "$MULTI_CONF" 9>&- || {
            log_tail "$MULTI/log/slurmctld.log"
            die "slurmctld for the nodes did not start (log above)."
        }
    fi
    for node in $(node_names "$n"); do
        if ! running_pid "$MULTI/run/slurmd-$node.pid" slurmd >/dev/null; then
            say "starting slurmd of $node"
            in_node "$node" slurmd -f "$MULTI_CONF" -N "$node" 9>&- || {
                log_tail "$MULTI/log/slurmd-$node.log"
                die "slurmd of node $node did not start (log above)."
            }
        fi
    done

    deadline=$((SECONDS + TIMEOUT))
    stuck_check=$((SECONDS + STUCK_AFTER))
    while ! multi_usable "$n"; do
        if [ "$SECONDS" -ge "$stuck_check" ]; then
            end_stuck_jobs "$MULTI_CONF"
            stuck_check=$((SECONDS + STUCK_AFTER))
        fi
        if [ $((SECONDS - last_resume)) -ge 5 ]; then
            # Nodes left down/drained by an earlier run answer again: back in service.
            for node in $(multi_sinfo | awk '$2 ~ /^(down|drain|drng|drained|fail|failg)$/ {print $1}'); do
                say "node $node is down or drained; resuming it"
                SLURM_CONF="$MULTI_CONF" scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
            done
            last_resume=$SECONDS
        fi
        running_pid "$MULTI/run/slurmctld.pid" slurmctld >/dev/null || {
            log_tail "$MULTI/log/slurmctld.log"
            die "the nodes' slurmctld exited (log above)."
        }
        for node in $(node_names "$n"); do
            pid="$(running_pid "$MULTI/run/slurmd-$node.pid" slurmd)" || {
                log_tail "$MULTI/log/slurmd-$node.log"
                die "slurmd of node $node exited (log above)."
            }
        done
        if [ "$SECONDS" -ge "$deadline" ]; then
            multi_sinfo >&2 || true
            log_tail "$MULTI/log/slurmctld.log"
            die "the $n nodes are not all usable after ${TIMEOUT}s (sinfo above)."
        fi
        sleep 0.2
    done
    say "SLURM is up: $n nodes ($(node_names "$n" | paste -sd' ' -)) on $BRIDGE; SLURM_CONF=$MULTI_CONF"
}
