"""envs.py against a real Docker daemon: the terminal, Harbor tasks (oracle 1, nothing 0), the episode runner,
the scripted expert and the corpus command. Every test must leave no container of this process behind."""
import concurrent.futures
import json
import os
import random
import socket
import time
from pathlib import Path

import pytest

from conftest import split_observation
import envs
from actobs import taskgen, terminus
from actobs.sandbox import container_files, daemon, sandbox
from actobs.tasks import Task, build_task_image, load_task, load_tasks, task_from_spec

HARBOR = Path(__file__).parent / "fixtures" / "harbor"


pytestmark = pytest.mark.usefixtures("no_leftovers")


@pytest.fixture
def sb(base_image):
    with sandbox.Sandbox(base_image, memory_mb=512) as box:
        box.screen()
        yield box


def scripted(*turns):
    """A policy replaying fixed commands, one reply per turn, then claiming completion twice."""
    def policy(states):
        replies = []
        for msgs in states:
            i = sum(m["role"] == "assistant" for m in msgs)
            cmds = [{"keystrokes": k, "duration": d} for k, d in turns[i]] if i < len(turns) else []
            replies.append(json.dumps({"analysis": "", "plan": "", "commands": cmds, "task_complete": i >= len(turns)}))
        return replies
    return policy


def echo_task(instruction="Write hi to /app/out.txt.", **kw):
    return Task("echo", instruction, tests={"test.sh": b'grep -qx hi /app/out.txt && echo 1 > '
                     b'/logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n'}, **kw)


# ---------------------------------------------------------------------------------------------- terminal

def test_first_screen_and_prompt(base_image):
    with sandbox.Sandbox(base_image) as s:
        host = s.container.attrs["Config"]["Hostname"]
        assert s.screen() == f"Current Terminal Screen:\nroot@{host}:/app#\n"
        assert s.send("echo hi\n", 5) == f"New Terminal Output:\nroot@{host}:/app# echo hi\nhi\nroot@{host}:/app#"
        assert s.last_idle  # returned on the prompt, well before 5 s
        assert s.send("echo again\n") == (f"New Terminal Output:\n\nroot@{host}:/app# echo again\n"
                                          f"again\nroot@{host}:/app#")


def test_without_a_network_loopback_only_and_no_endpoint_in_the_daemon(sb):
    """A sandbox without a network: a network namespace of its own with loopback only, localhost and its hostname
    resolved from /etc/hosts, and no libnetwork endpoint in dockerd (on the shared "none" network, teardowns at once
    can deadlock Debian 12's dockerd)."""
    sb.container.reload()
    settings = sb.container.attrs["NetworkSettings"]
    assert sb.container.attrs["Config"]["NetworkDisabled"] and not settings["SandboxID"] and not settings["Networks"]
    code, out = sb.exec("ls /sys/class/net; readlink /proc/self/ns/net; getent hosts localhost sandbox | wc -l; "
                        "exec 3<>/dev/tcp/1.1.1.1/53", user="root")
    lines = out.decode().splitlines()
    assert code != 0 and lines[:1] == ["lo"] and lines[1].startswith("net:[") and lines[2] == "2"
    assert lines[1] != os.readlink("/proc/self/ns/net") and "unreachable" in lines[3]


def test_heredoc_interactive_program_and_keys(sb):
    obs = sb.send("cat > /tmp/f << 'EOF'\nline one\nline two\nEOF\n", 2)
    assert "\n> line one\n> line two\n> EOF\n" in obs
    prompt = sb.send("", 0).split("\n")[-1]  # nothing typed: the diff is the prompt line, root@<host>:/app#
    assert prompt.endswith(":/app#") and sb.send("cat /tmp/f\n").endswith(f"\nline one\nline two\n{prompt}")
    assert ">>>" in sb.send("python3\n", 2.5) and not sb.last_idle  # python's prompt is not the shell's
    assert "\n4\n>>>" in sb.send("print(2 + 2)\n", 1.5)
    obs = sb.send("C-d", 2)
    assert sb.last_idle and obs.rstrip().endswith(":/app#")
    assert sb.send("cd /tmp\n").endswith(":/tmp#")
    sb.send("cd /app\n")


def test_reply_commands_are_read_once(sb):
    sb.send("", 0)
    assert sb.send("echo one\n", 1, read=False) is None
    obs = sb.send("echo two\n", 1)
    assert "echo one\none\n" in obs and "echo two\ntwo\n" in obs


def test_files_round_trip(sb):
    container_files.put_files(sb.container, [("/app/data/x.bin", b"\x00\x01abc", 0o640)])
    assert container_files.get_file(sb.container, "/app/data/x.bin") == b"\x00\x01abc"
    assert container_files.get_file(sb.container, "/app/nope") is None
    assert sb.exec("stat -c %a /app/data/x.bin") == (0, b"640\n")


def test_changes_read_on_the_host_are_the_daemons_diff(sb):
    """Sandbox.changes (container_files.changes) walks overlay2's upper dir against the image's layers; the
    daemon's own diff (which compares the whole tree) must agree on every kind of change: added, modified, metadata
    only, a lower file removed, a lower directory moved, emptied and refilled, a symlink, a file in a tmpfs (not a
    change)."""
    assert container_files.overlay_dirs(sb.container) is not None  # the walk runs here, not the fallback
    code, _ = sb.exec("echo x > /newfile && echo z > /etc/debian_version && chmod 600 /etc/profile && touch /etc/motd"
                      " && rm /etc/issue && mv /usr/share/doc/jq /usr/share/jqdoc && rm -rf /usr/share/doc/tmux"
                      " && mkdir /usr/share/doc/tmux && echo 1 > /usr/share/doc/tmux/README && ln -s /etc /app/link"
                      " && mkdir -p /tests/a && echo t > /tests/a/conftest.py && echo y > /dev/shm/f")
    assert code == 0
    daemon = {c["Path"]: "CA"[c["Kind"]] for c in sb.container.diff() if c["Kind"] in (0, 1)}
    found = sb.changes()
    assert found == daemon
    assert {"/newfile": "A", "/etc/debian_version": "C", "/etc/profile": "C", "/usr/share/jqdoc": "A",
            "/usr/share/doc/tmux/README": "C",  # the image has a README
            "/tests/a/conftest.py": "A"}.items() <= found.items()
    assert "/etc/issue" not in found and "/dev/shm/f" not in found


# ---------------------------------------------------------------------------------------------- Harbor tasks

def test_harbor_task_image_is_cached_and_settings_applied():
    t0 = time.time()
    task = load_task(HARBOR / "non-root")
    assert time.time() - t0 < 10 and task.image == load_task(HARBOR / "non-root").image
    assert (task.user, task.workdir) == ("builder", "/app")
    assert load_task(HARBOR / "workdir").workdir == "/srv/work"
    with envs.open_sandbox(task) as s:
        assert s.screen().endswith("builder@" + s.container.attrs["Config"]["Hostname"] + ":/app$\n")


def test_harbor_build_failure_explains_offline_from(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM actobs-missing/image:1\n")
    with pytest.raises(RuntimeError, match=r"(?s)Dockerfile: build failed.*python envs.py base-image --tag"):
        build_task_image("missing", tmp_path)


def test_generated_harbor_folder_runs_oracle(tmp_path):
    spec = taskgen.generate("replace_host", random.Random(5))
    taskgen.write_harbor(spec, tmp_path / spec.name, daemon.BASE_IMAGE)
    task = load_task(tmp_path / spec.name)
    assert [e.reward for e in envs.run_oracle([task]) + envs.run_oracle([task], noop=True)] == [1.0, 0.0]


def test_verifier_errors_are_not_failures(base_image):
    silent = Task("silent", "x", tests={"test.sh": b"exit 0\n"})
    slow = Task("slow", "x", verifier_timeout=1, tests={"test.sh": b"sleep 30\n"})
    bad = Task("bad", "x", tests={"test.sh": b"echo yes > /logs/verifier/reward.txt\n"})
    js = Task("json", "x", tests={"test.sh": b'echo \'{"reward": 0.5}\' > /logs/verifier/reward.json\n'})
    eps = envs.run_oracle([silent, slow, bad, js], noop=True)
    assert [e.failure for e in eps] == ["verifier_error"] * 3 + [None]
    assert "no /logs/verifier/reward.txt" in eps[0].error and "timed out" in eps[1].error
    assert "unreadable reward" in eps[2].error and eps[3].reward == 0.5


def test_load_tasks_keeps_the_kinds_asked_for(tmp_path, base_image):
    # --kinds: the RL split's tasks of those kinds only (read from task.toml's [metadata]); a kind the folder does
    # not have is an error that names the kinds it does have.
    for spec in taskgen.make_splits(0, 0, 6, seed=3)["eval"]:
        taskgen.write_harbor(spec, tmp_path / spec.name, base_image)
    kinds = {t.name: t.kind for t in load_tasks(tmp_path)}
    assert len(kinds) == 6 and len(set(kinds.values())) == 6
    want = sorted(set(kinds.values()))[:2]
    assert sorted(t.kind for t in load_tasks(tmp_path, want)) == want
    with pytest.raises(ValueError, match="no task of the kinds nosuch .*" + want[0]):
        load_tasks(tmp_path, ["nosuch"])


# ---------------------------------------------------------------------------------------------- episodes

def test_episode_messages_and_completion_needs_confirming(base_image):
    ep, = envs.run_episodes([echo_task()], scripted([("echo hi > /app/out.txt\n", 0.5)]), max_turns=5)
    assert (ep.reward, ep.failure, ep.turns) == (1.0, None, 3)
    roles = [m["role"] for m in ep.messages]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert "Task:\nWrite hi to /app/out.txt." in ep.messages[0]["content"]
    assert ep.messages[2]["content"].startswith("New Terminal Output:\nroot@")
    assert ep.messages[4]["content"].startswith("Current terminal state:\n")
    assert set(ep.timings) == {"start_s", "env_s", "policy_s", "verify_s", "total_s"}


def test_episode_failures(base_image):
    def policy(states):  # by task: garbage replies, a command longer than the agent timeout, never finishing
        by_task = {"A": "not json", "B": scripted(*[[("sleep 100\n", 60)]] * 9)([states[0]])[0],
                   "C": scripted(*[[("echo more\n", 0.1)]] * 9)([states[0]])[0]}
        return [by_task[msgs[0]["content"].split("Task:\n")[1][0]] for msgs in states]
    tasks = [echo_task(instruction="A"), echo_task(instruction="B", agent_timeout=3), echo_task(instruction="C")]
    eps = envs.run_episodes(tasks, policy, max_turns=4, max_parse_errors=3, concurrency=3)
    assert [e.failure for e in eps] == ["parse_errors", "timeout", "max_turns"]
    assert eps[0].messages[2]["content"].startswith("Previous response had parsing errors:\nERROR: No valid JSON")
    assert eps[0].turns == 3 and eps[1].timings["env_s"] < 15 and eps[2].turns == 4  # the 60 s wait cut at 3 s
    assert all(e.reward == 0.0 and e.messages[-1]["role"] == "assistant" for e in eps)


def test_episode_runs_as_terminus_2(base_image):
    """The loop answers as Terminus-2's: a reply cut at the token limit is asked again and none of it runs; a reply
    with warnings runs, its output under them; a completing reply with a bad command runs nothing and gets the
    completion check without its warnings; a parse error in between keeps the completion pending, so the next
    task_complete confirms it."""
    good = json.dumps({"analysis": "", "plan": "", "commands": [{"keystrokes": "echo hi > /app/out.txt\n"}]})
    done = json.dumps({"analysis": "", "plan": "", "commands": [{"keystrokes": "echo no > /app/out.txt\n"}, 3],
                       "task_complete": True})
    turns = [terminus.CutReply(done.replace("true", "false")[:40], 64), good, done, "oops", done]
    ep, = envs.run_episodes([echo_task()], lambda convs: [turns[len(c) // 2] for c in convs])
    told = [m["content"] for m in ep.messages[2::2]]
    assert (ep.reward, ep.failure, ep.turns, len(told)) == (1.0, None, 5, 4)
    assert told[0] == terminus.cut_message(64, ["No valid JSON object found"])
    assert told[1].startswith("Previous response had warnings:\nWARNINGS: - Command 1: Missing duration field, "
                              "using default 1.0\n\nNew Terminal Output:\n")
    assert terminus.is_completion_check(told[2]) and "Command 2 must be an object" not in told[2]
    assert terminus.is_parse_error(told[3])


def test_without_limits_only_the_agent_timeout_ends_an_episode(base_image):
    """By default (Harbor's) parse errors never end an episode and there is no turn cap: replies that never parse
    go on until the agent timeout, which is read at every reply (none of these runs a command)."""
    t0 = time.time()
    ep, = envs.run_episodes([echo_task(agent_timeout=3)], lambda convs: ["not json"] * len(convs))
    assert ep.failure == "timeout" and ep.turns > 3 and ep.reward == 0.0
    assert all(terminus.is_parse_error(m["content"]) for m in ep.messages[2::2])
    assert time.time() - t0 < 60


def test_sandbox_error_is_recorded(base_image):
    ep, = envs.run_episodes([echo_task(image="actobs-missing/image:1")], scripted(), max_turns=2)
    assert ep.failure == "sandbox_error" and "actobs-missing" in ep.error


@pytest.mark.slow
def test_expert_solves_every_kind(base_image):
    # and the harder variant of every training kind (a look-alike token, workers to set too...): seeds 9, 14 and 19
    # draw it; seeds 2 and 7 draw permissions with no script (a README only) and with no key folder at all
    harder = {14: ("fix_config", "csv_summary", "replace_host"),
              19: ("find_copy", "log_extract", "word_count", "rename"), 9: ("permissions",), 2: ("permissions",),
              7: ("permissions",)}
    specs = [taskgen.generate(k, random.Random(11)) for k in taskgen.GENERATORS] + \
        [taskgen.generate(k, random.Random(seed)) for seed, kinds in harder.items() for k in kinds]
    eps = envs.run_episodes([task_from_spec(s) for s in specs], taskgen.expert_policy, max_turns=10, concurrency=5)
    assert [(e.task, e.reward, e.failure) for e in eps] == [(s.name, 1.0, None) for s in specs]
    assert all(e.messages[-1]["role"] == "assistant" and 4 <= e.turns <= 6 for e in eps)


@pytest.mark.slow
def test_corpus_command_end_to_end(tmp_path, base_image):
    envs.main(["corpus", "--out", str(tmp_path), "--n-sft", "4", "--n-rl", "2", "--n-eval", "2", "--seed", "1",
               "--concurrency", "4"])
    rows = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["reward"] == 1.0 for r in rows)
    for r in rows:
        roles = [m["role"] for m in r["conversations"]]
        assert roles[0] == "user" and roles[1::2] == ["assistant"] * (len(roles) // 2) and set(roles[2::2]) == {"user"}
        assert json.loads(r["conversations"][1]["content"])["task_complete"] is False  # one JSON object, no think block
        # the harness's text and the terminal's, told apart exactly
        for obs in (m["content"] for m in r["conversations"][2::2]):
            wrapper, _ = split_observation(obs)
            assert "root@" not in wrapper
        assert terminus.is_completion_check(r["conversations"][-2]["content"])
    rl = sorted(p.name for p in (tmp_path / "rl").iterdir())
    assert len(rl) == 2 and not set(rl) & {r["task"] for r in rows}
    assert sorted(json.loads(x)["name"] for x in (tmp_path / "rl.jsonl").read_text().splitlines()) == rl
    task = load_task(tmp_path / "eval" / sorted((tmp_path / "eval").iterdir())[0].name)
    assert envs.run_oracle([task])[0].reward == 1.0


def test_sweep_removes_sandboxes_of_dead_processes(base_image, capsys):
    envs.main(["base-image"])
    assert "exists, reused" in capsys.readouterr().out
    dead = daemon.docker_client().containers.run(base_image, ["sleep", "60"], detach=True, network_mode="none",
                                               labels={daemon.LABEL: f"{socket.gethostname()}:999999999"})
    try:
        mine = sandbox.Sandbox(base_image)
        mine.start()
        assert daemon.sweep() >= 1  # also any other dead owner's, on a daemon shared with other runs
        ids = {c.id for c in daemon.docker_client().containers.list(all=True, sparse=True)}
        assert dead.id not in ids and mine.container.id in ids  # live owners keep their sandboxes
    finally:
        mine.close()
        if dead.id in {c.id for c in daemon.docker_client().containers.list(all=True, sparse=True)}:
            dead.remove(force=True)


def test_sweeps_at_once_share_the_leftovers(base_image):
    """Runs that start together each sweep the same dead owner's sandboxes: a removal another sweep has under way
    (Docker's 409 Conflict) is theirs to finish, not an error (one stopped a GRPO run at its first step)."""
    label = {daemon.LABEL: f"{socket.gethostname()}:999999998"}
    dead = [daemon.docker_client().containers.run(base_image, ["sleep", "60"], detach=True, network_mode="none",
                                                   labels=label) for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        removed = list(pool.map(lambda _: daemon.sweep(), range(4)))  # raises here if a sweep did
    left = {c.id for c in daemon.docker_client().containers.list(all=True, sparse=True)}
    # the counts are not bounded by these eight: a sweep also removes what earlier tests' killed processes left
    assert not left & {c.id for c in dead} and all(n >= 0 for n in removed)
