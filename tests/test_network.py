"""The egress network (actobs/sandbox/network.py): a sandbox reaches the internet through NAT and nothing of the host's
(its loopback, the bridge's gateway address, its other addresses), no private or link-local (metadata) address, no
other sandbox; sandboxes bind the same port at once; a host without it stops the run. And the host's packages
(.ci/packages.sh) on fake hosts, through apt's own resolver: nothing that conflicts with a node's Docker, no removal.
The network tests need root (CI's machine): they make a network namespace of their own for an "outside" host."""
import hashlib
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import envs
from actobs.sandbox import daemon, network
from actobs.sandbox.sandbox import Sandbox
from actobs.tasks import Task

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------
# The network


def connect(sb, host, port, send=""):
    """What a sandbox reads back from host:port after sending `send` (printf's escapes; "" and the connection made:
    "open"), or "closed" when it cannot connect (refused, unreachable, 5 s)."""
    code, out = sb.exec(["timeout", "5", "bash", "-c", f'exec 3<>/dev/tcp/{host}/{port} || exit 1; if [ -z "$1" ]; '
                         'then echo open; else printf "$1" >&3; timeout 3 cat <&3 2>/dev/null; fi; exit 0', "connect",
                         send])
    return out.decode().strip() if code == 0 else "closed"


class Listener:
    """A TCP server that answers what a connection sends with the peer's address, and keeps the peers it saw."""

    def __init__(self, host="0.0.0.0"):
        self.sock = socket.create_server((host, 0))
        self.port, self.peers = self.sock.getsockname()[1], []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.peers.append(peer[0])
            with conn:
                conn.recv(64)  # read before the reply: a close with unread data would reset the connection
                conn.sendall(f"peer={peer[0]}\n".encode())

    def close(self):
        self.sock.close()


@pytest.fixture
def egress(base_image):
    with Sandbox(base_image, network=network.EGRESS, memory_mb=256) as sb:
        yield sb


def host_addresses():
    return [a["local"] for i in json.loads(subprocess.check_output(["ip", "-j", "-4", "addr"]))
            for a in i.get("addr_info", []) if not a["local"].startswith("127.")]


def test_nameservers_outside_the_host():
    stub = "# systemd-resolved\nnameserver 127.0.0.53\noptions edns0\n"
    assert network.nameservers(stub, "nameserver 10.0.0.2\nnameserver fd00::1\nnameserver 9.9.9.9\n") == \
        ("10.0.0.2", "9.9.9.9")  # the stub's upstream servers, IPv4 only
    assert network.nameservers("nameserver 192.0.2.2\nnameserver 192.0.2.53\n", local={"192.0.2.2"}) == \
        ("192.0.2.53",)  # one of the host's own addresses is out of a sandbox's reach
    assert network.nameservers(stub) == ()


def test_egress_reaches_the_internet_and_nothing_of_the_hosts(egress, base_image):
    """A service of the host's on every address (0.0.0.0) and one on its loopback: a sandbox on the host's network
    reaches both (they are there); an egress sandbox reaches neither, by the loopback, the bridge's gateway address or
    any other address of the host's, and no connection of its arrives. It resolves a name and reaches the Debian
    mirror over HTTP, and dockerd holds no network endpoint for it (NetworkDisabled: no libnetwork)."""
    anywhere, loopback = Listener(), Listener("127.0.0.1")
    try:
        with Sandbox(base_image, network=network.HOST, memory_mb=256) as on_host:
            assert connect(on_host, "127.0.0.1", anywhere.port, "x") == "peer=127.0.0.1"
            assert connect(on_host, "127.0.0.1", loopback.port, "x") == "peer=127.0.0.1"
        gateway = str(network.ensure().gateway)
        for host in ["127.0.0.1", gateway, *host_addresses()]:
            assert connect(egress, host, anywhere.port) == "closed", host
        assert connect(egress, "127.0.0.1", loopback.port) == "closed"
        assert anywhere.peers == loopback.peers == ["127.0.0.1"]  # the sandbox on the host's network only
    finally:
        anywhere.close()
        loopback.close()
    reply = connect(egress, "deb.debian.org", 80, r"HEAD /debian/ HTTP/1.0\r\nHost: deb.debian.org\r\n\r\n")
    assert reply.startswith("HTTP/1."), reply
    egress.container.reload()
    assert egress.container.attrs["Config"]["NetworkDisabled"]
    assert not egress.container.attrs["NetworkSettings"]["Networks"]
    assert ipaddress.ip_address(egress.address) in network.ensure().subnet


@pytest.fixture
def outside():
    """An "outside" host in a network namespace of its own, behind a router address of this host's: 198.51.100.7 (a
    documentation address: the internet, to a sandbox), 169.254.169.254 (a cloud's metadata address) and 10.77.0.7
    (a private one), each serving Listener's answer on port 8080. Returns this host's address on the link (what NAT
    makes a sandbox's connections come from)."""
    ns, link = "actobs-test-outside", ("192.168.251.1", "192.168.251.2")
    addrs = ("198.51.100.7", "169.254.169.254", "10.77.0.7")
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # a killed run's
    subprocess.run(["ip", "link", "del", "actobs-t-out"], capture_output=True)
    cmds = [f"ip netns add {ns}", f"ip link add actobs-t-out type veth peer name eth0 netns {ns}",
            f"ip addr add {link[0]}/30 dev actobs-t-out", "ip link set actobs-t-out up",
            f"ip -n {ns} addr add {link[1]}/30 dev eth0", f"ip -n {ns} link set eth0 up",
            f"ip -n {ns} link set lo up", *(f"ip -n {ns} addr add {a}/32 dev lo" for a in addrs),
            *(f"ip route add {a}/32 via {link[1]}" for a in addrs)]
    for cmd in cmds:
        subprocess.run(cmd.split(), check=True)
    server = subprocess.Popen(
        ["ip", "netns", "exec", ns, "python3", "-c",
         "import socket\ns = socket.create_server(('0.0.0.0', 8080))\nwhile True:\n    c, p = s.accept()\n"
         "    c.recv(64); c.sendall(f'peer={p[0]}\\n'.encode()); c.close()"])
    try:
        for _ in range(100):
            if subprocess.run(["ip", "netns", "exec", ns, "bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/8080"],
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        yield link[0], addrs
    finally:
        server.kill()
        server.wait()
        subprocess.run(["ip", "netns", "del", ns], check=True)  # its veth and this host's routes through it go too


def test_egress_through_nat_and_no_private_or_metadata_address(outside, egress):
    """The outside host: this host reaches its three addresses; a sandbox reaches the documentation address only,
    seen there as this host's address (NAT), never the metadata or the private one."""
    router, (internet, metadata, private) = outside
    for addr in (internet, metadata, private):
        with socket.create_connection((addr, 8080), timeout=5) as s:
            s.sendall(b"x")
            assert s.recv(64).startswith(b"peer=")
    assert connect(egress, internet, 8080, "x") == f"peer={router}"
    assert connect(egress, metadata, 8080) == "closed"
    assert connect(egress, private, 8080) == "closed"


def test_sandboxes_bind_one_port_and_never_reach_each_other(base_image):
    """Eight egress sandboxes at once, each serving on port 8000 (a task's fixed port): every one answers on its own
    address, none reaches another's; each gets its own address, and its veth goes with it."""
    serve = ("python3 -c \"import socket\ns = socket.create_server(('0.0.0.0', 8000))\nwhile True:\n"
             "    c, p = s.accept(); c.recv(64); c.sendall(b'me\\n'); c.close()\" > /dev/null 2>&1 &")
    boxes = [Sandbox(base_image, network=network.EGRESS, memory_mb=256) for _ in range(8)]
    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda sb: sb.start(), boxes))
        for sb in boxes:
            sb.exec(serve)
        for sb in boxes:  # each server up (python's start, on a loaded host) before anything is concluded
            for _ in range(60):
                if connect(sb, "127.0.0.1", 8000, "x") == "me":
                    break
                time.sleep(0.5)
        assert len({sb.address for sb in boxes}) == 8
        for i, sb in enumerate(boxes):
            assert connect(sb, sb.address, 8000, "x") == "me", i
            other = boxes[(i + 1) % 8]
            assert connect(sb, other.address, 8000) == "closed", (sb.address, other.address)
        ports = [f"{network.PORT}{int(ipaddress.ip_address(sb.address)) - int(network.ensure().subnet[0])}"
                 for sb in boxes]
        assert all(os.path.exists(f"/sys/class/net/{p}") for p in ports)
    finally:
        for sb in boxes:
            sb.close()
    for _ in range(50):  # the kernel removes a veth with its namespace, a moment after the container
        if not any(os.path.exists(f"/sys/class/net/{p}") for p in ports):
            break
        time.sleep(0.1)
    assert not any(os.path.exists(f"/sys/class/net/{p}") for p in ports)
    assert daemon.my_containers() == []


def test_rules_set_once_whatever_the_processes(egress):
    """Each process writes the rules again at its start (8 ranks do at once): the jumps to the project's chains stay
    first, one of each, and each chain holds its rules once."""
    for _ in range(2):
        subprocess.run([sys.executable, "-c", "from actobs.sandbox import network; network.ensure()"], cwd=ROOT,
                       check=True)
    for table, chain, jumps in (("filter", "INPUT", [f"-i {network.BRIDGE} -j {network.CHAIN_IN}"]),
                                ("filter", "FORWARD", [f"-i {network.BRIDGE} -j {network.CHAIN_FWD}",
                                                       f"-o {network.BRIDGE} -j {network.CHAIN_FWD}"])):
        rules = [ln[len(f"-A {chain} "):] for ln in subprocess.check_output(
            ["iptables", "-w", "-t", table, "-S", chain], text=True).splitlines() if ln.startswith("-A ")]
        assert rules[:len(jumps)] == jumps and all(rules.count(j) == 1 for j in jumps)
    chain = subprocess.check_output(["iptables", "-w", "-S", network.CHAIN_FWD], text=True).splitlines()
    assert len(set(chain)) == len(chain) and chain[-1] == f"-A {network.CHAIN_FWD} -j ACCEPT"  # rewritten, not added


def test_rules_undone_while_the_run_goes_on_are_put_back(base_image):
    """What a node can do to the rules between two sandboxes: a flush of the project's chains (`iptables -F` flushes
    every chain) and another daemon's jumps put first in FORWARD and nat PREROUTING (Docker's DOCKER-USER on each
    restart). The next egress sandbox finds them and puts the rules back before it gets a network: it still reaches
    nothing of the host's, and each jump is first again, one copy of it (the one the foreign jump pushed down goes)."""
    net = network.ensure()
    for cmd in (["-F", network.CHAIN_FWD], ["-F", network.CHAIN_IN], ["-I", "FORWARD", "1", "-j", "ACCEPT"],
                ["-t", "nat", "-I", "PREROUTING", "1", "-j", "RETURN"]):
        subprocess.run(["iptables", "-w", *cmd], check=True)
    try:
        assert not network._placed(net)
        anywhere = Listener()
        try:
            with Sandbox(base_image, network=network.EGRESS, memory_mb=256) as sb:
                assert all(connect(sb, host, anywhere.port) == "closed" for host in [str(net.gateway),
                                                                                     *host_addresses()])
        finally:
            anywhere.close()
        assert network._placed(net) and anywhere.peers == []
        for table, chain, jumps in (("filter", "FORWARD", [f"-i {network.BRIDGE} -j {network.CHAIN_FWD}",
                                                           f"-o {network.BRIDGE} -j {network.CHAIN_FWD}"]),
                                    ("nat", "PREROUTING", [f"-i {network.BRIDGE} -j RETURN"])):
            rules = [ln[len(f"-A {chain} "):] for ln in subprocess.check_output(
                ["iptables", "-w", "-t", table, "-S", chain], text=True).splitlines() if ln.startswith("-A ")]
            assert rules[:len(jumps)] == jumps and all(rules.count(j) == 1 for j in jumps), rules
    finally:  # the foreign jumps go (the project's stay first in any case)
        subprocess.run(["iptables", "-w", "-D", "FORWARD", "-j", "ACCEPT"], check=True)
        subprocess.run(["iptables", "-w", "-t", "nat", "-D", "PREROUTING", "-j", "RETURN"], check=True)


def test_a_host_without_it_stops_the_run(monkeypatch, base_image):
    """Where the network cannot be made (here: IP forwarding off), run_oracle raises before any sandbox starts,
    saying why, rather than ending each episode as a sandbox_error; a task that does not allow the internet runs."""
    monkeypatch.setattr(network, "_egress", None)
    real = network._read
    monkeypatch.setattr(network, "_read", lambda p: "0\n" if p.endswith("ip_forward") else real(p))
    pay = {"test.sh": b"echo 1 > /logs/verifier/reward.txt\n"}
    online = Task("online", "x", image=base_image, tests=pay, memory_mb=256)
    with pytest.raises(network.NetworkUnavailable, match="IP forwarding is off"):
        envs.run_oracle([online], network=network.EGRESS)
    assert daemon.my_containers() == []
    offline = Task("offline", "x", image=base_image, tests=pay, memory_mb=256, allow_internet=False)
    ep, = envs.run_oracle([offline], noop=True, network=network.EGRESS)
    assert (ep.reward, ep.failure) == (1.0, None)


# ----------------------------------------------------------------------------------------------------------
# The host's packages (.ci/packages.sh), on fake hosts

# The packages the fake hosts may have or get, (version, relations) (no files: apt only simulates). containerd.io and
# docker-ce declare their relations as Docker's repository does; Debian's docker.io needs Debian's containerd
PACKAGES = {
    "docker.io": ("20.10.24", "Depends: containerd (>= 1.6), runc (>= 1.1), iptables"),
    "containerd": ("1.6.20", ""), "runc": ("1.1.5", ""), "debootstrap": ("1.0.128", ""), "xfsprogs": ("6.1.0", ""),
    "btrfs-progs": ("6.2", ""), "iptables": ("1.8.9", ""), "iproute2": ("6.1.0", ""),
}
INSTALLED = {
    "containerd.io": ("1.7.27", "Provides: containerd, runc\nConflicts: containerd, runc\nReplaces: containerd, runc"),
    "docker-ce": ("28.1.1", "Depends: containerd.io (>= 1.7), iptables\nConflicts: docker, docker.io, docker-engine"),
    "iptables": ("1.8.9", ""),
}


def stanza(name, version, rest, status=None):
    """A package's entry: in dpkg's database with its `status`, else in the repository's index."""
    where = f"Status: {status}\n" if status else f"Filename: ./{name}.deb\nSize: 1\n"
    return f"Package: {name}\nVersion: {version}\nArchitecture: all\n" + (f"{rest}\n" if rest else "") + where + \
        "Description: fake\n\n"


@pytest.fixture(scope="module")
def apt_repo(tmp_path_factory):
    """A local repository holding PACKAGES, for apt-get on the fake hosts."""
    repo = tmp_path_factory.mktemp("repo")
    (repo / "Packages").write_text("".join(stanza(n, *v) for n, v in PACKAGES.items()))
    data = (repo / "Packages").read_bytes()
    (repo / "Release").write_text(f"Origin: fake\nDate: Thu, 01 Jan 2026 00:00:00 UTC\nSHA256:\n "
                                  f"{hashlib.sha256(data).hexdigest()} {len(data)} Packages\n")
    return repo


def fake_host(tmp, repo, installed=(), commands=(), socket_=False):
    """Run .ci/packages.sh on a fake host: dpkg's database holding `installed` (names of INSTALLED), only `commands`
    on PATH, /run empty but for Docker's socket where `socket_`. apt-get is the real one, simulating (-s) on that
    database and the local repository; each call's arguments go to apt.log. Returns (exit status, output, the
    calls)."""
    (tmp / "dpkg" / "info").mkdir(parents=True)
    (tmp / "dpkg" / "status").write_text("".join(stanza(n, *INSTALLED[n], "install ok installed") for n in installed))
    for d in ("lists/partial", "cache/archives/partial", "parts", "bin"):
        (tmp / d).mkdir(parents=True)
    (tmp / "sources.list").write_text(f"deb [trusted=yes] file:{repo} ./\n")
    opts = " ".join(f"-o {k}={v}" for k, v in {
        "Dir::State::status": tmp / "dpkg/status", "Dir::State::Lists": tmp / "lists", "Dir::Cache": tmp / "cache",
        "Dir::Etc::SourceList": tmp / "sources.list", "Dir::Etc::SourceParts": tmp / "parts",
        "Dir::State::extended_states": tmp / "extended_states", "Debug::NoLocking": 1,
        "APT::Sandbox::User": "root"}.items())
    wrappers = {"apt-get": f'echo "$*" >> {tmp}/apt.log\n[ "$1" = update ] || set -- -s "$@"\n'
                           f'exec /usr/bin/apt-get {opts} "$@"',
                "dpkg-query": f'exec /usr/bin/dpkg-query --admindir={tmp}/dpkg "$@"',
                **{c: "exit 0" for c in commands}}
    for name, body in wrappers.items():
        (tmp / "bin" / name).write_text(f"#!/bin/bash\nexport PATH=/usr/sbin:/usr/bin:/sbin:/bin\n{body}\n")
        (tmp / "bin" / name).chmod(0o755)
    sock = ("python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"/var/run/docker.sock\")' && "
            if socket_ else "")
    # a mount namespace of its own: /run and /var/run (where it is not a link to /run) empty, whatever Docker this
    # machine runs
    script = (f"mount -t tmpfs tmpfs /run && {{ [ -L /var/run ] || mount -t tmpfs tmpfs /var/run; }} && {sock}"
              f"env -i PATH={tmp}/bin /bin/bash {ROOT}/.ci/packages.sh")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
                       capture_output=True, text=True)
    log = tmp / "apt.log"
    return r.returncode, r.stdout + r.stderr, log.read_text().splitlines() if log.exists() else []


def test_a_nodes_docker_is_left_alone(tmp_path, apt_repo):
    """A GPU node: docker-ce and containerd.io from Docker's repository, their dockerd and iptables. Only the missing
    tools are asked for, with removals refused, and apt installs them removing nothing; docker.io, asked for on the
    same host, would have removed the node's Docker, and --no-remove refuses it."""
    code, out, calls = fake_host(tmp_path, apt_repo, ["containerd.io", "docker-ce", "iptables"],
                                 ["dockerd", "iptables", "ip"])
    assert code == 0, out
    assert calls == ["update -qq", "install -y -qq --no-remove debootstrap xfsprogs btrfs-progs"]
    assert "Remv" not in out and all(f"Inst {p} " in out for p in ("debootstrap", "xfsprogs", "btrfs-progs"))
    apt = tmp_path / "bin" / "apt-get"
    old = subprocess.run([apt, "install", "-y", "docker.io"], capture_output=True, text=True)
    assert "Remv docker-ce" in old.stdout and "Remv containerd.io" in old.stdout  # what `install docker.io` did
    guarded = subprocess.run([apt, "install", "-y", "--no-remove", "docker.io"], capture_output=True, text=True)
    assert guarded.returncode != 0 and "remove is disabled" in guarded.stderr


@pytest.mark.parametrize("installed, commands, socket_, asked", [
    ((), (), False, "docker.io debootstrap xfsprogs btrfs-progs iptables iproute2"),  # a fresh machine
    ((), ("debootstrap", "mkfs.xfs", "mkfs.btrfs", "iptables", "ip"), True, None),  # a daemon answering on its socket
    (("containerd.io", "docker-ce", "iptables"), ("dockerd", "debootstrap", "mkfs.xfs", "mkfs.btrfs", "iptables", "ip"),
     False, None),  # nothing missing: apt is not run
])
def test_only_whats_missing(tmp_path, apt_repo, installed, commands, socket_, asked):
    code, out, calls = fake_host(tmp_path, apt_repo, installed, commands, socket_)
    assert code == 0, out
    assert calls == ([] if asked is None else ["update -qq", f"install -y -qq --no-remove {asked}"])
    assert "Remv" not in out


def test_containerd_io_without_docker_stops(tmp_path, apt_repo):
    """containerd.io alone (a node's container runtime, no Docker engine): docker.io would replace it, so nothing is
    asked of apt and the script says what to install instead."""
    code, out, calls = fake_host(tmp_path, apt_repo, ["containerd.io"], ["iptables", "ip"])
    assert code == 1 and calls == [] and "Install docker-ce" in out
