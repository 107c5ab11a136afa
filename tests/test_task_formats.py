"""The task layouts of the paper's task sets, in fixtures written for this project (tests/fixtures/SOURCES.md):
aider-polyglot (Python, Go, JavaScript exercises: per-language images and test commands), Endless Terminals
(test_final_state.py run by uvx under Python 3.12) and Harbor's features (a uvx pytest verifier, a workdir, a
non-root user, a download at solve time). Scored through tasks.load_task and envs.run_episodes, the path GRPO and
evaluate.py take: a policy that types the reference solution must score 1, one that does nothing 0, in real
sandboxes. task.toml read as Harbor's own parser reads it (its published wheel, fetched here); where a task's image
comes from (its prebuilt docker_image or its FROM images, pulled, never a local stand-in unless offline). Every test
leaves no container of this process behind."""
import base64
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import envs
import evaluate
from actobs import tasks as tasks_module
from actobs import terminus
from actobs.sandbox import daemon, sandbox
from actobs.sandbox.sandbox import DEFAULT_STORAGE_MB
from actobs.tasks import Task, load_task

FIXTURES = Path(__file__).parent / "fixtures"
AIDER, ENDLESS, HARBOR = FIXTURES / "aider", FIXTURES / "endless", FIXTURES / "harbor"

pytestmark = pytest.mark.usefixtures("no_leftovers")


def reply(keys=(), done=False):
    return json.dumps({"analysis": "", "plan": "", "commands": [{"keystrokes": k, "duration": 30} for k in keys],
                       "task_complete": done})


def oracle_policy(tasks, solve=True, second_try_only=False):
    """A policy that types each task's solution/solve.sh as one line (base64: no tab reaches the shell's
    completion), then claims completion; with solve=False it claims completion at once. second_try_only: it
    solves only once it has seen the failed tests' output (aider's second try)."""
    scripts = {t.instruction.strip(): base64.b64encode(t.solution["solve.sh"]).decode() for t in tasks}

    def policy(states):
        out = []
        for msgs in states:
            script = scripts[msgs[0]["content"].split("Task:\n")[1].split("\n\nCurrent terminal")[0].strip()]
            retrying = any(m["content"].startswith("The tests failed.") for m in msgs if m["role"] == "user")
            typed = any("base64 -d" in m["content"] for m in msgs if m["role"] == "assistant")
            if solve and not typed and (retrying or not second_try_only):
                out.append(reply([f"echo {script} | base64 -d > /tmp/solve.sh && bash /tmp/solve.sh\n"]))
            else:
                out.append(reply(done=True))
        return out
    return policy


def test_aider_layout_scores_each_language_through_evaluate(tmp_path, base_image, capsys):
    """Python (pytest -q: no session banner), Go (go test) and JavaScript (node --test), toolchains from Debian's
    packages at image build time; evaluate.py's per-kind rows by language."""
    tasks = [load_task(p) for p in sorted(AIDER.iterdir())]
    assert [t.build_error for t in tasks] == [""] * 3

    def rollout_with(policy):
        return lambda todo, on_episode, stats: envs.run_episodes(todo, policy, max_turns=4, concurrency=3,
                                                                 on_episode=on_episode, stats=stats)
    argv = ["--model", "unused", "--tasks", str(AIDER), "--attempts", "1", "--kind-by", "language"]
    solved = evaluate.evaluate(evaluate.parse_args(argv + ["--out", str(tmp_path / "solved.json")]),
                               rollout=rollout_with(oracle_policy(tasks)))
    idle = evaluate.evaluate(evaluate.parse_args(argv + ["--out", str(tmp_path / "idle.json")]),
                             rollout=rollout_with(oracle_policy(tasks, solve=False)))
    for res, want in ((solved, 1.0), (idle, 0.0)):
        got = {n: (e["kind"], e["attempts"][0]["reward"], e["attempts"][0]["failure"]) for n, e in res["tasks"].items()}
        assert got == {t.name: (t.meta["language"], want, None) for t in tasks}, got
    table = capsys.readouterr().out
    assert all(f"\n{lang:20}     1   100.0" in table for lang in ("go", "javascript", "python"))


def test_aider_second_try_sees_the_test_output(tmp_path, base_image, capsys):
    task = load_task(AIDER / "polyglot_python_run-length")
    argv = ["--model", "unused", "--tasks", str(AIDER / "polyglot_python_run-length"), "--attempts", "1",
            "--second-try", "--out", str(tmp_path / "r.json"), "--transcripts", str(tmp_path / "t.jsonl")]
    policy = oracle_policy([task], second_try_only=True)
    res = evaluate.evaluate(evaluate.parse_args(argv), rollout=lambda todo, on_episode, stats: envs.run_episodes(
        todo, policy, max_turns=4, on_episode=on_episode, stats=stats, second_try=True))
    a, = res["tasks"][task.name]["attempts"]
    assert (a["first_reward"], a["reward"], a["failure"]) == (0.0, 1.0, None)
    assert res["summary"]["first_try"][1] == 0.0 and res["summary"]["pass@k"][1] == 1.0
    conv = json.loads((tmp_path / "t.jsonl").read_text())["conversations"]
    retry = next(m["content"] for m in conv if m["content"].startswith("The tests failed."))
    assert "3 failed" in retry and "The terminal was restarted:\nCurrent Terminal Screen:\n" in retry
    assert "1st try" in capsys.readouterr().out


def test_endless_terminals_layout_offline_names_what_is_missing(base_image):
    """FROM ubuntu:22.04 builds on the stand-in and the agent starts in /home/user; the verifier's
    `uvx --python 3.12` has no Python 3.12 offline (the stand-in has 3.13, and uv cannot download one): a
    verifier_error that says so, for the solution and for doing nothing alike, never a score."""
    tasks = [load_task(p) for p in sorted(ENDLESS.iterdir())]
    assert [(t.build_error, t.workdir) for t in tasks] == [("", "/home/user")] * 2
    for ep in envs.run_oracle(tasks, concurrency=2) + envs.run_oracle(tasks, noop=True, concurrency=2):
        assert (ep.reward, ep.failure) == (0.0, "verifier_error"), ep.verifier_output
        assert "test runner never started" in ep.error and "Python 3.12" in ep.error, ep.error


def test_harbor_features_score_1_and_nothing_0(base_image):
    """A uvx pytest verifier (offline on the stand-in), a task.toml workdir and a non-root agent user."""
    tasks = [load_task(HARBOR / n) for n in ("uvx-pytest", "workdir", "non-root")]
    assert [(t.workdir, t.user) for t in tasks] == [("/app", "root"), ("/srv/work", "root"), ("/app", "builder")]
    solved = envs.run_episodes(tasks, oracle_policy(tasks), max_turns=4, concurrency=3)
    idle = envs.run_episodes(tasks, oracle_policy(tasks, solve=False), max_turns=4, concurrency=3)
    assert [(e.reward, e.failure) for e in solved] == [(1.0, None)] * 3, [e.verifier_output for e in solved]
    assert [(e.reward, e.failure, e.needs_network) for e in idle] == [(0.0, None, "")] * 3
    assert "2 failed in" in idle[0].verifier_output  # pytest -q ran: a wrong answer, not a broken verifier


def test_a_download_at_solve_time_needs_the_network(base_image):
    """pip install in the solution: without the network a 0 that says why; with it (host network here: the
    daemon has no bridge) the true 1. The toy world's tasks (allow_internet = false) never get it."""
    task = load_task(HARBOR / "pip-install")
    offline, = envs.run_oracle([task])
    assert (offline.reward, offline.failure) == (0.0, None)
    assert "Temporary failure in name resolution" in offline.needs_network, offline.error
    online, = envs.run_oracle([task], network="host")
    assert (online.reward, online.failure, online.needs_network) == (1.0, None, ""), online.verifier_output
    idle, = envs.run_oracle([task], noop=True, network="host")
    assert (idle.reward, idle.needs_network) == (0.0, "")
    task.allow_internet = False
    closed, = envs.run_oracle([task], network="host")
    assert (closed.reward, closed.needs_network) == (0.0, "")  # the task forbids it: nothing to give


def test_the_standins_uv_goes_online_with_the_network(base_image):
    """The stand-in's uv is offline (wheels of the verifiers' pins only); with the network, a verifier's
    `uvx --with <another wheel>` fetches it from PyPI, through the host's CAs."""
    uvx = "source /root/.local/bin/env && uvx -p 3.13 --with tomli-w==1.2.0 python -c 'import tomli_w'"
    with sandbox.Sandbox("ubuntu:24.04") as offline:
        code, out = offline.exec(uvx, timeout=120)
        assert code != 0 and b"the network was disabled" in out
    with sandbox.Sandbox("ubuntu:24.04", network="host") as online:
        code, out = online.exec(uvx, timeout=120)
        assert code == 0, out


def test_keep_agent_processes_keeps_a_service_for_its_tests(base_image):
    """A verifier that probes what the agent left running scores 0 when the agent's processes are stopped (the
    RL default) and 1 when they are kept, which is also what lets a left-behind process forge a reward."""
    tests = {"test.sh": b"pgrep -f heartbeat-loop >/dev/null && echo 1 > /logs/verifier/reward.txt "
                        b"|| echo 0 > /logs/verifier/reward.txt\n"}
    task = Task("service", "Keep a heartbeat running.", tests=tests)
    start = reply(["nohup bash -c 'exec -a heartbeat-loop sleep 1000' >/dev/null 2>&1 &\n"])

    def policy(states):
        return [start if len(m) == 1 else reply(done=True) for m in states]
    stopped, = envs.run_episodes([task], policy, max_turns=4)
    kept, = envs.run_episodes([task], policy, max_turns=4, keep_agent=True)
    assert (stopped.reward, kept.reward) == (0.0, 1.0)


# ---------------------------------------------------------------------------------------------- Harbor's format

def task_folder(path, toml, dockerfile="FROM actobs-base:bookworm\n"):
    """A Harbor task folder with this task.toml (and this Dockerfile; None: none)."""
    (path / "tests").mkdir(parents=True)
    (path / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (path / "instruction.md").write_text("Do nothing.\n")
    (path / "task.toml").write_text(toml)
    (path / "environment").mkdir()
    if dockerfile:
        (path / "environment" / "Dockerfile").write_text(dockerfile)
    return path


# Harbor's current format (schema 1.4): network_mode for allow_internet, [agent]'s own, memory_mb / storage_mb, a
# prebuilt docker_image without a Dockerfile; and the deprecated fields it still reads
CURRENT = {
    "closed": 'schema_version = "1.4"\n[task]\nname = "actobs/closed"\n[agent]\ntimeout_sec = 50.0\nuser = "dev"\n'
              '[environment]\nnetwork_mode = "no-network"\ncpus = 2\nmemory_mb = 1024\nstorage_mb = 2048\n'
              'workdir = "/work"\ndocker_image = "actobs-test/prebuilt:1"\n',
    "agent-closed": '[agent]\nnetwork_mode = "no-network"\n[environment]\nnetwork_mode = "public"\n',
    "legacy": 'version = "1.0"\n[verifier]\ntimeout_sec = 30.0\n[environment]\nallow_internet = false\n'
              'memory = "4G"\nstorage = "512M"\n',
    "defaults": 'schema_version = "1.4"\n',
}


def harbors_reading(paths, tmp_path):
    """{path: the fields} of each task.toml as Harbor's TaskConfig reads it: its published wheel (the version
    terminus.HARBOR_VERSION names), imported in a child process (its `toml` dump library stubbed: only reading)."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                    "--python-version", "3.12", "-d", str(wheels), f"harbor=={terminus.HARBOR_VERSION}"], check=True)
    zipfile.ZipFile(next(wheels.glob("*.whl"))).extractall(tmp_path / "harbor")
    code = f"""import json, sys, tomllib, types
sys.path.insert(0, {str(tmp_path / "harbor")!r}); sys.modules["toml"] = types.ModuleType("toml")
from harbor.models.task.config import TaskConfig
out = {{}}
for p in sys.argv[1:]:
    c = TaskConfig.model_validate(tomllib.loads(open(p).read()))
    e, a = c.environment, c.agent
    out[p] = dict(name=c.task and c.task.name, cpus=e.cpus, memory_mb=e.memory_mb, storage_mb=e.storage_mb,
                  workdir=e.workdir, docker_image=e.docker_image, agent_timeout=a.timeout_sec, user=a.user,
                  verifier_timeout=c.verifier.timeout_sec, network=(a.network_mode or e.network_mode).value)
print(json.dumps(out))"""
    res = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def test_task_toml_is_read_as_harbors_own_parser_reads_it(tmp_path):
    """Every fixture and Harbor's current fields: what load_task takes from task.toml is what Harbor's TaskConfig
    gives (where Harbor leaves a field unset, the value ActObs uses in its place: 1 cpu, 2048 MB, an agent timeout
    of 600 s where Harbor sets none)."""
    folders = sorted(p.parent for p in FIXTURES.glob("*/*/task.toml"))
    folders += [task_folder(tmp_path / "tasks" / k, toml, None if k == "closed" else "FROM x\n")
                for k, toml in CURRENT.items()]
    harbor = harbors_reading([f / "task.toml" for f in folders], tmp_path)
    for folder in folders:
        h, t = harbor[str(folder / "task.toml")], load_task(folder, build=False)
        assert (t.name, t.cpus, t.memory_mb, t.storage_mb, t.workdir, t.user, t.verifier_timeout, t.agent_timeout,
                t.allow_internet) == \
            (h["name"] or folder.name, h["cpus"] or 1, h["memory_mb"] or 2048, h["storage_mb"] or DEFAULT_STORAGE_MB,
             h["workdir"] or "/", str(h["user"] or "root"), h["verifier_timeout"], h["agent_timeout"] or 600.0,
             h["network"] == "public"), folder
    assert harbor[str(tmp_path / "tasks" / "closed" / "task.toml")]["docker_image"] == "actobs-test/prebuilt:1"


def test_task_toml_fields_this_cannot_run_are_refused(tmp_path):
    allow = task_folder(tmp_path / "allow", '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org"]\n')
    with pytest.raises(ValueError, match=r"allow/task.toml: bad value of network_mode.*'allowlist' is not one"):
        load_task(allow, build=False)
    steps = task_folder(tmp_path / "steps", '[[steps]]\nname = "one"\n')
    with pytest.raises(ValueError, match=r"steps/task.toml: a multi-step task"):
        load_task(steps, build=False)
    with pytest.raises(ValueError, match=r"none/environment/Dockerfile: missing"):  # no prebuilt image to run instead
        load_task(task_folder(tmp_path / "none", "", dockerfile=None), build=False)


@pytest.fixture
def registry(monkeypatch):
    """tasks.pull_image as a registry would answer: an image it has is tagged here (from the given local images),
    one it has not fails; every pull asked is kept. The tags it made (and those a test adds to its list) are removed
    afterwards."""
    pulled, made = [], []

    def pull_image(ref):
        pulled.append(ref)
        if ref not in has:
            raise tasks_module.BuildError(f"cannot pull {ref}: not found")
        daemon.docker_client().images.get(has[ref]).tag(ref)
        made.append(ref)
    has = {}
    monkeypatch.setattr(tasks_module, "pull_image", pull_image)
    yield has, pulled, made
    for ref in set(made):
        daemon.docker_client().images.remove(ref, noprune=True)


def test_own_images_are_pulled_never_a_stale_stand_in(tmp_path, registry):
    """A FROM image tagged here as a stand-in: offline the task builds on it; with pull the registry's image
    replaces the tag first, and the task image is built on that one (another tag). A prebuilt docker_image is pulled
    and run as it is; one that cannot be pulled falls back to the Dockerfile, or, without one, names the image."""
    has, pulled, made = registry
    client = daemon.docker_client()
    stand_in, real = client.images.get("ubuntu:24.04"), client.images.get("actobs-base:bookworm")
    stand_in.tag("actobs-test/from:1")
    made.append("actobs-test/from:1")
    folder = task_folder(tmp_path / "own", "", "FROM actobs-test/from:1\nRUN echo built > /built\n")
    offline = load_task(folder)
    assert pulled == [] and not offline.build_error
    has["actobs-test/from:1"] = "actobs-base:bookworm"
    online = load_task(folder, pull=True)
    assert pulled == ["actobs-test/from:1"] and not online.build_error and online.image != offline.image
    layers = client.images.get(online.image).attrs["RootFS"]["Layers"]
    assert layers[0] == real.attrs["RootFS"]["Layers"][0] != stand_in.attrs["RootFS"]["Layers"][0]
    # a prebuilt image: pulled and used; not in the registry: the Dockerfile, or a build error naming it
    has["actobs-test/prebuilt:1"] = "actobs-base:bookworm"
    prebuilt = task_folder(tmp_path / "prebuilt", '[environment]\ndocker_image = "actobs-test/prebuilt:1"\n',
                           dockerfile=None)
    assert load_task(prebuilt, pull=True).image == "actobs-test/prebuilt:1"
    fallback = task_folder(tmp_path / "fallback", '[environment]\ndocker_image = "actobs-test/gone:1"\n',
                           "FROM actobs-test/from:1\n")
    assert load_task(fallback, pull=True).image.startswith("actobs-task/fallback:")
    gone = load_task(task_folder(tmp_path / "gone", '[environment]\ndocker_image = "actobs-test/gone:1"\n',
                                 dockerfile=None), pull=True)
    assert gone.image is None and "cannot pull actobs-test/gone:1" in gone.build_error
    assert "environment/ has no Dockerfile" in gone.build_error


def test_a_pull_that_fails_names_the_image_and_the_offline_way(tmp_path, base_image, monkeypatch):
    """The real `docker pull` of an image no registry here has: tried three times, then a build error with the
    registry's answer and --offline-images."""
    monkeypatch.setattr(tasks_module, "_pulls", {})
    monkeypatch.setattr(tasks_module, "PULL_WAIT", 0.0)
    task = load_task(task_folder(tmp_path / "t", '[environment]\ndocker_image = "actobs-test/absent:1"\n',
                                 dockerfile=None), pull=True)
    assert task.image is None and "cannot pull actobs-test/absent:1" in task.build_error
    assert "--offline-images" in task.build_error
