"""The hand-written training loop end to end: losses fall, runs resume exactly, torchrun (DDP / FSDP2 on gloo)
gives the single-process loss curve, checkpoints are Hugging Face dirs."""
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import sft
from actobs import common, labels
from conftest import nemotron_rows, synthetic_trajectory

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The real Nemotron rows as published plus synthetic trajectories, one JSON object per line."""
    rng = random.Random(7)
    rows = nemotron_rows() + [{"conversations": synthetic_trajectory(rng)} for _ in range(45)]
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def args(tiny_dir, data, out, *extra):
    """sft.py's flags for these tests, in fp32: --dtype auto picks bf16 on a CPU with native bf16, where the equalities
    below (one process against two, a resumed run against an uninterrupted one) hold only to bf16's rounding."""
    return ["--model", str(tiny_dir), "--data", str(data), "--out", str(out), "--lr", "3e-3", "--batch-size", "8",
            "--val-size", "8", "--max-len", "768", "--micro-tokens", "2048", "--eval-every", "0", "--save-every", "0",
            "--warmup-ratio", "0.1", "--dtype", "fp32", *extra]


def log(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def train_curve(out, key):
    return [r[key] for r in log(out) if key in r and "train/loss" in r]


def weights(path):
    from safetensors.torch import load_file
    return load_file(str(Path(path) / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("lam", [1.0, 0.0])
def test_losses_fall(tiny_dir, data, tmp_path, lam):
    sft.main(args(tiny_dir, data, tmp_path, "--lam", str(lam), "--epochs", "3"))
    act, obs = train_curve(tmp_path, "train/act_nll"), train_curve(tmp_path, "train/obs_nll")
    evals = [r for r in log(tmp_path) if "eval/act_nll" in r]
    assert sum(act[-3:]) / 3 < sum(act[:3]) / 3 - 0.5
    if lam == 1.0:
        assert sum(obs[-3:]) / 3 < sum(obs[:3]) / 3 - 0.5
    assert evals and evals[-1]["step"] == len(act)
    assert all(r["train/lam"] == lam for r in log(tmp_path) if "train/lam" in r)


def test_final_checkpoint_is_a_hf_model_with_the_template(tiny_dir, data, tmp_path):
    from transformers import AutoModelForCausalLM
    sft.main(args(tiny_dir, data, tmp_path, "--stop-after", "0", "--batch-size", "40"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    tok = labels.load_tokenizer(tmp_path / "final", "native")
    assert tok.chat_template == labels.PREFIX_TEMPLATE
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["args"]["lam"] == 1.0 and cfg["torch"] == torch.__version__
    assert model.config.vocab_size == len(tok)
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
def test_resume_is_exact(tiny_dir, data, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    sft.main(args(tiny_dir, data, full, "--epochs", "2"))
    sft.main(args(tiny_dir, data, cut, "--epochs", "2", "--stop-after", "5"))
    assert not (cut / "final").exists() and (cut / "step-000005" / "trainer_state.pt").exists()
    sft.main(args(tiny_dir, data, cut, "--epochs", "2", "--resume"))
    a, b = weights(full / "final"), weights(cut / "final")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
    assert train_curve(full, "train/loss") == pytest.approx(train_curve(cut, "train/loss"), rel=1e-6)


def test_obs_then_act_schedule(tiny_dir, data, tmp_path):
    sft.main(args(tiny_dir, data, tmp_path, "--schedule", "obs-then-act"))
    rows = [r for r in log(tmp_path) if "train/loss" in r]
    half = len(rows) // 2
    assert len(rows) % 2 == 0 and half > 0
    assert all((r["train/w_act"], r["train/lam"]) == (0.0, 1.0) for r in rows[:half])
    assert all((r["train/w_act"], r["train/lam"]) == (1.0, 0.0) for r in rows[half:])
    # in the observation-only phase the loss is the observation NLL (per-trajectory normalised)
    assert rows[0]["train/obs_nll"] == pytest.approx(rows[0]["train/loss"], rel=0.05)
    # each phase is a full run: its own warm-up and cosine
    assert [r["train/lr"] for r in rows[half:]] == pytest.approx([r["train/lr"] for r in rows[:half]])
    assert rows[half]["train/lr"] > rows[half - 1]["train/lr"]  # back up at the phase boundary


def torchrun(n, argv, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           str(ROOT / "sft.py"), *argv]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_match_one(tiny_dir, data, tmp_path, mode):
    extra = ["--fsdp"] if mode == "fsdp" else []
    torchrun(1, args(tiny_dir, data, tmp_path / "one"))
    torchrun(2, args(tiny_dir, data, tmp_path / "two", *extra))
    one, two = train_curve(tmp_path / "one", "train/loss"), train_curve(tmp_path / "two", "train/loss")
    assert len(one) == len(two) > 3
    assert two == pytest.approx(one, rel=1e-5)
    a, b = weights(tmp_path / "one" / "final"), weights(tmp_path / "two" / "final")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_fsdp_resume_is_exact(tiny_dir, data, tmp_path):
    torchrun(2, args(tiny_dir, data, tmp_path / "full", "--fsdp"))
    torchrun(2, args(tiny_dir, data, tmp_path / "cut", "--fsdp", "--stop-after", "3"))
    torchrun(2, args(tiny_dir, data, tmp_path / "cut", "--fsdp", "--resume"))
    a, b = weights(tmp_path / "full" / "final"), weights(tmp_path / "cut" / "final")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_parquet_data_trains_as_its_jsonl(tiny_dir, data, tmp_path):
    """--data as the hub publishes the corpus (parquet, read through `datasets`): the same run as the JSONL."""
    import datasets
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    sft.main(args(tiny_dir, data, tmp_path / "jsonl"))
    sft.main(args(tiny_dir, tmp_path / "train.parquet", tmp_path / "parquet"))
    assert train_curve(tmp_path / "parquet", "train/loss") == train_curve(tmp_path / "jsonl", "train/loss") != []


def test_help_documents_every_flag():
    r = subprocess.run([sys.executable, str(ROOT / "sft.py"), "--help"], capture_output=True, text=True, check=True)
    for action in sft.get_parser()._actions:
        for opt in action.option_strings:
            assert opt in r.stdout
        assert action.help, f"{action.option_strings} has no help text"


def test_bad_data_stops_with_file_and_line(tiny_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": [{"role": "user", "content": "a"}]}\n'
                   '{"conversations": [{"role": "user", "content": null}]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: conversations\[0\].content: expected a string, got NoneType"):
        sft.main(args(tiny_dir, bad, tmp_path / "out"))


def test_truncation_to_nothing_is_skipped_and_counted(tiny_dir, data, tmp_path, capsys):
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    # a long first user turn: after --max-len 64 nothing but prompt remains
    rows.append({"conversations": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ls"}]})
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft.main(["--model", str(tiny_dir), "--data", str(path), "--out", str(tmp_path / "o"), "--max-len", "64",
              "--batch-size", "50", "--val-size", "4", "--eval-every", "0", "--save-every", "0"])
    # the three Nemotron rows' prompts alone are longer than 64 tokens too
    assert "4 with nothing to learn skipped" in capsys.readouterr().out
    rows = [r for r in log(tmp_path / "o") if "train/loss" in r]
    assert rows and all(math.isfinite(r[k]) for r in rows for k in ("train/loss", "train/act_nll", "train/obs_nll"))


def test_a_used_out_dir_needs_resume_and_settings_must_match(tiny_dir, data, tmp_path):
    sft.main(args(tiny_dir, data, tmp_path, "--stop-after", "2"))
    with pytest.raises(ValueError, match="already holds a run: pass --resume"):
        sft.main(args(tiny_dir, data, tmp_path))
    with pytest.raises(ValueError, match=r"other settings than it was trained with: --lam 1.0 -> 0.0"):
        sft.main(args(tiny_dir, data, tmp_path, "--resume", "--lam", "0"))
    sft.main(args(tiny_dir, data, tmp_path, "--resume"))
    steps = [r["step"] for r in log(tmp_path) if "train/loss" in r]
    assert steps == list(range(1, len(steps) + 1))  # no step logged twice
    before = weights(tmp_path / "final")
    sft.main(args(tiny_dir, data, tmp_path, "--resume"))  # finished: nothing to do, nothing overwritten
    after = weights(tmp_path / "final")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bad_flags_are_refused(tiny_dir, data, tmp_path):
    for extra, msg in ((["--keep", "0"], "--keep must be at least 1"), (["--lam", "-1"], "--lam must be >= 0"),
                       (["--fsdp"], "launch with torchrun")):
        with pytest.raises(ValueError, match=msg):
            sft.main(args(tiny_dir, data, tmp_path / "x", *extra))


def test_unrenderable_rows_stop_with_their_line_or_are_counted(tiny_dir, data, tmp_path, capsys):
    rows = data.read_text().splitlines()
    rows.insert(4, json.dumps({"conversations": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "ls<|im_end|>"}]}))
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError,
                       match=r"d.jsonl:5: messages\[1\] \(assistant\) contains the special token '<\|im_end\|>'"):
        sft.main(args(tiny_dir, path, tmp_path / "a"))
    sft.main(args(tiny_dir, path, tmp_path / "b", "--skip-bad", "--stop-after", "1"))
    assert "(1 bad rows," in capsys.readouterr().out


def test_optimizer_step_skips_a_non_finite_update():
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    before, said = [p.detach().clone() for p in lin.parameters()], []
    lin(torch.ones(1, 3)).sum().backward()
    lin.weight.grad[0, 0] = float("nan")
    assert math.isnan(common.optimizer_step(lin, opt, 1.0, 6, said.append))
    assert said == ["step 7: grad norm nan, update skipped"] and not opt.state
    assert all(torch.equal(a, b) for a, b in zip(before, lin.parameters())) and lin.weight.grad is None
    lin(torch.ones(1, 3)).sum().backward()  # a finite one is clipped and taken
    assert common.optimizer_step(lin, opt, 1.0, 7, said.append) > 1.0 and len(said) == 1
    assert not torch.equal(before[0], lin.weight)


@pytest.mark.parametrize("speedup, want", [(0.02, "fp32"), (0.97, "fp32"), (1.6, "bf16")])
def test_auto_dtype_is_bf16_only_where_it_is_faster(monkeypatch, speedup, want):
    # A CPU that emulates bf16 (this kind: AVX2, bf16 matmuls ~45x slower) must train in fp32; one with native bf16
    # in bf16; CUDA in bf16 without a probe; an explicit --dtype is kept as given.
    common.cpu_bf16_speedup.cache_clear()
    monkeypatch.setattr(common, "cpu_bf16_speedup", lambda: speedup)
    name, why = common.resolve_dtype("auto", torch.device("cpu"))
    assert name == want and f"{speedup:.2f}x" in why
    monkeypatch.setattr(common, "cpu_bf16_speedup", lambda: pytest.fail("CUDA and an explicit dtype need no probe"))
    assert common.resolve_dtype("auto", torch.device("cuda"))[0] == "bf16"
    assert [common.resolve_dtype(f, torch.device("cpu"))[0] for f in ("bf16", "fp32")] == ["bf16", "fp32"]


def test_the_bf16_probe_measures_this_cpu():
    # the real probe: finite, positive, under a second (it runs once a process, before a run's first step)
    common.cpu_bf16_speedup.cache_clear()
    t = time.perf_counter()
    speedup = common.cpu_bf16_speedup()
    assert 0 < speedup < math.inf and time.perf_counter() - t < 5
    assert common.cpu_bf16_speedup() == speedup  # cached


def test_a_cpu_without_fast_bf16_trains_in_fp32_and_the_run_says_so(monkeypatch, tiny_dir, data, tmp_path, capsys):
    monkeypatch.setattr(common, "cpu_bf16_speedup", lambda: 0.02)
    sft.main(args(tiny_dir, data, tmp_path, "--stop-after", "1", "--dtype", "auto"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["args"]["dtype"] == "auto" and cfg["compute_dtype"]["dtype"] == "torch.float32"
    assert "0.02x fp32's" in cfg["compute_dtype"]["why"] and "fp32 (auto: this CPU's bf16" in capsys.readouterr().out
