"""
A sandbox's files, read and written from this host through its container (sandbox.Sandbox.container), no program in
the container asked: files in and out as one tar archive through the daemon, and what changed since the container
started from its image (overlay2's upper dir walked here against the image's layers, or the daemon's diff). The walk
(walk_layer) is also disk.py's measure of the layer: bounded in entries, depth and time, past which it raises.
sandbox.py uploads a task's files with put_files; verify.py reads what the agent changed and what the verifier wrote.
"""
import errno
import io
import os
import stat
import tarfile
import time

from actobs.sandbox.daemon import SandboxError

# The bounds of a walk of a sandbox's layer (walk_layer): past any of them the layer is not measured, and whoever
# asked treats the sandbox as over its disk budget (fail closed). A tree deeper than MAX_DEPTH would hold that many
# folders open at once. A path longer than PATH_MAX names nothing a program finds by its whole name (a loader, an
# interpreter's start-up): upper_changes leaves such paths out.
MAX_DEPTH = 128
PATH_MAX = 4095

# ----------------------------------------------------------------------------------------------------------
# Files in and out

def put_files(container, files):
    """files: iterable of (absolute path, bytes, mode). Uploaded as one tar archive at /."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, data, mode in files:
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    if not container.put_archive("/", buf.getvalue()):
        raise SandboxError("put_archive failed")


def get_file(container, path):
    """Bytes of one file in the container, or None if it does not exist."""
    import docker
    try:
        stream, _ = container.get_archive(path)
    except docker.errors.NotFound:
        return None
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
        member = tar.next()
        return tar.extractfile(member).read() if member and member.isfile() else None


def get_files(container, folder, names):
    """Bytes of each of `names` in `folder` (None where it is missing or not a regular file), from one
    archive of the folder: one round trip through the daemon for several small files."""
    import docker
    try:
        stream, _ = container.get_archive(folder)
    except docker.errors.NotFound:
        return [None] * len(names)
    top = os.path.basename(folder.rstrip("/"))
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
        members = {m.name: m for m in tar.getmembers()}

        def read(name):
            m = members.get(f"{top}/{name}")
            return tar.extractfile(m).read() if m is not None and m.isfile() else None
        return [read(n) for n in names]


# ----------------------------------------------------------------------------------------------------------
# What changed since the image

def overlay_dirs(container):
    """(upper dir, lower dirs top first) of the container's overlay2 layers, read on this host; None for a
    remote daemon or another storage driver."""
    driver = container.attrs.get("GraphDriver", {})
    data = driver.get("Data", {}) if driver.get("Name") == "overlay2" else {}
    upper, lowers = data.get("UpperDir"), data.get("LowerDir")
    if not upper or not lowers or not os.access(upper, os.R_OK):
        return None
    return upper, lowers.split(":")


def _whiteout(st):
    """overlayfs marks a deleted lower file with a character device 0/0 in the layer above."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _xattr(path, name):
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None


def in_layers(lowers, path):
    """Whether `path` is in the image whose overlay layers (top first) are `lowers`: the topmost layer holding it,
    or a whiteout of it, decides; an opaque directory above it in a layer hides the layers below."""
    parts = path.strip("/").split("/")
    for lower in lowers:
        try:
            return not _whiteout(os.lstat(lower + path))
        except OSError:
            pass
        for i in range(len(parts) - 1, 0, -1):  # an ancestor this layer removed (whiteout) or emptied (opaque)
            ancestor = lower + "/" + "/".join(parts[:i])
            try:
                if _whiteout(os.lstat(ancestor)) or _xattr(ancestor, "trusted.overlay.opaque") == b"y":
                    return False
            except OSError:
                pass
    return False


class LayerLimit(RuntimeError):
    """A sandbox's writable layer past what is measured of it: more entries than its inode budget, deeper than
    MAX_DEPTH or not walked in time. Whoever asked treats the sandbox as over its disk budget."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHANGED = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)  # an entry removed, or replaced by a file or a link


def _changed(error, path, vanished):
    """An entry the walk read that went away or changed kind meanwhile: noted in `vanished` (if a list); any other
    error is the walk's own, raised."""
    if error.errno not in _CHANGED:
        raise error
    if vanished is not None:
        vanished.append(path)


def walk_layer(top, max_entries, deadline=None, tick=None, vanished=None):
    """Every entry under the folder `top` as (fd of its folder, that folder's path under top: "" or "/a/b", its name,
    its lstat): a folder's entries in name order, then its sub-folders', depth first. Name order, because a folder
    lists in the file system's own (on ext4 a hash seeded when the file system is made): it differs between
    machines, and what the walk reports (the first limit it meets, the changes a verifier lists) must not. No
    recursion and no path longer than a name: each folder is opened relative to its parent's descriptor, so a deep
    tree costs descriptors (MAX_DEPTH at most), never the stack or PATH_MAX. Raises LayerLimit past max_entries
    entries or MAX_DEPTH levels, or at `deadline` (time.monotonic). An entry that goes away or changes kind while it
    is read (the tree changes under the walk) is appended to the list `vanished`, if given. tick() is called every
    1,024 entries listed and again every 1,024 read; it may raise to stop the walk."""
    stack = [[os.open(top, _DIR_FLAGS), "", None]]  # per open folder: its fd, its path under top, sub-folders left
    listed = read = 0

    def every_1024(n):
        if n % 1024 == 0:
            if deadline is not None and time.monotonic() > deadline:
                raise LayerLimit(f"the sandbox's layer was not walked in time ({listed} entries)")
            if tick is not None:
                tick()

    try:
        while stack:
            level = stack[-1]
            fd, rel, subdirs = level
            if subdirs is None:  # a folder just opened: its entries, listed whole (within max_entries), then sorted
                names = []
                with os.scandir(fd) as it:  # scandir reads through a copy of fd; fd stays ours
                    for entry in it:
                        listed += 1
                        if listed > max_entries:
                            raise LayerLimit(f"more than {max_entries} entries in the sandbox's layer")
                        every_1024(listed)
                        names.append(entry.name)
                level[2] = subdirs = []
                for name in sorted(names):
                    read += 1
                    every_1024(read)
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except OSError as e:
                        _changed(e, f"{rel}/{name}", vanished)
                        continue
                    yield fd, rel, name, st
                    if stat.S_ISDIR(st.st_mode):
                        subdirs.append(name)
                subdirs.reverse()  # popped from the end: the first name first
            if not subdirs:
                os.close(stack.pop()[0])
                continue
            if len(stack) >= MAX_DEPTH:
                raise LayerLimit(f"the sandbox's layer is deeper than {MAX_DEPTH} levels")
            name = subdirs.pop()
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                _changed(e, f"{rel}/{name}", vanished)
                continue
            stack.append([child, f"{rel}/{name}", None])
    finally:
        for level in stack:
            os.close(level[0])


def upper_changes(upper, lowers, max_entries, deadline):
    """{path: "C" or "A"} of a container's overlay2 upper dir against its image's layers (changes), or
    None where the upper dir alone does not say: a directory renamed with overlayfs' redirect_dir keeps its
    content in the lower layer. The walk is walk_layer's, within max_entries and by `deadline` (time.monotonic)."""
    found = {}
    for dir_fd, rel, name, st in walk_layer(upper, max_entries, deadline):
        path = f"{rel}/{name}"
        if _whiteout(st) or len(path) > PATH_MAX:
            continue  # deleted: not a change of what is there; or out of reach of any program in the sandbox
        full = f"/proc/self/fd/{dir_fd}/{name}"  # the entry through its folder's descriptor: short however deep
        if stat.S_ISDIR(st.st_mode) and _xattr(full, "trusted.overlay.redirect") is not None:
            return None
        found[path] = "C" if in_layers(lowers, path) else "A"
    return found


def changes(container, max_entries, deadline):
    """{path: "C" (modified) or "A" (added)} for what changed in the container since it started from its
    image, as the storage driver keeps it (no program in the container is asked): overlay2's upper dir
    walked on this host, or the daemon's diff (its overlay2 diff compares the whole tree with the image's:
    ~0.35 s of the daemon's CPU per call, most of a verification's cost). Raises LayerLimit where the upper dir
    holds more than max_entries entries or is not walked by `deadline` (time.monotonic)."""
    dirs = overlay_dirs(container)
    found = upper_changes(*dirs, max_entries, deadline) if dirs else None
    if found is None:  # not walkable here, or a renamed lower directory (its content is not in the upper dir)
        found = {c["Path"]: "CA"[c["Kind"]] for c in container.diff() or () if c["Kind"] in (0, 1)}
    return found
