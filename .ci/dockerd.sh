#!/usr/bin/env bash
# Start or stop a private Docker daemon for ActObs's sandbox tests (CI, or a laptop without a running daemon).
#
#   . .ci/dockerd.sh start    # idempotent: starts dockerd if ours is not up, waits, exports DOCKER_HOST
#   .ci/dockerd.sh stop       # stops only the daemon this script started (found by its pidfile)
#   .ci/dockerd.sh status
#
# State lives under $ACTOBS_DOCKER_ROOT (default /var/lib/actobs-docker): data-root, exec-root, pidfile,
# socket and log. Sourcing `start` exports DOCKER_HOST; running it prints the export line.
# The daemon runs without iptables and without a bridge: sandboxes use network_mode="none", and image
# builds use --network host, so no NAT rules are touched on the host.

ACTOBS_DOCKER_ROOT="${ACTOBS_DOCKER_ROOT:-/var/lib/actobs-docker}"
_actobs_sock="$ACTOBS_DOCKER_ROOT/docker.sock"
_actobs_pid="$ACTOBS_DOCKER_ROOT/dockerd.pid"

_actobs_ready() { docker -H "unix://$_actobs_sock" version >/dev/null 2>&1; }

_actobs_start() {
    mkdir -p "$ACTOBS_DOCKER_ROOT/data" "$ACTOBS_DOCKER_ROOT/exec" || return 1
    local driver i
    # overlay2 is fast; vfs is the fallback where the host filesystem cannot carry overlay (nested overlay).
    for driver in ${ACTOBS_DOCKER_STORAGE:-overlay2 vfs}; do
        _actobs_ready && break
        nohup dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver="$driver" \
            --data-root "$ACTOBS_DOCKER_ROOT/data" --exec-root "$ACTOBS_DOCKER_ROOT/exec" \
            --pidfile "$_actobs_pid" -H "unix://$_actobs_sock" \
            >>"$ACTOBS_DOCKER_ROOT/dockerd.log" 2>&1 </dev/null &
        for i in $(seq 1 60); do
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
    export DOCKER_HOST="unix://$_actobs_sock"
    echo "export DOCKER_HOST=$DOCKER_HOST"
}

_actobs_stop() {
    [ -f "$_actobs_pid" ] || { echo "no dockerd started by this script"; return 0; }
    local pid
    pid="$(cat "$_actobs_pid")"
    kill "$pid" 2>/dev/null
    local i
    for i in $(seq 1 60); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    rm -f "$_actobs_pid"
    echo "stopped dockerd $pid"
}

case "${1:-}" in
    start) _actobs_start ;;
    stop) _actobs_stop ;;
    status) _actobs_ready && echo "up: unix://$_actobs_sock" || { echo "down"; false; } ;;
    *) echo "usage: .ci/dockerd.sh start|stop|status" >&2; false ;;
esac
