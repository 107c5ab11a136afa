"""
A sandbox's files, read and written from this host through its container (sandbox.Sandbox.container), no program in
the container asked: files in and out as one tar archive through the daemon, and what changed since the container
started from its image (overlay2's upper dir walked here against the image's layers, or the daemon's diff).
sandbox.py uploads a task's files with put_files; verify.py reads what the agent changed and what the verifier wrote.
"""
import io
import os
import stat
import tarfile
import time

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
        from sandbox import SandboxError
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


def upper_changes(upper, lowers):
    """{path: "C" or "A"} of a container's overlay2 upper dir against its image's layers (changes), or
    None where the upper dir alone does not say: a directory renamed with overlayfs' redirect_dir keeps its
    content in the lower layer."""
    found = {}
    for root, dirs, files in os.walk(upper):
        rel = root[len(upper):]
        for name in dirs + files:
            full, path = os.path.join(root, name), f"{rel}/{name}"
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if _whiteout(st):
                continue  # deleted: not a change of what is there
            if stat.S_ISDIR(st.st_mode) and _xattr(full, "trusted.overlay.redirect") is not None:
                return None
            found[path] = "C" if in_layers(lowers, path) else "A"
    return found


def changes(container):
    """{path: "C" (modified) or "A" (added)} for what changed in the container since it started from its
    image, as the storage driver keeps it (no program in the container is asked): overlay2's upper dir
    walked on this host, or the daemon's diff (its overlay2 diff compares the whole tree with the image's:
    ~0.35 s of the daemon's CPU per call, most of a verification's cost)."""
    dirs = overlay_dirs(container)
    found = upper_changes(*dirs) if dirs else None
    if found is None:  # not walkable here, or a renamed lower directory (its content is not in the upper dir)
        found = {c["Path"]: "CA"[c["Kind"]] for c in container.diff() or () if c["Kind"] in (0, 1)}
    return found
