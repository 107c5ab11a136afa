"""
The sandboxes' images, built offline: the base image (debootstrap of a minimal Debian with what the terminal and the
generated tasks need) and the offline Terminal-Bench 2.0 stand-in (Debian trixie, Python 3.13, pip, uv and wheels of
the verifiers' pytest pins), tagged as the FROM images Harbor tasks name, so their Dockerfiles build without a
registry. `python envs.py base-image [--standin]`; docs/sandboxes.md. A real run stands in only when asked
(ablation.sh --offline-images); otherwise it pulls the tasks' own images over these tags (tasks.pull_image).
"""
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from actobs.sandbox.daemon import docker_client, docker_env, image_exists

BASE_PACKAGES = ["tmux", "python3", "procps", "jq"]  # tmux: the terminal; the rest: what generated tasks use
STANDIN_SUITE = "trixie"  # ships Python 3.13: Terminal-Bench 2.0 verifiers run `uvx -p 3.13 ...`
# The FROM lines of Terminal-Bench 2.0 tasks, and of Endless Terminals' (ubuntu:22.04)
STANDIN_TAGS = ["ubuntu:24.04", "python:3.13-slim-bookworm", "ubuntu:22.04"]
HOST_CAS = "/usr/local/share/ca-certificates"  # the host's extra CA certificates, trusted by the stand-in too
UV_VERSION = "0.9.7"
VERIFIER_PINS = ["pytest==8.4.1", "pytest-json-ctrf==0.3.5"]  # what Terminal-Bench 2.0 tests/test.sh install
DEBIAN_MIRROR = os.environ.get("ACTOBS_DEBIAN_MIRROR")  # unset: debootstrap's own default mirror
# The stand-in's uv is offline (build_uv_image sets UV_OFFLINE=1); a sandbox given the network lifts that and has uv
# trust the system's CAs, which in the stand-in include the host's (a TLS-inspecting egress proxy).
STANDIN_ONLINE = {"UV_OFFLINE": "0", "UV_NATIVE_TLS": "1"}
STANDIN_TOOLS = ("/root/.local/bin", "/opt/actobs-wheels")  # the stand-in's verifier tool kit: uv, uvx, env, wheels


def build_base_image(suite="bookworm", extra_tags=(), rebuild=False, with_uv=False):
    """debootstrap a minimal Debian `suite` with the packages the terminal and the generated tasks need, import it
    as actobs-base:SUITE. with_uv: tag the uv layer (build_uv_image) instead, for Harbor verifiers (uvx pytest)."""
    tag = f"actobs-base:{suite}"
    if rebuild or not image_exists(tag):
        if shutil.which("debootstrap") is None:
            raise SystemExit("debootstrap not found: apt-get install -y debootstrap")
        with tempfile.TemporaryDirectory(prefix="actobs-rootfs-") as root:
            t0 = time.time()
            subprocess.run(["debootstrap", "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES),
                            suite, root] + ([DEBIAN_MIRROR] if DEBIAN_MIRROR else []),
                           check=True, stdout=subprocess.DEVNULL)
            for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):  # keeps the image ~100 MB smaller
                subprocess.run(["find", f"{root}/{junk}", "-type", "f", "-delete"], check=True)
            os.chmod(root, 0o755)  # the temporary folder's 0700 would become /'s mode (btrfs keeps it; overlay2 not)
            tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
            subprocess.run(["docker", "import", "-c", "ENV LANG=C.UTF-8", "-c", 'CMD ["bash"]', "-", tag],
                           stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL, env=docker_env())
            if tar.wait() != 0:
                raise RuntimeError("tar of the debootstrap root failed")
            print(f"built {tag} in {time.time() - t0:.0f}s")
    else:
        print(f"{tag} exists, reused")
    if with_uv:
        tag = build_uv_image(tag)
    for extra in extra_tags or ():
        docker_client().images.get(tag).tag(extra)
        print(f"tagged {tag} as {extra}")
    return tag


def build_uv_image(base):
    """base + pip (no PEP 668 lock, as in python:3.x images) + uv + local wheels of the pytest pins Terminal-Bench
    verifiers install at verification time, with UV_OFFLINE so their `uvx -p 3.13 -w pytest==... pytest` runs
    without a network. apt and pip reach Debian and PyPI only here, at build time, never from a sandbox.
    STANDIN_TOOLS names where uv and the wheels go (verify.py restores them when an agent changed them)."""
    bindir, wheels = STANDIN_TOOLS
    dockerfile = (
        f"FROM {base}\n"
        # The host's own extra CAs (a TLS-inspecting egress proxy): task builds then reach PyPI as the host does.
        "COPY ca/ /usr/local/share/ca-certificates/\n"
        "RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-pip python-is-python3 "
        "ca-certificates >/dev/null && update-ca-certificates >/dev/null && "
        "rm -rf /var/lib/apt/lists/* /usr/lib/python3*/EXTERNALLY-MANAGED\n"
        f"COPY uv uvx {bindir}/\nCOPY wheels {wheels}\n"
        f"RUN chmod 755 {bindir}/uv {bindir}/uvx && "
        f"echo 'export PATH=\"$HOME/.local/bin:$PATH\"' > {bindir}/env\n"
        # Offline, apt's default retries turn a verifier's `apt-get update` into a 7 s wait.
        "RUN echo 'Acquire::Retries \"0\";' > /etc/apt/apt.conf.d/80actobs-offline\n"
        f"ENV UV_OFFLINE=1 UV_FIND_LINKS={wheels} UV_PYTHON_DOWNLOADS=never\n"
        f"RUN {bindir}/uvx {' '.join('--with ' + p for p in VERIFIER_PINS)} pytest --version\n")
    cas = {p.name: p.read_bytes() for p in sorted(Path(HOST_CAS).glob("*.crt"))}
    key = dockerfile + UV_VERSION + docker_client().images.get(base).id + repr(cas)
    tag = f"{base}-uv-{hashlib.sha256(key.encode()).hexdigest()[:12]}"  # a new base or layer -> a new image
    if image_exists(tag):
        print(f"{tag} exists, reused")
        return tag
    import zipfile
    with tempfile.TemporaryDirectory(prefix="actobs-uv-") as ctx:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:"]
        env = dict(os.environ, PIP_CONSTRAINT="")  # a site-wide constraints file must not move these pins
        subprocess.run(pip + ["--no-deps", "-d", f"{ctx}/uvwheel", f"uv=={UV_VERSION}"], check=True, env=env)
        subprocess.run(pip + ["-d", f"{ctx}/wheels"] + VERIFIER_PINS, check=True, env=env)  # pure-Python wheels
        with zipfile.ZipFile(next(Path(ctx, "uvwheel").glob("*.whl"))) as whl:
            for name in ("uv", "uvx"):
                Path(ctx, name).write_bytes(whl.read(f"uv-{UV_VERSION}.data/scripts/{name}"))
        Path(ctx, "ca").mkdir()
        for name, data in cas.items():
            Path(ctx, "ca", name).write_bytes(data)
        Path(ctx, "Dockerfile").write_text(dockerfile)
        t0 = time.time()
        docker_client().images.build(path=ctx, tag=tag, network_mode="host", rm=True, forcerm=True)
    print(f"built {tag} in {time.time() - t0:.0f}s")
    return tag
