"""
Terminal sandboxes for ActObs: Docker containers driven through tmux with the Terminus-2 protocol,
Harbor / Terminal-Bench 2.0 task folders, an embedded procedural task world (taskgen.py), and a
concurrent episode runner used by SFT data generation, GRPO rollouts and evaluation.

Needs a Docker daemon (DOCKER_HOST); `. .ci/dockerd.sh start` starts a private one.

    python envs.py base-image                              # debootstrap bookworm -> actobs-base:bookworm (reused)
    python envs.py base-image --tag ubuntu:24.04 --with-uv # + uv/pytest, tagged as the FROM of Harbor tasks
    python envs.py oracle tests/fixtures/harbor-tasks/*    # run solution/solve.sh, print rewards (expect 1.0)
    python envs.py oracle --noop tests/fixtures/harbor-tasks/*   # do nothing, print rewards (expect 0.0)
    python envs.py corpus --out data/corpus --n-sft 200 --n-rl 64 --n-eval 64 --seed 0
    python envs.py sweep                                   # remove sandboxes left by dead processes

Offline images: where no registry is reachable, a Dockerfile's `FROM ubuntu:24.04` is satisfied by a local
image with that tag: `python envs.py base-image --tag ubuntu:24.04 --with-uv` tags the project's Debian base
(bash, tmux, python3) plus uv and offline pytest wheels (what Terminal-Bench verifiers fetch) as
ubuntu:24.04, and Docker builds the Harbor Dockerfiles without pulling. Task images are cached by a hash of
environment/ and of the local FROM image.

The terminal needs bash, tmux and coreutils' `timeout` in the image (the base image has them).
"""
import argparse
import dataclasses
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import taskgen
from terminus import (DEFAULT_PROMPT, MAX_DURATION, OUTPUT_HEADER, SCREEN_HEADER, confirm_message, decode, fill_prompt,
                      load_template, pane_diff, parse_error_message, parse_reply, truncate_output, visible_screen,
                      with_warnings)

BASE_IMAGE = "actobs-base:bookworm"
BASE_PACKAGES = ["tmux", "python3", "procps", "jq"]  # tmux: the terminal; the rest: what generated tasks use
UV_VERSION = "0.9.7"
VERIFIER_PINS = ["pytest==8.4.1", "pytest-json-ctrf==0.3.5"]  # what Terminal-Bench 2.0 tests/test.sh install
DEBIAN_MIRROR = os.environ.get("ACTOBS_DEBIAN_MIRROR")  # unset: debootstrap's own default mirror
PRIVATE_SOCKET = os.environ.get("ACTOBS_DOCKER_ROOT", "/var/lib/actobs-docker") + "/docker.sock"
LABEL = "actobs.sandbox"  # every container carries it; value = "<hostname>:<pid>" of the owning process
SCREEN = (160, 40)  # tmux window (columns, rows)

# ----------------------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("base-image", help="build the Debian base image (debootstrap -> docker import), reuse it")
    b.add_argument("--tag", action="append", help="extra tag(s) for the base image, e.g. ubuntu:24.04")
    b.add_argument("--rebuild", action="store_true", help="build even if the image exists")
    b.add_argument("--with-uv", action="store_true", help="add uv and offline pytest wheels (Harbor verifiers)")

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


def owner_label():
    return f"{socket.gethostname()}:{os.getpid()}"


def sweep():
    """Remove leftover sandboxes: those whose owning process on this host is gone (killed runs, crashed tests)."""
    removed = 0
    for c in docker_client().containers.list(all=True, filters={"label": LABEL}):
        host, _, pid = c.labels.get(LABEL, "").rpartition(":")
        if host != socket.gethostname():
            continue
        if pid.isdigit() and _pid_alive(int(pid)):
            continue
        c.remove(force=True)
        removed += 1
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
    return docker_client().containers.list(all=True, filters={"label": f"{LABEL}={owner_label()}"})


def image_exists(tag):
    import docker
    try:
        docker_client().images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def build_base_image(tag=BASE_IMAGE, extra_tags=(), rebuild=False, with_uv=False):
    """debootstrap a minimal bookworm with the packages the terminal and the generated tasks need, import it.
    with_uv: tag the uv layer (build_uv_image) instead, for Harbor tasks whose verifiers fetch pytest with uvx."""
    if rebuild or not image_exists(tag):
        if shutil.which("debootstrap") is None:
            raise SystemExit("debootstrap not found: apt-get install -y debootstrap")
        with tempfile.TemporaryDirectory(prefix="actobs-rootfs-") as root:
            t0 = time.time()
            subprocess.run(["debootstrap", "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES),
                            "bookworm", root] + ([DEBIAN_MIRROR] if DEBIAN_MIRROR else []),
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
    """base + uv + local wheels of the pytest pins Terminal-Bench verifiers install at verification time, with
    UV_OFFLINE so their `uvx --with pytest==... pytest` runs without a network. The wheels are fetched on the
    host with pip (the one place a package index is reachable), never from inside a sandbox."""
    dockerfile = (
        f"FROM {base}\nCOPY uv uvx /root/.local/bin/\nCOPY wheels /opt/actobs-wheels\n"
        "RUN chmod 755 /root/.local/bin/uv /root/.local/bin/uvx && "
        "echo 'export PATH=\"$HOME/.local/bin:$PATH\"' > /root/.local/bin/env\n"
        # Offline, apt's default retries turn a verifier's `apt-get update` into a 7 s wait.
        "RUN echo 'Acquire::Retries \"0\";' > /etc/apt/apt.conf.d/80actobs-offline\n"
        "ENV UV_OFFLINE=1 UV_FIND_LINKS=/opt/actobs-wheels UV_PYTHON_DOWNLOADS=never\n"
        f"RUN /root/.local/bin/uvx {' '.join('--with ' + p for p in VERIFIER_PINS)} pytest --version\n")
    key = dockerfile + UV_VERSION + docker_client().images.get(base).id
    tag = f"{base}-uv-{hashlib.sha256(key.encode()).hexdigest()[:12]}"  # a new base or layer -> a new image
    if image_exists(tag):
        print(f"{tag} exists, reused")
        return tag
    import zipfile
    with tempfile.TemporaryDirectory(prefix="actobs-uv-") as ctx:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:", "--python-version", "3.11"]
        env = dict(os.environ, PIP_CONSTRAINT="")  # a site-wide constraints file must not move these pins
        subprocess.run(pip + ["--no-deps", "-d", f"{ctx}/uvwheel", f"uv=={UV_VERSION}"], check=True, env=env)
        subprocess.run(pip + ["-d", f"{ctx}/wheels"] + VERIFIER_PINS, check=True, env=env)
        with zipfile.ZipFile(next(Path(ctx, "uvwheel").glob("*.whl"))) as whl:
            for name in ("uv", "uvx"):
                Path(ctx, name).write_bytes(whl.read(f"uv-{UV_VERSION}.data/scripts/{name}"))
        Path(ctx, "Dockerfile").write_text(dockerfile)
        docker_client().images.build(path=ctx, tag=tag, network_mode="none", rm=True, forcerm=True)
    print(f"built {tag}")
    return tag


# ----------------------------------------------------------------------------------------------------------
# Sandbox: one container + one tmux terminal inside it

# Runs once per sandbox as the task's user. PROMPT_COMMAND writes a counter and the expanded prompt each
# time bash is about to show its prompt: the step script uses that to know the shell is back and idle.
TERMINAL_SETUP = r"""
d=/tmp/.actobs-$(id -u); mkdir -p "$d"
cat > "$d/rc" <<'RC'
[ -f /etc/bash.bashrc ] && . /etc/bash.bashrc
[ -f ~/.bashrc ] && . ~/.bashrc
PS1='\u@\h:\w\$ '
set -o ignoreeof
__actobs_n=0
PROMPT_COMMAND='__actobs_n=$((__actobs_n+1)); printf "%s\n%s\n" "$__actobs_n" "${PS1@P}" >| /tmp/.actobs-$UID/prompt'
RC
printf 'set -g history-limit 10000\nset -g status off\n' > "$d/tmux.conf"
tmux -f "$d/tmux.conf" new-session -d -s main -x "$1" -y "$2" "bash --rcfile $d/rc -i"
tmux display -p -t main '#{pane_pid}' > "$d/shellpid"
for i in $(seq 500); do [ -s "$d/prompt" ] && exit 0; sleep 0.01; done
echo "shell prompt did not appear" >&2; exit 1
"""

# One docker exec per terminal step: send the keys, wait (at most $3 seconds) until bash is the terminal's
# foreground process again, has redrawn its prompt (counter moved, when a newline was typed) and the pane's
# last line is that prompt; then, if $5 is 1, print the state and the pane (history + screen) and clear
# tmux's history so the next capture only holds new lines.
TERMINAL_STEP = r"""
d=/tmp/.actobs-$UID; keys=$1; literal=$2; wait_s=$3; newline=$4
read -r shell < "$d/shellpid"
{ read -r c0; read -r _; } < "$d/prompt"
if [ "$literal" = 1 ]; then
  while [ -n "$keys" ]; do tmux send-keys -t main -l -- "${keys:0:2000}"; keys=${keys:2000}; done
elif [ -n "$keys" ]; then
  tmux send-keys -t main "$keys"
fi
t=${EPOCHREALTIME/./}; end=$(( t + 10#${wait_s/./} * 1000 )); state=busy; n=0; nap=0.001
exec {never}<> <(:)  # a pipe nobody writes: `read -t` on it is a sleep without forking a process
while :; do
  { read -r c; read -r p; } < "$d/prompt"
  if [ "$newline" = 0 ] || [ "$c" != "$c0" ]; then
    read -r -a st < "/proc/$shell/stat"
    if [ "${st[7]}" = "$shell" ]; then
      scr=$(tmux capture-pane -p -t main); last=${scr##*$'\n'}  # $(...) drops the empty trailing rows
      p=${p%"${p##*[! ]}"}
      if [ "$last" = "$p" ]; then state=idle; break; fi
    fi
  fi
  [ "${EPOCHREALTIME/./}" -ge "$end" ] && break
  read -t "$nap" -u "$never"; ((++n > 20)) && nap=0.005
done
if [ "$5" = 1 ]; then
  tmux display -p -t main "$state #{history_size} #{history_limit}" \; capture-pane -p -S - -E - -t main \; clear-history -t main
else
  echo "$state 0 1"
fi
"""


class SandboxError(RuntimeError):
    pass


class Sandbox:
    """A container with the task's limits and a tmux terminal; use as a context manager (always removed)."""

    def __init__(self, image, *, workdir="/app", user="root", cpus=1.0, memory_mb=2048, pids=1024,
                 network=False, files=()):
        self.image, self.workdir, self.user = image, workdir, user
        self.cpus, self.memory_mb, self.pids, self.network, self.files = cpus, memory_mb, pids, network, files
        self.container = None
        self._start = 0  # pane line where the next observation begins
        self._anchor = ""  # that line's text when it was read
        self.last_idle = False

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
        self.container = docker_client().containers.run(
            # The image's own entrypoint is replaced: the container only has to stay up for our execs.
            self.image, entrypoint=["sleep", "infinity"], detach=True, init=True, labels={LABEL: owner_label()},
            network_mode="host" if self.network else "none", mem_limit=f"{self.memory_mb}m",
            memswap_limit=f"{self.memory_mb}m", pids_limit=self.pids, nano_cpus=int(self.cpus * 1e9),
            working_dir=self.workdir, environment={"LANG": "C.UTF-8"})
        # Harbor tasks expect these to exist and be writable by the agent's user.
        self.exec(f"mkdir -p {self.workdir} /logs/agent /logs/verifier && chmod 777 /logs/agent /logs/verifier",
                  user="root")
        if self.files:
            self.put_files(self.files)
        code, out = self.exec(["bash", "-c", TERMINAL_SETUP, "setup", str(SCREEN[0]), str(SCREEN[1])])
        if code != 0:
            raise SandboxError(f"terminal did not start in {self.image} (needs bash and tmux): {decode(out)}")
        self.start_s = time.time() - t0

    def close(self):
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
        if code != 0 or len(fields) != 3:
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
    allow_internet: bool = False
    files: tuple = ()  # (path, bytes, mode) written into the container before the episode (generated tasks)
    tests: dict = dataclasses.field(default_factory=dict)  # relative path -> bytes, copied to /tests
    solution: dict = dataclasses.field(default_factory=dict)  # relative path -> bytes, copied to /solution


def _read_dir(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def load_task(path, build=True):
    """Read a Harbor task folder; with build=True build its environment image (cached by content hash)."""
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
    env, agent, verifier = cfg.get("environment", {}), cfg.get("agent", {}), cfg.get("verifier", {})
    try:
        task = Task(name=str(cfg.get("task", {}).get("name") or path.name),
                    instruction=(path / "instruction.md").read_text(),
                    agent_timeout=float(agent.get("timeout_sec", 600.0)),
                    verifier_timeout=float(verifier.get("timeout_sec", 120.0)),
                    cpus=float(env.get("cpus", 1)), memory_mb=int(env.get("memory_mb", 2048)),
                    allow_internet=bool(env.get("allow_internet", False)),
                    workdir=str(env.get("workdir", "")), user=str(agent.get("user", "")),
                    tests=_read_dir(path / "tests"),
                    solution=_read_dir(path / "solution") if (path / "solution").is_dir() else {})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{toml_path}: bad value: {e}") from None
    config = {}
    if build:
        task.image = build_task_image(task.name, path / "environment")
        config = docker_client().images.get(task.image).attrs["Config"]
    # task.toml wins; then the image's WORKDIR / USER, as `docker run` would use them.
    task.workdir = task.workdir or config.get("WorkingDir") or "/"
    task.user = task.user or config.get("User") or "root"
    return task


def build_task_image(name, context):
    """Build environment/ once: the tag carries a hash of its files, so an unchanged task reuses its image."""
    import docker
    digest = hashlib.sha256()
    for rel, data in _read_dir(context).items():
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    for ref in re.findall(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)", (context / "Dockerfile").read_text(), re.M | re.I):
        if image_exists(ref):  # a re-tagged local FROM image (base-image --tag) must rebuild the task
            digest.update(docker_client().images.get(ref).id.encode())
    tag = f"actobs-task/{re.sub(r'[^a-z0-9._-]+', '-', name.lower()).strip('-.')}:{digest.hexdigest()[:12]}"
    if image_exists(tag):
        return tag
    try:
        docker_client().images.build(path=str(context), tag=tag, network_mode="host", rm=True, forcerm=True)
    except docker.errors.BuildError as e:
        log = "".join(chunk.get("stream", "") + chunk.get("error", "") for chunk in e.build_log)[-2000:]
        raise RuntimeError(f"{context}/Dockerfile: build failed: {e}\n{log}\nIf its FROM image cannot be pulled, "
                           f"give it a local one: python envs.py base-image --tag <image:tag>") from None
    return tag


def task_from_spec(spec):
    """A generated task (taskgen.Spec) as a Task on the base image; its files are uploaded at start."""
    return Task(spec.name, spec.instruction, **taskgen.LIMITS,
                files=tuple((p, text.encode(), mode) for p, text, mode in spec.files),
                tests={"test.sh": spec.test.encode()}, solution={"solve.sh": spec.solve.encode()})


def open_sandbox(task, network=False):
    return Sandbox(task.image, workdir=task.workdir, user=task.user, cpus=task.cpus, memory_mb=task.memory_mb,
                   network=network and task.allow_internet, files=task.files)


def verify(sb, task):
    """Run tests/test.sh as root; returns (reward, error). An error (timeout, no or bad reward file) is not a 0."""
    sb.put_files([("/tests/" + rel, data, 0o755) for rel, data in task.tests.items()])
    sb.exec("rm -f /logs/verifier/reward.txt /logs/verifier/reward.json", user="root")
    code, out = sb.exec(["bash", "/tests/test.sh"], user="root", timeout=task.verifier_timeout)
    tail = decode(out)[-1000:]
    if code in (124, 137):
        return 0.0, f"verifier timed out after {task.verifier_timeout:.0f}s: {tail}"
    txt, js = sb.get_file("/logs/verifier/reward.txt"), sb.get_file("/logs/verifier/reward.json")
    try:
        if txt is not None:
            return float(txt.decode().strip()), None
        if js is not None:
            value = json.loads(js)
            if isinstance(value, dict):  # {"reward": x}, or a single named reward
                value = value["reward"] if "reward" in value or len(value) != 1 else next(iter(value.values()))
            return float(value), None
    except (ValueError, TypeError, KeyError) as e:
        return 0.0, f"unreadable reward file: {e!r}"
    return 0.0, f"verifier wrote no /logs/verifier/reward.txt or reward.json (exit {code}): {tail}"


# ----------------------------------------------------------------------------------------------------------
# Episodes

@dataclasses.dataclass
class Episode:
    task: str
    messages: list  # Nemotron form: user (prompt), then assistant / user (observation) turns
    reward: float = 0.0
    turns: int = 0
    failure: str | None = None  # timeout | parse_errors | max_turns | verifier_error | sandbox_error
    error: str = ""  # details of the failure
    # start_s, env_s (terminal steps), policy_s (policy calls of the rounds it was live in), verify_s, total_s
    timings: dict = dataclasses.field(default_factory=dict)


class _Run:
    """One episode's state between policy calls; every method runs in a worker thread."""

    def __init__(self, task, template, network):
        self.task, self.template, self.network = task, template, network
        self.ep = Episode(task.name, [], timings=dict(start_s=0.0, env_s=0.0, policy_s=0.0, verify_s=0.0))
        self.sb, self.done, self.confirming, self.parse_errors = None, False, False, 0

    def begin(self):
        self.t0 = time.time()
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
                try:
                    self.ep.reward, verr = verify(self.sb, self.task)
                except Exception as e:
                    self.ep.reward, verr = 0.0, f"{type(e).__name__}: {e}"
                self.ep.timings["verify_s"] = time.time() - t
                if verr and self.ep.failure is None:
                    self.ep.failure, self.ep.error = "verifier_error", verr
        finally:
            self.close()
            self.ep.timings["total_s"] = time.time() - self.t0

    def close(self):
        if self.sb is not None:
            self.sb.close()


def run_episodes(tasks, policy, *, max_turns=30, concurrency=8, template=None, network=False, max_parse_errors=3):
    """Run one episode per entry of `tasks` (repeat a task for several rollouts). Up to `concurrency` sandboxes
    are live at once; each round the policy gets the conversations of all live episodes in one batch:
    policy(list of message lists) -> list of reply strings. Sandboxes are removed even if the policy raises."""
    template = template or DEFAULT_PROMPT
    sweep()
    runs = [_Run(t, template, network) for t in tasks]
    pending, live = list(range(len(runs)))[::-1], []
    pool = ThreadPoolExecutor(max(1, concurrency))
    try:
        while pending or live:
            new = [pending.pop() for _ in range(min(len(pending), concurrency - len(live)))]
            list(pool.map(lambda i: runs[i].begin(), new))
            live = [i for i in live + new if not runs[i].done]
            if not live:
                continue
            t = time.time()
            replies = policy([runs[i].ep.messages for i in live])
            if len(replies) != len(live) or not all(isinstance(r, str) for r in replies):
                raise ValueError(f"policy must return {len(live)} reply strings, got {str(replies)[:200]}")
            for i in live:
                runs[i].ep.timings["policy_s"] += time.time() - t
            list(pool.map(lambda ir: runs[ir[0]].act(ir[1], max_turns, max_parse_errors), zip(live, replies)))
            live = [i for i in live if not runs[i].done]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # no thread is still starting a container after this
        for r in runs:
            r.close()
    return [r.ep for r in runs]


def run_oracle(tasks, *, noop=False, concurrency=4):
    """Run each task's solution/solve.sh (or nothing, with noop) and the verifier; returns Episodes."""
    def one(task):
        ep, t0 = Episode(task.name, []), time.time()
        try:
            with open_sandbox(task) as sb:
                if not noop:
                    sb.put_files([("/solution/" + rel, data, 0o755) for rel, data in task.solution.items()])
                    code, out = sb.exec(["bash", "/solution/solve.sh"], timeout=task.agent_timeout)
                    if code in (124, 137):
                        ep.failure, ep.error = "timeout", decode(out)[-500:]
                ep.reward, verr = verify(sb, task)
                if verr:
                    ep.failure, ep.error = "verifier_error", verr
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
        build_base_image(extra_tags=args.tag, rebuild=args.rebuild, with_uv=args.with_uv)
    elif args.cmd == "sweep":
        print(f"removed {sweep()} leftover sandboxes")
    elif args.cmd == "oracle":
        tasks = [load_task(p) for p in args.tasks]
        episodes = run_oracle(tasks, noop=args.noop, concurrency=args.concurrency)
        for e in episodes:
            print(f"{e.task}\treward {e.reward:.2f}\t{e.failure or 'ok'}\t{e.timings['total_s']:.1f}s\t{e.error[:300]}")
        return episodes
    elif args.cmd == "corpus":
        corpus(args)


if __name__ == "__main__":
    main()
