#!/usr/bin/env bash
# The host's packages ActObs needs (Debian or Ubuntu, as root; setup.sh runs it), and nothing else: only the tools
# missing, and never a package removed (apt-get --no-remove: a request that would remove one fails instead).
#   debootstrap     the sandboxes' base images (images.py)
#   xfsprogs        the daemon's disk quota (.ci/dockerd.sh); btrfs-progs: the opt-in one
#   iptables        the egress network's rules (actobs/sandbox/network.py); iproute2: its bridge and veths
#   docker.io       only where no Docker engine is installed or running: a node's own Docker (docker-ce with
#                   containerd.io from Docker's repository, usually) conflicts with it, and is used as it is
# Prints what it installs. Tested on a fake host: tests/test_network.py.
set -euo pipefail

# shellcheck disable=SC2016  # dpkg-query's own format, not the shell's
installed() { [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" = installed ]; }

want=()
if command -v dockerd >/dev/null || [ -S /var/run/docker.sock ] || installed docker-ce || installed docker.io \
        || installed moby-engine; then
    :  # a Docker engine is here: used as it is (.ci/dockerd.sh runs its dockerd beside the node's daemon)
elif installed containerd.io; then
    echo ".ci/packages.sh: containerd.io is installed without a Docker engine; Debian's docker.io would replace it." \
         "Install docker-ce from Docker's repository (it goes with containerd.io), then run this again" >&2
    exit 1
else
    want+=(docker.io)
fi
command -v debootstrap >/dev/null || want+=(debootstrap)
command -v mkfs.xfs >/dev/null || want+=(xfsprogs)
command -v mkfs.btrfs >/dev/null || want+=(btrfs-progs)
command -v iptables >/dev/null || want+=(iptables)
command -v ip >/dev/null || want+=(iproute2)
[ ${#want[@]} -gt 0 ] || exit 0
echo ".ci/packages.sh: installing ${want[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-remove "${want[@]}"
