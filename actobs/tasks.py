"""
Tasks: a Harbor task folder (task.toml, instruction.md, environment/Dockerfile, tests/test.sh, solution/solve.sh)
read into a Task with its environment image built, or a generated task (taskgen.py) as a Task on the base image.
envs.py runs their episodes, verify.py their verifiers.

Task images are cached by a hash of environment/ and of the local FROM image. Where the images come from, as Harbor
has it: task.toml's prebuilt `docker_image` when it names one, else environment/Dockerfile built on its own FROM
images. With pull=True (a real run on a node that reaches a registry) those images are pulled first, so a local tag
never stands in for them; without it (offline) the local ones are used, e.g. the stand-in that
`envs.py base-image --standin` tags as ubuntu:24.04 (sandbox/images.py).
"""
import dataclasses
import hashlib
import re
import subprocess
import threading
import time
import tomllib
from pathlib import Path

from actobs import taskgen
from actobs.sandbox.daemon import BASE_IMAGE, docker_client, docker_env, image_exists
from actobs.sandbox.sandbox import DEFAULT_STORAGE_MB
from actobs.terminus import decode


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
    inodes: int | None = None  # entries the sandbox's layer may hold; None: disk.Budget's default for storage_mb
    allow_internet: bool = True  # Harbor's default; the sandbox gets a network only when the run gives one
    files: tuple = ()  # (path, bytes, mode) written into the container before the episode (generated tasks)
    tests: dict = dataclasses.field(default_factory=dict)  # relative path -> bytes, copied to /tests
    solution: dict = dataclasses.field(default_factory=dict)  # relative path -> bytes, copied to /solution
    build_error: str = ""  # why the image could not be built; its episodes end as image_build_error
    kind: str | None = None  # task.toml [metadata]: the first of KIND_FIELDS it has
    meta: dict = dataclasses.field(default_factory=dict)  # [metadata] field -> value, for KIND_FIELDS it has
    schema_version: str = ""  # task.toml `schema_version` (or `version`), e.g. "1.0"


# [metadata] fields that name a task's kind, for per-kind tables: taskgen.write_harbor's `kind`, Terminal-Bench's and
# Endless Terminals' `category`, aider-polyglot's `language`, and `difficulty`. The first one present is Task.kind.
KIND_FIELDS = ("kind", "category", "language", "difficulty")


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


def internet(env, agent):
    """Whether the agent's sandbox may reach the internet: Harbor's network_mode ([agent]'s when it sets one, else
    [environment]'s: "public" or "no-network"), else the deprecated allow_internet, else Harbor's default (public).
    An allowlist is refused: the sandbox gets all of the network or none, and all would let through what the task
    forbids."""
    mode = agent.get("network_mode") or env.get("network_mode")
    if mode is None:
        return bool(env.get("allow_internet", True))
    if mode not in ("public", "no-network"):
        raise ValueError(f"{mode!r} is not one this runs (public, no-network)")
    return mode == "public"


def load_task(path, build=True, pull=False):
    """Read a Harbor task folder; with build=True give it its image (task_image: cached by content hash; pull: the
    registry's images, never a local stand-in). An image that does not build is recorded in task.build_error (its
    episodes end as image_build_error), so one broken task never stops the others; a malformed folder raises
    ValueError."""
    path = Path(path)
    toml_path = path / "task.toml"
    try:
        cfg = tomllib.loads(toml_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{toml_path}: missing") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{toml_path}: invalid TOML: {e}") from None
    for section in ("task", "environment", "agent", "verifier", "metadata"):
        if not isinstance(cfg.get(section, {}), dict):
            raise ValueError(f"{toml_path}: [{section}] must be a table, got {cfg[section]!r}")
    env, agent, verifier = cfg.get("environment", {}), cfg.get("agent", {}), cfg.get("verifier", {})
    # a prebuilt docker_image makes environment/Dockerfile optional (Harbor's EnvironmentConfig)
    for name in ("instruction.md", "tests/test.sh") + (() if env.get("docker_image") else ("environment/Dockerfile",)):
        if not (path / name).is_file():
            raise ValueError(f"{path / name}: missing")
    if cfg.get("steps"):
        raise ValueError(f"{toml_path}: a multi-step task ([[steps]]) is not one this runs")
    meta = {k: str(cfg["metadata"][k]) for k in KIND_FIELDS if cfg.get("metadata", {}).get(k) not in (None, "")}
    version = str(cfg.get("schema_version", cfg.get("version", "")))
    if version and not re.fullmatch(r"[01](\.\d+)*", version):  # Harbor's 1.x; Endless Terminals writes "0.1"
        raise ValueError(f"{toml_path}: schema_version {version!r} is not one this reads (0.x or 1.x)")
    field = ""
    try:
        field = "[environment] memory"
        memory = size_mb(env["memory_mb"] if "memory_mb" in env else env.get("memory", 2048))
        field = "[environment] storage"
        storage = size_mb(env["storage_mb"] if "storage_mb" in env else env.get("storage", DEFAULT_STORAGE_MB))
        field = "[environment] inodes"  # ActObs's own field (Harbor has none): the layer's entries
        inodes = env.get("inodes")
        if inodes is not None and (not isinstance(inodes, int) or isinstance(inodes, bool) or inodes < 1):
            raise ValueError(f"not a count of entries: {inodes!r}")
        field = "network_mode"  # [agent]'s or [environment]'s
        allow_internet = internet(env, agent)
        field = ""
        task = Task(name=str(cfg.get("task", {}).get("name") or path.name),
                    instruction=(path / "instruction.md").read_text(),
                    agent_timeout=float(agent.get("timeout_sec", 600.0)),
                    verifier_timeout=float(verifier.get("timeout_sec", 600.0)),  # Harbor's default
                    cpus=float(env.get("cpus", 1)), memory_mb=memory, storage_mb=storage, inodes=inodes,
                    allow_internet=allow_internet,
                    workdir=str(env.get("workdir", "")), user=str(agent.get("user", "")),
                    tests=_read_dir(path / "tests"),
                    solution=_read_dir(path / "solution") if (path / "solution").is_dir() else {},
                    kind=next(iter(meta.values()), None), meta=meta, schema_version=version)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{toml_path}: bad value{' of ' + field if field else ''}: {e}") from None
    config = {}
    if build:
        try:
            task.image = task_image(task.name, path / "environment", env.get("docker_image"),
                                    float(env.get("build_timeout_sec", 600.0)), pull)
            config = docker_client().images.get(task.image).attrs["Config"]
        except BuildError as e:
            task.image, task.build_error = None, str(e)
    # task.toml wins; then the image's WORKDIR / USER, as `docker run` would use them.
    task.workdir = task.workdir or config.get("WorkingDir") or "/"
    task.user = task.user or config.get("User") or "root"
    return task


def load_tasks(path, kinds=None):
    """Every Harbor task folder (with a task.toml) under `path`, images built (cached), sorted by folder name;
    with kinds, only the tasks whose [metadata] kind is one of them."""
    dirs = sorted(p.parent for p in Path(path).glob("*/task.toml"))
    if not dirs:
        raise ValueError(f"{path}: no task folders (*/task.toml); write the toy world's with "
                         "`python envs.py corpus --out DIR` (DIR/rl)")
    if kinds:
        found = {d: load_task(d, build=False).kind for d in dirs}
        dirs = [d for d in dirs if found[d] in kinds]
        if not dirs:
            raise ValueError(f"{path}: no task of the kinds {', '.join(kinds)} (--kinds); its kinds are "
                             f"{', '.join(sorted({str(k) for k in found.values()}))}")
    return [load_task(d) for d in dirs]


class BuildError(RuntimeError):
    pass


def task_image(name, context, prebuilt, timeout, pull):
    """The image a task runs in, as Harbor picks it: task.toml's prebuilt docker_image when it names one (pulled
    with pull, else used when it is here), else environment/Dockerfile built (build_task_image). A prebuilt image
    that cannot be had falls back to the Dockerfile when there is one, as Harbor's --force-build would build it."""
    why = ""
    if prebuilt:
        try:
            if pull:
                pull_image(prebuilt)
            if image_exists(prebuilt):
                return prebuilt
            why = f"its docker_image {prebuilt} is not here (offline images)"
        except BuildError as e:
            why = str(e)
        if not (context / "Dockerfile").is_file():
            raise BuildError(f"{context.parent}: {why}, and environment/ has no Dockerfile to build instead")
    return build_task_image(name, context, timeout, pull)


def from_images(dockerfile):
    """The images a Dockerfile's FROM lines name, less its own build stages, scratch and names built from ARGs."""
    stages, refs = set(), []
    for m in re.finditer(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", dockerfile, re.M | re.I):
        if m[1].lower() != "scratch" and m[1] not in stages and "$" not in m[1] and m[1] not in refs:
            refs.append(m[1])
        if m[2]:
            stages.add(m[2])
    return refs


_pulls, _pulls_lock = {}, threading.Lock()  # image -> (lock, error or "" once pulled): one pull an image a process
PULL_WAIT = 5.0  # seconds before a pull's second try; doubled for the third


def pull_image(ref, tries=3):
    """`docker pull ref`, once per process (concurrent callers wait for the first), retried with backoff; raises
    BuildError naming the image, with the registry's answer."""
    with _pulls_lock:
        lock, _ = _pulls.setdefault(ref, (threading.Lock(), None))
    with lock:
        error = _pulls[ref][1]
        if error is None:
            for attempt in range(tries):
                try:
                    res = subprocess.run(["docker", "pull", "-q", ref], env=docker_env(), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, timeout=1800)
                    error = "" if res.returncode == 0 else decode(res.stdout).strip()[-1000:]
                except subprocess.TimeoutExpired:
                    error = "docker pull took more than 30 minutes"
                if not error or "toomanyrequests" in error or attempt + 1 == tries:
                    break
                time.sleep(PULL_WAIT * 2 ** attempt)
            _pulls[ref] = (lock, error)
    if error:
        hint = " (Docker Hub's pull limit: `docker login` raises it)" if "toomanyrequests" in error else ""
        raise BuildError(f"cannot pull {ref}{hint}: {error}\nOffline, give the images locally and run with "
                         "--offline-images (python envs.py base-image --standin tags a stand-in)")


def build_task_image(name, context, timeout=600.0, pull=False):
    """Build environment/ once: the tag carries a hash of its files and of its FROM images, so an unchanged task
    reuses its image. pull: its FROM images are pulled first (pull_image), so the build and the tag follow the
    registry's image and never a local stand-in. Raises BuildError with the build log's tail (and how to give an
    offline FROM, when that is the cause)."""
    digest = hashlib.sha256()
    for rel, data in _read_dir(context).items():
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    for ref in from_images((context / "Dockerfile").read_text()):
        if pull:
            pull_image(ref)
        if image_exists(ref):  # a re-tagged local FROM image (base-image --tag) must rebuild the task
            digest.update(docker_client().images.get(ref).id.encode())
    tag = f"actobs-task/{re.sub(r'[^a-z0-9._-]+', '-', name.lower()).strip('-.')}:{digest.hexdigest()[:12]}"
    if image_exists(tag):
        return tag
    # The CLI, not the SDK: killing it on timeout cancels the build in the daemon.
    cmd = ["docker", "build", "--network", "host", "--force-rm", "-t", tag, str(context)]
    env = dict(docker_env(), DOCKER_BUILDKIT="0")
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
    return Task(spec.name, spec.instruction, **taskgen.LIMITS, allow_internet=False,
                files=tuple((p, text.encode(), mode) for p, text, mode in spec.files),
                tests={"test.sh": spec.test.encode()}, solution={"solve.sh": spec.solve.encode()})
