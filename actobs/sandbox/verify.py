"""
The verifier of an episode: it runs in the agent's container once the agent is stopped, on inputs that are the
task's, and its reward is read from what it wrote (verify); what the agent changed of the verifier's inputs and
programs is the episode's tamper evidence, read against the image (its commands on PATH, a path as it holds it).
envs.py scores every episode through it.

The verifier's inputs are the task's: what the agent left where a verifier loads code from (a conftest.py or pytest
ini file above /tests, a start-up hook, a pytest plugin, the stand-in's uv and wheels) is taken away or recorded,
and its changes of the verifier's programs are recorded: docs/sandboxes.md#what-a-sandbox-guarantees.
"""
import functools
import json
import os
import threading

from actobs.sandbox.container_files import get_file, get_files, put_files
from actobs.sandbox.daemon import LABEL, SandboxError, docker_client, owner_label
from actobs.sandbox.images import STANDIN_TOOLS
from actobs.terminus import decode, pytest_never_ran

VERIFIER_TAIL = 2000  # characters of the verifier's output kept on each episode

# Emptied and written afresh before every verifier run: our pytest ini, uv's cache. A tmpfs of its own (/dev/shm
# is noexec), so the environment uv builds there does not count against the agent's disk budget.
VERIFIER_DIR = "/run/actobs-verifier"
PYTEST_INIS = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")  # pytest's lookup order
STARTUP_HOOKS = ("sitecustomize.py", "usercustomize.py")  # imported by every Python start (site.py)


def _under(path, folder):
    return path == folder or path.startswith(folder + "/")


# Run as root by prepare_verifier: $0 is VERIFIER_DIR, the rest are agent-written hooks to remove. VERIFIER_DIR is
# emptied, not removed (a tmpfs mount point), after any symlink in its place is gone; it is written from inside,
# as the daemon's archive upload does not reach into a tmpfs. /logs/verifier starts empty, writable by all.
FRESH_INPUTS = """
rm -rf /tests "$@" && mkdir -m 755 /tests || exit 1
if [ -L "$0" ]; then rm -f "$0"; fi
mkdir -p -m 700 "$0" && find "$0" -mindepth 1 -delete && echo "[pytest]" > "$0/pytest.ini" || exit 1
rm -rf /logs/verifier && mkdir -p /logs/verifier && chmod 777 /logs/verifier
"""
# The verifier, then /tests removed in the same exec (an agent's second try neither reads the tests nor shows as
# tampering); $1: the test script. A verifier that times out leaves /tests to verify's own removal.
RUN_TESTS = 'bash "$1"; code=$?; rm -rf /tests; exit $code'
REWARD_FILES = ("reward.txt", "reward.json")  # in /logs/verifier, the first found is the reward


def json_reward(text):
    """The reward of a reward.json's text: a number; or an object: its "reward" when it has one, else the mean of its
    values, a score per check (a graded reward, full marks only when every check has them; one value: that value).
    Raises ValueError (or KeyError, TypeError) on anything else."""
    value = json.loads(text)
    if not isinstance(value, dict):
        return float(value)
    if "reward" in value:
        return float(value["reward"])
    if not value:
        raise ValueError("reward.json holds an empty object")
    return sum(float(v) for v in value.values()) / len(value)


def verifier_loaded(sb, changed):
    """The paths in `changed` (container_files.changes) that a verifier loads code or settings from without being asked:
    anything in /tests; a conftest.py or pytest ini file in / (above /tests); a Python start-up hook
    (sitecustomize, usercustomize, a .pth file with an `import` line: site.py runs those); an entry_points.txt
    registering a pytest plugin; the stand-in's tool kit (STANDIN_TOOLS, where the image has it)."""
    def reads(path, needle):
        return needle in (get_file(sb.container, path) or b"")
    tools = [t for t in STANDIN_TOOLS if changed.get(t) == "C"]  # "A": not the image's kit, the agent's own
    found = []
    for path in changed:
        parent, name = os.path.split(path)
        if (_under(path, "/tests") or (parent == "/" and name in ("conftest.py",) + PYTEST_INIS)
                or name in STARTUP_HOOKS or any(_under(path, t) for t in tools)
                or (name.endswith(".pth") and reads(path, b"import"))
                or (name == "entry_points.txt" and reads(path, b"[pytest11]"))):
            found.append(path)
    return sorted(found)


def verifier_env(task):
    """The verifier's environment: pytest reads only the task's ini (or an empty one of ours) with /tests as its
    root and no conftest.py above it; no user site-packages; uv and pip read no config file and uv starts from
    an empty cache (the agent could have changed the image's), so the verifier's packages come from the
    stand-in's checked wheels."""
    ini = next((f"/tests/{n}" for n in PYTEST_INIS if n in task.tests), f"{VERIFIER_DIR}/pytest.ini")
    return {"PYTEST_ADDOPTS": f"-c {ini} --rootdir=/tests --confcutdir=/tests", "PYTHONNOUSERSITE": "1",
            "UV_CACHE_DIR": f"{VERIFIER_DIR}/uv-cache", "UV_NO_CONFIG": "1", "PIP_CONFIG_FILE": os.devnull}


# docker exec's PATH in an image that sets none
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_commands_lock = threading.Lock()


def image_commands(image):
    """(the image's PATH folders and the stand-in's uv folder, the names of the commands in them), as a fresh
    container of the image lists them: what a verifier's command resolves to before any agent ran. Once per image:
    the sandboxes verifying at once wait for the first one's listing."""
    with _commands_lock:
        return _image_commands(image)


@functools.lru_cache(maxsize=64)
def _image_commands(image):
    env = dict(e.split("=", 1) for e in docker_client().images.get(image).attrs["Config"].get("Env") or ())
    dirs = tuple(dict.fromkeys(d for d in env.get("PATH", DEFAULT_PATH).split(":") + [STANDIN_TOOLS[0]]
                               if d.startswith("/")))
    out = docker_client().containers.run(image, list(dirs), entrypoint=["bash", "-c", 'ls -1A "$@" 2>/dev/null; :',
                                                                        "ls"],
                                         labels={LABEL: owner_label()}, network_mode="none", remove=True)
    names = decode(out).splitlines()
    return dirs, frozenset(n for n in names if n and not n.endswith(":"))  # "folder:" heads each listing


# The verifier's programs: the shell and coreutils, the dynamic loader and libraries, the interpreters with their
# standard libraries and site-packages, uv and pytest; they come from these folders (and the image's PATH).
PROGRAM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr/bin", "/usr/sbin", "/usr/lib",
                "/usr/lib32", "/usr/lib64", "/usr/libexec", "/usr/local/bin", "/usr/local/sbin", "/usr/local/lib",
                "/etc/ld.so.preload", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives") + STANDIN_TOOLS


def program_changes(sb, changed):
    """The paths in `changed` (container_files.changes) that change the programs the verifier runs, as the image
    has them: a file of PROGRAM_DIRS or of the image's PATH that the image has and the agent modified or replaced
    (bash, python, uv, a library, a module, a compiled .pyc), a loader setting the agent added, and an added command
    that shadows one the image has on PATH (a `tr` in /usr/local/bin). New packages and commands are not
    changes of the verifier's programs: an honest `pip install` or `apt-get install` adds, it does not replace."""
    path_dirs, commands = image_commands(sb.image)
    dirs = PROGRAM_DIRS + path_dirs
    above = set()  # every folder above a changed path: a "C" there is the folder's listing, not a program
    for p in changed:
        while p not in ("/", ""):
            p = os.path.dirname(p)
            above.add(p)
    found = []
    for path, kind in changed.items():
        if not any(_under(path, d) for d in dirs) or path in above:
            continue
        if (kind == "C" or _under(path, "/etc/ld.so.conf.d") or path == "/etc/ld.so.preload"
                or (os.path.dirname(path) in path_dirs and os.path.basename(path) in commands)):
            found.append(path)
    return sorted(found)


@functools.lru_cache(maxsize=8)
def image_archive(image, path):
    """A tar of `path` as `image` holds it, read from a container that is created and never started."""
    import docker
    c = docker_client().containers.create(image, entrypoint=["true"], labels={LABEL: owner_label()},
                                          network_mode="none")
    try:
        stream, _ = c.get_archive(path)
        return b"".join(stream)
    except docker.errors.NotFound:
        raise SandboxError(f"{image} has no {path}") from None
    finally:
        c.remove(force=True)


def restore(sb, path):
    """Put `path` back as the image has it (the tree is removed first), from a copy taken once per image."""
    code, out = sb.exec(["rm", "-rf", path], user="root")
    if code != 0:
        raise SandboxError(f"could not remove {path}: {decode(out)[-300:]}")
    if not sb.container.put_archive(os.path.dirname(path), image_archive(sb.image, path)):
        raise SandboxError(f"could not restore {path}")


def prepare_verifier(sb, task, strict=False):
    """After stop_agent: put back what the agent changed of the verifier's start-up hooks (sitecustomize,
    usercustomize), pytest plugin registrations and tool kit (as the image has them, or removed), write /tests
    and VERIFIER_DIR afresh, root-owned. Returns the verifier-loaded paths the agent wrote (verifier_loaded)
    and its changes of the verifier's programs (program_changes), sorted: the episode's tamper evidence. .pth
    files stay (removing them would break packages the agent installed): the verifier's own environment does
    not read the image's (uvx), or its interpreter is the image's. strict: also remove the .pyc files the agent
    added under PROGRAM_DIRS (a crafted one runs in place of a module's source; Python writes them again)."""
    changed = sb.changes()
    tampered = verifier_loaded(sb, changed)
    programs = program_changes(sb, changed)
    hooks = [p for p in tampered if os.path.basename(p) in STARTUP_HOOKS + ("entry_points.txt",)]
    for path in hooks:
        if changed[path] == "C":  # the image has one: its own comes back
            restore(sb, path)
    added = [p for p in hooks if changed[p] == "A"]
    if strict:
        added += [p for p, kind in changed.items() if kind == "A" and p.endswith(".pyc")
                  and any(_under(p, d) for d in PROGRAM_DIRS)]
    for tool in STANDIN_TOOLS:
        if changed.get(tool) == "C" and any(_under(p, tool) for p in tampered):
            restore(sb, tool)
    code, out = sb.exec(["bash", "-c", FRESH_INPUTS, VERIFIER_DIR] + added, user="root")
    if code != 0:
        raise RuntimeError(f"could not prepare the verifier: {decode(out)[-300:]}")
    put_files(sb.container, [("/tests/" + rel, data, 0o755) for rel, data in task.tests.items()])
    return sorted(set(tampered) | set(programs))


class Tampered(Exception):
    """strict verification: the agent changed what the verifier loads or runs; the episode scores 0 unverified."""


def verify(sb, task, keep_agent=False, tampered=None, strict=False):
    """Stop every agent process, then run tests/test.sh as root in a fresh /logs/verifier, with the task's
    inputs (prepare_verifier, verifier_env); returns (reward, error, output tail), and adds the tamper evidence
    (the verifier-loaded paths and the verifier's programs the agent changed) to the list `tampered`, if given.
    strict (RL: a policy must never be paid for it): any tamper evidence raises Tampered before the verifier
    runs; otherwise (evaluation, Harbor's semantics: a task may legitimately change those files) the verifier
    runs on what the agent left, with the planted inputs undone, and the evidence is only recorded. The reward
    is read only from what the verifier wrote: no agent process is left to write it. An error (timeout, no or
    bad reward file, a test runner that never started) is not a 0 reward. keep_agent: leave the agent's
    processes running (tests that probe a service the agent started, as Harbor does); then anything the agent
    left behind can write the reward file or change the tests or the verifier's inputs: a forged reward."""
    if not keep_agent:
        sb.stop_agent()
    found = prepare_verifier(sb, task, strict)
    if tampered is not None:
        tampered.extend(found)
    if strict and found:
        sb.exec(["rm", "-rf", "/tests"], user="root")
        raise Tampered(f"the agent changed what the verifier loads or runs: {', '.join(found[:5])}"
                       + (f" and {len(found) - 5} more" if len(found) > 5 else ""))
    code, out = sb.exec(["bash", "-c", RUN_TESTS, "verify", "/tests/test.sh"], user="root",
                        timeout=task.verifier_timeout, env=verifier_env(task))
    tail = decode(out)[-VERIFIER_TAIL:]
    if code in (124, 137):
        sb.exec(["rm", "-rf", "/tests"], user="root")
        return 0.0, f"verifier timed out after {task.verifier_timeout:.0f}s", tail
    txt, js = get_files(sb.container, "/logs/verifier", REWARD_FILES)  # one archive of the folder, read by the daemon
    try:
        if txt is not None:
            reward = float(txt.decode().strip())
        elif js is not None:
            reward = json_reward(js)
        else:
            return 0.0, f"verifier wrote no /logs/verifier/reward.txt or reward.json (exit {code})", tail
    except (ValueError, TypeError, KeyError) as e:
        return 0.0, f"unreadable reward file: {e!r}", tail
    never = pytest_never_ran(out) if reward == 0 and b"pytest" in task.tests.get("test.sh", b"") else None
    if never:
        return 0.0, f"the verifier's test runner never started ({never})", tail
    return reward, None, tail
