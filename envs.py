"""
Terminal sandboxes for ActObs: Docker containers driven through tmux with the Terminus-2 protocol,
Harbor / Terminal-Bench 2.0 task folders, an embedded procedural task world (taskgen.py), and a
concurrent episode runner used by SFT data generation, GRPO rollouts and evaluation.

Needs a Docker daemon (DOCKER_HOST); `. .ci/dockerd.sh start` starts a private one.

    python envs.py base-image                              # debootstrap bookworm -> actobs-base:bookworm (reused)
    python envs.py base-image --standin                    # trixie + uv/pytest, tagged ubuntu:24.04 and
                                                           # python:3.13-slim-bookworm (Terminal-Bench 2.0's FROMs)
    python envs.py oracle tests/fixtures/harbor-tasks/*    # run solution/solve.sh, print rewards (expect 1.0)
    python envs.py oracle --noop tests/fixtures/harbor-tasks/*   # do nothing, print rewards (expect 0.0)
    python envs.py corpus --out data/corpus --n-sft 200 --n-rl 64 --n-eval 64 --seed 0
    python envs.py sweep                                   # remove sandboxes left by dead processes

Offline images: where no registry is reachable, a Dockerfile's `FROM ubuntu:24.04` is satisfied by a local
image with that tag: `python envs.py base-image --standin` debootstraps Debian trixie (Python 3.13, what
Terminal-Bench 2.0 verifiers ask uv for) with bash, tmux, pip, uv and offline wheels of the verifiers' pytest
pins, and tags it with STANDIN_TAGS; Docker then builds the Harbor Dockerfiles without pulling. Task images are
cached by a hash of environment/ and of the local FROM image.

The terminal needs bash, tmux and coreutils' `timeout` in the image (the base image has them).
"""
import argparse
import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tomllib
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import taskgen
from terminus import (DEFAULT_PROMPT, MAX_DURATION, OUTPUT_HEADER, SCREEN_HEADER, confirm_message, decode, fill_prompt,
                      load_template, pane_diff, parse_error_message, parse_reply, truncate_output, visible_screen,
                      with_warnings)

BASE_IMAGE = "actobs-base:bookworm"
BASE_PACKAGES = ["tmux", "python3", "procps", "jq"]  # tmux: the terminal; the rest: what generated tasks use
STANDIN_SUITE = "trixie"  # ships Python 3.13: Terminal-Bench 2.0 verifiers run `uvx -p 3.13 ...`
STANDIN_TAGS = ["ubuntu:24.04", "python:3.13-slim-bookworm"]  # the FROM lines of Terminal-Bench 2.0 tasks
HOST_CAS = "/usr/local/share/ca-certificates"  # the host's extra CA certificates, trusted by the stand-in too
UV_VERSION = "0.9.7"
VERIFIER_PINS = ["pytest==8.4.1", "pytest-json-ctrf==0.3.5"]  # what Terminal-Bench 2.0 tests/test.sh install
DEBIAN_MIRROR = os.environ.get("ACTOBS_DEBIAN_MIRROR")  # unset: debootstrap's own default mirror
PRIVATE_SOCKET = os.environ.get("ACTOBS_DOCKER_ROOT", "/var/lib/actobs-docker") + "/docker.sock"
LABEL = "actobs.sandbox"  # every container carries it; value = "<hostname>:<pid>" of the owning process
SCREEN = (160, 40)  # tmux window (columns, rows)
DEFAULT_STORAGE_MB = 10240  # disk budget when a task names none (Harbor's default)
DISK_POLL_S = 0.2  # how often a sandbox's writable layer is measured (a walk of a small one: ~0.2 ms)
VERIFIER_TAIL = 2000  # characters of the verifier's output kept on each episode

# ----------------------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("base-image", help="build the Debian base image (debootstrap -> docker import), reuse it")
    b.add_argument("--tag", action="append", help="extra tag(s) for the base image, e.g. ubuntu:24.04")
    b.add_argument("--rebuild", action="store_true", help="build even if the image exists")
    b.add_argument("--with-uv", action="store_true", help="add uv and offline pytest wheels (Harbor verifiers)")
    b.add_argument("--suite", default="bookworm", help="Debian release to debootstrap (image actobs-base:SUITE)")
    b.add_argument("--standin", action="store_true",
                   help=f"the offline Terminal-Bench 2.0 stand-in: --suite {STANDIN_SUITE} --with-uv, tagged {STANDIN_TAGS}")

    o = sub.add_parser("oracle", help="run Harbor tasks with solution/solve.sh and print rewards")
    o.add_argument("tasks", nargs="+", type=Path, help="Harbor task folders")
    o.add_argument("--noop", action="store_true", help="do nothing instead of solving (the reward must be 0)")
    o.add_argument("--concurrency", type=int, default=4)

    c = sub.add_parser("corpus", help="generate tasks, run the scripted expert, write Nemotron-format JSONL")
    c.add_argument("--out", type=Path, required=True, help="output folder: sft.jsonl, rl/, eval/")
    c.add_argument("--n-sft", type=int, default=200, help="SFT tasks (expert episodes)")
    c.add_argument("--n-rl", type=int, default=64, help="RL tasks written as Harbor folders")
    c.add_argument("--n-eval", type=int, default=64, help="evaluation tasks written as Harbor folders")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--concurrency", type=int, default=8)
    c.add_argument("--max-turns", type=int, default=12)
    c.add_argument("--keep-failed", action="store_true", help="also write episodes with reward < 1")
    c.add_argument("--prompt-template", type=Path, help="file with {instruction} and {terminal_state}")

    sub.add_parser("sweep", help="remove sandboxes whose owning process is gone")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
# Docker client, labels, base image

_client = None
_client_lock = threading.Lock()


def docker_client():
    """One shared client; its HTTP pool is sized for many concurrent sandboxes (the SDK default is 10)."""
    global _client
    with _client_lock:
        if _client is None:
            import docker  # imported lazily: importing envs.py must not need a daemon
            if "DOCKER_HOST" not in os.environ and not os.path.exists("/var/run/docker.sock") \
                    and os.path.exists(PRIVATE_SOCKET):  # the daemon of .ci/dockerd.sh
                os.environ["DOCKER_HOST"] = f"unix://{PRIVATE_SOCKET}"
            try:
                _client = docker.from_env(max_pool_size=128, timeout=600)
            except docker.errors.DockerException as e:
                raise RuntimeError(f"no Docker daemon at {os.environ.get('DOCKER_HOST', 'the default socket')} ({e}); "
                                   "start one with `. .ci/dockerd.sh start`") from None
        return _client


_cpus, _warned = None, set()


def host_cpus(cpus):
    """cpus capped to what the Docker host has (Docker refuses more), with a warning once per value."""
    global _cpus
    if _cpus is None:
        _cpus = docker_client().info()["NCPU"]
    if cpus > _cpus and cpus not in _warned:
        _warned.add(cpus)
        print(f"warning: a task asks for {cpus:g} CPUs, the Docker host has {_cpus}; using {_cpus}", file=sys.stderr)
    return min(cpus, _cpus)


def _tree_bytes(path):
    """Bytes allocated under path (st_blocks: fallocate'd space counts, sparse holes do not)."""
    total = 0
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def owner_label():
    return f"{socket.gethostname()}:{os.getpid()}"


def sweep():
    """Remove leftover sandboxes: those whose owning process on this host is gone (killed runs, crashed tests)."""
    removed = 0
    import docker
    # sparse: no inspect per container, which would race with other processes removing theirs
    for c in docker_client().containers.list(all=True, sparse=True, filters={"label": LABEL}):
        host, _, pid = (c.attrs.get("Labels") or {}).get(LABEL, "").rpartition(":")
        if host != socket.gethostname():
            continue
        if pid.isdigit() and _pid_alive(int(pid)):
            continue
        try:
            c.remove(force=True)
            removed += 1
        except docker.errors.NotFound:
            pass
    return removed


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def my_containers():
    """Containers owned by this process (tests assert this is empty after every episode)."""
    return docker_client().containers.list(all=True, sparse=True, filters={"label": f"{LABEL}={owner_label()}"})


def image_exists(tag):
    import docker
    try:
        docker_client().images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


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
            tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
            subprocess.run(["docker", "import", "-c", "ENV LANG=C.UTF-8", "-c", 'CMD ["bash"]', "-", tag],
                           stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL)
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
    without a network. apt and pip reach Debian and PyPI only here, at build time, never from a sandbox."""
    dockerfile = (
        f"FROM {base}\n"
        # The host's own extra CAs (a TLS-inspecting egress proxy): task builds then reach PyPI as the host does.
        "COPY ca/ /usr/local/share/ca-certificates/\n"
        "RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-pip python-is-python3 "
        "ca-certificates >/dev/null && update-ca-certificates >/dev/null && "
        "rm -rf /var/lib/apt/lists/* /usr/lib/python3*/EXTERNALLY-MANAGED\n"
        "COPY uv uvx /root/.local/bin/\nCOPY wheels /opt/actobs-wheels\n"
        "RUN chmod 755 /root/.local/bin/uv /root/.local/bin/uvx && "
        "echo 'export PATH=\"$HOME/.local/bin:$PATH\"' > /root/.local/bin/env\n"
        # Offline, apt's default retries turn a verifier's `apt-get update` into a 7 s wait.
        "RUN echo 'Acquire::Retries \"0\";' > /etc/apt/apt.conf.d/80actobs-offline\n"
        "ENV UV_OFFLINE=1 UV_FIND_LINKS=/opt/actobs-wheels UV_PYTHON_DOWNLOADS=never\n"
        f"RUN /root/.local/bin/uvx {' '.join('--with ' + p for p in VERIFIER_PINS)} pytest --version\n")
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


# ----------------------------------------------------------------------------------------------------------
# Sandbox: one container + one tmux terminal inside it

# Runs once per sandbox as the task's user. PROMPT_COMMAND writes a counter and the expanded prompt each
# time bash is about to show its prompt: the step script uses that to know the shell is back and idle.
# Control files and tmux's socket live in /dev/shm, so an agent's `rm -rf /tmp/*` does not cut the terminal.
TERMINAL_SETUP = r"""
d=/dev/shm/.actobs-$(id -u); mkdir -p "$d"
cat > "$d/rc" <<'RC'
[ -f /etc/bash.bashrc ] && . /etc/bash.bashrc
[ -f ~/.bashrc ] && . ~/.bashrc
PS1='\u@\h:\w\$ '
set -o ignoreeof
__actobs_n=0
PROMPT_COMMAND='__actobs_n=$((__actobs_n+1)); printf "%s\n%s\n" "$__actobs_n" "${PS1@P}" >| /dev/shm/.actobs-$UID/prompt'
RC
printf 'set -g history-limit 10000\nset -g status off\n' > "$d/tmux.conf"
tmux -S "$d/tmux" -f "$d/tmux.conf" new-session -d -s main -x "$1" -y "$2" "bash --rcfile $d/rc -i"
tmux -S "$d/tmux" display -p -t main '#{pane_pid}' > "$d/shellpid"
for i in $(seq 500); do [ -s "$d/prompt" ] && exit 0; sleep 0.01; done
echo "shell prompt did not appear" >&2; exit 1
"""

# One docker exec per terminal step: send the keys, wait (at most $3 seconds) until bash is the terminal's
# foreground process again, has redrawn its prompt (counter moved, when a newline was typed) and the pane's
# last line is that prompt; then, if $5 is 1, print the state and the pane (history + screen) and clear
# tmux's history so the next capture only holds new lines. State `exited`: the agent's shell is gone (it typed
# `exit`, or killed the shell or tmux).
TERMINAL_STEP = r"""
d=/dev/shm/.actobs-$UID; keys=$1; literal=$2; wait_s=$3; newline=$4
tmux() { command tmux -S "$d/tmux" "$@"; }
gone() { echo "exited 0 1"; exit 0; }
read -r shell 2>/dev/null < "$d/shellpid" && [ -d "/proc/$shell" ] || gone
{ read -r c0; read -r _; } < "$d/prompt"
if [ "$literal" = 1 ]; then
  while [ -n "$keys" ]; do tmux send-keys -t main -l -- "${keys:0:2000}" 2>/dev/null || gone; keys=${keys:2000}; done
elif [ -n "$keys" ]; then
  tmux send-keys -t main "$keys" 2>/dev/null || gone
fi
t=${EPOCHREALTIME/./}; end=$(( t + 10#${wait_s/./} * 1000 )); state=busy; n=0; nap=0.001
exec {never}<> <(:)  # a pipe nobody writes: `read -t` on it is a sleep without forking a process
while :; do
  { read -r c; read -r p; } < "$d/prompt"
  if [ "$newline" = 0 ] || [ "$c" != "$c0" ]; then
    read -r -a st 2>/dev/null < "/proc/$shell/stat" || gone
    if [ "${st[7]}" = "$shell" ]; then
      scr=$(tmux capture-pane -p -t main 2>/dev/null); last=${scr##*$'\n'}  # $(...) drops the empty trailing rows
      p=${p%"${p##*[! ]}"}
      if [ "$last" = "$p" ]; then state=idle; break; fi
    fi
  fi
  [ "${EPOCHREALTIME/./}" -ge "$end" ] && break
  read -t "$nap" -u "$never"; ((++n > 20)) && nap=0.005
done
[ -d "/proc/$shell" ] || gone
if [ "$5" = 1 ]; then
  tmux display -p -t main "$state #{history_size} #{history_limit}" \; capture-pane -p -S - -E - -t main \; clear-history -t main 2>/dev/null || gone
else
  echo "$state 0 1"
fi
"""

# PID 1 of every sandbox: bash with every catchable signal ignored. The kernel never delivers SIGKILL/SIGSTOP
# from inside the container to its init, so nothing the agent does (`kill -9 -1`, `kill 1`) stops the
# container, and bash reaps the orphans it adopts (daemons the agent leaves behind).
INIT = 'trap "" HUP INT QUIT TERM USR1 USR2; while :; do sleep 86400 & wait; done'

# Run as root before the verifier: SIGKILL to every process but init and this shell (kill(-1) is atomic
# against fork: a process forking while it runs is killed with its child), then check that nothing but init,
# init's sleep and this shell's own children is left (zombies are dead already; D-state ones get a moment).
STOP_AGENT = r"""
kill -9 -1 2>/dev/null
for i in {1..100}; do
  left=
  for f in /proc/[0-9]*/stat; do
    read -r st 2>/dev/null < "$f" || continue
    pid=${st%% *}; comm=${st#* (}; comm=${comm%) *}; rest=(${st##*) })
    [ "$pid" = 1 ] || [ "$pid" = $$ ] || [ "${rest[0]}" = Z ] || [ "${rest[1]}" = $$ ] && continue
    [ "${rest[1]}" = 1 ] && [ "$comm" = sleep ] && continue
    left+=" $pid($comm)"
  done
  [ -z "$left" ] && exit 0
  sleep 0.05
done
echo "still running after SIGKILL:$left"; exit 1
"""


class SandboxError(RuntimeError):
    pass


class ShellExited(SandboxError):
    """The agent's shell is gone: it typed `exit`, or killed the shell or tmux. The agent's doing."""


class DiskLimit(SandboxError):
    """The sandbox wrote more than its disk budget; its processes were killed."""


class ProcessLimit(SandboxError):
    """The agent's processes hold every process slot of the sandbox (a fork bomb): the terminal cannot run."""


class Sandbox:
    """A container with the task's limits and a tmux terminal; use as a context manager (always removed).
    storage_mb: the disk budget of the container's writable layer, watched every DISK_POLL_S seconds."""

    def __init__(self, image, *, workdir="/app", user="root", cpus=1.0, memory_mb=2048, storage_mb=DEFAULT_STORAGE_MB,
                 pids=1024, network=False, files=()):
        self.image, self.workdir, self.user = image, workdir, user
        self.cpus, self.memory_mb, self.storage_mb = cpus, memory_mb, storage_mb
        self.pids, self.network, self.files = pids, network, files
        self.container = None
        self._start = 0  # pane line where the next observation begins
        self._anchor = ""  # that line's text when it was read
        self.last_idle = False
        self.disk_exceeded = ""  # set by the disk watcher: why the sandbox was stopped
        self._closed = threading.Event()

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self):
        t0 = time.time()
        import docker
        # Created, then started: a container that fails to start is still ours to remove (close()).
        self.container = docker_client().containers.create(
            # The image's own entrypoint is replaced: the container only has to stay up for our execs. PID 1 is
            # bash (INIT). A fixed hostname keeps prompts and observations reproducible from the seed.
            self.image, entrypoint=["bash", "-c", INIT], labels={LABEL: owner_label()},
            hostname="sandbox", network_mode="host" if self.network else "none", mem_limit=f"{self.memory_mb}m",
            memswap_limit=f"{self.memory_mb}m", pids_limit=self.pids, nano_cpus=int(host_cpus(self.cpus) * 1e9),
            working_dir=self.workdir, environment={"LANG": "C.UTF-8"})
        try:
            self.container.start()
        except docker.errors.APIError as e:
            raise SandboxError(f"{self.image}: the container did not start (the image needs bash): "
                               f"{e.explanation}") from None
        threading.Thread(target=self._watch_disk, daemon=True).start()
        # Harbor tasks expect these to exist and be writable by the agent's user.
        code, out = self.exec(f"mkdir -p {self.workdir} /logs/agent /logs/verifier && "
                              "chmod 777 /logs/agent /logs/verifier", user="root")
        if code != 0:
            raise SandboxError(f"{self.image}: could not prepare the container: {decode(out)[-300:]}")
        if self.files:
            self.put_files(self.files)
        code, out = self.exec(["bash", "-c", TERMINAL_SETUP, "setup", str(SCREEN[0]), str(SCREEN[1])])
        if code != 0:
            raise SandboxError(f"terminal did not start in {self.image} (needs bash and tmux): {decode(out)}")
        self.start_s = time.time() - t0

    def _watch_disk(self):
        """Measure the writable layer every DISK_POLL_S s; past the budget, kill every process in the container
        so the host's disk never fills (overshoot: what the agent writes in one poll interval)."""
        container, limit = self.container, self.storage_mb * 2**20
        driver = container.attrs.get("GraphDriver", {})
        upper = driver.get("Data", {}).get("UpperDir") if driver.get("Name") == "overlay2" else None
        if upper is None or not os.access(upper, os.R_OK):
            upper = None  # a remote daemon or another storage driver: ask the daemon (slower, same result)
        took = 0.0
        while not self._closed.wait(max(DISK_POLL_S, 10 * took)):  # a huge tree: at most ~10% of a core
            t = time.time()
            try:
                used = _tree_bytes(upper) if upper else \
                    docker_client().api.inspect_container(container.id, size=True).get("SizeRw", 0)
            except Exception:
                return  # the container is gone
            took = time.time() - t
            if used > limit:
                self.disk_exceeded = f"wrote {used / 2**20:.0f} MB, over the disk budget of {self.storage_mb} MB"
                try:
                    container.exec_run(["bash", "-c", "kill -9 -1"], user="root")
                except Exception:
                    pass
                return

    def stop_agent(self):
        """Kill every process the agent could have started (the terminal, daemons, setsid/nohup children)."""
        code, out = self.exec(["bash", "-c", STOP_AGENT], user="root")
        if code != 0:
            raise SandboxError(f"agent processes could not be stopped: {decode(out)[-300:]}")

    def close(self):
        self._closed.set()
        if self.container is not None:
            try:
                self.container.remove(force=True)
            except Exception:
                pass  # already gone; the start-up sweep catches anything the daemon kept
            self.container = None

    def exec(self, cmd, *, user=None, timeout=None):
        """Run a command; `timeout` runs it under coreutils timeout because exec_run itself cannot time out."""
        if isinstance(cmd, str):
            cmd = ["bash", "-c", cmd]
        if timeout is not None:
            cmd = ["timeout", "-k", "2", str(timeout)] + cmd
        res = self.container.exec_run(cmd, user=user or self.user, workdir=self.workdir,
                                      environment={"LANG": "C.UTF-8"})
        return res.exit_code, res.output

    def put_files(self, files):
        """files: iterable of (absolute path, bytes, mode). Uploaded as one tar archive at /."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path, data, mode in files:
                info = tarfile.TarInfo(path.lstrip("/"))
                info.size, info.mode, info.mtime = len(data), mode, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        if not self.container.put_archive("/", buf.getvalue()):
            raise SandboxError("put_archive failed")

    def get_file(self, path):
        """Bytes of one file in the container, or None if it does not exist."""
        import docker
        try:
            stream, _ = self.container.get_archive(path)
        except docker.errors.NotFound:
            return None
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            return tar.extractfile(member).read() if member and member.isfile() else None

    def _shell_gone(self):
        """True only when a probe ran and found no shell (a probe that cannot even start says nothing)."""
        code, out = self.exec(["bash", "-c", 'read -r p 2>/dev/null < /dev/shm/.actobs-$UID/shellpid && '
                               '[ -d /proc/$p ] && echo alive || echo gone'])
        return out.strip() == b"gone"

    def _pids_full(self):
        stats = self.container.stats(stream=False, one_shot=True)
        return stats.get("pids_stats", {}).get("current", 0) >= 0.95 * self.pids

    def screen(self):
        """Initial observation: the visible screen; also marks the read position for the first diff."""
        screen, _ = self._step("", 5.0, read=True)  # returns as soon as the first prompt is drawn
        return SCREEN_HEADER + screen

    def send(self, keystrokes, duration=1.0, read=True):
        """Type keystrokes (Terminus-2 semantics) and wait until the shell is idle, at most `duration` seconds.
        With read=True return the observation: all output since the last read (a reply's commands are read
        once, after the last one, as Terminus-2 does)."""
        screen, diff = self._step(keystrokes, min(max(float(duration), 0.0), MAX_DURATION), read)
        if not read:
            return None
        if diff is None or not diff.strip():
            return SCREEN_HEADER + screen
        return OUTPUT_HEADER + truncate_output(diff)

    def _step(self, keystrokes, duration, read):
        # A keystroke string that is exactly a tmux key name (C-c, Enter, Up...) is a key; all else is text.
        literal = "0" if re.fullmatch(r"(C-|M-|S-)+\S|Enter|Escape|Tab|BSpace|Up|Down|Left|Right|Home|End|"
                                      r"PageUp|PageDown|PPage|NPage|F\d{1,2}|Space|DC|IC", keystrokes) else "1"
        newline = "1" if ("\n" in keystrokes or "\r" in keystrokes or literal == "0") else "0"
        code, out = self.exec(["bash", "-c", TERMINAL_STEP, "step", keystrokes, literal, f"{duration:.3f}",
                               newline, "1" if read else "0"], timeout=duration + 5)
        text = decode(out)
        header, _, pane = text.partition("\n")
        fields = header.split()
        if self.disk_exceeded:
            raise DiskLimit(self.disk_exceeded)
        if code != 0 and self._shell_gone():
            fields = ["exited"]  # e.g. the agent's `kill -9 -1` also killed this step
        if fields[:1] == ["exited"]:
            raise ShellExited("the agent's shell exited (exit, or its shell or tmux was killed)")
        if code != 0 or len(fields) != 3:
            if self._pids_full():  # the step itself could not fork: the agent's processes hold them all
                raise ProcessLimit(f"all {self.pids} processes of the sandbox in use; terminal step failed "
                                   f"(exit {code}): {text[-300:]}")
            raise SandboxError(f"terminal step failed (exit {code}): {text[-500:]}")
        self.last_idle = fields[0] == "idle"  # whether the step ended early on an idle prompt
        if not read:
            return None, None
        lines = pane.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        hist, limit = int(fields[1]), int(fields[2])
        diff = pane_diff(lines, self._start, self._anchor)
        if diff is None and hist >= 0.8 * limit:
            # tmux drops the oldest 10% of a full history: the start scrolled out during this step, all that is
            # kept is new output (its head is cut, as truncation would cut it anyway).
            diff = "\n" + "\n".join(lines).rstrip()
        # After clear-history the visible screen is all that is left; remember its last non-empty line.
        visible = lines[hist:]
        last = max((i for i, ln in enumerate(visible) if ln.strip()), default=0)
        self._start, self._anchor = last, visible[last].rstrip() if visible else ""
        return visible_screen(lines, SCREEN[1]), diff


# ----------------------------------------------------------------------------------------------------------
# Tasks: Harbor folders (task.toml, instruction.md, environment/Dockerfile, tests/test.sh, solution/solve.sh)

@dataclasses.dataclass
class Task:
    name: str
    instruction: str
    image: str = BASE_IMAGE
    workdir: str = "/app"
    user: str = "root"
    agent_timeout: float = 600.0
    verifier_timeout: float = 120.0
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = DEFAULT_STORAGE_MB
    allow_internet: bool = False
    files: tuple = ()  # (path, bytes, mode) written into the container before the episode (generated tasks)
    tests: dict = dataclasses.field(default_factory=dict)  # relative path -> bytes, copied to /tests
    solution: dict = dataclasses.field(default_factory=dict)  # relative path -> bytes, copied to /solution
    build_error: str = ""  # why the image could not be built; its episodes end as image_build_error
    kind: str | None = None  # task.toml [metadata]: `kind` (taskgen.write_harbor) or `category` (Terminal-Bench)


def _read_dir(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def size_mb(value):
    """Harbor's sizes: an int is MB; a string is a number with a K/M/G/T unit ("4G", "512M", "1.5Gi")."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(value), re.I)
    if not m:
        raise ValueError(f"not a size: {value!r} (expected e.g. 4096, \"4G\", \"512M\")")
    return int(float(m[1]) * 1024 ** "KMGT".index(m[2].upper() or "M") / 1024)


def load_task(path, build=True):
    """Read a Harbor task folder; with build=True build its environment image (cached by content hash). An
    image that does not build is recorded in task.build_error (its episodes end as image_build_error), so one
    broken task never stops the others; a malformed folder raises ValueError."""
    path = Path(path)
    toml_path = path / "task.toml"
    try:
        cfg = tomllib.loads(toml_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{toml_path}: missing") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{toml_path}: invalid TOML: {e}") from None
    for name in ("instruction.md", "environment/Dockerfile", "tests/test.sh"):
        if not (path / name).is_file():
            raise ValueError(f"{path / name}: missing")
    for section in ("task", "environment", "agent", "verifier", "metadata"):
        if not isinstance(cfg.get(section, {}), dict):
            raise ValueError(f"{toml_path}: [{section}] must be a table, got {cfg[section]!r}")
    env, agent, verifier = cfg.get("environment", {}), cfg.get("agent", {}), cfg.get("verifier", {})
    meta = cfg.get("metadata", {})
    kind = meta.get("kind") or meta.get("category")
    field = ""
    try:
        field = "[environment] memory"
        memory = size_mb(env["memory_mb"] if "memory_mb" in env else env.get("memory", 2048))
        field = "[environment] storage"
        storage = size_mb(env["storage_mb"] if "storage_mb" in env else env.get("storage", DEFAULT_STORAGE_MB))
        field = ""
        task = Task(name=str(cfg.get("task", {}).get("name") or path.name),
                    instruction=(path / "instruction.md").read_text(),
                    agent_timeout=float(agent.get("timeout_sec", 600.0)),
                    verifier_timeout=float(verifier.get("timeout_sec", 120.0)),
                    cpus=float(env.get("cpus", 1)), memory_mb=memory, storage_mb=storage,
                    allow_internet=bool(env.get("allow_internet", False)),
                    workdir=str(env.get("workdir", "")), user=str(agent.get("user", "")),
                    tests=_read_dir(path / "tests"),
                    solution=_read_dir(path / "solution") if (path / "solution").is_dir() else {},
                    kind=str(kind) if kind else None)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{toml_path}: bad value{' of ' + field if field else ''}: {e}") from None
    config = {}
    if build:
        prebuilt = env.get("docker_image")
        try:
            if prebuilt and image_exists(prebuilt):  # a registry image already here: used as Harbor would
                task.image = prebuilt
            else:
                task.image = build_task_image(task.name, path / "environment",
                                              timeout=float(env.get("build_timeout_sec", 600.0)))
            config = docker_client().images.get(task.image).attrs["Config"]
        except BuildError as e:
            task.image, task.build_error = None, str(e)
    # task.toml wins; then the image's WORKDIR / USER, as `docker run` would use them.
    task.workdir = task.workdir or config.get("WorkingDir") or "/"
    task.user = task.user or config.get("User") or "root"
    return task


class BuildError(RuntimeError):
    pass


def build_task_image(name, context, timeout=600.0):
    """Build environment/ once: the tag carries a hash of its files, so an unchanged task reuses its image.
    Raises BuildError with the build log's tail (and how to give an offline FROM, when that is the cause)."""
    digest = hashlib.sha256()
    for rel, data in _read_dir(context).items():
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    for ref in re.findall(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)", (context / "Dockerfile").read_text(), re.M | re.I):
        if image_exists(ref):  # a re-tagged local FROM image (base-image --tag) must rebuild the task
            digest.update(docker_client().images.get(ref).id.encode())
    tag = f"actobs-task/{re.sub(r'[^a-z0-9._-]+', '-', name.lower()).strip('-.')}:{digest.hexdigest()[:12]}"
    if image_exists(tag):
        return tag
    # The CLI, not the SDK: killing it on timeout cancels the build in the daemon.
    cmd = ["docker", "build", "--network", "host", "--force-rm", "-t", tag, str(context)]
    env = dict(os.environ, DOCKER_BUILDKIT="0")
    try:
        res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        log = decode(e.output or b"")[-2000:]
        raise BuildError(f"{context}/Dockerfile: build timed out after {timeout:.0f}s (build_timeout_sec)\n{log}")
    if res.returncode != 0:
        log = decode(res.stdout)
        steps = re.findall(r"^Step \d+/\d+ : (.*)$", log, re.M)
        hint = ""
        if steps and re.match(r"FROM\s", steps[-1], re.I):  # it failed on the FROM line itself
            hint = "\nIts FROM image is not here and cannot be pulled; give it a local one: " \
                   "python envs.py base-image --tag <image:tag>"
        raise BuildError(f"{context}/Dockerfile: build failed (exit {res.returncode})\n{log[-2000:]}{hint}")
    return tag


def task_from_spec(spec):
    """A generated task (taskgen.Spec) as a Task on the base image; its files are uploaded at start."""
    return Task(spec.name, spec.instruction, **taskgen.LIMITS,
                files=tuple((p, text.encode(), mode) for p, text, mode in spec.files),
                tests={"test.sh": spec.test.encode()}, solution={"solve.sh": spec.solve.encode()})


def open_sandbox(task, network=False):
    return Sandbox(task.image, workdir=task.workdir, user=task.user, cpus=task.cpus, memory_mb=task.memory_mb,
                   storage_mb=task.storage_mb, network=network and task.allow_internet, files=task.files)


def verify(sb, task):
    """Stop every agent process, then run tests/test.sh as root in a fresh /logs/verifier; returns (reward,
    error, output tail). The reward is read only from what the verifier wrote: no agent process is left to
    write it. An error (timeout, no or bad reward file, a test runner that never started) is not a 0 reward."""
    sb.stop_agent()
    sb.put_files([("/tests/" + rel, data, 0o755) for rel, data in task.tests.items()])
    sb.exec("rm -rf /logs/verifier && mkdir -p /logs/verifier && chmod 777 /logs/verifier", user="root")
    code, out = sb.exec(["bash", "/tests/test.sh"], user="root", timeout=task.verifier_timeout)
    tail = decode(out)[-VERIFIER_TAIL:]
    if code in (124, 137):
        return 0.0, f"verifier timed out after {task.verifier_timeout:.0f}s", tail
    txt, js = sb.get_file("/logs/verifier/reward.txt"), sb.get_file("/logs/verifier/reward.json")
    try:
        if txt is not None:
            reward = float(txt.decode().strip())
        elif js is not None:
            value = json.loads(js)
            if isinstance(value, dict):  # {"reward": x}, or a single named reward
                value = value["reward"] if "reward" in value or len(value) != 1 else next(iter(value.values()))
            reward = float(value)
        else:
            return 0.0, f"verifier wrote no /logs/verifier/reward.txt or reward.json (exit {code})", tail
    except (ValueError, TypeError, KeyError) as e:
        return 0.0, f"unreadable reward file: {e!r}", tail
    # Terminal-Bench verifiers write 0 whenever pytest fails, also when it never started (no interpreter,
    # no pytest offline): without pytest's session banner that 0 is not a wrong answer.
    if reward == 0 and b"pytest" in task.tests.get("test.sh", b"") and b"test session starts" not in out:
        return 0.0, "the verifier's test runner never started (no pytest session in its output)", tail
    return reward, None, tail


# ----------------------------------------------------------------------------------------------------------
# Episodes

# Failure kinds. The agent's doing (scored; the reward goes with it): timeout, parse_errors, max_turns,
# shell_exited (the verifier still scores what was done), disk_limit and pids_limit (reward 0), verifier_error
# (reward 0: the verifier timed out, wrote no reward, or its test runner never started; an agent can break its
# own checker).
# Infrastructure, never the agent's doing: GRPO and evaluation leave these episodes out.
INFRA_FAILURES = frozenset({"sandbox_error", "image_build_error"})


@dataclasses.dataclass
class Episode:
    task: str
    messages: list  # Nemotron form: user (prompt), then assistant / user (observation) turns
    reward: float = 0.0
    turns: int = 0
    failure: str | None = None  # None or a failure kind (above; max_len: the policy's context was full)
    error: str = ""  # details of the failure
    verifier_output: str = ""  # the tail of tests/test.sh's output, whenever it ran
    # start_s, env_s (terminal steps), policy_s (waits for its own replies), verify_s, total_s
    timings: dict = dataclasses.field(default_factory=dict)
    # Filled by token-level policies (grpo.VLLMPolicy): the one append-only sequence the policy saw and
    # produced, one label per token (labels.PROMPT / ACTION / OBS), the behaviour log-prob of each token
    # (0.0 where not sampled), which OBS tokens are the protocol's fixed wrapper text, and whether the context
    # length cut the episode (then its messages end with the last observation).
    token_ids: list = dataclasses.field(default_factory=list)
    roles: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    obs_wrapper: list = dataclasses.field(default_factory=list)
    truncated: bool = False


class _Run:
    """One episode's state between policy calls; every method runs in a worker thread."""

    def __init__(self, task, template, network):
        self.task, self.template, self.network = task, template, network
        self.ep = Episode(task.name, [], timings=dict(start_s=0.0, env_s=0.0, policy_s=0.0, verify_s=0.0))
        self.sb, self.done, self.confirming, self.parse_errors = None, False, False, 0

    def begin(self):
        self.t0 = time.time()
        if self.task.build_error:
            return self.finish("image_build_error", self.task.build_error, verify_=False)
        try:
            self.sb = open_sandbox(self.task, self.network)
            self.sb.start()
            self.ep.timings["start_s"] = self.sb.start_s
            self.ep.messages.append({"role": "user", "content": fill_prompt(
                self.template, self.task.instruction, self.sb.screen())})
        except Exception as e:
            self.finish("sandbox_error", f"{type(e).__name__}: {e}", verify_=False)

    def act(self, reply, max_turns, max_parse_errors):
        t = time.time()
        self.ep.turns += 1
        self.ep.messages.append({"role": "assistant", "content": reply})
        try:
            failure, error = self._act(reply, max_parse_errors, last_turn=self.ep.turns >= max_turns)
        except DiskLimit as e:
            return self.finish("disk_limit", str(e), verify_=False)
        except ProcessLimit as e:
            return self.finish("pids_limit", str(e), verify_=False)
        except ShellExited as e:
            return self.finish("shell_exited", str(e))
        except Exception as e:
            return self.finish("sandbox_error", f"{type(e).__name__}: {e}", verify_=False)
        finally:
            self.ep.timings["env_s"] += time.time() - t
        if failure is not None or self.done:
            self.finish(failure, error)

    def _act(self, reply, max_parse_errors, last_turn):
        """Carry out one reply; returns (failure, error) when the episode ends without a confirmed completion.
        The messages end with the last reply: they are exactly what the policy saw, plus what it answered."""
        max_turns = "max_turns", f"no confirmed completion after {self.ep.turns} turns"
        parsed, error, warnings = parse_reply(reply)
        if error:
            self.parse_errors += 1
            if self.parse_errors >= max_parse_errors:
                return "parse_errors", f"{self.parse_errors} replies in a row could not be parsed: {error}"
            if last_turn:
                return max_turns
            self.ep.messages.append({"role": "user", "content": parse_error_message(error, warnings)})
            return None, None
        self.parse_errors = 0
        commands = parsed.commands or [("", 0.0)]
        t0 = time.time()
        for i, (keys, duration) in enumerate(commands):
            # The agent's clock counts its own time (start, steps, policy calls), not waits on other episodes.
            used = sum(self.ep.timings[k] for k in ("start_s", "env_s", "policy_s")) + time.time() - t0
            left = self.task.agent_timeout - used
            if left <= 0:
                return "timeout", f"agent timeout of {self.task.agent_timeout:.0f}s reached"
            obs = self.sb.send(keys, min(duration, left), read=i == len(commands) - 1)
        if parsed.task_complete and self.confirming:
            self.done = True
            return None, None
        if last_turn:
            return max_turns
        self.confirming = parsed.task_complete
        content = confirm_message(obs) if parsed.task_complete else obs
        self.ep.messages.append({"role": "user", "content": with_warnings(content, warnings)})
        return None, None

    def finish(self, failure, error="", verify_=True):
        self.done = True
        self.ep.failure, self.ep.error = failure, error or ""
        try:
            if verify_:
                t = time.time()
                _score(self.ep, self.sb, self.task)
                self.ep.timings["verify_s"] = time.time() - t
        finally:
            self.close()
            self.ep.timings["total_s"] = time.time() - self.t0

    def close(self):
        if self.sb is not None:
            self.sb.close()


def _score(ep, sb, task):
    """Verify into the episode. The disk budget is checked last: a sandbox over it scores 0 as disk_limit."""
    try:
        ep.reward, verr, ep.verifier_output = verify(sb, task)
    except Exception as e:
        ep.reward, verr = 0.0, f"{type(e).__name__}: {e}"
    if sb.disk_exceeded:
        ep.reward, ep.failure, ep.error = 0.0, "disk_limit", sb.disk_exceeded
    elif verr and ep.failure is None:
        ep.failure, ep.error = "verifier_error", verr


class BatchPolicy:
    """A plain batch function `fn(list of message lists) -> list of reply strings` (the scripted expert, HF
    sampling) under the submit/poll protocol of run_episodes. It is lock-step: called once every live episode
    waits on it, with all their conversations in one batch."""
    lockstep = True

    def __init__(self, fn):
        self.fn, self.waiting = fn, []

    def submit(self, key, episode):
        self.waiting.append((key, episode.messages))

    def pending(self):
        return len(self.waiting)

    def poll(self):
        batch, self.waiting = self.waiting, []
        replies = self.fn([m for _, m in batch])
        if len(replies) != len(batch) or not all(isinstance(r, str) for r in replies):
            raise ValueError(f"policy must return {len(batch)} reply strings, got {str(replies)[:200]}")
        return [(key, r) for (key, _), r in zip(batch, replies)]

    def abort(self):
        self.waiting = []


def run_episodes(tasks, policy, *, max_turns=30, concurrency=8, template=None, network=False, max_parse_errors=3,
                 on_episode=None, stats=None):
    """Run one episode per entry of `tasks` (repeat a task for several rollouts), up to `concurrency` sandboxes
    live at once; a finished episode's slot starts the next sandbox at once. Sandbox starts and terminal steps
    run in a thread pool; this thread drives the policy.

    `policy` is a plain batch function (wrapped in BatchPolicy: lock-step rounds) or an object with
    submit(key, episode) (the episode's messages end with an observation: queue its next reply),
    poll() -> [(key, reply str, or None to end the episode as `max_len`)] (do some work, return what is
    finished), pending() (replies still owed) and abort() (drop them). A policy with `lockstep = False`
    (grpo.VLLMPolicy) generates while sandboxes step: an episode's next turn is queued the moment its
    observation is back. on_episode(i, episode) is called as each one ends. `stats`, a dict, receives wall_s,
    policy_s (time inside poll: the generator working) and idle_s (the generator waiting for sandboxes).
    Sandboxes are removed even if the policy raises."""
    template = template or DEFAULT_PROMPT
    policy = policy if hasattr(policy, "submit") else BatchPolicy(policy)
    sweep()
    runs = [_Run(t, template, network) for t in tasks]
    todo, env, live, asked = list(range(len(runs)))[::-1], {}, 0, {}  # env: future of a pool job -> episode
    pool = ThreadPoolExecutor(max(1, concurrency))
    t_start, busy = time.time(), 0.0
    try:
        while todo or env or policy.pending():
            while todo and live < concurrency:
                i = todo.pop()
                env[pool.submit(runs[i].begin)] = i
                live += 1
            done = [f for f in env if f.done()]
            for f in done:
                i = env.pop(f)
                f.result()  # _Run records sandbox failures itself; anything raised here is a bug
                if runs[i].done:
                    live -= 1
                    if on_episode is not None:
                        on_episode(i, runs[i].ep)
                else:
                    asked[i] = time.time()
                    policy.submit(i, runs[i].ep)
            if done:
                continue
            if policy.pending() and not (policy.lockstep and env):
                t = time.time()
                replies = policy.poll()
                busy += time.time() - t
                for i, reply in replies:
                    runs[i].ep.timings["policy_s"] += time.time() - asked.pop(i)
                    if reply is None:  # the policy's context is full: end here and verify what was done
                        job = functools.partial(runs[i].finish, "max_len", "the episode reached the context length")
                    else:
                        job = functools.partial(runs[i].act, reply, max_turns, max_parse_errors)
                    env[pool.submit(job)] = i
            elif env:
                wait(env, return_when=FIRST_COMPLETED)
    finally:
        policy.abort()
        pool.shutdown(wait=True, cancel_futures=True)  # no thread is still starting a container after this
        for r in runs:
            r.close()
    if stats is not None:
        wall = time.time() - t_start
        stats.update(wall_s=wall, policy_s=busy, idle_s=wall - busy)
    return [r.ep for r in runs]


def run_oracle(tasks, *, noop=False, concurrency=4):
    """Run each task's solution/solve.sh (or nothing, with noop) and the verifier; returns Episodes."""
    def one(task):
        ep, t0 = Episode(task.name, []), time.time()
        if task.build_error:
            ep.failure, ep.error, ep.timings["total_s"] = "image_build_error", task.build_error, 0.0
            return ep
        try:
            with open_sandbox(task) as sb:
                if not noop:
                    sb.put_files([("/solution/" + rel, data, 0o755) for rel, data in task.solution.items()])
                    code, out = sb.exec(["bash", "/solution/solve.sh"], timeout=task.agent_timeout)
                    if code in (124, 137) and not sb.disk_exceeded:
                        ep.failure, ep.error = "timeout", decode(out)[-500:]
                _score(ep, sb, task)
        except Exception as e:
            ep.failure, ep.error = "sandbox_error", f"{type(e).__name__}: {e}"
        ep.timings["total_s"] = time.time() - t0
        return ep
    sweep()
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, tasks))


# ----------------------------------------------------------------------------------------------------------

def write_jsonl(path, rows):
    """Written to a temp name, then renamed: a killed run never leaves a truncated file that looks complete."""
    tmp = Path(f"{path}.tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def corpus(args):
    template = load_template(args.prompt_template)
    splits = taskgen.make_splits(args.n_sft, args.n_rl, args.n_eval, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("rl", "eval"):
        for spec in splits[split]:
            taskgen.write_harbor(spec, args.out / split / spec.name, BASE_IMAGE)
        write_jsonl(args.out / f"{split}.jsonl", [dataclasses.asdict(s) for s in splits[split]])
    tasks = [task_from_spec(s) for s in splits["sft"]]
    t0 = time.time()
    episodes = run_episodes(tasks, taskgen.expert_policy, max_turns=args.max_turns, concurrency=args.concurrency,
                            template=template)
    rows = [{"conversations": e.messages, "task": e.task, "reward": e.reward} for e in episodes
            if args.keep_failed or (e.reward >= 1.0 and e.failure is None)]
    write_jsonl(args.out / "sft.jsonl", rows)
    solved = sum(e.reward >= 1.0 for e in episodes)
    turns = sum(e.turns for e in episodes) / max(1, len(episodes))
    print(f"sft: {solved}/{len(episodes)} solved | {turns:.1f} turns/episode | {len(rows)} rows -> "
          f"{args.out / 'sft.jsonl'} | {time.time() - t0:.0f}s")
    for e in episodes:
        if e.failure:
            print(f"  {e.task}: {e.failure} {e.error[:200]}")
    print(f"rl: {len(splits['rl'])} tasks -> {args.out / 'rl'} | eval: {len(splits['eval'])} tasks -> {args.out / 'eval'}")


def main(argv=None):
    args = parse_args(argv)
    if args.cmd == "base-image":
        if args.standin:
            build_base_image(STANDIN_SUITE, STANDIN_TAGS + (args.tag or []), args.rebuild, with_uv=True)
        else:
            build_base_image(args.suite, args.tag, args.rebuild, args.with_uv)
    elif args.cmd == "sweep":
        print(f"removed {sweep()} leftover sandboxes")
    elif args.cmd == "oracle":
        tasks = [load_task(p) for p in args.tasks]
        episodes = run_oracle(tasks, noop=args.noop, concurrency=args.concurrency)
        for e in episodes:
            print(f"{e.task}\treward {e.reward:.2f}\t{e.failure or 'ok'}\t{e.timings['total_s']:.1f}s")
            if e.failure:  # the end of the story: a build log's hint, the verifier's last words
                print("    " + (e.error[-600:] + "\n" + e.verifier_output[-600:]).strip().replace("\n", "\n    "))
        return episodes
    elif args.cmd == "corpus":
        corpus(args)


if __name__ == "__main__":
    main()
