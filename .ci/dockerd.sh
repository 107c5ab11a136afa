#!/usr/bin/env bash
# Start or stop a private Docker daemon for ActObs's sandbox tests (CI, or a laptop without a running daemon).
#
#   . .ci/dockerd.sh start    # idempotent: starts dockerd if ours is not up, waits, exports DOCKER_HOST
#   .ci/dockerd.sh stop       # stops only the daemon this script started (found by its pidfile)
#   .ci/dockerd.sh status
#
# State lives under $ACTOBS_DOCKER_ROOT (default /var/lib/actobs-docker): data-root, exec-root, pidfile,
# socket and log. Sourcing `start` exports DOCKER_HOST; running it prints the export line.
# The daemon runs without iptables and without a bridge: sandboxes are NetworkDisabled (the egress network is the
# project's own bridge, actobs/sandbox/network.py), and image builds use --network host, so it touches no NAT rule.
# It may run beside a node's own Docker (whose dockerd binary it then is): its own data, sockets and containerd
# namespace, no iptables rule (a dockerd with iptables removes the other's DOCKER chains when it starts).
#
# The daemon's store sits in a file system of fixed size: a sparse file under $ACTOBS_DOCKER_ROOT
# ($ACTOBS_DOCKER_DISK_GB, default half the free space where it is made), loop-mounted, so the kernel stops every
# write past it and the host never fills, whatever a sandbox or a late disk watch does. At each start the space the
# file can still take must be free on the host (else it says so and stops), and what the store freed is given back
# to the host (fstrim).
# Disk quota. By default (ACTOBS_DOCKER_STORAGE unset: "xfs overlay2 vfs", the first that runs) the overlay2
# driver keeps its data on XFS mounted with project quotas ($ACTOBS_DOCKER_ROOT/xfs.img): the daemon then takes a
# size limit per container (disk.py asks for one at each sandbox's create), so the kernel refuses a write past a
# sandbox's disk budget at overlay2's speed; images and image builds have no limit. Where that cannot run (no
# xfsprogs, no loop device, not root, a kernel without XFS quota support) the log says why and plain overlay2 (or
# vfs, where the host cannot carry overlay) runs on ext4 ($ACTOBS_DOCKER_ROOT/ext4.img): budgets are then held per
# file (ulimit fsize, seccomp) and watched (disk.py), with no kernel quota; where no loop mount can be made either,
# on $ACTOBS_DOCKER_ROOT/data, unbounded, with a warning.
# ACTOBS_DOCKER_STORAGE=btrfs: the btrfs driver on $ACTOBS_DOCKER_ROOT/btrfs.img with qgroups (disk.py sets one
# limit per sandbox), for kernels without XFS quotas; slower (RESULTS.md), so never chosen unasked.

# shellcheck disable=SC2015  # `A && B || { ...; return 1; }` here means "if A or B fails": meant so
ACTOBS_DOCKER_ROOT="${ACTOBS_DOCKER_ROOT:-/var/lib/actobs-docker}"
_actobs_sock="$ACTOBS_DOCKER_ROOT/docker.sock"
_actobs_pid="$ACTOBS_DOCKER_ROOT/dockerd.pid"

_actobs_ready() { docker -H "unix://$_actobs_sock" version >/dev/null 2>&1; }

# Wait up to 30 s for process $1 to exit; fails while it still runs.
_actobs_gone() {
    local _
    for _ in $(seq 1 60); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.5; done
    ! kill -0 "$1" 2>/dev/null
}

_actobs_log() { echo "$(date -u +%FT%TZ) .ci/dockerd.sh: $*" | tee -a "$ACTOBS_DOCKER_ROOT/dockerd.log" >&2; }

# Size of a new loop file: $ACTOBS_DOCKER_DISK_GB, or half the free space under $ACTOBS_DOCKER_ROOT.
_actobs_disk_gb() {
    echo "${ACTOBS_DOCKER_DISK_GB:-$(( $(df --output=avail -k "$ACTOBS_DOCKER_ROOT" | tail -1) / 2 / 2**20 ))}"
}

# Whether the host has room for what the loop file $1 can still take, plus 1 GB; fails with a reason. A sparse
# file takes host blocks as the store fills: room for all of it is what makes the store's size a bound.
_actobs_fits() {
    local left free
    left=$(( ($(stat -c %s "$1") - $(stat -c %b "$1") * $(stat -c %B "$1")) / 2**20 ))
    free=$(( $(df --output=avail -k "$(dirname "$1")" | tail -1) / 2**10 ))
    [ $(( left + 1024 )) -le "$free" ] && return 0
    echo "$1 can still grow by $left MB and the host has $free MB free: free space, or remove it (with the daemon" \
         "stopped; its images are built again)"
    return 1
}

# Mount (creating it the first time) XFS with project quotas at $ACTOBS_DOCKER_ROOT/xfs; fails with a reason.
_actobs_xfs() {
    local mnt="$ACTOBS_DOCKER_ROOT/xfs" img="$ACTOBS_DOCKER_ROOT/xfs.img" new=
    if ! mountpoint -q "$mnt"; then
        command -v mkfs.xfs >/dev/null || { echo "xfsprogs not installed"; return 1; }
        if [ ! -f "$img" ]; then
            new=1
            truncate -s "$(_actobs_disk_gb)G" "$img" && mkfs.xfs -q "$img" >/dev/null 2>&1 \
                || { rm -f "$img"; echo "mkfs.xfs failed"; return 1; }
        fi
        mkdir -p "$mnt"
        # allocsize: XFS's speculative preallocation past a growing file's end (up to its size: 126 MB while 200 MB
        # are written) counts in the file's blocks, which the disk watch (disk.py) reads; 64k keeps it off
        if ! mount -o loop,pquota,allocsize=64k "$img" "$mnt" 2>/dev/null; then
            [ -n "$new" ] && rm -f "$img"  # nothing in it yet: the next start tries afresh
            echo "cannot loop-mount $img with project quotas ($(dmesg 2>/dev/null | grep -i xfs | tail -1 | \
                sed 's/^\[[^]]*\] //' || true))"
            return 1
        fi
    fi
    grep -q " $mnt xfs .*prjquota" /proc/mounts || { echo "$mnt is mounted without project quotas"; return 1; }
}

# Mount (creating it the first time) ext4 at $ACTOBS_DOCKER_ROOT/ext4: the fixed-size store of a daemon without a
# quota; fails with a reason.
_actobs_ext4() {
    local mnt="$ACTOBS_DOCKER_ROOT/ext4" img="$ACTOBS_DOCKER_ROOT/ext4.img" new=
    if ! mountpoint -q "$mnt"; then
        command -v mkfs.ext4 >/dev/null || { echo "e2fsprogs not installed"; return 1; }
        if [ ! -f "$img" ]; then
            new=1
            truncate -s "$(_actobs_disk_gb)G" "$img" && mkfs.ext4 -q -m 0 "$img" >/dev/null 2>&1 \
                || { rm -f "$img"; echo "mkfs.ext4 failed"; return 1; }
        fi
        mkdir -p "$mnt"
        if ! mount -o loop "$img" "$mnt" 2>/dev/null; then
            [ -n "$new" ] && rm -f "$img"
            echo "cannot loop-mount $img"
            return 1
        fi
    fi
}

# Mount (creating it the first time) the quota filesystem at $ACTOBS_DOCKER_ROOT/btrfs; fails with a reason.
_actobs_btrfs() {
    local mnt="$ACTOBS_DOCKER_ROOT/btrfs" img="$ACTOBS_DOCKER_ROOT/btrfs.img"
    if ! mountpoint -q "$mnt"; then
        command -v mkfs.btrfs >/dev/null && command -v btrfs >/dev/null \
            || { echo "btrfs-progs not installed"; return 1; }
        if [ ! -f "$img" ]; then
            truncate -s "$(_actobs_disk_gb)G" "$img" && mkfs.btrfs -q "$img" >/dev/null 2>&1 \
                || { rm -f "$img"; echo "mkfs.btrfs failed"; return 1; }
        fi
        mkdir -p "$mnt" && mount -o loop "$img" "$mnt" 2>&1 || { echo "cannot loop-mount $img"; return 1; }
    fi
    btrfs quota enable "$mnt" 2>&1 || { echo "btrfs quota enable failed"; return 1; }
}

_actobs_start() {
    mkdir -p "$ACTOBS_DOCKER_ROOT/exec" || return 1
    local driver data img why started="" old
    # A daemon of ours that is still going away (a stop under way, or the daemon of a run just killed) holds the
    # pidfile, and a new dockerd refuses to start on it: each driver below would fail in turn and the last one up
    # would be a slower driver on another image store. Wait for it to exit; a pidfile of a dead process is stale.
    if [ -f "$_actobs_pid" ] && ! _actobs_ready; then
        old="$(cat "$_actobs_pid")"
        if ! _actobs_gone "$old"; then
            echo "dockerd $old (pidfile $_actobs_pid) neither answers nor exits; stop it first" >&2
            return 1
        fi
        rm -f "$_actobs_pid"
    fi
    # xfs: overlay2 with kernel-enforced disk budgets; overlay2 without; vfs where the host cannot carry overlay
    # (nested overlay); btrfs only when asked.
    for driver in ${ACTOBS_DOCKER_STORAGE:-xfs overlay2 vfs}; do
        _actobs_ready && break
        data="$ACTOBS_DOCKER_ROOT/data" img=
        if [ "$driver" = xfs ]; then
            if ! why="$(_actobs_xfs)"; then
                _actobs_log "no disk quota on overlay2 ($why)"
                continue
            fi
            data="$ACTOBS_DOCKER_ROOT/xfs" img="$ACTOBS_DOCKER_ROOT/xfs.img"
            _actobs_log "disk quota: overlay2 on XFS with project quotas, $img" \
                "($(du -h --apparent-size "$img" | cut -f1) at most)"
        elif [ "$driver" = btrfs ]; then
            if ! why="$(_actobs_btrfs)"; then
                _actobs_log "no disk quota ($why): falling back to a per-file and watched disk budget (disk.py)"
                continue
            fi
            data="$ACTOBS_DOCKER_ROOT/btrfs" img="$ACTOBS_DOCKER_ROOT/btrfs.img"
            _actobs_log "disk quota: btrfs qgroups on $img ($(du -h --apparent-size "$img" | cut -f1) at most)"
        elif why="$(_actobs_ext4)"; then
            data="$ACTOBS_DOCKER_ROOT/ext4" img="$ACTOBS_DOCKER_ROOT/ext4.img"
            _actobs_log "the store: ext4 on $img ($(du -h --apparent-size "$img" | cut -f1) at most)"
            if [ -d "$ACTOBS_DOCKER_ROOT/data" ]; then
                _actobs_log "$ACTOBS_DOCKER_ROOT/data (an earlier, unbounded store) is no longer used: remove it" \
                    "to free its space"
            fi
        else
            _actobs_log "warning: the store is not bounded ($why): a sandbox the disk watch stops late can fill" \
                "the host's disk"
        fi
        if [ -n "$img" ]; then
            fstrim "$data" 2>/dev/null || true  # what the store freed goes back to the host
            if ! why="$(_actobs_fits "$img")"; then
                _actobs_log "$why"
                return 1
            fi
        fi
        mkdir -p "$data" || return 1
        # the containerd namespaces: a node's containerd (containerd.io), which dockerd uses where it runs, keeps
        # these containers apart from the node's daemon's
        nohup dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver="${driver/xfs/overlay2}" \
            --containerd-namespace actobs --containerd-plugins-namespace actobs-plugins \
            --data-root "$data" --exec-root "$ACTOBS_DOCKER_ROOT/exec" \
            --pidfile "$_actobs_pid" -H "unix://$_actobs_sock" \
            >>"$ACTOBS_DOCKER_ROOT/dockerd.log" 2>&1 </dev/null &
        started="$driver"
        for _ in $(seq 1 60); do
            _actobs_ready && break
            kill -0 $! 2>/dev/null || break  # dockerd exited (e.g. unsupported storage driver)
            sleep 0.5
        done
    done
    if ! _actobs_ready; then
        echo "dockerd did not come up; last log lines:" >&2
        tail -n 20 "$ACTOBS_DOCKER_ROOT/dockerd.log" >&2
        return 1
    fi
    case "$started" in
        ""|xfs|btrfs) ;;  # already up, or up with a quota
        *) _actobs_log "no disk quota: dockerd runs on $started; budgets held per file and watched (disk.py)" ;;
    esac
    export DOCKER_HOST="unix://$_actobs_sock"
    echo "export DOCKER_HOST=$DOCKER_HOST"
}

_actobs_stop() {
    [ -f "$_actobs_pid" ] || { echo "no dockerd started by this script"; return 0; }
    local pid mnt
    pid="$(cat "$_actobs_pid")"
    kill "$pid" 2>/dev/null
    _actobs_gone "$pid" || kill -9 "$pid"
    # only our daemon's pidfile: a start that ran while this one waited may own the file by now
    [ "$(cat "$_actobs_pid" 2>/dev/null)" = "$pid" ] && rm -f "$_actobs_pid"
    # the store's file system, unless a daemon started meanwhile uses it
    if [ ! -f "$_actobs_pid" ]; then
        for mnt in "$ACTOBS_DOCKER_ROOT"/ext4 "$ACTOBS_DOCKER_ROOT"/xfs "$ACTOBS_DOCKER_ROOT"/btrfs; do
            if mountpoint -q "$mnt"; then umount "$mnt" || umount -l "$mnt"; fi
        done
    fi
    echo "stopped dockerd $pid"
}

case "${1:-}" in
    start) _actobs_start ;;
    stop) _actobs_stop ;;
    status) _actobs_ready && echo "up: unix://$_actobs_sock" || { echo "down"; false; } ;;
    *) echo "usage: .ci/dockerd.sh start|stop|status" >&2; false ;;
esac
