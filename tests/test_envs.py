"""envs.py / taskgen.py without Docker: the Terminus-2 protocol, observations, task loading, the generator and
the expert. Exact strings where the format decides what the model learns."""
import json
import random
from pathlib import Path

import pytest

import envs
import taskgen

FIXTURES = Path(__file__).parent / "fixtures"
HARBOR = FIXTURES / "harbor-tasks"
GOOD = {"analysis": "a", "plan": "p", "commands": [{"keystrokes": "ls\n", "duration": 0.1}], "task_complete": False}


# ---------------------------------------------------------------------------------------------- protocol

def test_parse_reply_think_and_json():
    reply, err, warnings = taskgen.parse_reply("<think>\nlook first {not json}\n</think>\n\n" + json.dumps(GOOD, indent=2))
    assert err is None and warnings == []
    assert reply == taskgen.Reply("a", "p", [("ls\n", 0.1)], False)


def test_parse_reply_extra_text_warns():
    reply, err, warnings = taskgen.parse_reply("Sure! " + json.dumps(GOOD) + "\nHope this helps")
    assert err is None and reply.commands == [("ls\n", 0.1)]
    assert warnings == ["Extra text detected before JSON object", "Extra text detected after JSON object"]


def test_parse_reply_defaults_and_caps():
    reply, err, _ = taskgen.parse_reply(json.dumps({"analysis": "", "plan": "", "commands": [
        {"keystrokes": "C-c"}, {"keystrokes": "sleep 100\n", "duration": 500}, {"keystrokes": "", "duration": -1}]}))
    assert err is None and reply.task_complete is False
    assert reply.commands == [("C-c", 1.0), ("sleep 100\n", 60.0), ("", 0.0)]


@pytest.mark.parametrize("text, error", [
    ("no json here", "No valid JSON found in response"),
    ('{"analysis": "a", "plan": "p"}', "Missing required fields: commands"),
    ('{"analysis": "a", "plan": "p", "commands": "ls"}', "Field 'commands' must be an array"),
    ('{"analysis": "a", "plan": "p", "commands": [{"duration": 1}]}', "Command 1 must be an object with a string 'keystrokes' field"),
    ("<think>never closed {", "<think> block is not closed with </think>"),
])
def test_parse_reply_errors(text, error):
    reply, err, _ = taskgen.parse_reply(text)
    assert reply is None and err == error


def test_parse_reply_invalid_json_names_the_problem():
    reply, err, _ = taskgen.parse_reply('{"analysis": "a", "plan": "p", "commands": [}')
    assert reply is None and err.startswith("Invalid JSON: ")


def test_messages_have_the_corpus_form():
    assert taskgen.parse_error_message("No valid JSON found in response", ["No valid JSON object found"]) == (
        "Previous response had parsing errors:\nERROR: No valid JSON found in response\n"
        "WARNINGS: - No valid JSON object found\n\nPlease reply again with one valid JSON object in the required format.")
    confirm = taskgen.confirm_message("New Terminal Output:\n\nroot@x:/app#")
    assert confirm.startswith("Current terminal state:\nNew Terminal Output:\n\nroot@x:/app#\n\n")
    assert '"task_complete": true' in confirm
    assert taskgen.with_warnings("OBS", ["w1", "w2"]) == "Previous response had warnings:\nWARNINGS: - w1\n- w2\n\nOBS"
    assert taskgen.with_warnings("OBS", []) == "OBS"


def test_prompt_template_from_a_corpus_row(tmp_path):
    """A user's corpus prompt (here a real Nemotron row) becomes a template that reproduces that row exactly."""
    first = json.loads((FIXTURES / "nemotron_terminal_sample.json").read_text())[0]["conversations"][0]["content"]
    head, rest = first.split("Task Description:\n", 1)
    instruction, state = rest.split("\n\nCurrent terminal state:\n", 1)
    path = tmp_path / "prompt.txt"
    path.write_text(head + "Task Description:\n{instruction}\n\nCurrent terminal state:\n{terminal_state}")
    template = taskgen.load_template(path)
    assert taskgen.fill_prompt(template, instruction, state) == first
    bad = tmp_path / "bad.txt"
    bad.write_text("no placeholders {instruction}")
    with pytest.raises(ValueError, match=r"bad.txt: prompt template lacks the \{terminal_state\} placeholder"):
        taskgen.load_template(bad)
    default = taskgen.fill_prompt(taskgen.load_template(None), "Do X.", "Current Terminal Screen:\nroot@h:/app#\n")
    assert default.endswith("Task:\nDo X.\n\nCurrent terminal state:\nCurrent Terminal Screen:\nroot@h:/app#\n")
    assert '"keystrokes": "ls -la\\n"' in default


# ---------------------------------------------------------------------------------------------- observations

def test_truncate_output_keeps_head_and_tail_within_utf8():
    text = "H" * 6000 + "é" * 3000 + "T" * 6000  # 18,000 bytes
    out = taskgen.truncate_output(text)
    assert out.startswith("H" * 5000) and out.endswith("T" * 5000)
    assert "\n[... 8000 bytes of output omitted ...]\n" in out
    assert taskgen.truncate_output("short") == "short"
    cut = taskgen.truncate_output("é" * 6000)  # 12,000 bytes: cuts fall inside characters
    assert "\ufffd" not in cut and len(cut.encode()) <= 10_000 + 60


def test_decode_replaces_invalid_utf8():
    assert taskgen.decode(b"ok \xff\xfe end") == "ok \ufffd\ufffd end"


def test_pane_diff_matches_terminus_incremental_output():
    first = ["root@h:/app# ls", "a.txt", "root@h:/app#", "", ""]
    assert taskgen.pane_diff(first, 0, "root@h:/app#") == "root@h:/app# ls\na.txt\nroot@h:/app#"
    later = ["old output", "root@h:/app# echo hi", "hi", "root@h:/app#"]
    assert taskgen.pane_diff(later, 1, "root@h:/app#") == "\nroot@h:/app# echo hi\nhi\nroot@h:/app#"
    assert taskgen.pane_diff(later, 1, "root@other:/#") is None  # the line the keys were typed at is gone
    assert taskgen.pane_diff(later, 9, "root@h:/app#") is None
    assert taskgen.visible_screen(["x"] * 50 + ["root@h:/app#", "", ""], rows=4) == "x\nroot@h:/app#\n"


# ---------------------------------------------------------------------------------------------- tasks

def test_load_task_reads_harbor_fields():
    task = envs.load_task(HARBOR / "hello-user", build=False)
    assert task.name == "harbor/hello-user" and task.instruction.startswith("Run `whoami`")
    assert (task.agent_timeout, task.verifier_timeout, task.cpus, task.memory_mb) == (120.0, 120.0, 1.0, 2048)
    assert set(task.tests) == {"test.sh"} and set(task.solution) == {"solve.sh"}
    assert set(envs.load_task(HARBOR / "hello-world", build=False).tests) == {"test.sh", "test_state.py"}


def test_load_task_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"task.toml: missing"):
        envs.load_task(tmp_path, build=False)
    (tmp_path / "task.toml").write_text("[agent\ntimeout_sec = 1")
    with pytest.raises(ValueError, match=r"task.toml: invalid TOML"):
        envs.load_task(tmp_path, build=False)
    (tmp_path / "task.toml").write_text("[agent]\ntimeout_sec = 'soon'\n")
    for rel in ("environment/Dockerfile", "tests/test.sh"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("x")
    with pytest.raises(ValueError, match=r"instruction.md: missing"):
        envs.load_task(tmp_path, build=False)
    (tmp_path / "instruction.md").write_text("do it")
    with pytest.raises(ValueError, match=r"task.toml: bad value"):
        envs.load_task(tmp_path, build=False)


# ---------------------------------------------------------------------------------------------- generator, expert

def test_generator_is_seeded_and_has_kinds():
    assert len(taskgen.GENERATORS) >= 8
    for kind in taskgen.GENERATORS:
        a, b = taskgen.generate(kind, random.Random(7)), taskgen.generate(kind, random.Random(7))
        assert a == b and a.name.startswith(kind + "-") and a.files and "reward.txt" in a.test
    assert taskgen.generate("find_copy", random.Random(1)) != taskgen.generate("find_copy", random.Random(2))


def test_splits_are_disjoint_and_hold_out_kinds():
    s = taskgen.make_splits(40, 20, 20, seed=3)
    names = {k: {t.name for t in v} for k, v in s.items()}
    assert [len(names[k]) for k in ("sft", "rl", "eval")] == [40, 20, 20]
    assert not names["sft"] & names["rl"] and not names["sft"] & names["eval"] and not names["rl"] & names["eval"]
    assert {t.kind for t in s["eval"]} >= set(taskgen.HELDOUT_KINDS)
    assert not {t.kind for t in s["sft"] + s["rl"]} & set(taskgen.HELDOUT_KINDS)
    assert taskgen.make_splits(40, 20, 20, seed=3) == s


def test_write_harbor_round_trips(tmp_path):
    spec = taskgen.generate("permissions", random.Random(0))
    taskgen.write_harbor(spec, tmp_path / spec.name)
    task = envs.load_task(tmp_path / spec.name, build=False)
    assert task.name == f"actobs/{spec.name}" and task.instruction.strip() == spec.instruction
    assert task.tests == {"test.sh": spec.test.encode()} and task.solution == {"solve.sh": spec.solve.encode()}
    script = next(p for p, _, _ in spec.files if p.endswith(".sh"))
    assert (tmp_path / spec.name / "environment/files" / script.lstrip("/")).stat().st_mode & 0o777 == 0o644


def test_expert_replies_parse_and_decide_from_observations():
    spec = taskgen.generate("find_copy", random.Random(0))
    target, token = spec.params["target"], spec.params["token"]
    prompt = taskgen.fill_prompt(taskgen.DEFAULT_PROMPT, spec.instruction, "Current Terminal Screen:\nroot@h:/app#\n")
    msgs = [{"role": "user", "content": prompt}]
    clumsy = "/ap/" in taskgen.expert_reply(msgs)
    if clumsy:  # one episode in four starts with a mistyped path
        msgs += [{"role": "assistant", "content": taskgen.expert_reply(msgs)},
                 {"role": "user", "content": "New Terminal Output:\nls: cannot access '/ap/notes': No such file or directory"}]
        reply, err, _ = taskgen.parse_reply(taskgen.expert_reply(msgs))
        assert "mistyped" in reply.analysis
    msgs += [{"role": "assistant", "content": taskgen.expert_reply(msgs)},
             {"role": "user", "content": f"New Terminal Output:\nroot@h:/app# grep -rl {token} /app/notes\n{target}\nroot@h:/app#"}]
    reply, err, warnings = taskgen.parse_reply(taskgen.expert_reply(msgs))
    assert err is None and warnings == [] and reply.commands == [(f"cp {target} /app/found.txt\n", 0.1)]
    assert taskgen.expert_reply(msgs).startswith("<think>\n")


def test_import_has_no_side_effects():
    import subprocess
    import sys
    code = "import envs, taskgen; assert envs._client is None; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"DOCKER_HOST": "unix:///nonexistent.sock", "PATH": ""}, cwd=Path(__file__).parent.parent)
    assert out.stdout == "ok\n", out.stderr
