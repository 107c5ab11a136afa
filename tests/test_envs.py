"""tasks.py / envs.py / taskgen.py without Docker: task loading, the generator and the expert (the protocol's own tests
are in test_terminus.py)."""
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from actobs import taskgen, terminus, tiny
from actobs.sandbox import daemon, verify
from actobs.tasks import load_task, task_from_spec

FIXTURES = Path(__file__).parent / "fixtures"
HARBOR, AIDER, ENDLESS = FIXTURES / "harbor", FIXTURES / "aider", FIXTURES / "endless"


# ---------------------------------------------------------------------------------------------- tasks

def test_load_task_reads_harbor_fields():
    task = load_task(HARBOR / "non-root", build=False)
    assert task.name == "non-root" and task.instruction.startswith("Write your user name")
    assert (task.agent_timeout, task.verifier_timeout, task.cpus, task.memory_mb) == (120.0, 60.0, 1.0, 2048)
    assert set(task.tests) == {"test.sh"} and set(task.solution) == {"solve.sh"} and task.user == "builder"
    assert task.kind == "system-administration" and task.schema_version == "1.1"  # [metadata] category
    uvx = load_task(HARBOR / "uvx-pytest", build=False)
    assert uvx.name == "actobs/uvx-pytest" and set(uvx.tests) == {"test.sh", "test_greeting.py"}
    assert load_task(HARBOR / "workdir", build=False).workdir == "/srv/work"
    assert uvx.allow_internet and load_task(HARBOR / "pip-install", build=False).allow_internet  # Harbor's default


def test_load_task_reads_aider_and_endless_terminals_layouts():
    py, go, js = (load_task(AIDER / f"polyglot_{x}", build=False)
                  for x in ("python_run-length", "go_roman", "javascript_word-count"))
    assert [t.meta["language"] for t in (py, go, js)] == ["python", "go", "javascript"]
    assert py.kind == "code-editing" and py.meta == {"category": "code-editing", "language": "python",
                                                     "difficulty": "easy"}
    assert (py.schema_version, py.agent_timeout, py.verifier_timeout, py.memory_mb) == ("1.0", 1800.0, 1800.0, 4096)
    assert set(go.tests) == {"test.sh", "roman_test.go"}  # tests reach the sandbox at verification only
    et = load_task(ENDLESS / "csv-filter", build=False)
    assert (et.schema_version, et.kind, et.allow_internet) == ("0.1", "data-processing", True)
    assert set(et.tests) == {"test.sh", "test_final_state.py"}  # the workdir, /home/user, is the image's WORKDIR
    assert not task_from_spec(taskgen.generate("find_copy", random.Random(0))).allow_internet  # toy world


def test_load_task_refuses_an_unknown_schema(tmp_path):
    for rel in ("instruction.md", "environment/Dockerfile", "tests/test.sh"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("x")
    (tmp_path / "task.toml").write_text('schema_version = "2.0"\n')
    with pytest.raises(ValueError, match=r"task.toml: schema_version '2.0' is not one this reads"):
        load_task(tmp_path, build=False)


def test_load_task_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"task.toml: missing"):
        load_task(tmp_path, build=False)
    (tmp_path / "task.toml").write_text("[agent\ntimeout_sec = 1")
    with pytest.raises(ValueError, match=r"task.toml: invalid TOML"):
        load_task(tmp_path, build=False)
    (tmp_path / "task.toml").write_text("[agent]\ntimeout_sec = 'soon'\n")
    for rel in ("environment/Dockerfile", "tests/test.sh"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("x")
    with pytest.raises(ValueError, match=r"instruction.md: missing"):
        load_task(tmp_path, build=False)
    (tmp_path / "instruction.md").write_text("do it")
    with pytest.raises(ValueError, match=r"task.toml: bad value"):
        load_task(tmp_path, build=False)
    (tmp_path / "task.toml").write_text("metadata = 1\n")
    with pytest.raises(ValueError, match=r"task.toml: \[metadata\] must be a table"):
        load_task(tmp_path, build=False)


# ---------------------------------------------------------------------------------------------- pytest ran or not

WRONG = "def test_wrong():\n    assert 1 == 2\n\ndef test_right():\n    pass\n"


@pytest.mark.parametrize("form", [["-q"], ["-qq"], ["-rA", "-p", "junitxml", "--junitxml", "{tmp}/j.xml"],
                                  ["--color=yes"]])
def test_a_wrong_answer_is_a_run_under_every_pytest_form(tmp_path, form):
    """A real pytest (`python -m pytest`, the `pytest` script's entry point), as verifiers call it: failed tests
    and a test module that does not import are runs (wrong answers) at any verbosity, with a plugin or colour;
    a missing file, a bad flag or no selected test is a run that never was."""
    (tmp_path / "test_wrong.py").write_text(WRONG)
    (tmp_path / "test_broken.py").write_text("import the_agents_module_that_is_not_there\n\ndef test_x():\n    pass\n")
    (tmp_path / "test_pass.py").write_text("def test_right():\n    pass\n")
    cmd = [sys.executable, "-m", "pytest"] + [a.format(tmp=tmp_path) for a in form]

    def run(*args):
        res = subprocess.run(cmd + ["-p", "no:cacheprovider", *args], cwd=tmp_path, capture_output=True)
        return res.returncode, terminus.pytest_never_ran(res.stdout + res.stderr)
    assert run("test_wrong.py") == (1, None)
    assert run("test_broken.py") == (2, None)
    if form != ["-q"]:
        return
    assert run("test_pass.py") == (0, None)
    code, why = run("test_missing.py")
    assert code == 4 and why == "pytest ran no test: ERROR: file or directory not found: test_missing.py"
    code, why = run("--no-such-flag", "test_wrong.py")
    assert code == 4 and "error: unrecognized arguments: --no-such-flag" in why
    code, why = run("-k", "nothing_matches", "test_wrong.py")
    assert code == 5 and why.startswith("pytest ran no test: 2 deselected in ")


def test_no_pytest_output_is_a_verifier_that_never_ran():
    assert terminus.pytest_never_ran(b"bash: line 9: uvx: command not found\n") == \
        "no pytest run in its output; its last error: bash: line 9: uvx: command not found"
    assert terminus.pytest_never_ran(b"") == "no pytest run in its output"
    assert "INTERNALERROR" in terminus.pytest_never_ran(b"INTERNALERROR> Traceback (most recent call last):\n")
    assert terminus.pytest_never_ran(b"Temporary failure resolving 'deb.debian.org'\n1 failed in 0.20s\n") is None


def test_reward_json_is_a_number_its_reward_or_the_mean_of_its_scores():
    """reward.json's one rule: a number; an object's "reward"; else the mean of the object's values (a score per
    check, graded); anything else is unreadable (verify() then ends the episode verifier_error)."""
    assert verify.json_reward("0.5") == 0.5
    assert verify.json_reward('{"reward": 0.25, "tests": 1}') == 0.25
    assert verify.json_reward('{"a": 1, "b": 0, "c": 1, "d": 0}') == 0.5
    assert verify.json_reward('{"only": 0.75}') == 0.75
    for bad in ("{}", '{"a": "x"}', "[1]", '{"a": null}', '{"reward": "high"}', "not json"):
        with pytest.raises((ValueError, TypeError)):
            verify.json_reward(bad)


# ---------------------------------------------------------------------------------------------- generator, expert

def test_generator_is_seeded_and_has_kinds():
    assert list(taskgen.GENERATORS) == ["find_copy", "fix_config", "csv_summary", "permissions", "log_extract",
                                        "word_count", "rename", "replace_host", "archive"]
    for kind in taskgen.GENERATORS:
        a, b = taskgen.generate(kind, random.Random(7)), taskgen.generate(kind, random.Random(7))
        assert a == b and a.name.startswith(kind + "-") and a.files and "reward.txt" in a.test
    assert taskgen.generate("find_copy", random.Random(1)) != taskgen.generate("find_copy", random.Random(2))
    # the graded kind: permissions' task and expert, a score per file in reward.json; outside the world's splits
    graded, plain = (taskgen.generate(k, random.Random(7)) for k in ("permissions_graded", "permissions"))
    assert graded.instruction == plain.instruction and graded.files == plain.files and graded.solve == plain.solve
    assert "/logs/verifier/reward.json" in graded.test and "reward.txt" not in graded.test
    assert graded.test.count("; then s=1; else s=0;") == len(graded.files)  # a check per file
    assert not {t.kind for split in taskgen.make_splits(40, 20, 20).values() for t in split} & set(taskgen.GRADED)


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
    # the kinds whose policy types names it read in a listing range from one name to four
    perms = [taskgen.generate("permissions", random.Random(i)).params for i in range(40)]
    assert {len(p["scripts"]) + len(p["keys"]) for p in perms} == {1, 2, 3, 4}
    hosts = [taskgen.generate("replace_host", random.Random(i)) for i in range(40)]
    assert {sum(s.params["old"] in text for _, text, _ in s.files) for s in hosts} == {1, 2, 3, 4}
    for spec in (taskgen.generate("fix_config", random.Random(i)) for i in range(40)):
        m = next(re.search(p, spec.instruction) for p, e in taskgen.EXPERTS if e.__name__ == "_fix_config")
        assert (m.group(1), m.group(2), m.group(3)) == (str(spec.params["port"]), spec.params["workers"],
                                                        spec.params["level"])
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
    taskgen.write_harbor(spec, tmp_path / spec.name, daemon.BASE_IMAGE)
    task = load_task(tmp_path / spec.name, build=False)
    assert (task.name == f"actobs/{spec.name}" and task.instruction.strip() == spec.instruction
            and task.kind == "permissions")
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
                 {"role": "user",
                  "content": terminus.OUTPUT_HEADER + "ls: cannot access '/ap/notes': No such file or directory"}]
        reply, err, _ = terminus.parse_reply(taskgen.expert_reply(msgs))
        assert "mistyped" in reply.analysis
    msgs += [{"role": "assistant", "content": taskgen.expert_reply(msgs)},
             {"role": "user",
              "content": terminus.OUTPUT_HEADER + f"root@h:/app# grep -rl {token} /app/notes\n{target}\nroot@h:/app#"}]
    reply, err, warnings = terminus.parse_reply(taskgen.expert_reply(msgs))
    assert err is None and warnings == [] and reply.commands == [(f"cp {target} /app/found.txt\n", 0.1)]
    # JSON only
    assert json.loads(taskgen.expert_reply(msgs))["commands"][0]["keystrokes"] == f"cp {target} /app/found.txt\n"


def test_expert_types_each_name_as_the_listing_printed_it():
    # A small policy copies a name after the text it followed in the observation: the expert's look prints full
    # paths, and its act types them verbatim in the listing's order (not sorted, not rebuilt from a bare name).
    def act(spec, shell):
        prompt = terminus.fill_prompt(terminus.DEFAULT_PROMPT, spec.instruction,
                                      terminus.SCREEN_HEADER + "root@h:/app#\n")
        msgs = [{"role": "user", "content": prompt}]
        look = terminus.parse_reply(taskgen.expert_reply(msgs))[0].commands[0][0]
        msgs += [{"role": "assistant", "content": taskgen.expert_reply(msgs)},
                 {"role": "user",
                  "content": terminus.OUTPUT_HEADER + f"root@h:/app# {look}" + shell + "\nroot@h:/app#"}]
        return look, terminus.parse_reply(taskgen.expert_reply(msgs))[0]

    perms = taskgen.generate("permissions", random.Random(0))
    look, reply = act(perms, "ls: cannot access '/app/bin/*.sh': No such file or directory\n"
                      "-rw-rw-rw- 1 root root 17 Dec  4 16:41 /app/secrets/zeta.key\n"
                      "-rw-rw-rw- 1 root root 17 Dec  4 16:41 /app/secrets/alpha.key")
    assert look == "ls -l /app/bin/*.sh /app/secrets/*.key\n"  # the echoed command line ends in *.key: not a name
    assert [c for c, _ in reply.commands] == ["chmod 600 /app/secrets/zeta.key /app/secrets/alpha.key\n"]
    assert ("keys: /app/secrets/zeta.key, /app/secrets/alpha.key" in reply.analysis
            and "Scripts: none seen" in reply.analysis)
    host = taskgen.generate("replace_host", random.Random(0))
    old, new = host.params["old"], host.params["new"]
    look, reply = act(host, "/app/conf/sierra.conf\n/app/conf/amber.conf")
    assert look == f"grep -rl {old} /app/conf\n"
    assert [c for c, _ in reply.commands] == [f"sed -i 's/{old}/{new}/g' /app/conf/sierra.conf /app/conf/amber.conf\n"]


def test_expert_types_the_word_as_the_instruction_tokenizes_it():
    # The instruction quotes the word (`the word "apple"`): under the BPE's pre-split the word is a piece of its own.
    # Typed after a space (`grep -oiw apple`) it would be another piece, " apple", and no copy from the instruction
    # types that; the expert quotes it in its plan and commands, where the JSON reply's \" leaves the same piece.
    pieces = lambda text: [p for p, _ in tiny.pre_split("qwen").pre_tokenize_str(text)]  # noqa: E731
    for i in range(8):
        spec = taskgen.generate("word_count", random.Random(i))
        word = spec.params["word"]
        assert word in pieces(spec.instruction)
        prompt = terminus.fill_prompt(terminus.DEFAULT_PROMPT, spec.instruction,
                                      terminus.SCREEN_HEADER + "root@h:/app#\n")
        msgs, typed = [{"role": "user", "content": prompt}], []
        for _ in range(4):  # the look (after a mistyped first look in one episode of four) and the count
            reply = taskgen.expert_reply(msgs)
            typed += [c for c, _ in terminus.parse_reply(reply)[0].commands if word in c]
            assert " " + word not in pieces(reply), pieces(reply)
            msgs += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": terminus.OUTPUT_HEADER + "root@h:/app# ls\na_0.txt\nroot@h:/app#"}]
        assert len(typed) == 2 and all(f'grep -oiw "{word}" ' in c for c in typed), typed


def seccomp_action(profile, name, args):
    """What `profile` (Docker's JSON) does with syscall `name` called with `args`, evaluated as seccomp does: a rule
    whose comparisons all hold decides; ALLOW, or ERRNO with its errno; else the default (caps and arches aside)."""
    hold = {"SCMP_CMP_EQ": lambda a, c: a == c["value"], "SCMP_CMP_GT": lambda a, c: a > c["value"],
            "SCMP_CMP_MASKED_EQ": lambda a, c: a & c["value"] == c["valueTwo"]}
    for rule in profile["syscalls"]:
        if name in rule["names"] and not rule.get("includes") and not rule.get("excludes") \
                and all(hold[c["op"]](args[c["index"]], c) for c in rule.get("args") or ()):
            return "allow" if rule["action"] == "SCMP_ACT_ALLOW" else rule.get("errnoRet", 1)
    return 1  # the default action: EPERM


def test_seccomp_profile_refuses_exactly_preallocation():
    """disk.seccomp_profile: fallocate in its plain and punch-hole modes only (any other mode, or upper bits set in
    the register, EOPNOTSUPP); ioctl for every command but FS_IOC_RESVSP(64) in any size (their 32-bit forms), the
    register's upper 32 bits ignored as the kernel ignores them; no io_uring; the rest as Docker's default."""
    from actobs.sandbox import disk
    profile, base = json.loads(disk.seccomp_profile()), json.loads(disk.DOCKER_SECCOMP.read_text())
    eopnotsupp = 95
    assert [seccomp_action(profile, "fallocate", [3, m]) for m in (0, 3, 1, 2, 4, 0x11, 1 << 32, (1 << 32) | 3)] \
        == ["allow", "allow"] + [eopnotsupp] * 6
    resvsp = [0x40305828, 0x4030582A, 0x402C5828, 0x402C582A]  # RESVSP, RESVSP64; 64-bit, then 32-bit struct
    rng = random.Random(0)
    commands = resvsp + [c | rng.getrandbits(32) << 32 for c in resvsp] + [rng.getrandbits(64) for _ in range(5000)]
    commands += [c ^ 1 << b for c in resvsp for b in range(32)]  # every neighbour one bit away
    for cmd in commands:
        refused = cmd & 0xFFFFFFFF in resvsp or (cmd & 0xC000FFFD == 0x40005828)  # any size of _IOW('X', 40 or 42)
        assert seccomp_action(profile, "ioctl", [3, cmd]) == (1 if refused else "allow"), hex(cmd)
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
        assert seccomp_action(profile, name, [0, 0]) == 1
    for name in ("read", "openat", "clone", "mmap", "ftruncate", "personality"):
        assert seccomp_action(profile, name, [0, 0]) == seccomp_action(base, name, [0, 0]), name


def test_import_has_no_side_effects():
    import subprocess
    import sys
    code = ("import envs; from actobs import taskgen; from actobs.sandbox import daemon; "
            "assert daemon._client is None; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"DOCKER_HOST": "unix:///nonexistent.sock", "PATH": ""}, cwd=Path(__file__).parent.parent)
    assert out.stdout == "ok\n", out.stderr
