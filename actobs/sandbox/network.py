"""
The network of a sandbox whose task may use the internet (--network egress): the internet through NAT, and nothing
of the host's. A Linux bridge of the project's own (BRIDGE, not Docker's), on which
- every packet a sandbox sends to this host is refused (its loopback, the bridge's gateway address, its other
  addresses: the node's services, a Docker daemon on TCP, other containers' published ports);
- private, shared, link-local (cloud metadata), multicast and reserved addresses and the networks the host sits on
  are never reached, but for DNS (port 53) to the host's name servers; the rest is reached through NAT as the host
  routes it;
- the bridge's ports are isolated: no sandbox reaches another; each has its own network namespace, so its ports
  are its own (no port is shared);
- no IPv6.
The container is created with Docker's NetworkDisabled (no libnetwork endpoint: docs/sandboxes.md), and this host
plumbs a veth into its namespace once it runs (attach); the veth goes with the container. Needs root, iproute2,
nsenter, iptables and IP forwarding on, and the daemon on this host: ensure() says what is missing and the run
stops. The rules live in chains of their own (ACTOBS-*), which no Docker daemon flushes.
"""
import fcntl
import ipaddress
import json
import os
import random
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass

from actobs.sandbox.daemon import SandboxError

EGRESS, HOST = "egress", "host"  # the --network modes; none: no network
BRIDGE = "actobs-br"
PORT = "actobs-"  # the host ends of the sandboxes' veths: actobs-<n>, n the sandbox's address in the subnet
SUBNETS = ("10.213.0.0/16", "172.30.0.0/16", "192.168.213.0/24")  # the bridge's: the first no route of the host meets
CHAIN_IN, CHAIN_FWD, CHAIN_NAT = "ACTOBS-INPUT", "ACTOBS-FORWARD", "ACTOBS-NAT"
LOCK = "/run/actobs-network.lock"  # one process at a time sets the bridge and the rules up
# Never reached from a sandbox: "this" network, private (RFC 1918), shared (carrier NAT), loopback, link-local
# (169.254.169.254: cloud metadata), multicast, reserved and broadcast
NEVER = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
         "192.168.0.0/16", "224.0.0.0/3")
RESOLVED = "/run/systemd/resolve/resolv.conf"  # systemd-resolved's upstream servers, where /etc/resolv.conf is its stub


class NetworkUnavailable(RuntimeError):
    """No egress network can be made on this host; the message says why."""


@dataclass(frozen=True)
class Egress:
    subnet: ipaddress.IPv4Network
    mtu: int  # the host's route out: the sandboxes' veths take it
    nameservers: tuple  # what a sandbox's /etc/resolv.conf lists
    networks: tuple  # the networks the host sits on: never reached

    @property
    def gateway(self):
        return self.subnet.network_address + 1


_egress, _lock = None, threading.Lock()


def nameservers(resolv, resolved=None, local=()):
    """The IPv4 name servers a sandbox can use: /etc/resolv.conf's text `resolv`, or where it names a loopback server
    (a local stub), systemd-resolved's upstream list `resolved`; this host's own addresses `local` left out (a
    sandbox reaches nothing of the host's)."""
    def servers(text):
        return [ipaddress.ip_address(m) for m in re.findall(r"^\s*nameserver\s+(\S+)", text or "", re.M)
                if re.fullmatch(r"[\d.]+", m)]
    found = servers(resolv)
    if any(s.is_loopback for s in found) and resolved:
        found = servers(resolved)
    return tuple(str(s) for s in found if not s.is_loopback and str(s) not in local)


def ruleset(subnet, servers, networks):
    """iptables-restore input (--noflush) that fills the project's chains: a declared chain is emptied and written in
    one transaction, so a rule is never missing while another process refreshes them. What a sandbox may not reach
    is refused (REJECT: its connection fails at once, as without a route), not left to time out."""
    fwd = [f"-o {BRIDGE} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",  # replies to what a sandbox opened
           f"-o {BRIDGE} -j DROP"]  # nothing else in: not from the host's networks, nor from another sandbox
    fwd += [f"-d {s}/32 -p {proto} --dport 53 -j ACCEPT" for s in servers for proto in ("udp", "tcp")]
    fwd += [f"-d {net} -j REJECT" for net in (*NEVER, *networks)]
    fwd += ["-j ACCEPT"]  # the internet, as the host routes it
    return "\n".join(["*filter", f":{CHAIN_IN} - [0:0]", f":{CHAIN_FWD} - [0:0]",
                      f"-A {CHAIN_IN} -j REJECT",  # every packet from a sandbox to this host
                      *(f"-A {CHAIN_FWD} {r}" for r in fwd), "COMMIT",
                      "*nat", f":{CHAIN_NAT} - [0:0]", f"-A {CHAIN_NAT} ! -d {subnet} -j MASQUERADE", "COMMIT", ""])


def _run(cmd, stdin=None):
    r = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if r.returncode != 0:
        raise NetworkUnavailable(f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return r.stdout


def _ip_json(*args):
    return json.loads(_run(["ip", "-j", *args]) or "[]")


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _bridge():
    """The bridge's subnet. Made the first time (on the first subnet of SUBNETS that no route of the host meets);
    IPv6 off and up every time."""
    made = os.path.exists(f"/sys/class/net/{BRIDGE}")
    addrs = _ip_json("-4", "addr", "show", "dev", BRIDGE)[0]["addr_info"] if made else []
    if not made:
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    if os.path.exists(f"/proc/sys/net/ipv6/conf/{BRIDGE}"):
        with open(f"/proc/sys/net/ipv6/conf/{BRIDGE}/disable_ipv6", "w") as f:
            f.write("1")
    if addrs:
        subnet = ipaddress.ip_network(f"{addrs[0]['local']}/{addrs[0]['prefixlen']}", strict=False)
    else:
        routes = [ipaddress.ip_network(r["dst"]) for r in _ip_json("-4", "route", "show", "table", "all")
                  if r.get("dst", "default") != "default" and r.get("type", "unicast") == "unicast"]
        free = [s for s in map(ipaddress.ip_network, SUBNETS) if not any(s.overlaps(r) for r in routes)]
        if not free:
            raise NetworkUnavailable(f"every subnet of {SUBNETS} meets a route of this host")
        subnet = free[0]
        _run(["ip", "addr", "add", f"{subnet.network_address + 1}/{subnet.prefixlen}", "dev", BRIDGE])
    _run(["ip", "link", "set", BRIDGE, "up"])
    return subnet


def _jumps(subnet):
    """[(tool, table, chain, rules)]: the rules (iptables -S form, without `-A chain`) that must come first in each
    of the host's chains: into the project's chains, no DNAT for a sandbox's packets (another daemon's published
    ports would otherwise take them past INPUT), and IPv6 dropped."""
    out = [("iptables", "filter", "INPUT", [f"-i {BRIDGE} -j {CHAIN_IN}"]),
           ("iptables", "filter", "FORWARD", [f"-i {BRIDGE} -j {CHAIN_FWD}", f"-o {BRIDGE} -j {CHAIN_FWD}"]),
           ("iptables", "nat", "PREROUTING", [f"-i {BRIDGE} -j RETURN"]),
           ("iptables", "nat", "POSTROUTING", [f"-s {subnet} -j {CHAIN_NAT}"])]
    if os.path.exists("/proc/sys/net/ipv6"):  # the bridge has IPv6 off; should it come on, nothing passes
        out += [("ip6tables", "filter", "INPUT", [f"-i {BRIDGE} -j DROP"]),
                ("ip6tables", "filter", "FORWARD", [f"-i {BRIDGE} -j DROP", f"-o {BRIDGE} -j DROP"])]
    return out


def _listed(tool, table):
    """{chain: [its rules, iptables -S form without `-A chain`]} of a table."""
    out = {}
    for ln in _run([tool, "-w", "-t", table, "-S"]).splitlines():
        if ln.startswith("-A "):
            chain, rule = ln[3:].split(" ", 1)
            out.setdefault(chain, []).append(rule)
    return out


def _placed(net):
    """Whether the rules are as _place left them: each jump first in its chain, and the project's chains holding as
    many rules as ruleset() writes (a flush, a firewall reload or another daemon putting its own jumps first
    undoes them: the host and its published ports would be reached)."""
    want = ruleset(net.subnet, net.nameservers, net.networks).splitlines()
    tables = {}
    for tool, table, chain, rules in _jumps(net.subnet):
        if (tool, table) not in tables:
            tables[tool, table] = _listed(tool, table)
        have = tables[tool, table]
        if have.get(chain, [])[:len(rules)] != rules:
            return False
    counts = {c: sum(ln.startswith(f"-A {c} ") for ln in want) for c in (CHAIN_IN, CHAIN_FWD, CHAIN_NAT)}
    return all(len(tables[("iptables", "filter" if c != CHAIN_NAT else "nat")].get(c, [])) == n
               for c, n in counts.items())


def _place(net):
    """The project's chains filled (ruleset) and each jump put first where it is not, in one commit per table: the
    copies a jump has anywhere in its chain deleted and the jumps inserted at the top together, so no packet passes
    between the two and repeated placements (a flush, another daemon's jumps put first) leave one copy. Under LOCK."""
    _run(["iptables-restore", "-w", "--noflush"], ruleset(net.subnet, net.nameservers, net.networks))
    tables, commits = {}, {}
    for tool, table, chain, rules in _jumps(net.subnet):
        if shutil.which(f"{tool}-restore") is None:
            raise NetworkUnavailable(f"{tool}-restore is not installed (iptables' package has it)")
        if (tool, table) not in tables:  # one listing a table (filter holds two of the chains)
            tables[tool, table] = _listed(tool, table)
        have = tables[tool, table].get(chain, [])
        if have[:len(rules)] != rules or any(have.count(r) > 1 for r in rules):
            commits.setdefault((tool, table), []).extend(
                [f"-D {chain} {r}" for r in rules for _ in range(have.count(r))]
                + [f"-I {chain} {i} {r}" for i, r in enumerate(rules, 1)])
    for (tool, table), lines in commits.items():
        _run([f"{tool}-restore", "-w", "--noflush"], "\n".join([f"*{table}", *lines, "COMMIT", ""]))


def _setup():
    missing = [t for t in ("ip", "nsenter", "iptables", "iptables-restore") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        raise NetworkUnavailable("the egress network needs root and " + (", ".join(missing) or "iproute2, nsenter, "
                                 "iptables") + (" (not installed)" if missing else ""))
    if tuple(map(int, re.findall(r"\d+", os.uname().release)[:2])) < (4, 18):
        raise NetworkUnavailable(f"kernel {os.uname().release}: isolated bridge ports (no sandbox reaching another) "
                                 "came in 4.18")
    if (_read("/proc/sys/net/ipv4/ip_forward") or "0").strip() != "1":
        raise NetworkUnavailable("IP forwarding is off on this host: `sysctl -w net.ipv4.ip_forward=1` turns it on "
                                 "(a Docker daemon with iptables does the same), with a FORWARD policy of your choice")
    local = {a["local"] for i in _ip_json("-4", "addr") for a in i.get("addr_info", [])}
    servers = nameservers(_read("/etc/resolv.conf"), _read(RESOLVED), local)
    if not servers:
        raise NetworkUnavailable("no name server a sandbox can reach: /etc/resolv.conf (or systemd-resolved's "
                                 f"{RESOLVED}) lists none outside this host")
    outs = [r["dev"] for r in _ip_json("-4", "route", "show", "default") if "dev" in r]
    if not outs:
        raise NetworkUnavailable("this host has no default route: no way out for a sandbox")
    networks = tuple(r["dst"] for r in _ip_json("-4", "route", "show", "table", "main", "scope", "link")
                     if r.get("dev") != BRIDGE and r.get("dst", "default") != "default")
    mtu = min(int(_read(f"/sys/class/net/{d}/mtu") or 1500) for d in outs)
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        net = Egress(_bridge(), mtu, servers, networks)
        _place(net)
    return net


def ensure():
    """The egress network of this host, made or refreshed once per process (the bridge, the rules); raises
    NetworkUnavailable saying what is missing. run_episodes and run_oracle call it before any sandbox, so a run
    without it stops at once."""
    global _egress
    with _lock:
        if _egress is None:
            _egress = _setup()
        return _egress


def attach(container, net):
    """Plumb a running container created with NetworkDisabled into the bridge: eth0 with an address of the subnet,
    the bridge's address its default route, its port isolated. The rules are checked first (_placed) and put back
    where something undid them; where they cannot be, the sandbox gets no network. Returns the address. Raises
    SandboxError."""
    try:
        if not _placed(net):
            with open(LOCK, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                _place(net)
            if not _placed(net):
                raise NetworkUnavailable("the egress rules could not be put back in place")
    except NetworkUnavailable as e:
        raise SandboxError(f"container {container.short_id}: {e}") from None
    container.reload()
    pid = container.attrs["State"]["Pid"]
    ns = f"/proc/{pid}/ns/net"
    # The daemon's process must be this host's and the container's (a client in another PID namespace would plumb
    # some other process), in a namespace of its own
    if container.id not in (_read(f"/proc/{pid}/cgroup") or "") or \
            os.stat(ns).st_ino == os.stat("/proc/self/ns/net").st_ino:
        raise SandboxError(f"container {container.short_id}: its process {pid} is not visible from here (the egress "
                           "network needs the Docker daemon on this host)")
    taken = {int(n[len(PORT):]) for n in os.listdir("/sys/class/net") if re.fullmatch(PORT + r"\d+", n)}
    for _ in range(16):  # another process may take the same number between the listing and the add
        n = random.randrange(2, net.subnet.num_addresses - 1)
        if n in taken:
            continue
        port = f"{PORT}{n}"
        r = subprocess.run(["ip", "link", "add", port, "mtu", str(net.mtu), "type", "veth", "peer", "name", "eth0",
                            "mtu", str(net.mtu), "netns", str(pid)], capture_output=True, text=True)
        if r.returncode == 0:
            break
        if "File exists" not in r.stderr:
            raise SandboxError(f"container {container.short_id}: no veth: {r.stderr.strip()}")
        taken.add(n)
    else:
        raise SandboxError(f"container {container.short_id}: no free address on {BRIDGE}")
    address = net.subnet.network_address + n
    try:
        _run(["ip", "-batch", "-"], f"link set {port} addrgenmode none master {BRIDGE}\n"
             f"link set dev {port} type bridge_slave isolated on\nlink set {port} up\n")
        if (_read(f"/sys/class/net/{port}/brport/isolated") or "").strip() != "1":
            raise NetworkUnavailable(f"{port}: the bridge port is not isolated (kernel 4.18 and iproute2 4.19 have it)")
        _run(["nsenter", f"--net={ns}", "ip", "-batch", "-"], f"link set eth0 addrgenmode none\n"
             f"addr add {address}/{net.subnet.prefixlen} dev eth0\nlink set eth0 up\n"
             f"route add default via {net.gateway}\n")
    except NetworkUnavailable as e:
        raise SandboxError(f"container {container.short_id}: {e}") from None
    return address
