"""
A sandbox's disk budget: bytes and entries (inodes) of its writable layer, by the kind of Docker daemon (`quota()`
finds it once per process): what the kernel caps ("size": overlay2 on XFS with project quotas; "btrfs": qgroups),
what holds each allocation where nothing caps (a file-size limit and seccomp rules), and the watch (Budget), which
fails closed: a measurement that errors, cannot finish or falls behind stops the sandbox as over its budget. The
daemon's whole store sits in a file system of fixed size (.ci/dockerd.sh), so the host never fills whatever one
sandbox or a late watch does. What each kind enforces, what is watched, and the limits: docs/sandboxes.md.
"""
import dataclasses
import errno
import functools
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

from actobs.sandbox.container_files import LayerLimit, walk_layer
from actobs.sandbox.daemon import BASE_IMAGE, LABEL, SandboxError, docker_client, owner_label

# The watch (Budget._watch_layer): the file system's counters every DISK_POLL_S; a walk of the layer at least every
# DISK_WALK_MAX_S, WALK_PACE times its CPU time apart (a huge layer costs the watching process at most a sixth of a
# core); a walk of the frozen layer longer than WALK_DEADLINE_S, a watch that has not looked for WATCH_STALE_S, or
# processes that do not freeze within FREEZE_S stop the sandbox as over its budget.
DISK_POLL_S, DISK_WALK_MAX_S, WALK_PACE = 0.2, 1.0, 5
WALK_DEADLINE_S, WATCH_STALE_S, FREEZE_S = 30.0, 20.0, 10.0
BYTES_PER_INODE = 16384  # the default inode budget: an entry per 16 KiB of the bytes, as ext4 makes its inodes
HELD_RESCAN_S, HELD_RESCAN_MB = 1.0, 16  # the deleted files held counted again this often, or after this growth
HELD_MAX = 1 << 20  # open files and mappings looked at per count of those: more, and the sandbox is over its budget
QUOTA_MARGIN_MB = 16  # the kernel's cap is the budget plus this, so a sandbox stopped by the cap shows as over budget
# Docker's default seccomp profile as Docker 28.5.2 ships it, data only (origin and licence: seccomp/SOURCE.md):
# seccomp_profile() adds this module's rules to it.
DOCKER_SECCOMP = Path(__file__).with_name("seccomp") / "docker-default.json"
FALLOC_MODES = (0, 3)  # allowed fallocate modes: plain, and FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
# FS_IOC_RESVSP = _IOW('X', 40, struct space_resv), FS_IOC_RESVSP64 the same with 42: direction, type and number
# under this mask (the size bits out, so the 32-bit forms match too; 40 and 42 differ only in bit 1, out too).
RESVSP_MASK, RESVSP = 0xC000FFFD, 0x40005828


@dataclasses.dataclass(frozen=True)
class DiskQuota:
    """How the kernel caps a sandbox's writable layer on this daemon (see the module's docstring). kind "size":
    the daemon's own per-container size limit (`--storage-opt size=`); kind "btrfs": a qgroup limit this process
    sets on the container's subvolume (root: the data root, sysfs: the qgroups folder)."""
    kind: str
    root: str = ""
    sysfs: str = ""


_quota = None  # the daemon's DiskQuota, or False: its sandboxes get no kernel quota
_seccomp = None  # whether the daemon applies seccomp profiles
_quota_lock = threading.Lock()


def _size_limit_refused():
    """Why the daemon refuses a per-container size limit, or "" when it takes one (a container is created with
    one and removed, never started)."""
    import docker
    try:
        c = docker_client().containers.create(BASE_IMAGE, entrypoint=["true"], labels={LABEL: owner_label()},
                                              network_mode="none", storage_opt={"size": "64M"})
    except docker.errors.ImageNotFound:
        return f"{BASE_IMAGE} is not there to probe it with (`python envs.py base-image`)"
    except docker.errors.APIError as e:
        return e.explanation or str(e)
    c.remove(force=True)
    return ""


def quota():
    """The daemon's DiskQuota, found once; or None, said once on stderr with what then holds the budget."""
    global _quota, _seccomp
    with _quota_lock:
        if _quota is None:
            info = docker_client().info()
            root, driver = info.get("DockerRootDir", ""), info.get("Driver")
            _seccomp = any("name=seccomp" in opt for opt in info.get("SecurityOptions") or ())
            _quota, why = False, ""
            if driver == "btrfs":
                if shutil.which("btrfs") is None or not os.access(root, os.W_OK):
                    why = f"no btrfs command, or {root} is not on this host or not writable by this process"
                else:
                    show = subprocess.run(["btrfs", "filesystem", "show", root], capture_output=True, text=True)
                    uuid = re.search(r"uuid: (\S+)", show.stdout)
                    sysfs = f"/sys/fs/btrfs/{uuid[1]}/qgroups" if uuid else ""
                    if os.path.isdir(sysfs):
                        _quota = DiskQuota("btrfs", root, sysfs)
                    else:
                        why = f"btrfs quotas are off on {root}"
            else:
                refused = _size_limit_refused()
                if refused:
                    backing = dict(info.get("DriverStatus") or ()).get("Backing Filesystem", "?")
                    why = f"the daemon's {driver} driver on {backing} takes no per-container size: {refused}"
                else:
                    _quota = DiskQuota("size")
            if why:
                held = "no file may grow past the budget (ulimit fsize), and " + (
                    "fallocate's preallocating modes, the RESVSP ioctls and io_uring are refused (seccomp)"
                    if _seccomp else "the daemon applies no seccomp: fallocate --keep-size, the RESVSP ioctls "
                    "and io_uring can still allocate past it until the watch stops the sandbox")
                print(f"warning: no disk quota ({why}): {held}; the sum of many files is watched "
                      "(disk.py; .ci/dockerd.sh starts a daemon with a quota where the kernel has XFS quotas)",
                      file=sys.stderr)
        return _quota or None


def _arg(index, op, value, datum=0):
    """A seccomp argument comparison as Docker's profiles write it (MASKED_EQ: value is the mask)."""
    return {"index": index, "op": f"SCMP_CMP_{op}", "value": value, "valueTwo": datum}


@functools.lru_cache(maxsize=1)
def seccomp_profile():
    """Docker's default profile (DOCKER_SECCOMP) with fallocate past FALLOC_MODES, the RESVSP ioctls and io_uring
    taken out, as the JSON text the daemon takes in security_opt."""
    profile = json.loads(DOCKER_SECCOMP.read_text())
    gated = {"fallocate", "ioctl", "io_uring_setup", "io_uring_enter", "io_uring_register"}
    for rule in profile["syscalls"]:
        rule["names"] = [n for n in rule["names"] if n not in gated]
    rules = [{"names": ["fallocate"], "action": "SCMP_ACT_ALLOW", "args": [_arg(1, "EQ", m)]} for m in FALLOC_MODES]
    # Every other mode: EOPNOTSUPP (seccomp compares all 64 bits of the register: upper bits set fall under GT)
    rules += [{"names": ["fallocate"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EOPNOTSUPP,
               "args": [_arg(1, op, m)]} for op, m in (("EQ", 1), ("EQ", 2), ("GT", 3))]
    # ioctl unless its command matches RESVSP under the mask. An unconditional allow beside a conditional refusal
    # lets everything through (measured), and seccomp has no "masked not equal": so one allow per masked bit, for
    # the commands equal to RESVSP in the bits above it and different in it. A mask ignores the register's upper
    # 32 bits, which the kernel drops from the command too.
    bits = [1 << b for b in range(31, -1, -1) if RESVSP_MASK >> b & 1]
    for i, bit in enumerate(bits):
        above = sum(bits[:i + 1])
        rules.append({"names": ["ioctl"], "action": "SCMP_ACT_ALLOW",
                      "args": [_arg(1, "MASKED_EQ", above, (RESVSP & above) ^ bit)]})
    profile["syscalls"] += rules
    return json.dumps(profile)


def layer_usage(upper, max_entries, deadline=None, tick=None, vanished=None):
    """(bytes allocated, entries) under overlay2's upper dir `upper`, by container_files.walk_layer (the same bounds
    and arguments). Allocated blocks: fallocate'd space counts, sparse holes do not; a file with several names counts
    once."""
    total, entries, linked = 0, 0, set()
    for _, _, _, st in walk_layer(upper, max_entries, deadline, tick, vanished):
        entries += 1
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            if st.st_ino in linked:
                continue
            linked.add(st.st_ino)
        total += st.st_blocks * 512
    return total, entries


def fs_used(path):
    """(bytes, inodes) in use on the file system holding `path`: its own counters (statvfs, microseconds)."""
    v = os.statvfs(path)
    return (v.f_blocks - v.f_bfree) * v.f_frsize, v.f_files - v.f_ffree


def unlinked_bytes(root, max_handles=HELD_MAX):
    """Bytes of the files that the processes of a container hold open or mapped after deleting them: out of any
    folder's walk, yet on the disk until the last of them lets go. root: the container's / as this host sees it
    (/proc/<its init's pid>/root); its processes are listed by its own /proc, and only files on its root file
    system count (a deleted file on a tmpfs is memory). Raises LayerLimit past max_handles open files and mappings
    (their count is the agent's to choose); returns None where the container is gone."""
    try:
        dev, pids = os.stat(root).st_dev, os.listdir(f"{root}/proc")
    except FileNotFoundError:
        return None
    seen, total, handles = set(), 0, 0
    for pid in filter(str.isdigit, pids):
        proc = f"{root}/proc/{pid}"
        try:  # its open files, and its mappings of deleted files (the maps' text: cheaper than a stat per mapping)
            held = [f"{proc}/fd/{fd}" for fd in os.listdir(f"{proc}/fd")]
            with open(f"{proc}/maps") as maps:
                held += [f"{proc}/map_files/{line.split()[0]}" for line in maps if line.endswith(" (deleted)\n")]
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process is gone
        handles += len(held)
        if handles > max_handles:
            raise LayerLimit(f"more than {max_handles} open files and mappings in the sandbox to count")
        for path in held:
            try:
                st = os.stat(path)
            except OSError:
                continue  # closed meanwhile, or a descriptor of no file (a socket, an anonymous inode)
            if st.st_nlink == 0 and st.st_dev == dev and st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


def _cgroup_file(pid, controller, name, mode=os.W_OK):
    """The file `name` of the cgroup of the container whose init has host pid `pid`, in cgroup v1's `controller`
    hierarchy, or in v2's single one where controller is None; None where this host cannot use it (`mode`)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller is None and controllers == "":
            folders = ["", "unified"]  # v2's single hierarchy, at the root or (a hybrid host) under unified/
        elif controller is not None and controller in controllers.split(","):
            folders = [controller]
        else:
            continue
        for folder in folders:
            f = Path("/sys/fs/cgroup", folder, path.lstrip("/"), name)
            if os.access(f, mode):
                return f
    return None


def freeze(container, pid, frozen):
    """Stop (frozen) or let go on every process of the container whose init has host pid `pid`, from this host
    through its cgroup's freezer (at once), else through the daemon (docker pause). Returns once they are."""
    v1 = _cgroup_file(pid, "freezer", "freezer.state")
    v2 = None if v1 else _cgroup_file(pid, None, "cgroup.freeze")
    if v1 is None and v2 is None:
        (container.pause if frozen else container.unpause)()
        return
    if v1 is not None:
        v1.write_text("FROZEN" if frozen else "THAWED")
        done = lambda: v1.read_text().strip() == ("FROZEN" if frozen else "THAWED")  # noqa: E731
    else:
        v2.write_text("1" if frozen else "0")
        done = lambda: f"frozen {int(frozen)}" in v2.with_name("cgroup.events").read_text()  # noqa: E731
    t0 = time.monotonic()
    while not done():  # FREEZING: a process in the middle of a system call gets there at its end
        if time.monotonic() - t0 > FREEZE_S:
            raise RuntimeError(f"the sandbox's processes did not {'freeze' if frozen else 'thaw'} in {FREEZE_S:.0f} s")
        time.sleep(0.001)


def kill_from_host(pid):
    """SIGKILL every process in the cgroup of the container whose init has host pid `pid`, but that init, from this
    host: at once, where a `docker exec` of the kill takes 70 ms on an idle host and seconds on a busy one while the
    writers go on. Nothing where the cgroup is not readable here. (Frozen processes die when thawed.)"""
    procs = _cgroup_file(pid, "pids", "cgroup.procs", os.R_OK) or _cgroup_file(pid, None, "cgroup.procs", os.R_OK)
    if procs is None:
        return
    ns = os.readlink(f"/proc/{pid}/ns/pid")
    for p in map(int, procs.read_text().split()):
        try:  # only the sandbox's own processes, whatever the cgroup file listed
            if p != pid and os.readlink(f"/proc/{p}/ns/pid") == ns:
                os.kill(p, signal.SIGKILL)
        except OSError:
            pass  # gone


class HostRise:
    """`with HostRise() as rise:` -> rise.mb: how far the disk holding `path` (default: the daemon's data root)
    filled past its level at the start, at most, sampled every `every` s while the block ran (a measure for tests
    and benchmarks: every writer on that disk counts)."""

    def __init__(self, every=0.05, path=None):
        self.every, self.path, self.mb, self._done = every, path, 0.0, threading.Event()

    def __enter__(self):
        root = self.path or docker_client().info()["DockerRootDir"]
        free0 = shutil.disk_usage(root).free

        def sample():
            while not self._done.wait(self.every):
                self.mb = max(self.mb, (free0 - shutil.disk_usage(root).free) / 2**20)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


class Budget:
    """One sandbox's disk budget: `mb` MB and `inodes` entries in its writable layer (default: one per
    BYTES_PER_INODE of the bytes). create_options: what enforces it on this daemon at create; limit: the cap set
    before the container starts; watch: the measurement, from start until close. `exceeded` says why the watch
    stopped the sandbox, or is ""; stale() whether the watch fell behind (the sandbox is then treated as over)."""

    def __init__(self, mb, inodes=None):
        self.mb, self.inodes, self.exceeded = mb, inodes or max(1, mb * 2**20 // BYTES_PER_INODE), ""
        self.quota = None  # the daemon's DiskQuota, found at create_options
        self.qgroup = None  # the sysfs folder of the writable layer's qgroup, on a btrfs daemon with quotas
        self.checked = time.monotonic()  # when the watch last measured or looked at the counters
        self.peak = (0, 0)  # the largest layer a walk measured: bytes (deleted files held included), entries
        # The sandbox's processes are stopped for a walk (thawed before the watch lets go): set before the freeze
        # begins and cleared once the thaw is done, so a command the runtime refused meanwhile knows why (Sandbox.exec)
        self.frozen = False
        self.freezes = 0  # freezes begun
        self._closed = threading.Event()

    def create_options(self):
        """containers.create's keyword arguments for the budget on this daemon."""
        import docker
        self.quota = quota()
        if self.quota is not None:
            return {"storage_opt": {"size": f"{self.mb + QUOTA_MARGIN_MB}M"}} if self.quota.kind == "size" else {}
        ulimits = [docker.types.Ulimit(name="fsize", soft=self.mb * 2**20, hard=self.mb * 2**20),
                   docker.types.Ulimit(name="core", soft=0, hard=0)]
        return {"ulimits": ulimits, **({"security_opt": [f"seccomp={seccomp_profile()}"]} if _seccomp else {})}

    def limit(self, container):
        """On btrfs, cap the writable layer's subvolume: its exclusive bytes (what the sandbox wrote, not the image
        it shares) at the budget + QUOTA_MARGIN_MB. Before the container starts."""
        if self.quota is None or self.quota.kind != "btrfs":
            return
        root = self.quota.root
        try:
            mount_id = Path(root, "image/btrfs/layerdb/mounts", container.id, "mount-id").read_text().strip()
            subvol = str(Path(root, "btrfs/subvolumes", mount_id))
            rootid = subprocess.run(["btrfs", "inspect-internal", "rootid", subvol], check=True,
                                    capture_output=True, text=True).stdout.strip()
            subprocess.run(["btrfs", "qgroup", "limit", "-e", str((self.mb + QUOTA_MARGIN_MB) * 2**20), subvol],
                           check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SandboxError(f"could not set the disk quota: {getattr(e, 'stderr', '') or e}") from None
        self.qgroup = Path(self.quota.sysfs, f"0_{rootid}")

    def stale(self):
        """Why the sandbox is treated as over its budget though the watch did not say so: the watch fell behind
        (it has not looked for WATCH_STALE_S: a thread starved or stuck), or ""."""
        late = time.monotonic() - self.checked
        if self._closed.is_set() or late <= WATCH_STALE_S:
            return ""
        return f"the disk watch fell behind (nothing measured for {late:.0f} s): stopped as over the disk budget"

    def watch(self, container, upper):
        """Start measuring the writable layer (upper: overlay2's upper dir on this host, or None) until close; past
        the budget, or when a measurement fails or cannot finish, kill every process in the container."""
        self.checked = time.monotonic()
        threading.Thread(target=self._watch, args=(container, upper), daemon=True).start()

    def _watch(self, container, upper):
        pid = None
        try:
            container.reload()  # here, not in the sandbox's start: its init's pid, known once it started
            pid = container.attrs["State"]["Pid"]
            self._watch_layer(container, pid, upper) if upper else self._watch_daemon(container)
        except LayerLimit as e:
            self._stop(container, pid, f"{e}: stopped as over the disk budget")
        except BaseException as e:  # fail closed: only a sandbox that is gone ends the watch quietly
            if not self._closed.is_set() and not _gone(container):
                self._stop(container, pid, f"the disk watch could not measure the sandbox ({type(e).__name__}: {e}): "
                                           "stopped as over the disk budget")
        finally:
            if self.frozen:
                try:
                    self._freeze(container, pid, False)
                except Exception:
                    pass  # gone

    def _stop(self, container, pid, why):
        """Over the budget: every process in the sandbox killed, from this host at once where its cgroup is
        readable here (frozen ones die as they are thawed), then by a `docker exec` of `kill -9 -1`, atomic against
        a fork in between. A way that fails leaves it to the next."""
        self.exceeded = why
        for kill in (lambda: pid and kill_from_host(pid), lambda: self.frozen and self._freeze(container, pid, False),
                     lambda: container.exec_run(["bash", "-c", "kill -9 -1"], user="root")):
            try:
                kill()
            except Exception:
                pass

    def _freeze(self, container, pid, frozen):
        if frozen:
            self.freezes, self.frozen = self.freezes + 1, True
        freeze(container, pid, frozen)
        self.frozen = frozen

    def _watch_daemon(self, container):
        """Without overlay2's upper dir here: the qgroup's counters on btrfs (its exclusive bytes plus what is
        reserved for writes not yet committed: the kernel checks the cap against that sum), else the daemon's
        SizeRw (a remote daemon or another driver: slower, and blind to deleted files still held). No inode count:
        btrfs allocates inodes as it goes, within its fixed-size image (.ci/dockerd.sh)."""
        api = docker_client().api  # the SDK's inspect_container has no `size` parameter: the endpoint, directly
        while not self._closed.wait(DISK_POLL_S):
            if self.qgroup is not None:
                used = sum(int((self.qgroup / name).read_text()) for name in ("exclusive", "rsv_data"))
            else:
                used = api._result(api._get(api._url("/containers/{0}/json", container.id), params={"size": 1}),
                                   True).get("SizeRw", 0)
            self.checked = time.monotonic()
            if used > self.mb * 2**20:
                return self._stop(container, None, f"wrote {used / 2**20:.0f} MB, over the disk budget of {self.mb} MB")

    def _walk(self, upper, tick, frozen):
        """One walk of the layer: (bytes, entries, the file system's (bytes, inodes) as it began). Unfrozen, None
        where it cannot stand for the layer: the tree changed under it, or the file system grew past what the layer
        may (tick raised), or it ran past WALK_DEADLINE_S or its entry count (a moving tree may count an entry
        twice); then the frozen layer is walked. Frozen, those bounds raise LayerLimit."""
        fs, vanished = fs_used(upper), []
        try:
            used, entries = layer_usage(upper, self.inodes, time.monotonic() + WALK_DEADLINE_S, tick, vanished)
        except (_Suspect, LayerLimit):
            if frozen:
                raise
            return None
        return None if vanished and not frozen else (used, entries, fs)

    def _held(self, root, fs_bytes):
        """A count of the deleted files the sandbox's processes hold: (bytes, the file system's bytes, when)."""
        return unlinked_bytes(root) or 0, fs_bytes, time.monotonic()

    def _watch_layer(self, container, pid, upper):
        """overlay2's upper dir walked here (layer_usage), plus the files the sandbox's processes deleted but hold
        (unlinked_bytes: counted again each HELD_RESCAN_S, or at once when the file system grew HELD_RESCAN_MB), against
        the budget's bytes and entries. Every DISK_POLL_S the file system's own counters (fs_used): since the last walk
        began the layer can have grown by at most what the file system did; when that could take it past its budget,
        or a walk saw the tree change under it, the sandbox is frozen and walked at rest. The walk's CPU time paces
        the next walk (WALK_PACE, within DISK_POLL_S and DISK_WALK_MAX_S)."""
        limit, root = self.mb * 2**20, f"/proc/{pid}/root"
        held = (0, None, 0.0)  # the last count of deleted files held: bytes, the file system's bytes then, when
        last = None  # the last walk: bytes, entries, the file system's (bytes, inodes) as it began
        due = 0.0  # when the next walk is due (time.monotonic)

        def could_be_over():
            fs_bytes, fs_inodes = fs_used(upper)
            self.checked = time.monotonic()
            return (last[0] + held[0] + max(0, fs_bytes - last[2][0]) > limit
                    or last[1] + max(0, fs_inodes - last[2][1]) > self.inodes)

        def tick():  # every 1,024 entries of an unfrozen walk
            if could_be_over():
                raise _Suspect

        def mark():  # every 1,024 entries of a frozen walk: the watch is not behind
            self.checked = time.monotonic()

        while not self._closed.is_set():
            suspect = last is not None and could_be_over()
            if not suspect and time.monotonic() < due:
                self._closed.wait(DISK_POLL_S)
                continue
            t = time.thread_time()
            walk = None if suspect else self._walk(upper, tick if last is not None else mark, frozen=False)
            if walk is None:
                self._freeze(container, pid, True)
                try:
                    walk = self._walk(upper, mark, frozen=True)
                    held = self._held(root, walk[2][0])
                finally:
                    self._freeze(container, pid, False)
            elif held[1] is None or walk[2][0] - held[1] > HELD_RESCAN_MB * 2**20 \
                    or time.monotonic() - held[2] > HELD_RESCAN_S:
                held = self._held(root, walk[2][0])
            last, self.checked = walk, time.monotonic()
            self.peak = (max(self.peak[0], last[0] + held[0]), max(self.peak[1], last[1]))
            if last[0] + held[0] > limit:
                return self._stop(container, pid, f"wrote {(last[0] + held[0]) / 2**20:.0f} MB, over the disk "
                                                  f"budget of {self.mb} MB")
            due = time.monotonic() + min(max(WALK_PACE * (time.thread_time() - t), DISK_POLL_S), DISK_WALK_MAX_S)

    def close(self):
        self._closed.set()


class _Suspect(Exception):
    """Raised inside an unfrozen walk: the file system grew enough that the layer could be past its budget."""


def _gone(container):
    """Whether the container no longer runs (removed, or its init dead): only then does a failed measurement end
    the watch quietly. A daemon that does not answer does not say it is gone."""
    import docker
    try:
        container.reload()
    except docker.errors.NotFound:
        return True
    except Exception:
        return False
    return not container.attrs["State"].get("Running", False)
