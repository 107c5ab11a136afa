"""
The ablation's run folder (ablation.sh): its settings, a check of every stage's output (checks.py), and REPORT.md.

    python -m scripts.report settings RUN mode=full seed=0 sft="--lr 2e-3 ..." ...   # ablation.sh, at start
    python -m scripts.report limits RUN                                             # ablation.sh, after the corpus
    python -m scripts.report build RUN                                              # ablation.sh, at the end

`settings` writes RUN/settings.json (each stage's flags, the seed, the mode, the git commit, the compute dtype) and
refuses a folder that holds a run with other settings, so a resumed run never mixes two; what it takes is more: the
settings of a stage the run did not have, the comparisons of `--all` (the Obs→Act arm, ECHO, T*) and more λ-sweep
arms (`bash ablation.sh --all` or `--sweep` on a finished run), whose stages then run alone. `limits` stops a run whose
GRPO or evaluation limits would cut the expert's own replies or episodes (in the base model's tokens). `build` checks
that every stage left well-formed output (files exist and parse, one GRPO log row per step, every task attempted
n times and every attempt's transcript kept, pass@k in [0, 1] and non-decreasing in k, finite probe numbers,
the ECHO run trained with its --echo-coef, the T* evaluation ran at the probe's T*; ECHO and T* where the run
has them), then writes REPORT.md,
report.json and the plots: pass_at_k.png (all checkpoints), grpo_curves.png (reward, entropy, KL from init per
GRPO run), lambda_sweep.png (pass@1 and pass@n advantage over ActionSFT against λ, with a λ sweep) and
geometry.png (cos(g_act, g_obs) and r during SFT per arm). Any problem: one line each, exit status 1.
"""
import argparse
import json
import sys
from pathlib import Path

from actobs import compare, passk, runlog, steplog, taskgen
from scripts.checks import (ECHO, TSTAR, check_corpus, check_eval, check_grpo, check_inputs, check_limits, check_model,
                            check_probes, check_sft, check_tstar, checkpoint, flags, read_json, read_jsonl)
from scripts.plots import write_plots

LABELS = {"actionsft": "ActionSFT (λ=0)", "actobs": "ActObs (λ=1)",
          "obs-then-act": "Obs→Act"}  # else the arm's name
SWEEP_KEY = "sweep_arms"  # the one setting a resumed run may change: it may add λ-sweep arms


# Which images a real run's tasks ran on (ablation.sh's images setting; scripts/fetch.py --offline-images)
IMAGES = {"own": "Task images: the benchmarks' own (task.toml's prebuilt docker_image, else environment/Dockerfile on "
                 "its FROM images, pulled from their registry).",
          "standin": "Task images: the offline stand-in (Debian tagged as ubuntu:24.04, ubuntu:22.04 and "
                     "python:3.13-slim-bookworm; --offline-images): the scores are not the benchmarks'.",
          None: "Task images: not recorded (a run folder of an older ablation.sh: the stand-in then)."}


def lam_of(st, arm):
    """The arm's λ when its SFT loss is `--lam X` alone (not a schedule), else None."""
    f = flags(st.get(f"loss_{arm}", ""))
    return float(f["--lam"]) if set(f) == {"--lam"} else None


def arm_labels(st):
    """{SFT arm: label}: the arms, then the λ-sweep arms."""
    return {**{a: LABELS.get(a, a) for a in st["arms"].split()},
            **{a: f"λ={lam_of(st, a):g}" for a in st[SWEEP_KEY].split()}}


def model_names(st):
    """{run folder: label} of every evaluated checkpoint: the base, each SFT arm, each arm and λ-sweep arm after
    GRPO (a λ-sweep arm's SFT checkpoint is not evaluated), ActionSFT after GRPO with ECHO and at T* where the run
    has them (ablation.sh --all)."""
    arm_label = arm_labels(st)
    return {"base": "base", **{a: arm_label[a] for a in st["arms"].split()},
            **{f"{a}-grpo": f"{label} + GRPO" for a, label in arm_label.items()},
            **({f"{ECHO}-grpo": f"{LABELS['actionsft']} + GRPO + ECHO"} if st["echo"] else {}),
            **({TSTAR: f"{LABELS['actionsft']} + GRPO at T*"} if st["tstar"] else {})}


def grpo_runs(st):
    """{GRPO run folder: its SFT checkpoint's folder}: each arm's, each λ-sweep arm's, ECHO's (from ActionSFT)."""
    return {**{f"{a}-grpo": a for a in st["arms"].split() + st[SWEEP_KEY].split()},
            **({f"{ECHO}-grpo": "actionsft"} if st["echo"] else {})}


def eval_attempts(st, model):
    """The attempts an evaluated model's results must have: the GRPO'd policies and T* `eval`'s, the SFT checkpoints
    and the base fewer when `eval_sft` / `eval_base` say so (ablation.sh: only the GRPO'd policies are compared at
    pass@n; a folder without these settings evaluated every model at `eval`'s)."""
    key = "eval_base" if model == "base" else "eval_sft" if model in st["arms"].split() else "eval"
    return int(flags(st.get(key) or st["eval"])["--attempts"])


# ----------------------------------------------------------------------------------------------------------
# Settings

def grammar_words(stage_flags):
    """Whether a stage's flags decode the replies under the reply grammar (--grammar [reply|think]), in words."""
    g = flags(stage_flags).get("--grammar")
    return passk.constrained({"grammar": "reply" if g is True else g})


def write_settings(run, pairs):
    settings = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep:
            raise SystemExit(f"settings: expected KEY=VALUE, got {p!r}")
        settings[key] = value
    path = run / "settings.json"
    if path.exists():
        old = json.loads(path.read_text())
        changed = sorted(k for k in set(old["stages"]) | set(settings) if old["stages"].get(k) != settings.get(k)
                         and not added(old["stages"], settings, k))
        if changed:
            raise SystemExit(f"{run} holds a run with other settings ({', '.join(changed)} differ): remove it, or "
                             "set RUN_DIR to another folder"
                             + (f" (it has the λ-sweep arms {old['stages'][SWEEP_KEY]}: "
                                "pass ablation.sh --sweep=... with them)" if SWEEP_KEY in changed else "")
                             + (" (it has the comparisons of --all: pass it)" if old["stages"].get("tstar")
                                and not settings.get("tstar") else ""))
        if old["stages"] != settings:  # more stages or λ-sweep arms: the run now has them
            path.write_text(json.dumps({**old, "stages": settings}, indent=2))
        return
    from actobs import common  # torch: only here
    import torch
    # the stages' --dtype auto on this machine (bf16 only where it is fast), said once and kept with the run
    dtype, why = common.resolve_dtype("auto", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"compute dtype: {dtype} ({why})")
    cfg = runlog.run_config(settings)
    run.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"stages": settings, "git": cfg["git"], "started": cfg["started"],
                                "compute_dtype": {"dtype": dtype, "why": why}}, indent=2))


def added(old, new, key):
    """Whether a setting differs only by what a resumed run may add: a key the run lacks (the settings of a stage
    it did not have, an added arm's loss), more arms or λ-sweep arms, ECHO or T* where the run had none (--all)."""
    if key in (SWEEP_KEY, "arms"):
        return set(old.get(key, "").split()) <= set(new.get(key, "").split())
    return key not in old or (key in ("echo", "tstar") and not old[key])


# ----------------------------------------------------------------------------------------------------------
# Tables and plots

def overview(results, names):
    """One row per model: pass@k over all tasks up to its attempts ("-" past them), pass@1 / pass@n on the held-out
    kind (n: its attempts), distinct solved, attempts, mean turns and how the unsolved episodes that did not just end
    wrong ended (failure kinds)."""
    ks = passk.ks_up_to(max(res["settings"]["attempts"] for res in results.values()))
    head = ("| model | " + " | ".join(f"pass@{k}" for k in ks)
            + " | held-out pass@1 / @n | solved | attempts | excluded | mean turns | episodes ended by |")
    lines = [head, "|" + "---|" * (len(ks) + 7)]
    for m, res in results.items():
        n = res["settings"]["attempts"]
        own = passk.ks_up_to(n)
        s = passk.summarize(res["tasks"], own)
        held = {t: e for t, e in res["tasks"].items() if e.get("heldout")}
        h = passk.summarize(held, own) if held else None
        hcell = f"{passk.pct(h['pass@k'][own[0]])} / {passk.pct(h['pass@k'][own[-1]])}" if h else "-"
        turns = [a["turns"] for e in res["tasks"].values() for a in e["attempts"]]
        ends = ", ".join(f"{k} {v}" for k, v in sorted(s["failures"].items())) or "-"
        lines.append(f"| {names[m]} | " + " | ".join(passk.pct(s["pass@k"][k]) if k <= n else "-" for k in ks)
                     + f" | {hcell} | {s['solved']}/{s['tasks']} | {s['tasks']} × {n} | {s['excluded']} "
                     f"| {sum(turns) / max(len(turns), 1):.1f} | {ends} |")
    return "\n".join(lines)


def compare_within_kinds(runs):
    """compare.compare as every table of the report makes it: the evaluation split is drawn as a fixed count of
    tasks per kind (taskgen.make_splits), so its bootstrap resamples tasks within each kind."""
    return compare.compare(runs, by_kind=True)


def comparison(results, models, names):
    """evaluate.py compare on these models (the first is the baseline), on all tasks and then by kind."""
    runs = [(names[m], results[m]) for m in models]
    cmp = compare_within_kinds(runs)
    text = [compare.compare_table(cmp)]
    text += [f"\n== {label}\n" + compare.compare_table(sub)
             for label, sub in compare.compare_by_kind(runs, by_kind=True)]
    return cmp, "\n".join(text)


def probe_table(probes, run, names):
    short = lambda p: (Path(p).resolve().relative_to(run.resolve()).parts[0]
                       if Path(p).resolve().is_relative_to(run.resolve()) else p)
    name = lambda p: names.get(short(p), str(p))
    lines = ["| model | obs NLL | wrapper | payload | KL(ckpt ‖ base) | "
             "command entropy, positions 1 / 2 / 3 / 4-7 / 8+ |",
             "|---|---|---|---|---|---|"]
    for p, v in probes.get("obs_nll", {}).items():
        kl = probes.get("kl", {}).get(p, {}).get("kl")
        ent = probes.get("cmd_entropy", {}).get(p, {}).get("entropy", {})
        ents = " / ".join("-" if x is None else f"{x:.3f}" for x in ent.values()) or "-"
        lines.append(f"| {name(p)} | {v['obs_nll']:.3f} | {v['wrapper_nll']:.3f} | {v['payload_nll']:.3f} | "
                     + ("-" if kl is None else f"{kl:.4f}") + f" | {ents} |")
    return "\n".join(lines)


def halfwidth(cmp, i=1, k=1):
    """(lo, hi, half-width) of the paired bootstrap 95% interval of run [i] - [0] in pass@k, from compare.compare."""
    row = next(r for r in cmp["rows"] if r["k"] == k)
    lo, hi = row["ci"][i]
    return lo, hi, (hi - lo) / 2


def tstar_section(results, probes, names):
    """ActionSFT + GRPO at the evaluation temperature and at T*, next to ActObs + GRPO: (comparison, markdown)."""
    e, t = probes["entropy_actobs-grpo"], probes["tstar_actionsft-grpo"]
    cmp = compare_within_kinds([(names[m], results[m]) for m in ("actionsft-grpo", TSTAR, "actobs-grpo")])
    moved = max(abs(r["diff"][1]) for r in cmp["rows"])
    # the paper's T* raises ActionSFT + GRPO's temperature (its entropy fell below ActObs + GRPO's); a T* below the
    # evaluation's is a lowering, and the report says so
    way = "a raise" if t["t_star"] > e["temperature"] else "not a raise: a lowering"
    text = (f"Self-entropy of {names['actobs-grpo']} at the evaluation temperature T = {e['temperature']:g}: "
            f"{e['entropy']:.3f} nats/token; {names['actionsft-grpo']} matches it at T* = {t['t_star']:.3f}, {way} "
            f"(probes/tstar_actionsft-grpo.json, .png). At T* its pass@k moves by at most {100 * moved:.1f} points "
            f"and it solves {cmp['solved'][1] - cmp['solved'][0]:+d} distinct tasks (the paper: T* = 0.64, at most "
            "0.7 points, no extra task: ActObs's gain is not the randomness of a higher temperature).")
    return cmp, "\n".join([text, "", "```", compare.compare_table(cmp), "```"])


def sweep_points(st):
    """[(λ, GRPO run)] of the arms whose SFT loss is `--lam X` alone: the baseline arm first, then by λ; none when
    the baseline is not such an arm."""
    base, *rest = st["arms"].split() + st[SWEEP_KEY].split()
    if lam_of(st, base) is None:
        return []
    rest = sorted((a for a in rest if lam_of(st, a) is not None), key=lambda a: lam_of(st, a))
    return [(lam_of(st, a), f"{a}-grpo") for a in [base] + rest]


def sweep_table(cmp, lams):
    """pass@1 and pass@n of each λ's GRPO'd arm minus the baseline's, with the 95% intervals of compare.compare()."""
    ks = [cmp["ks"][0], cmp["ks"][-1]]
    rows = {r["k"]: r for r in cmp["rows"]}
    lines = ["| λ | run | " + " | ".join(f"pass@{k} | vs [0] (95% CI)" for k in ks) + " |",
             "|---|---|" + "---|---|" * len(ks)]
    for i, (lam, label) in enumerate(zip(lams, cmp["runs"])):
        cells = []
        for k in ks:
            r = rows[k]
            cells += [passk.pct(r["pass"][i]), "baseline [0]" if i == 0 else
                      f"{100 * r['diff'][i]:+.1f} [{100 * r['ci'][i][0]:+.1f}, {100 * r['ci'][i][1]:+.1f}]"]
        lines.append(f"| {lam:g} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rl_time(log):
    """What a GRPO run did to its policy over the steps that trained (the others log none of these): action-token
    entropy at the first, on average, at the last, and the KL from the SFT checkpoint at the last, as grpo.py
    estimates it on the sampled tokens: k1 (the mean log-ratio, grpo_curves.png's; noise can make it < 0) and k3
    (exp(-d) + d - 1 with d the log-ratio: never < 0, so it ranks the runs); None without a KL term (--kl-coef 0:
    grpo.py computes none)."""
    ent, kl, k3 = ([r[k] for r in log if k in r] for k in ("train/entropy", "train/kl_init", "train/kl_init_k3"))
    if not ent:
        return {"trained_steps": 0}
    return {"trained_steps": len(ent), "entropy_first": ent[0], "entropy_mean": sum(ent) / len(ent),
            "entropy_last": ent[-1], "kl_end": kl[-1] if kl else None, "kl_k3_end": k3[-1] if k3 else None}


def solve_rise(log):
    """The solve rate over a GRPO run's first steps' episodes and over its last steps', and z: how far the later is
    above the earlier (passk.rise_z). First and last are a third of the steps each, at most 3 (1 of 2 steps); in a
    run with --redraw K the K steps each, the last drawing the first ones' tasks (the steps' rollout/task_draw), so
    that the comparison is not two draws of tasks."""
    redrawn = [r for r in log if r.get("rollout/task_draw", r.get("step")) != r.get("step")]
    k = len(redrawn) or max(1, min(3, len(log) // 3))
    early, late = passk.solved_counts(log[:k]), passk.solved_counts(log[-k:])
    return k, early[0] / max(early[1], 1), late[0] / max(late[1], 1), passk.rise_z(early, late)


def rl_table(grpo, names):
    """One row per GRPO run: reward, the solve rate's rise (solve_rise), signal, and its rl_time; then which kept the
    most entropy and which ended closest to its SFT checkpoint."""
    lines = ["| GRPO run | steps (trained) | reward first → last | solve rate, first → last steps (z) | "
             "groups with signal (sum) | entropy first / mean / last | "
             "KL from the SFT checkpoint at the end, k1 / k3 |",
             "|---|---|---|---|---|---|---|"]
    rl = {m: rl_time(g) for m, g in grpo.items()}
    for m, g in grpo.items():
        t, (k, first, last, z) = rl[m], solve_rise(g)
        kl = f"{t['kl_end']:.2e} / {t['kl_k3_end']:.2e}" if t.get("kl_end") is not None else "not computed (no KL term)"
        trained = (f"{t['entropy_first']:.3f} / {t['entropy_mean']:.3f} / {t['entropy_last']:.3f} | {kl} |"
                   if t["trained_steps"] else "no step trained | — |")
        lines.append(f"| {names[m]} | {len(g)} ({t['trained_steps']}) | {g[0]['rollout/reward_mean']:.3f} → "
                     f"{g[-1]['rollout/reward_mean']:.3f} | {first:.3f} → {last:.3f}, {k} each ({z:+.1f}) | "
                     f"{sum(r['rollout/groups_with_signal'] for r in g):.0f} | {trained}")
    trained = {m: t for m, t in rl.items() if t["trained_steps"]}
    if trained:
        most = max(trained, key=lambda m: trained[m]["entropy_mean"])
        with_kl = {m: t for m, t in trained.items() if t["kl_k3_end"] is not None}
        closest = (f"; closest to its SFT checkpoint at the end (k3): "
                   f"{names[min(with_kl, key=lambda m: with_kl[m]['kl_k3_end'])]}" if with_kl else "")
        lines += ["", f"Most entropy kept during GRPO (mean over the trained steps): {names[most]}{closest} (the "
                  "paper: ActObs, on both). A step that trained nothing (no group with signal) measures neither."]
    return rl, "\n".join(lines)


def transcript_links(run, names, models):
    """Per GRPO run, links to a solved and a failed episode of its last steps that have one (steplog.pick_transcripts:
    each step's transcripts/step_NNNN.md)."""
    lines = ["Episodes to read, from each run's transcripts/ (the last step with a solved one, with a failed one):", ""]
    for m in models:
        picked = sorted(steplog.pick_transcripts(run / m / "transcripts").items(), reverse=True)  # solved, failed
        lines.append(f"- {names[m]}: " + (", ".join(f"[{kind}]({path.relative_to(run)})" for kind, path in picked)
                                          or "no transcript"))
    return "\n".join(lines)


def geometry_table(geo, arm_label):
    """One row per SFT arm: cos(g_act, g_obs) and r = |g_obs| / |g_act|, at the first and the last probed step."""
    lines = ["| arm | cos(g_act, g_obs) first → last | r = ‖g_obs‖/‖g_act‖ first → last |", "|---|---|---|"]
    for a, g in geo.items():
        g = sorted(g, key=lambda r: r["step"])
        lines.append(f"| {arm_label[a]} | {g[0]['probe/cos']:.3f} → {g[-1]['probe/cos']:.3f} | "
                     f"{g[0]['probe/r']:.3f} → {g[-1]['probe/r']:.3f} |")
    return "\n".join(lines)


def time_table(times):
    """{stage: seconds} from times.jsonl, summed over the sessions of a resumed run, and its table with the total."""
    total = {}
    for t in times:
        total[t["stage"]] = total.get(t["stage"], 0) + t["seconds"]
    lines = ["| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in total.items()] + [f"| **total** | {sum(total.values())} |"]
    return total, "\n".join(lines)


def build(run):
    """Check every stage's output (one line per problem, returned); with none, write REPORT.md, report.json and the
    plots, and return []."""
    problems = []
    settings = read_json(run / "settings.json", problems)
    if settings is None:
        return problems
    st = settings["stages"]
    missing = [k for k in ("arms", SWEEP_KEY, "corpus", "heldout_n", "sft", "grpo", "echo", "tstar", "eval")
               if k not in st]
    if missing:
        return [f"{run / 'settings.json'}: no {', '.join(missing)} (a run folder of an older ablation.sh?)"]
    check_model(run / "base" / "model", problems)
    real = st.get("mode") == "real"  # a real model: Terminal-Bench 2.0 the tables' split, aider-polyglot apart
    sets = check_inputs(run, st, problems) if real else {"eval": check_corpus(run, st, problems)}
    ev = sets["tb2" if real else "eval"]
    arms, sweep_arms = st["arms"].split(), st[SWEEP_KEY].split()
    names = model_names(st)
    geo = {a: check_sft(run, a, problems, "--probe-every" in flags(st["sft"])) for a in arms + sweep_arms}
    steps, attempts = int(flags(st["grpo"])["--steps"]), int(flags(st["eval"])["--attempts"])
    echo_coef = float(flags(st["echo"])["--echo-coef"]) if st["echo"] else 0.0
    grpo = {m: check_grpo(run, m, init, steps, echo_coef if m == f"{ECHO}-grpo" else 0.0, problems)
            for m, init in grpo_runs(st).items()}
    results = read_results(run, run / "eval", ev, st, names, problems)
    aider = read_results(run, run / "eval" / "aider", sets["aider"], st, names, problems) if real else {}
    probes = check_probes(run, arms, bool(st["tstar"]), problems)
    if st["tstar"]:
        check_tstar(run, probes, results, problems)
    times = read_jsonl(run / "times.jsonl", problems)
    if problems:
        return problems

    grpod = [f"{a}-grpo" for a in arms] + [f"{ECHO}-grpo"] * bool(st["echo"])  # the paper's comparison: every arm, ECHO
    after, after_txt = comparison(results, grpod, names)
    before, before_txt = comparison(results, arms, names)  # the base solves ~nothing: its own row in the overview
    # what GRPO did to each SFT checkpoint: all tasks only (the per-kind blocks are in the tables above)
    effect = {m: compare_within_kinds([(names[r], results[r]) for r in (init, m)])
              for m, init in grpo_runs(st).items() if init in results}
    tstar, tstar_txt = tstar_section(results, probes, names) if st["tstar"] else (None, "")
    lo, hi, half = halfwidth(after)
    pooled = halfwidth(compare.compare([(names[m], results[m]) for m in grpod[:2]]))[2]  # tasks resampled across kinds
    points = sweep_points(st) if sweep_arms else []
    swept = compare_within_kinds([(names[m], results[m]) for _, m in points]) if points else None
    arm_label = arm_labels(st)
    write_plots(run, names, arm_label, results, grpo, geo, points, swept)
    rl, rl_txt = rl_table(grpo, names)
    total, time_txt = time_table(times)

    md = [f"# ActObs ablation: {st['model']}, {st['preset']} preset" if real else
          f"# ActObs CPU ablation: {st.get('mode', '?')} run", "",
          f"Commit {settings['git'][:10]}, started {settings['started']}, seed {st.get('seed')}, compute dtype "
          f"{settings.get('compute_dtype', {}).get('dtype', 'bf16')}; replies in GRPO's rollouts "
          f"{grammar_words(st['grpo'])}, in the evaluations {grammar_words(st['eval'])}. Settings of every stage: "
          "settings.json; each run dir has its own config.json.", "",
          *([IMAGES[st.get("images")], ""] if real else []),
          f"Resolution: on these {after['rows'][0]['tasks']} tasks × {attempts} attempts, the paired bootstrap 95% "
          f"interval of the pass@1 difference {names[grpod[1]]} − {names[grpod[0]]}, tasks resampled within each "
          + ("category" if real else "kind (the split is drawn as a fixed count per kind)")
          + f", is [{100 * lo:+.1f}, {100 * hi:+.1f}] points: "
          f"**half-width {100 * half:.1f} points** ({100 * pooled:.1f} resampling tasks across kinds; the paper's "
          "effects: 1–4 points).", "",
          (f"## pass@k on Terminal-Bench 2.0 ({len(ev)} tasks, attempts a task as the table gives)" if real else
           f"## pass@k on the evaluation split ({len(ev)} tasks, attempts a task as the table gives; held-out kind: "
           f"{', '.join(taskgen.HELDOUT_KINDS)})"), "", overview(results, names), "",
          "pass@k in %, unbiased estimator over tasks; excluded = attempts lost to infrastructure failures "
          "(not counted). Plot: pass_at_k.png.", "",
          f"## After the same GRPO ({names[grpod[0]]} is the baseline [0]"
          + (f"; ECHO: GRPO from {names['actionsft']} with `{st['echo']}`)" if st["echo"] else ")"),
          "", "```", after_txt, "```", ""]
    if st["tstar"]:
        md += [f"## Temperature-matched {names['actionsft-grpo']}", "", tstar_txt, ""]
    md += [f"## Before GRPO: the SFT arms ({names[arms[0]]} is the baseline [0]; {eval_attempts(st, arms[0])} attempts "
           "a task)", "", "```", before_txt, "```", ""]
    for m, cmp in effect.items():
        md += [f"## What GRPO did: {names[grpo_runs(st)[m]]} → {names[m]}", "", "```", compare.compare_table(cmp),
               "```", ""]
    if real:
        md += [f"## aider-polyglot after the same GRPO ({len(sets['aider'])} tasks, by language; {names[grpod[0]]} is "
               "the baseline [0])", "", "```", comparison(aider, grpod, names)[1], "```", ""]
    md += ["A difference whose 95% interval contains 0 is no evidence of a difference: report it as a null result.", ""]
    if swept:
        md += ["## The λ trade-off: SFT with λ × the observation loss, then the same GRPO "
               f"({names[points[0][1]]} is the baseline [0])", "", sweep_table(swept, [lam for lam, _ in points]), "",
               "Points and paired bootstrap 95% intervals over tasks. The paper: a larger λ "
               "raises the pass@8 advantage and lowers pass@1's.", "", "![λ sweep](lambda_sweep.png)", ""]
    md += ["## GRPO runs: entropy and KL from the SFT checkpoint during RL (each run's curves.png and log.jsonl)", "",
           rl_txt, "", transcript_links(run, names, grpo), "", "![GRPO curves](grpo_curves.png)", "",
           "## Gradient geometry during SFT (geometry.png; each arm's probe_geometry.png)", "",
           geometry_table(geo, arm_label) if any(geo.values()) else "Not measured in this run: sft.py's "
           "--probe-every runs in a single process; `probes.py geometry` gives it over saved step checkpoints.", "",
           "## Probes of the SFT checkpoints on held-out trajectories (probes/*.json and *.png)", "",
           probe_table(probes, run, names), "",
           "## Wall time per stage (seconds, summed over the sessions of a resumed run)", "", time_txt, ""]
    (run / "REPORT.md").write_text("\n".join(md))
    (run / "report.json").write_text(json.dumps({"after_grpo": after, "before_grpo": before, "grpo_effect": effect,
                                                 "pass1_halfwidth": half, "pass1_halfwidth_pooled": pooled,
                                                 "tstar": tstar, "rl_time": rl,
                                                 "lambda_sweep": swept and {"lambdas": [lam for lam, _ in points],
                                                                            **swept},
                                                 "summary": {m: r["summary"] for m, r in results.items()},
                                                 **({"aider_summary": {m: r["summary"] for m, r in aider.items()}}
                                                    if real else {}),
                                                 "stage_seconds": total}, indent=1))
    return []


def read_results(run, folder, tasks, st, names, problems):
    """{model: its results} of the evaluations in `folder` (one JSON a model, checks.check_eval) on `tasks`."""
    out = {}
    for m in names:
        res = check_eval(folder / f"{m}.json", tasks, eval_attempts(st, m), checkpoint(run, m), problems)
        if res is not None:
            out[m] = res
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("settings", help="record the run's settings; refuse a folder with other ones")
    s.add_argument("run", type=Path)
    s.add_argument("pairs", nargs="+", help="KEY=VALUE, e.g. grpo=\"--steps 8 ...\"")
    lim = sub.add_parser("limits", help="check that GRPO's and evaluation's rollout limits fit the expert's replies "
                         "and episodes (in the base model's tokens); exit status 1 if not")
    lim.add_argument("run", type=Path)
    lim.add_argument("--warn", action="store_true", help="print what does not fit, and exit 0 (the quick run's tiny "
                     "limits are meant to cut)")
    b = sub.add_parser("build", help="check every stage's output, write REPORT.md, report.json and the plots")
    b.add_argument("run", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "settings":
        return write_settings(args.run, args.pairs)
    if args.cmd == "limits":
        problems = []
        settings = read_json(args.run / "settings.json", problems)
        reply, episode = check_limits(args.run, settings["stages"], problems) if settings else (None, None)
        print(f"{args.run}: the expert's longest reply is {reply} tokens, its longest episode {episode}")
        for line in problems:
            print(f"  {'warning: ' if args.warn else ''}{line}", file=sys.stderr)
        if problems and not args.warn:
            raise SystemExit(1)
        return
    problems = build(args.run)
    if problems:
        print(f"{args.run}: {len(problems)} problem(s) in the stages' outputs:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        raise SystemExit(1)
    print((args.run / "REPORT.md").read_text())
    print(f"-> {args.run / 'REPORT.md'}")


if __name__ == "__main__":
    main()
