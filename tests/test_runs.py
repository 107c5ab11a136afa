"""Runs record what ran: config.json (flags, commit, uncommitted changes, library versions), the AdamW settings,
the optional W&B mirror of log.jsonl, and what a resumed GRPO run needs to draw the same tasks and seeds; runs of one
script sharing a process (common.run_cli) each run as alone."""
import importlib.util
import json
import random
import shutil
import struct
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch

import grpo
import sft
from actobs import common, runlog
from conftest import synthetic_trajectory

ROOT = Path(__file__).parent.parent


def git(cwd, *a):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def runlog_copy(folder):
    """actobs/runlog.py imported from a copy in `folder`: its code_state describes that folder."""
    spec = importlib.util.spec_from_file_location("runlog_copy", folder / "actobs" / "runlog.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_state_is_a_patch_that_replays_the_edit(tmp_path):
    src = tmp_path / "src"
    (src / "actobs").mkdir(parents=True)
    shutil.copy(ROOT / "actobs" / "runlog.py", src / "actobs")
    shutil.copy(ROOT / "sft.py", src)
    (src / ".gitignore").write_text("runs/\n")
    git(src, "init", "-q")
    git(src, "add", ".")
    git(src, "commit", "-q", "-m", "base")
    with open(src / "sft.py", "a") as f:
        f.write("# an idea: an edit that is not committed\n")
    (src / "idea.py").write_text("LAM = 0.5\n")  # a new module, not yet added
    (src / "runs").mkdir()
    (src / "runs" / "ignored.py").write_text("x = 1\n")
    (src / "notes.txt").write_text("not a source\n")
    state = runlog_copy(src).code_state()
    assert state["git"] == git(src, "rev-parse", "HEAD").strip()
    assert "ignored.py" not in state["diff"] and "notes.txt" not in state["diff"]

    replay = tmp_path / "replay"
    git(tmp_path, "clone", "-q", str(src), str(replay))
    subprocess.run(["git", "apply"], input=state["diff"], text=True, cwd=replay, check=True)
    for name in ("sft.py", "idea.py"):
        assert (replay / name).read_text() == (src / name).read_text()

    shutil.rmtree(src / ".git")  # a copy of the code outside git: each source's hash
    sources = runlog_copy(src).code_state()
    assert sources["git"] == "" and "diff" not in sources
    assert set(sources["sources"]) == {"actobs/runlog.py", "sft.py", "idea.py", "runs/ignored.py"}
    import hashlib
    assert sources["sources"]["idea.py"] == hashlib.sha256(b"LAM = 0.5\n").hexdigest()


def test_versions_come_from_metadata_without_importing_vllm():
    code = ("import json, sys, sft; from actobs import runlog; "
            "print(json.dumps([runlog.run_config({})['vllm'], 'vllm' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    dists = metadata.packages_distributions().get("vllm")
    assert json.loads(out) == [metadata.version(dists[0]) if dists else None, False]
    cfg = runlog.run_config({"out": Path("a/b")})
    assert (cfg["torch"], cfg["transformers"]) == (torch.__version__, metadata.version("transformers"))
    assert cfg["args"] == {"out": "a/b"} and cfg["argv"] == sys.argv


def test_adam_settings_are_flags_of_both_stages():
    s = sft.get_parser().parse_args(["--data", "d", "--model", "m", "--out", "o"])
    g = grpo.get_parser().parse_args(["--init", "m", "--tasks", "t", "--out", "o"])
    assert (s.adam_betas, s.adam_eps, g.adam_betas, g.adam_eps) == ([0.9, 0.95], 1e-8, [0.9, 0.999], 1e-8)
    assert not {"adam_betas", "adam_eps"} & (set(sft.FREE_ON_RESUME) | set(grpo.FREE_ON_RESUME))  # --resume keeps them
    g = grpo.get_parser().parse_args(["--init", "m", "--tasks", "t", "--out", "o", "--adam-betas", "0.8", "0.9",
                                      "--adam-eps", "1e-6", "--lr", "0.5", "--weight-decay", "0.1"])
    opt = common.adamw(torch.nn.Linear(2, 2).parameters(), lr=g.lr, betas=g.adam_betas, eps=g.adam_eps,
                       weight_decay=g.weight_decay)
    assert {k: opt.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")} == \
        {"lr": 0.5, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1}


def wandb_history(run_file):
    """The history rows of an offline W&B run file: W&B's record log (a 7-byte file header, then 32 KiB blocks of
    records, each a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes) of
    protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, rows, pos, part = run_file.read_bytes(), [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(part)
            part = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_sft_run_records_its_config_and_mirrors_its_log_to_wandb(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    rng = random.Random(1)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"conversations": synthetic_trajectory(rng)}) + "\n" for _ in range(12)))
    out = tmp_path / "run"
    argv = ["--model", str(tiny_dir), "--data", str(data), "--out", str(out), "--batch-size", "4", "--val-size", "4",
            "--max-len", "256", "--eval-every", "1", "--save-every", "0", "--stop-after", "1", "--adam-betas", "0.8",
            "0.9", "--adam-eps", "1e-7", "--wandb", "actobs-test"]
    sft.main(argv)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["args"]["adam_betas"] == [0.8, 0.9] and cfg["args"]["adam_eps"] == 1e-7
    assert cfg["args"]["wandb"] == "actobs-test"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert cfg["git"] == head
    assert "diff" in cfg and cfg["torch"] == torch.__version__
    state = torch.load(out / "step-000001" / "trainer_state.pt", weights_only=False)
    group = state["optimizer"]["param_groups"][0]
    assert group["betas"] == (0.8, 0.9) and group["eps"] == 1e-7
    with pytest.raises(ValueError, match=r"--adam-betas \[0.8, 0.9\] -> \[0.9, 0.95\]"):
        sft.main([a for a in argv if a not in ("--adam-betas", "0.8", "0.9")] + ["--resume"])

    sft.main(argv[: argv.index("--stop-after")] + argv[argv.index("--stop-after") + 2:] + ["--resume"])  # to the end
    import wandb
    wandb.teardown()  # the W&B service process writes the offline run file behind finish(): wait for it
    run_id = (out / "wandb_id").read_text()
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(runs) == 2  # one W&B run, continued by the resumed session
    logged = {}
    for row in (json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()):
        logged.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k != "step"})
    mirrored = {}
    for row in wandb_history(runs[0]) + wandb_history(runs[1]):
        mirrored.setdefault(row["_step"], {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    assert sorted(logged) == [1, 2] and "eval/act_nll" in logged[1] and "train/loss" in logged[2]
    assert mirrored == logged  # every row, under the same names and steps


def draws(steps, seed=5, world=2, n_tasks=7, tasks_per_step=4):
    """What grpo.main's rank r rolls out at each step: its share of the step's tasks and its sampling seed."""
    per_rank = tasks_per_step // world
    return {step: [(grpo.step_groups(n_tasks, tasks_per_step, step, seed)[r * per_rank:(r + 1) * per_rank],
                    grpo.step_seed(seed, step, r)) for r in range(world)] for step in steps}


def test_a_resumed_grpo_run_draws_the_same_tasks_and_seeds():
    full = draws(range(8))
    np.random.seed(1)  # a fresh process resumed at step 5: other global RNG states, no state restored
    random.seed(1)
    torch.manual_seed(1)
    assert draws(range(5, 8)) == {s: full[s] for s in range(5, 8)}
    seeds = [seed for ranks in full.values() for _, seed in ranks]
    assert len(set(seeds)) == len(seeds)  # no two ranks or steps replay one sampling stream
    assert len({tuple(t for tasks, _ in ranks for t in tasks) for ranks in full.values()}) > 4  # steps draw anew
    assert all(len(set(t for tasks, _ in ranks for t in tasks)) == 4 for ranks in full.values())  # no repeats in a step


def test_grpo_checkpoint_holds_no_rng_state_and_resumes_on_as_many_ranks(model, tokenizer, tmp_path):
    """grpo.main saves with rng=False: its draws need no RNG state (above); the rank count is in the trainer state."""
    flags = {"fsdp": False, "resume": True, "lr": 0.1, "seed": 0}
    opt = torch.optim.AdamW(model.parameters(), lr=flags["lr"])
    common.save_checkpoint(tmp_path / "step-000003", model, model, tokenizer, opt, 3, flags, 0, fsdp=False, rng=False)
    assert not list((tmp_path / "step-000003").glob("rng-*"))
    ckpt, state, finished = common.resume_point(tmp_path, True, flags, ("fsdp", "resume"), 1)
    assert (ckpt, state["step"], finished) == (tmp_path / "step-000003", 3, False) and state["args"] == flags
    with pytest.raises(ValueError, match="written by 1 ranks; resume with as many"):
        common.resume_point(tmp_path, True, flags, ("fsdp", "resume"), 2)


@pytest.mark.parametrize("stage, required", [(sft, ["--data", "d", "--model", "m"]),
                                             (grpo, ["--init", "m", "--tasks", "t"])])
def test_resume_refuses_a_changed_flag_unless_the_stage_declares_it_free(stage, required, tmp_path):
    """The resume rule sits beside each stage's parser: FREE_ON_RESUME, the flags of how a run computes and where it
    writes (its --help groups "execution" and "run", exactly); every other flag must be the checkpoint's. So a flag
    added and declared nowhere is kept safely: resuming with another value of it is refused, the same value goes on."""
    parser = stage.get_parser()
    parser.add_argument("--new-flag", type=int, default=1)  # a new flag, declared neither free nor kept
    argv = [*required, "--out", str(tmp_path)]
    ckpt = tmp_path / "step-000001"
    ckpt.mkdir()
    torch.save({"args": vars(parser.parse_args(argv)), "step": 1, "world": 1}, ckpt / "trainer_state.pt")
    def resume(*flags):
        return common.resume_point(tmp_path, True, vars(parser.parse_args([*argv, "--resume", *flags])),
                                   stage.FREE_ON_RESUME, 1)
    with pytest.raises(ValueError, match="--new-flag 1 -> 2"):
        resume("--new-flag", "2")
    with pytest.raises(ValueError, match="--lr"):
        resume("--lr", "0.5")
    assert resume("--micro-tokens", "7", "--keep", "5", "--dtype", "fp32")[0] == ckpt
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert sorted(groups["execution"] + groups["run"]) == sorted(stage.FREE_ON_RESUME)


# ----------------------------------------------------------------------------------------------------------
# Several runs of one script in one process (common.run_cli's RUN_SEPARATOR)

def test_split_runs_cuts_at_the_separator_and_refuses_an_empty_run():
    assert common.split_runs(["--a", "1"]) == [["--a", "1"]]
    assert common.split_runs(["x", "--a", ":::", "y", "--b", "2"]) == [["x", "--a"], ["y", "--b", "2"]]
    for argv in ([":::", "x"], ["x", ":::"], ["x", ":::", ":::", "y"]):
        with pytest.raises(SystemExit, match="arguments are missing"):
            common.split_runs(argv)


def compare_files(tmp_path):
    """Two results files evaluate.py compare reads: 2 tasks x 2 attempts each."""
    paths = []
    for name, rewards in (("a", [0.0, 1.0]), ("b", [1.0, 1.0])):
        tasks = {f"t{i}": {"path": f"t{i}", "kind": None, "heldout": False,
                           "attempts": [{"attempt": j, "reward": r, "failure": None} for j, r in enumerate(rewards)]}
                 for i in range(2)}
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"settings": {"attempts": 2}, "tasks": tasks}))
    return [str(p) for p in paths]


def test_runs_in_one_process_run_in_order_and_stop_at_the_first_failure(tmp_path):
    """Through the CLI, stdout a pipe: every run's output comes out, in order, and a failing run stops the ones after
    it with a non-zero status."""
    a, b = compare_files(tmp_path)
    png = [tmp_path / f"{i}.png" for i in range(3)]
    cli = [sys.executable, str(ROOT / "evaluate.py")]
    r = subprocess.run(cli + ["compare", a, b, "--png", str(png[0]), ":::", "compare", b, a, "--png", str(png[1])],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    tables = r.stdout.count("pass@k and differences in points")  # a compare table's last line
    assert r.stdout.count("== run ") == 2 and tables == 2
    assert r.stdout.index(f"[0] {a[:-5]} ") < r.stdout.index(f"[0] {b[:-5]} ")  # in order: a baseline, then b
    assert png[0].exists() and png[1].exists()
    r = subprocess.run(cli + ["compare", a, b, ":::", "compare", str(tmp_path / "missing.json"), ":::",
                              "compare", a, b, "--png", str(png[2])], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "missing.json" in r.stderr and not png[2].exists()
    assert r.stdout.count("== run ") == 2  # the third never started


def test_a_run_sharing_a_process_samples_as_it_does_alone(vllm_dir, tmp_path, base_image, no_leftovers):
    """evaluate.py on two checkpoints in one process, the second after the first's engine: each of the second's
    attempts samples the same first reply (same weights, same seeds) as that checkpoint evaluated alone. The first
    checkpoint's weights are far from the second's, so an engine that kept them would sample other replies."""
    from actobs import taskgen
    from transformers import AutoModelForCausalLM
    other = tmp_path / "other"
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(vllm_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    m.save_pretrained(other)
    for f in Path(vllm_dir).iterdir():  # the same tokenizer and chat template
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, other / f.name)
    tasks = tmp_path / "tasks"
    for spec in taskgen.make_splits(0, 0, 2, seed=0)["eval"]:
        taskgen.write_harbor(spec, tasks / spec.name, base_image)

    def run(model, name):
        return ["--model", str(model), "--tasks", str(tasks), "--attempts", "2", "--max-turns", "1",
                "--max-new-tokens", "16", "--max-len", "2048", "--concurrency", "4", "--dtype", "float32",
                "--out", str(tmp_path / f"{name}.json"),
                "--transcripts", str(tmp_path / f"{name}.jsonl")]
    cli = [sys.executable, str(ROOT / "evaluate.py")]
    for argv in (run(other, "first") + [":::"] + run(vllm_dir, "shared"), run(vllm_dir, "alone")):
        r = subprocess.run(cli + argv, cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]

    def first_replies(name):
        rows = map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())
        return {(r["task"], r["attempt"]): r["conversations"][1]["content"] for r in rows}
    shared, alone, first = first_replies("shared"), first_replies("alone"), first_replies("first")
    assert len(alone) == 4 and shared == alone
    assert all(first[k] != alone[k] for k in alone)
