"""envs.py / taskgen.py without Docker: task loading, the generator and the expert (the protocol's own tests
are in test_terminus.py)."""
import json
import random
import re
from pathlib import Path

import pytest

import envs
import sandbox
import taskgen
import terminus

FIXTURES = Path(__file__).parent / "fixtures"
HARBOR = FIXTURES / "harbor-tasks"


# ---------------------------------------------------------------------------------------------- tasks

def test_load_task_reads_harbor_fields():
    task = envs.load_task(HARBOR / "hello-user", build=False)
    assert task.name == "harbor/hello-user" and task.instruction.startswith("Run `whoami`")
    assert (task.agent_timeout, task.verifier_timeout, task.cpus, task.memory_mb) == (120.0, 120.0, 1.0, 2048)
    assert set(task.tests) == {"test.sh"} and set(task.solution) == {"solve.sh"}
    assert set(envs.load_task(HARBOR / "hello-world", build=False).tests) == {"test.sh", "test_state.py"}
    assert task.kind == "programming"  # [metadata] category


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
    (tmp_path / "task.toml").write_text("metadata = 1\n")
    with pytest.raises(ValueError, match=r"task.toml: \[metadata\] must be a table"):
        envs.load_task(tmp_path, build=False)


# ---------------------------------------------------------------------------------------------- generator, expert

def test_generator_is_seeded_and_has_kinds():
    assert len(taskgen.GENERATORS) >= 8
    for kind in taskgen.GENERATORS:
        a, b = taskgen.generate(kind, random.Random(7)), taskgen.generate(kind, random.Random(7))
        assert a == b and a.name.startswith(kind + "-") and a.files and "reward.txt" in a.test
    assert taskgen.generate("find_copy", random.Random(1)) != taskgen.generate("find_copy", random.Random(2))


def test_every_training_kind_mixes_easy_and_harder_instances():
    # What makes an instance harder (a look-alike token, one more setting, a distractor...) is drawn per instance,
    # so each kind has both; the expert's instruction pattern still recovers every value it must type.
    hard = {"find_copy": lambda p: p["decoy"] is not None, "fix_config": lambda p: p["workers"] is not None,
            "csv_summary": lambda p: p["measure"] == "units", "permissions": lambda p: bool(p["keep"]),
            "log_extract": lambda p: bool(p["other"]), "word_count": lambda p: bool(p["longer"]),
            "rename": lambda p: len(p["others"]) > 1, "replace_host": lambda p: p["kept"] > 0}
    assert set(hard) == set(taskgen.GENERATORS) - set(taskgen.HELDOUT_KINDS)
    for kind, is_hard in hard.items():
        specs = [taskgen.generate(kind, random.Random(i)) for i in range(40)]
        assert {is_hard(s.params) for s in specs} == {True, False}, kind
        assert len({len(s.files) for s in specs}) > 1 or kind in ("fix_config", "csv_summary", "log_extract"), kind
    for spec in (taskgen.generate("fix_config", random.Random(i)) for i in range(40)):
        m = next(re.search(p, spec.instruction) for p, e in taskgen.EXPERTS if e.__name__ == "_fix_config")
        assert (m.group(1), m.group(2), m.group(3)) == (str(spec.params["port"]), spec.params["workers"], spec.params["level"])
    for spec in (taskgen.generate("find_copy", random.Random(i)) for i in range(40)):
        texts = [t for _, t, _ in spec.files]
        assert sum(spec.params["token"] in t for t in texts) == 1  # grep for the exact token finds one file
        assert sum("TOKEN-" in t for t in texts) == 1 + (spec.params["decoy"] is not None)


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
    taskgen.write_harbor(spec, tmp_path / spec.name, sandbox.BASE_IMAGE)
    task = envs.load_task(tmp_path / spec.name, build=False)
    assert task.name == f"actobs/{spec.name}" and task.instruction.strip() == spec.instruction and task.kind == "permissions"
    assert task.tests == {"test.sh": spec.test.encode()} and task.solution == {"solve.sh": spec.solve.encode()}
    script = next(p for p, _, _ in spec.files if p.endswith(".sh"))
    assert (tmp_path / spec.name / "environment/files" / script.lstrip("/")).stat().st_mode & 0o777 == 0o644


def test_expert_replies_parse_and_decide_from_observations():
    spec = taskgen.generate("find_copy", random.Random(0))
    target, token = spec.params["target"], spec.params["token"]
    prompt = terminus.fill_prompt(terminus.DEFAULT_PROMPT, spec.instruction, terminus.SCREEN_HEADER + "root@h:/app#\n")
    msgs = [{"role": "user", "content": prompt}]
    clumsy = "/ap/" in taskgen.expert_reply(msgs)
    if clumsy:  # one episode in four starts with a mistyped path
        msgs += [{"role": "assistant", "content": taskgen.expert_reply(msgs)},
                 {"role": "user", "content": terminus.OUTPUT_HEADER + "ls: cannot access '/ap/notes': No such file or directory"}]
        reply, err, _ = terminus.parse_reply(taskgen.expert_reply(msgs))
        assert "mistyped" in reply.analysis
    msgs += [{"role": "assistant", "content": taskgen.expert_reply(msgs)},
             {"role": "user", "content": terminus.OUTPUT_HEADER + f"root@h:/app# grep -rl {token} /app/notes\n{target}\nroot@h:/app#"}]
    reply, err, warnings = terminus.parse_reply(taskgen.expert_reply(msgs))
    assert err is None and warnings == [] and reply.commands == [(f"cp {target} /app/found.txt\n", 0.1)]
    assert json.loads(taskgen.expert_reply(msgs))["commands"][0]["keystrokes"] == f"cp {target} /app/found.txt\n"  # JSON only


def test_import_has_no_side_effects():
    import subprocess
    import sys
    code = "import envs, sandbox, taskgen; assert sandbox._client is None; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"DOCKER_HOST": "unix:///nonexistent.sock", "PATH": ""}, cwd=Path(__file__).parent.parent)
    assert out.stdout == "ok\n", out.stderr
