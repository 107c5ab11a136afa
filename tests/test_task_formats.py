"""The task layouts of the paper's task sets, in fixtures written for this project (tests/fixtures/SOURCES.md):
aider-polyglot (Python, Go, JavaScript exercises: per-language images and test commands), Endless Terminals
(test_final_state.py run by uvx under Python 3.12) and Harbor's features (a uvx pytest verifier, a workdir, a
non-root user, a download at solve time). Scored through tasks.load_task and envs.run_episodes, the path GRPO and
evaluate.py take: a policy that types the reference solution must score 1, one that does nothing 0, in real
sandboxes. Every test leaves no container of this process behind."""
import base64
import json
from pathlib import Path

import pytest

import envs
import evaluate
from actobs.sandbox import sandbox
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
