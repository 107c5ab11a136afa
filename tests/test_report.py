"""scripts/report.py: the run folder's settings guard and the output checks that make the quick ablation fail CI."""
import json
import sys
from pathlib import Path

import pytest

import labels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import report  # noqa: E402


def test_flags():
    assert report.flags("--steps 8 --lr 1e-5 --resume --name 'a b'") == {"--steps": "8", "--lr": "1e-5", "--resume": True,
                                                                         "--name": "a b"}


def test_settings_refuse_another_run(tmp_path):
    report.write_settings(tmp_path, ["mode=quick", "grpo=--steps 2"])
    first = json.loads((tmp_path / "settings.json").read_text())
    assert first["stages"] == {"mode": "quick", "grpo": "--steps 2"}
    report.write_settings(tmp_path, ["mode=quick", "grpo=--steps 2"])  # the same settings: a resume
    assert json.loads((tmp_path / "settings.json").read_text()) == first
    with pytest.raises(SystemExit, match="grpo differ"):
        report.write_settings(tmp_path, ["mode=quick", "grpo=--steps 3"])
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        report.write_settings(tmp_path / "other", ["mode"])


def eval_results(ck, attempts=2, rewards=((1.0, 0.0), (0.0, 0.0)), pass_at_k=(0.25, 0.5)):
    tasks = {f"t{i}": {"attempts": [{"attempt": j, "reward": r, "failure": None} for j, r in enumerate(rs)]}
             for i, rs in enumerate(rewards)}
    return {"settings": {"attempts": attempts, "model": str(ck)}, "tasks": tasks,
            "summary": {"pass@k": {str(2 ** i): v for i, v in enumerate(pass_at_k)}}}


# each broken results file and the one problem it must be reported for
EVAL_PROBLEMS = {"ok": None, "missing_attempt": "task t1 has attempts [0], expected 0..1",
                 "reward_range": "task t0 has a reward outside [0, 1]",
                 "decreasing": "pass@k [0.5, 0.25] not in [0, 1] or decreasing in k", "other_model": "evaluated {tmp}/elsewhere with 2 attempts; expected {tmp}/ck with 2",
                 "other_tasks": "tasks differ from the evaluation split (2 vs 3)",
                 "missing_transcript": "no transcript of 1 recorded attempts, e.g. ('t0', 1)"}


@pytest.mark.parametrize("case", EVAL_PROBLEMS)
def test_check_eval(tmp_path, case):
    ck, path = tmp_path / "ck", tmp_path / "eval.json"
    res = eval_results(ck)
    episodes = [{"task": name, "attempt": a["attempt"]} for name, e in res["tasks"].items() for a in e["attempts"]]
    if case == "missing_transcript":
        episodes.pop(1)
    (tmp_path / "eval.episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in episodes))
    if case == "missing_attempt":
        res["tasks"]["t1"]["attempts"].pop()
    elif case == "reward_range":
        res["tasks"]["t0"]["attempts"][0]["reward"] = 1.5
    elif case == "decreasing":
        res["summary"]["pass@k"] = {"1": 0.5, "2": 0.25}
    elif case == "other_model":
        res["settings"]["model"] = str(tmp_path / "elsewhere")
    path.write_text(json.dumps(res))
    problems = []
    tasks = {"t0": "a", "t1": "b", **({"t2": "c"} if case == "other_tasks" else {})}
    report.check_eval(path, tasks, 2, ck, problems)
    want = EVAL_PROBLEMS[case] and EVAL_PROBLEMS[case].format(tmp=tmp_path)
    assert len(problems) == (want is not None) and all(want in p for p in problems), problems


def grpo_run(run, steps, bad_step=None, bare_step=None, trained=True):
    """A GRPO run folder; bad_step logs a NaN loss, bare_step no training metrics (with train/optimizer_steps 0
    unless trained: a step that trained and logged nothing is malformed)."""
    d = run / "arm-grpo"
    (d / "final").mkdir(parents=True)
    for f in report.WEIGHTS:
        (d / "final" / f).write_text("{}")
    (d / "curves.png").write_bytes(b"")
    rows = [{"step": s, "rollout/reward_mean": 0.5, "train/entropy": 1.0, "train/kl_init": 0.0,
             "train/loss": float("nan") if s == bad_step else 0.1} for s in range(1, steps + 1)]
    if bare_step:
        rows[bare_step - 1] = {"step": bare_step, "rollout/reward_mean": 0.0, **({} if trained else {"train/optimizer_steps": 0})}
    (d / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("steps,bad_step,bare_step,trained,want", [
    (3, None, None, True, None), (2, None, None, True, "steps [1, 2], expected 1..3"),
    (3, 2, None, True, "step 2: not finite: train/loss"),
    (3, None, 2, False, None),  # no group with signal: no update, no training metrics
    (3, None, 2, True, "step 2: not finite: train/entropy, train/kl_init, train/loss")])
def test_check_grpo(tmp_path, steps, bad_step, bare_step, trained, want):
    grpo_run(tmp_path, steps, bad_step, bare_step, trained)
    problems = []
    report.check_grpo(tmp_path, "arm", 3, problems)
    assert len(problems) == (want is not None) and all(want in p for p in problems), problems


def test_build_names_what_is_missing(tmp_path):
    report.write_settings(tmp_path, ["arms=actionsft actobs", "corpus=--n-rl 2 --n-eval 2", "heldout_n=1",
                                     "grpo=--steps 2", "eval=--attempts 2"])
    problems = report.build(tmp_path)
    text = "\n".join(problems)
    for piece in ("base/model", "corpus/sft.jsonl", "actobs/log.jsonl", "actionsft-grpo", "eval/actobs-grpo.json",
                  "probes/kl.json", "times.jsonl"):
        assert piece in text, piece


def test_limits_measure_the_expert_in_rollout_tokens(tmp_path, tiny_dir, synthetic):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "model").symlink_to(tiny_dir)
    tok = labels.load_tokenizer(tiny_dir, "native")
    long = "echo " + "word " * 60 + "\n"
    rows = [{"task": f"t{i}", "conversations": c} for i, c in enumerate(synthetic[:6])]
    rows.append({"task": "long", "conversations": [{"role": "user", "content": "Print sixty words."},
                                                    {"role": "assistant", "content": long}]})
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    reply, reply_task, episode, episode_task = report.expert_lengths(tok, rows)
    # what a policy generates for that reply: its text and the end-of-turn token
    assert (reply, reply_task) == (len(tok(long, add_special_tokens=False)["input_ids"]) + 1, "long")
    assert episode == max(len(labels.render(tok, r["conversations"])[0]) for r in rows) and episode_task != "long"
    for new, length, cut in ((reply, episode, None), (reply - 1, episode, "max-new-tokens"), (reply, episode - 1, "max-len")):
        problems = []
        limits = f"--max-new-tokens {new} --max-len {length}"
        assert report.check_limits(tmp_path, {"grpo": limits, "eval": limits}, problems) == (reply, episode)
        assert len(problems) == (0 if cut is None else 2), problems
        assert all(f"--{cut} " in p and (reply_task if cut == "max-new-tokens" else episode_task) in p for p in problems)
