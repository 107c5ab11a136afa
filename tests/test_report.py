"""scripts/report.py and scripts/checks.py: the run folder's settings guard and the output checks that make the quick
ablation fail CI."""
import json

import pytest

from actobs import compare, labels, passk, steplog, taskgen
from actobs.episode import Episode
from actobs.sandbox import daemon
from scripts import checks, report


def test_flags():
    assert checks.flags("--steps 8 --lr 1e-5 --resume --name 'a b'") == {"--steps": "8", "--lr": "1e-5",
                                                                         "--resume": True, "--name": "a b"}


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
                 "decreasing": "pass@k [0.5, 0.25] not in [0, 1] or decreasing in k",
                 "other_model": "evaluated {tmp}/elsewhere with 2 attempts; expected {tmp}/ck with 2",
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
    checks.check_eval(path, tasks, 2, ck, problems)
    want = EVAL_PROBLEMS[case] and EVAL_PROBLEMS[case].format(tmp=tmp_path)
    assert len(problems) == (want is not None) and all(want in p for p in problems), problems


def checkpoint(d):
    (d / "final").mkdir(parents=True)
    for f in checks.WEIGHTS + ("model.safetensors",):
        (d / "final" / f).write_text("{}")


def grpo_run(run, steps, bad_step=None, bare_step=None, trained=True, name="arm-grpo", init="arm", echo_coef=0.0,
             entropy=(1.0,), kl=(0.0,), kl_coef=0.05):
    """A GRPO run folder from run/init/final; bad_step logs a NaN loss, bare_step no training metrics (with
    train/optimizer_steps 0 unless trained: a step that trained and logged nothing is malformed). Step s logs
    entropy[s - 1] and kl[s - 1] (the last value on) as k1, half of it as k3; with kl_coef 0 no KL (grpo.py then
    computes none)."""
    d = run / name
    checkpoint(d)
    (d / "config.json").write_text(json.dumps({"args": {"init": str(run / init / "final"), "echo_coef": echo_coef,
                                                        "kl_coef": kl_coef}}))
    (d / "curves.png").write_bytes(b"")
    rows = [{"step": s, "rollout/reward_mean": 0.5, "rollout/solve_rate": 0.5, "rollout/episodes_valid": 8,
             "rollout/groups_with_signal": 1,
             "train/entropy": entropy[min(s, len(entropy)) - 1],
             **({"train/kl_init": kl[min(s, len(kl)) - 1], "train/kl_init_k3": kl[min(s, len(kl)) - 1] / 2}
                if kl_coef else {}),
             "train/loss": float("nan") if s == bad_step else 0.1} for s in range(1, steps + 1)]
    if bare_step:
        rows[bare_step - 1] = {"step": bare_step, "rollout/reward_mean": 0.0, "rollout/solve_rate": 0.0,
                               "rollout/episodes_valid": 8,
                               "rollout/groups_with_signal": 0, **({} if trained else {"train/optimizer_steps": 0})}
    (d / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.mark.parametrize("steps,bad_step,bare_step,trained,want,kl_coef", [
    (3, None, None, True, None, 0.05), (2, None, None, True, "steps [1, 2], expected 1..3", 0.05),
    (3, 2, None, True, "step 2: not finite: train/loss", 0.05),
    (3, None, 2, False, None, 0.05),  # no group with signal: no update, no training metrics
    (3, None, 2, True, "step 2: not finite: train/entropy, train/kl_init, train/kl_init_k3, train/loss", 0.05),
    (3, None, None, True, None, 0.0),  # no KL term: none logged, none asked for
    (3, None, 2, True, "step 2: not finite: train/entropy, train/loss", 0.0)])
def test_check_grpo(tmp_path, steps, bad_step, bare_step, trained, want, kl_coef):
    grpo_run(tmp_path, steps, bad_step, bare_step, trained, kl_coef=kl_coef)
    problems = []
    checks.check_grpo(tmp_path, "arm-grpo", "arm", 3, 0.0, problems)
    assert len(problems) == (want is not None) and all(want in p for p in problems), problems


@pytest.mark.parametrize("init,echo_coef", [("other", 0.05), ("arm", 0.0)])
def test_check_grpo_names_the_recipe_it_ran(tmp_path, init, echo_coef):
    """An ECHO run that trained without ECHO, or from another checkpoint, is not the ECHO arm."""
    grpo_run(tmp_path, 2, init=init, echo_coef=echo_coef)
    problems = []
    checks.check_grpo(tmp_path, "arm-grpo", "arm", 2, 0.05, problems)
    assert (len(problems) == 1
            and f"with --echo-coef {echo_coef}; expected {tmp_path}/arm/final with 0.05" in problems[0])


def test_rl_time_over_the_steps_that_trained(tmp_path):
    rows = grpo_run(tmp_path, 4, bare_step=4, trained=False, entropy=(0.9, 0.6, 0.3), kl=(0.0, 0.02, 0.05))
    assert report.rl_time(rows) == {"trained_steps": 3, "entropy_first": 0.9, "entropy_mean": pytest.approx(0.6),
                                    "entropy_last": 0.3, "kl_end": 0.05, "kl_k3_end": 0.025}
    assert report.rl_time(rows[3:]) == {"trained_steps": 0}


def test_a_grpo_run_without_a_kl_term_says_so(tmp_path):
    """--kl-coef 0: grpo.py loads no initial policy and logs no KL; the report's table says it was not computed and
    ranks closeness to the SFT checkpoint among the runs that have it."""
    with_kl = grpo_run(tmp_path, 2, name="a-grpo", kl=(0.02,))
    without = grpo_run(tmp_path, 2, name="b-grpo", kl_coef=0.0)
    assert report.rl_time(without)["kl_end"] is None
    _, text = report.rl_table({"a-grpo": with_kl, "b-grpo": without}, {"a-grpo": "A", "b-grpo": "B"})
    rows = {line.split(" | ")[0]: line for line in text.splitlines()
            if line.startswith("| A") or line.startswith("| B")}
    assert "not computed (no KL term)" in rows["| B"] and "2.00e-02 / 1.00e-02" in rows["| A"]
    assert "closest to its SFT checkpoint at the end (k3): A" in text


@pytest.mark.parametrize("every", [True, False])
def test_build_names_what_is_missing(tmp_path, every):
    """every: a run of `ablation.sh --all` (ECHO and T*), else the main job's, whose report asks for neither."""
    report.write_settings(tmp_path, ["arms=actionsft actobs", "sweep_arms=lam0.5", "loss_lam0.5=--lam 0.5",
                                     "corpus=--n-rl 2 --n-eval 2", "heldout_n=1", "sft=--probe-every 2",
                                     "grpo=--steps 2", f"echo={'--echo-coef 0.05' if every else ''}",
                                     f"tstar={'1' if every else ''}",
                                     "eval=--attempts 2"])
    problems = report.build(tmp_path)
    text = "\n".join(problems)
    for piece in ("base/model", "corpus/sft.jsonl", "actobs/log.jsonl", "lam0.5/log.jsonl", "actionsft-grpo",
                  "lam0.5-grpo", "eval/actobs-grpo.json", "eval/lam0.5-grpo.json", "probes/kl.json", "times.jsonl"):
        assert piece in text, piece
    for piece in ("echo-grpo/config.json", "eval/echo-grpo.json", "eval/actionsft-grpo-tstar.json",
                  "probes/tstar_actionsft-grpo.json", "probes/entropy_actobs-grpo.json"):
        assert (piece in text) == every, piece
    assert "eval/lam0.5.json" not in text  # a λ-sweep arm is evaluated after GRPO only


def test_build_names_missing_settings(tmp_path):
    # no ECHO, no sweep
    report.write_settings(tmp_path, ["arms=actionsft actobs", "grpo=--steps 2", "eval=--attempts 2"])
    assert report.build(tmp_path) == [f"{tmp_path}/settings.json: no sweep_arms, corpus, heldout_n, sft, echo, tstar "
                                      "(a run folder of an older ablation.sh?)"]


def test_settings_take_new_stages_and_more_sweep_arms_only(tmp_path):
    base = ["arms=actionsft actobs", "loss_actobs=--lam 1", "grpo=--steps 2"]
    report.write_settings(tmp_path, base[:2])  # a folder from before ECHO and the sweep: their settings are added
    base += ["echo=--echo-coef 0.05"]
    report.write_settings(tmp_path, base + ["sweep_arms="])
    more = base + ["sweep_arms=lam0.5", "loss_lam0.5=--lam 0.5"]
    report.write_settings(tmp_path, more)  # `--sweep` on a finished run: its arms are added
    assert json.loads((tmp_path / "settings.json").read_text())["stages"]["sweep_arms"] == "lam0.5"
    report.write_settings(tmp_path, more)
    with pytest.raises(SystemExit, match="sweep_arms differ.*λ-sweep arms lam0.5"):
        report.write_settings(tmp_path, base + ["sweep_arms="])
    with pytest.raises(SystemExit, match=r"\(loss_actobs differ\)"):  # an arm's loss is not a sweep arm's
        report.write_settings(tmp_path, base[:1] + ["loss_actobs=--lam 0.9", *base[2:], "sweep_arms=lam0.5",
                                                    "loss_lam0.5=--lam 0.5"])
    with pytest.raises(SystemExit, match=r"\(loss_lam0.5 differ\)"):
        report.write_settings(tmp_path, base + ["sweep_arms=lam0.5", "loss_lam0.5=--lam 0.6"])
    with pytest.raises(SystemExit, match=r"\(echo differ\)"):  # a stage's settings are never dropped
        report.write_settings(tmp_path, base[:3] + ["sweep_arms=lam0.5", "loss_lam0.5=--lam 0.5"])


def test_settings_take_the_comparisons_of_all_on_a_main_run(tmp_path):
    """`bash ablation.sh --all` on a finished main job adds Obs→Act, ECHO and T*; the main job's flags on a folder of
    --all are refused, saying so (its arms and stages are never dropped)."""
    main = ["arms=actionsft actobs", "sweep_arms=", "loss_actobs=--lam 1", "grpo=--steps 2"]
    every = ["arms=actionsft actobs obs-then-act", "sweep_arms=", "loss_actobs=--lam 1",
             "loss_obs-then-act=--schedule obs-then-act", "grpo=--steps 2"]
    report.write_settings(tmp_path, main + ["echo=", "tstar="])
    report.write_settings(tmp_path, every + ["echo=--echo-coef 0.05", "tstar=1"])
    st = json.loads((tmp_path / "settings.json").read_text())["stages"]
    assert (st["arms"], st["echo"], st["tstar"]) == ("actionsft actobs obs-then-act", "--echo-coef 0.05", "1")
    with pytest.raises(SystemExit, match=r"\(arms, echo, loss_obs-then-act, tstar differ\).*comparisons of --all"):
        report.write_settings(tmp_path, main + ["echo=", "tstar="])
    with pytest.raises(SystemExit, match=r"\(echo differ\)"):  # ECHO's weight once set is kept
        report.write_settings(tmp_path, every + ["echo=--echo-coef 0.1", "tstar=1"])


# A complete synthetic run folder, what ablation.sh leaves: ActionSFT and ActObs, the λ = 0.5 sweep arm, ECHO, T*.
# Per model, each evaluation task's two attempts' rewards (3 tasks; the first is the held-out kind's).
REWARDS = {"actionsft-grpo": ((1, 0), (0, 0), (0, 0)), "actobs-grpo": ((1, 1), (1, 0), (0, 0)),
           "lam0.5-grpo": ((1, 0), (1, 0), (0, 0)), "echo-grpo": ((0, 0), (1, 0), (0, 0)),
           checks.TSTAR: ((1, 1), (0, 0), (0, 0)), "actobs": ((0, 0), (1, 0), (0, 0))}
T_STAR, T_EVAL = 0.7, 1.0
ENTROPY = {"actionsft-grpo": (0.8, 0.5), "actobs-grpo": (0.9, 0.8), "lam0.5-grpo": (0.85, 0.7), "echo-grpo": (0.8, 0.6)}
KL = {"actionsft-grpo": (0.01, 0.04), "actobs-grpo": (0.01, 0.02), "lam0.5-grpo": (0.01, 0.03),
      "echo-grpo": (0.01, 0.05)}


def synthetic_run(run, sweep=True, before_attempts=None, every=True):
    """before_attempts: the SFT checkpoints and the base evaluated with these fewer attempts (eval_sft, eval_base);
    every: ECHO and T* too (ablation.sh --all)."""
    sweep_arms = ["lam0.5"] if sweep else []
    fewer = [f"eval_sft=--attempts {before_attempts}",
             f"eval_base=--attempts {before_attempts}"] if before_attempts else []
    report.write_settings(run, ["mode=quick", "seed=0", "arms=actionsft actobs", f"sweep_arms={' '.join(sweep_arms)}",
                                "loss_actionsft=--lam 0", "loss_actobs=--lam 1",
                                *(["loss_lam0.5=--lam 0.5"] if sweep else []),
                                "corpus=--n-sft 4 --n-rl 2 --n-eval 3", "heldout_n=1", "sft=--probe-every 2",
                                "grpo=--steps 2",
                                f"echo={'--echo-coef 0.05' if every else ''}", f"tstar={'1' if every else ''}",
                                "eval=--attempts 2", *fewer])
    (run / "base" / "model").mkdir(parents=True)
    for f in checks.WEIGHTS + ("model.safetensors",):
        (run / "base" / "model" / f).write_text("{}")
    splits = taskgen.make_splits(4, 2, 3)
    for split in ("rl", "eval"):
        for spec in splits[split]:
            taskgen.write_harbor(spec, run / "corpus" / split / spec.name, daemon.BASE_IMAGE)
    rows = [json.dumps({"task": spec.name, "conversations": [{"role": "user", "content": "hi"}]}) + "\n"
            for spec in splits["sft"]]
    (run / "corpus" / "sft.jsonl").write_text("".join(rows))
    (run / "train.jsonl").write_text("".join(rows[:-1]))
    (run / "heldout.jsonl").write_text(rows[-1])
    for arm in ["actionsft", "actobs"] + sweep_arms:
        checkpoint(run / arm)
        geo = [{"step": s, "train/loss": 1.0, "probe/cos": 0.1 * s, "probe/r": 1.0} for s in (1, 2)]
        (run / arm / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in geo))
        (run / arm / "probe_geometry.png").write_bytes(b"")
    for arm in ["actionsft", "actobs"] + sweep_arms:
        grpo_run(run, 2, name=f"{arm}-grpo", init=arm, entropy=ENTROPY[f"{arm}-grpo"], kl=KL[f"{arm}-grpo"])
    if every:
        grpo_run(run, 2, name="echo-grpo", init="actionsft", echo_coef=0.05, entropy=ENTROPY["echo-grpo"],
                 kl=KL["echo-grpo"])
    tasks = checks.task_names(run / "corpus" / "eval", [])
    (run / "eval").mkdir()
    for m in report.model_names(json.loads((run / "settings.json").read_text())["stages"]):
        n = before_attempts if before_attempts and m in ("base", "actionsft", "actobs") else 2
        rewards = dict(zip(tasks, (rs[:n] for rs in REWARDS.get(m, ((0, 0),) * 3))))
        res = {"settings": {"attempts": n, "model": str(checks.checkpoint(run, m)),
                            "temperature": T_STAR if m == checks.TSTAR else T_EVAL},
               "tasks": {t: {"kind": kind, "heldout": kind in taskgen.HELDOUT_KINDS,
                             "attempts": [{"attempt": j, "reward": float(r), "failure": None, "turns": 3}
                                          for j, r in enumerate(rewards[t])]} for t, kind in tasks.items()}}
        res["summary"] = passk.summarize(res["tasks"], passk.ks_up_to(n))
        (run / "eval" / f"{m}.json").write_text(json.dumps(res))
        (run / "eval" / f"{m}.episodes.jsonl").write_text("".join(json.dumps({"task": t, "attempt": j}) + "\n"
                                                                   for t in tasks for j in range(n)))
    (run / "probes").mkdir()
    sft = [str(run / a / "final") for a in ("actionsft", "actobs")]
    probes = {"obs_nll": {p: {"obs_nll": 1.0, "wrapper_nll": 0.5, "payload_nll": 1.5} for p in sft},
              "cmd_entropy": {p: {"entropy": {"1": 0.5, "2": None}} for p in sft}, "kl": {p: {"kl": 0.1} for p in sft},
              "entropy_actobs-grpo": {"model": str(run / "actobs-grpo" / "final"), "temperature": T_EVAL,
                                      "entropy": 0.8},
              "tstar_actionsft-grpo": {"model": str(run / "actionsft-grpo" / "final"), "target": 0.8, "t_star": T_STAR,
                                       "trace": [[0.05, 0.1], [3.0, 2.0]]}}
    for name, res in probes.items():
        if every or name in checks.PROBES:
            (run / "probes" / f"{name}.json").write_text(json.dumps(res))
    (run / "times.jsonl").write_text(json.dumps({"stage": "base", "seconds": 3}) + "\n")
    return tasks


def pass1(model, tasks):
    return [sum(REWARDS[model][i]) / 2 for i in range(len(tasks))]


def test_solve_rise_is_over_the_first_and_last_steps_episodes():
    """A third of the steps each, at most 3; the rates are over the steps' valid episodes, not means of rates."""
    log = [{"rollout/solve_rate": r, "rollout/episodes_valid": n}
           for r, n in [(0.1, 10), (0.2, 10), (0.3, 10), (0.5, 8), (0.5, 8), (0.5, 8), (0.75, 4), (0.8, 10), (0.9, 10)]]
    k, first, last, z = report.solve_rise(log)
    assert (k, first, last) == (3, 0.2, pytest.approx(20 / 24))
    assert z == pytest.approx(passk.rise_z((6, 30), (20, 24))) and z > 3
    assert report.solve_rise(log[:2])[:3] == (1, 0.1, 0.2)  # two steps: the first against the last
    # --redraw 2: the last two steps drew the first two's tasks; those are the steps compared
    for i, r in enumerate(log):
        r.update(step=i + 1, **{"rollout/task_draw": i - 6 if i >= 7 else i + 1})
    k, first, last, z = report.solve_rise(log)
    assert (k, first, last) == (2, 0.15, pytest.approx(17 / 20))


def test_build_reports_every_comparison(tmp_path):
    tasks = synthetic_run(tmp_path)
    assert report.build(tmp_path) == []
    md = (tmp_path / "REPORT.md").read_text()
    out = json.loads((tmp_path / "report.json").read_text())
    # the header's half-width: the paired bootstrap of ActObs + GRPO - ActionSFT + GRPO in pass@1, computed here,
    # tasks resampled within their kinds (the split's design), and across kinds for comparison
    a, b = pass1("actionsft-grpo", tasks), pass1("actobs-grpo", tasks)
    lo, hi = compare.bootstrap_diff(a, b, strata=list(tasks.values()))
    plo, phi = compare.bootstrap_diff(a, b)
    assert len(set(tasks.values())) > 1 and (lo, hi) != (plo, phi)
    assert out["pass1_halfwidth"] == pytest.approx((hi - lo) / 2)
    assert out["pass1_halfwidth_pooled"] == pytest.approx((phi - plo) / 2)
    assert f"**half-width {100 * (hi - lo) / 2:.1f} points** ({100 * (phi - plo) / 2:.1f} resampling" in md
    assert f"[{100 * lo:+.1f}, {100 * hi:+.1f}]" in md
    # ECHO is a run of the after-GRPO comparison, and has its own what-GRPO-did block
    assert out["after_grpo"]["runs"][-1] == "ActionSFT (λ=0) + GRPO + ECHO"
    assert out["after_grpo"]["rows"][0]["pass"][-1] == pytest.approx(1 / 6)
    assert "## What GRPO did: ActionSFT (λ=0) → ActionSFT (λ=0) + GRPO + ECHO" in md
    assert set(out["grpo_effect"]) == {"actionsft-grpo", "actobs-grpo", "echo-grpo"}  # not λ=0.5: no SFT evaluation
    # T*: ActionSFT + GRPO at T_EVAL, at T*, and ActObs + GRPO; at T* it solves the same one task, pass@1 +1/6
    t = out["tstar"]
    assert t["runs"] == ["ActionSFT (λ=0) + GRPO", "ActionSFT (λ=0) + GRPO at T*", "ActObs (λ=1) + GRPO"]
    assert t["rows"][0]["diff"][1] == pytest.approx(1 / 6) and t["solved"] == [1, 1, 2]
    assert "matches it at T* = 0.700, not a raise: a lowering" in md
    assert "moves by at most 16.7 points and it solves +0 distinct tasks" in md
    # the λ sweep: 0 (the baseline), 0.5, 1 in that order; pass@1 and pass@2 advantages with their intervals
    sw = out["lambda_sweep"]
    assert sw["lambdas"] == [0.0, 0.5, 1.0] and sw["runs"][1] == "λ=0.5 + GRPO"
    assert sw["rows"][0]["diff"][1:] == pytest.approx([1 / 6, 1 / 3]) and sw["ks"] == [1, 2]
    lo, hi = compare.bootstrap_diff(pass1("actionsft-grpo", tasks), pass1("lam0.5-grpo", tasks),
                                     strata=list(tasks.values()))
    assert f"| 0.5 | λ=0.5 + GRPO | 33.3 | +16.7 [{100 * lo:+.1f}, {100 * hi:+.1f}] |" in md
    assert (tmp_path / "lambda_sweep.png").stat().st_size > 0 and "![λ sweep](lambda_sweep.png)" in md
    # RL time: entropy first / mean / last and the final KL of every GRPO run; the most entropy and least KL: ActObs
    assert "| ActObs (λ=1) + GRPO | 2 (2) | 0.500 → 0.500 | 0.500 → 0.500, 1 each (+0.0) | 2 | " \
           "0.900 / 0.850 / 0.800 | 2.00e-02 / 1.00e-02 |" in md
    assert "| ActionSFT (λ=0) + GRPO + ECHO | 2 (2) |" in md and "| λ=0.5 + GRPO | 2 (2) |" in md
    assert "Most entropy kept during GRPO (mean over the trained steps): ActObs (λ=1) + GRPO; closest to its SFT " \
           "checkpoint at the end (k3): ActObs (λ=1) + GRPO" in md
    assert out["rl_time"]["echo-grpo"]["kl_end"] == 0.05 and "![GRPO curves](grpo_curves.png)" in md


def test_the_main_jobs_report_has_no_echo_or_tstar(tmp_path):
    """ablation.sh without --all: the report builds from the two arms alone, with no ECHO run or T* section."""
    synthetic_run(tmp_path, sweep=False, every=False)
    assert report.build(tmp_path) == []
    md = (tmp_path / "REPORT.md").read_text()
    out = json.loads((tmp_path / "report.json").read_text())
    assert out["after_grpo"]["runs"] == ["ActionSFT (λ=0) + GRPO", "ActObs (λ=1) + GRPO"] and out["tstar"] is None
    assert set(out["grpo_effect"]) == {"actionsft-grpo", "actobs-grpo"}
    assert ("ECHO" not in md and "T*" not in md
            and "## After the same GRPO (ActionSFT (λ=0) + GRPO is the baseline [0])" in md)


def test_the_report_links_a_solved_and_a_failed_transcript_per_grpo_run(tmp_path):
    """Each GRPO run's line links the last step's transcript with a solved episode and the last with a failed one
    (steplog.pick_transcripts), as paths within the run folder; a run without transcripts says so."""
    synthetic_run(tmp_path)
    folder = tmp_path / "actobs-grpo" / "transcripts"
    episode = lambda reward: Episode("t0", [{"role": "user", "content": "go"},  # noqa: E731
                                            {"role": "assistant", "content": "{}"}], reward=reward, turns=1)
    steplog.write_transcripts(folder, 1, [episode(1.0), episode(0.0)], [0.5, -0.5], 2)
    steplog.write_transcripts(folder, 2, [episode(0.0), episode(0.0)], [0.0, 0.0], 2)
    assert report.build(tmp_path) == []
    md = (tmp_path / "REPORT.md").read_text()
    assert ("- ActObs (λ=1) + GRPO: [solved](actobs-grpo/transcripts/step_0001.md), "
            "[failed](actobs-grpo/transcripts/step_0002.md)") in md
    assert "- ActionSFT (λ=0) + GRPO: no transcript" in md


def test_build_without_a_sweep(tmp_path):
    synthetic_run(tmp_path, sweep=False)
    assert report.build(tmp_path) == []
    assert "λ trade-off" not in (tmp_path / "REPORT.md").read_text() and not (tmp_path / "lambda_sweep.png").exists()
    assert json.loads((tmp_path / "report.json").read_text())["lambda_sweep"] is None


def _set(path, keys, value):
    res = json.loads(path.read_text())
    d = res
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value
    path.write_text(json.dumps(res))


# each broken output of the new stages, and the one problem it must be reported for
NEW_STAGE_PROBLEMS = {
    "echo without ECHO": (("echo-grpo/config.json", ("args", "echo_coef"), 0.0), "with --echo-coef 0.0; expected"),
    "T* evaluated elsewhere": (("eval/actionsft-grpo-tstar.json", ("settings", "temperature"), 1.0),
                               "evaluated at T = 1.0, the probe's T* is 0.7"),
    "entropy at another T": (("probes/entropy_actobs-grpo.json", ("temperature",), 0.5),
                             "at T = 0.5; expected {run}/actobs-grpo/final at its evaluation's T = 1.0"),
    "T* of the SFT checkpoint": (("probes/tstar_actionsft-grpo.json", ("model",), "{run}/actionsft/final"),
                                 "expected a number, of {run}/actionsft-grpo/final")}


@pytest.mark.parametrize("case", NEW_STAGE_PROBLEMS)
def test_build_flags_new_stages(tmp_path, case):
    synthetic_run(tmp_path)
    (path, keys, value), want = NEW_STAGE_PROBLEMS[case]
    _set(tmp_path / path, keys, value.format(run=tmp_path) if isinstance(value, str) else value)
    problems = report.build(tmp_path)
    assert len(problems) == 1 and want.format(run=tmp_path) in problems[0], problems


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
    reply, reply_task, episode, episode_task = checks.expert_lengths(tok, rows)
    # what a policy generates for that reply: its text and the end-of-turn token
    assert (reply, reply_task) == (len(tok(long, add_special_tokens=False)["input_ids"]) + 1, "long")
    assert episode == max(len(labels.render(tok, r["conversations"])[0]) for r in rows) and episode_task != "long"
    for new, length, cut in ((reply, episode, None), (reply - 1, episode, "max-new-tokens"),
                             (reply, episode - 1, "max-len")):
        problems = []
        limits = f"--max-new-tokens {new} --max-len {length}"
        assert checks.check_limits(tmp_path, {"grpo": limits, "eval": limits}, problems) == (reply, episode)
        assert len(problems) == (0 if cut is None else 2), problems
        assert all(f"--{cut} " in p and (reply_task if cut == "max-new-tokens" else episode_task) in p
                   for p in problems)


def test_build_takes_fewer_attempts_before_grpo(tmp_path):
    """ablation.sh evaluates the SFT checkpoints and the base with fewer attempts than the GRPO'd policies: the
    after-GRPO comparison keeps pass@n, the ones with an SFT checkpoint stop at its attempts, the overview marks what
    a model has no attempts for."""
    synthetic_run(tmp_path, before_attempts=1)
    assert report.build(tmp_path) == []
    out = json.loads((tmp_path / "report.json").read_text())
    assert out["after_grpo"]["ks"] == [1, 2] and out["before_grpo"]["ks"] == [1]
    assert all(cmp["ks"] == [1] for cmp in out["grpo_effect"].values())
    assert out["before_grpo"]["runs"] == ["ActionSFT (λ=0)", "ActObs (λ=1)"]  # the base is in the overview only
    md = (tmp_path / "REPORT.md").read_text()
    base_row = next(line for line in md.splitlines() if line.startswith("| base |"))
    assert base_row.split(" | ")[1:3] == ["0.0", "-"] and "| 3 × 1 |" in base_row
    # an evaluation with other attempts than its setting is a problem, named
    res = json.loads((tmp_path / "eval" / "base.json").read_text())
    res["settings"]["attempts"] = 2
    (tmp_path / "eval" / "base.json").write_text(json.dumps(res))
    assert any("base.json: evaluated" in p and "expected" in p and "with 1" in p for p in report.build(tmp_path))


def test_the_report_header_says_whether_replies_were_constrained():
    """REPORT.md's header reads --grammar from a stage's flags: bare (the reply grammar), with its value, or absent."""
    assert report.grammar_words("--steps 2 --grammar --lr 1") == "constrained by the reply grammar (--grammar reply)"
    assert report.grammar_words("--steps 2 --grammar think") == "constrained by the reply grammar (--grammar think)"
    assert report.grammar_words("--steps 2") == "unconstrained"


@pytest.mark.parametrize("probe", ["obs_nll", "cmd_entropy", "kl"])
def test_build_names_an_arm_the_probes_left_out(tmp_path, probe):
    """An arm added to a finished run (ablation.sh --all) whose SFT checkpoint a probe file does not hold is named,
    not dropped from the probes' table."""
    synthetic_run(tmp_path, sweep=False)
    path = tmp_path / "probes" / f"{probe}.json"
    res = json.loads(path.read_text())
    del res[str(tmp_path / "actobs" / "final")]
    path.write_text(json.dumps(res))
    assert report.build(tmp_path) == [f"{path}: no result for actobs"]
