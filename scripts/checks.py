"""
The output checks of the ablation's run folder (`scripts/report.py build`): every stage left well-formed output.
Each check appends one line per problem to `problems` and returns what it could read, which report.py then tables.
Here too: the names ablation.sh gives the folder's runs and the checks expect, and the parser of a stage's flags as
settings.json holds them.
"""
import itertools
import json
import math
import shlex
from pathlib import Path

from actobs import labels, taskgen
from actobs.tasks import load_task

# ----------------------------------------------------------------------------------------------------------
# The run folder's names, and a stage's flags

WEIGHTS = ("config.json", "tokenizer.json", "tokenizer_config.json")  # with weights: a safetensors file, or shards
# ablation.sh's names: ECHO's GRPO run (from ActionSFT), ActionSFT + GRPO's evaluation at T*, the probes of the SFT
# checkpoints and those of the temperature match (T*, with --all)
ECHO, TSTAR = "echo", "actionsft-grpo-tstar"
PROBES, TSTAR_PROBES = ("obs_nll", "cmd_entropy", "kl"), ("entropy_actobs-grpo", "tstar_actionsft-grpo")


def flags(args):
    """'--steps 8 --lr 1e-5 --resume' -> {'--steps': '8', '--lr': '1e-5', '--resume': True}"""
    words, out = shlex.split(args), {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else None
            out[w] = True if nxt is None or nxt.startswith("--") else nxt
    return out


def checkpoint(run, model):
    """The checkpoint an evaluated model's results must name."""
    return (run / "base" / "model" if model == "base"
            else run / ("actionsft-grpo" if model == TSTAR else model) / "final")


# ----------------------------------------------------------------------------------------------------------
# Checks: each appends a line to `problems` and returns what it could read

def read_json(path, problems):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        problems.append(f"{path}: {type(e).__name__}: {e}")


def read_jsonl(path, problems):
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        problems.append(f"{path}: {type(e).__name__}: {e}")
        return []


def finite(x):
    return isinstance(x, int | float) and math.isfinite(x)


def check_model(path, problems):
    missing = [f for f in WEIGHTS if not (path / f).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        problems.append(f"{path}: not a complete checkpoint (missing {', '.join(missing)})")


def task_names(split_dir, problems):
    """{name: kind} of the Harbor task folders of a split."""
    out = {}
    for toml in sorted(split_dir.glob("*/task.toml")):
        try:  # tasks.py reads a task folder as evaluate.py does: the same name and kind
            task = load_task(toml.parent, build=False)
        except ValueError as e:
            problems.append(str(e))
            continue
        out[task.name] = task.kind
    if not out:
        problems.append(f"{split_dir}: no task folders")
    return out


def check_corpus(run, st, problems):
    corpus, n = run / "corpus", flags(st["corpus"])
    rows = read_jsonl(corpus / "sft.jsonl", problems)
    if not rows or any("conversations" not in r for r in rows):
        problems.append(f"{corpus / 'sft.jsonl'}: no rows, or rows without conversations")
    sft_kinds = {r.get("task", "").rsplit("-", 1)[0] for r in rows}
    rl, ev = task_names(corpus / "rl", problems), task_names(corpus / "eval", problems)
    for split, tasks, want in (("rl", rl, n["--n-rl"]), ("eval", ev, n["--n-eval"])):
        if len(tasks) != int(want):
            problems.append(f"{corpus / split}: {len(tasks)} tasks, settings say {want}")
    sft = {r.get("task") for r in rows}
    rl_names, ev_names = {n.split("/")[-1] for n in rl}, {n.split("/")[-1] for n in ev}  # "actobs/<spec name>"
    shared = (sft | rl_names) & ev_names | sft & rl_names
    if shared:
        problems.append(f"{corpus}: splits share tasks: {', '.join(sorted(shared)[:5])}")
    for kind in taskgen.HELDOUT_KINDS:
        if kind in sft_kinds or kind in rl.values():
            problems.append(f"{corpus}: the held-out kind {kind!r} appears in SFT or RL")
        if kind not in ev.values() and len(ev) >= len(taskgen.HELDOUT_KINDS):
            problems.append(f"{corpus / 'eval'}: the held-out kind {kind!r} is missing")
    train, held = read_jsonl(run / "train.jsonl", problems), read_jsonl(run / "heldout.jsonl", problems)
    if len(held) != int(st["heldout_n"]) or len(train) + len(held) != len(rows):
        problems.append(f"{run}: train.jsonl ({len(train)}) + heldout.jsonl ({len(held)}) is not the corpus "
                        f"({len(rows)} rows) split at {st['heldout_n']}")
    return ev


def check_sft(run, arm, problems, geometry=True):
    """The SFT run folder of `arm`: its final checkpoint, a finite loss and (geometry: sft.py ran --probe-every) at
    least two finite gradient-geometry rows and their plot. -> those rows."""
    d = run / arm
    check_model(d / "final", problems)
    log = read_jsonl(d / "log.jsonl", problems)
    geo = [r for r in log if "probe/cos" in r]
    if geometry and (len(geo) < 2 or not all(finite(r["probe/cos"]) and finite(r["probe/r"]) for r in geo)):
        problems.append(f"{d / 'log.jsonl'}: {len(geo)} gradient-geometry rows (need >= 2, finite)")
    if not any(finite(r.get("train/loss")) for r in log):
        problems.append(f"{d / 'log.jsonl'}: no finite train/loss")
    if geometry and not (d / "probe_geometry.png").is_file():
        problems.append(f"{d}: no probe_geometry.png")
    return geo


def check_inputs(run, st, problems):
    """A real run's inputs (scripts/fetch.py): its SFT rows and the probes' held-out ones, its evaluation sets and
    its RL tasks. -> {set: {task name: kind}} of Terminal-Bench 2.0 (tb2) and aider-polyglot (aider)."""
    train, held = read_jsonl(run / "train.jsonl", problems), read_jsonl(run / "heldout.jsonl", problems)
    if not train or any("conversations" not in r for r in train + held) or len(held) != int(st["heldout_n"]):
        problems.append(f"{run}: train.jsonl ({len(train)} rows) and heldout.jsonl ({len(held)}, settings say "
                        f"{st['heldout_n']}) are not the fetched rows")
    task_names(run / "tasks" / "rl", problems)  # the oracle-solvable RL tasks: some
    return {s: task_names(run / "tasks" / s, problems) for s in ("tb2", "aider")}


def check_grpo(run, name, init, steps, echo_coef, problems):
    """The GRPO run folder `name`: from run/init/final, with that --echo-coef, one log row per step."""
    d = run / name
    check_model(d / "final", problems)
    args = (read_json(d / "config.json", problems) or {}).get("args", {})
    if not args or Path(args.get("init", "")).resolve() != (run / init / "final").resolve() \
            or args.get("echo_coef") != echo_coef:
        problems.append(f"{d / 'config.json'}: GRPO from {args.get('init')} with --echo-coef {args.get('echo_coef')}; "
                        f"expected {run / init / 'final'} with {echo_coef}")
    log = read_jsonl(d / "log.jsonl", problems)
    if [r.get("step") for r in log] != list(range(1, steps + 1)):
        problems.append(f"{d / 'log.jsonl'}: steps {[r.get('step') for r in log]}, expected 1..{steps}")
    for r in log:
        if not (finite(r.get("rollout/reward_mean")) and 0 <= r["rollout/reward_mean"] <= 1):
            problems.append(f"{d / 'log.jsonl'} step {r.get('step')}: "
                            f"rollout/reward_mean {r.get('rollout/reward_mean')!r}")
        # a step that trained nothing (train/optimizer_steps 0: no group with signal) logs no training metrics
        trained = r.get("train/optimizer_steps", 1) > 0
        kl = ("train/kl_init", "train/kl_init_k3") if (args or {}).get("kl_coef") else ()  # a KL term: logged
        bad = [k for k in ("train/entropy", *kl, "train/loss") if (trained or k in r) and not finite(r.get(k))]
        if bad:
            problems.append(f"{d / 'log.jsonl'} step {r.get('step')}: not finite: {', '.join(bad)}")
    if not (d / "curves.png").is_file():
        problems.append(f"{d}: no curves.png")
    return log


def check_eval(path, tasks, attempts, checkpoint, problems):
    res = read_json(path, problems)
    if res is None:
        return None
    where = str(path)
    if res["settings"]["attempts"] != attempts or Path(res["settings"]["model"]).resolve() != checkpoint.resolve():
        problems.append(f"{where}: evaluated {res['settings']['model']} with {res['settings']['attempts']} attempts; "
                        f"expected {checkpoint} with {attempts}")
    if set(res["tasks"]) != set(tasks):
        problems.append(f"{where}: tasks differ from the evaluation split ({len(res['tasks'])} vs {len(tasks)})")
    for name, entry in res["tasks"].items():
        idx = sorted(a["attempt"] for a in entry["attempts"])
        if idx != list(range(attempts)):
            problems.append(f"{where}: task {name} has attempts {idx}, expected 0..{attempts - 1}")
        if not all(finite(a["reward"]) and 0 <= a["reward"] <= 1 for a in entry["attempts"]):
            problems.append(f"{where}: task {name} has a reward outside [0, 1]")
    transcripts = path.with_suffix(".episodes.jsonl")
    have = {(r.get("task"), r.get("attempt")) for r in read_jsonl(transcripts, problems)}
    lost = [(name, a["attempt"]) for name, e in res["tasks"].items() for a in e["attempts"]
            if (name, a["attempt"]) not in have]
    if lost:
        problems.append(f"{transcripts}: no transcript of {len(lost)} recorded attempts, e.g. {lost[0]}")
    s = res.get("summary")
    vals = [v for v in (s or {}).get("pass@k", {}).values() if v is not None]
    if s is None or not vals:
        problems.append(f"{where}: no summary pass@k")
    elif not all(0 <= v <= 1 for v in vals) or any(a > b + 1e-12 for a, b in zip(vals, vals[1:])):
        problems.append(f"{where}: pass@k {vals} not in [0, 1] or decreasing in k")
    return res


def check_probes(run, arms, tstar, problems):
    """The probes' results: finite numbers; the SFT checkpoints' probes hold every arm's (one added to a finished
    run by ablation.sh --all is probed again); the temperature match's where the run has it."""
    out = {}
    for name in PROBES + TSTAR_PROBES * tstar:
        res = read_json(run / "probes" / f"{name}.json", problems)
        if res is None:
            continue
        nums = [v for v in _numbers(res)]
        if not nums or not all(math.isfinite(v) for v in nums):
            problems.append(f"{run / 'probes' / name}.json: no numbers, or non-finite ones")
        if name in PROBES:  # keyed by the checkpoints probed
            have = {Path(k).resolve() for k in res}
            if missing := [a for a in arms if checkpoint(run, a).resolve() not in have]:
                problems.append(f"{run / 'probes' / name}.json: no result for {', '.join(missing)}")
        out[name] = res
    return out


def check_tstar(run, probes, results, problems):
    """The temperature match: ActObs + GRPO's self-entropy at the temperature its evaluation ran at, T* found on
    ActionSFT + GRPO, and ActionSFT + GRPO's evaluation at that T*."""
    e, t = probes.get("entropy_actobs-grpo"), probes.get("tstar_actionsft-grpo")
    ev, ts = results.get("actobs-grpo"), results.get(TSTAR)
    where = run / "probes"
    if e and ev and (Path(e.get("model", "")).resolve() != checkpoint(run, "actobs-grpo").resolve()
                     or e.get("temperature") != ev["settings"]["temperature"]):
        problems.append(f"{where / 'entropy_actobs-grpo.json'}: self-entropy of {e.get('model')} at T = "
                        f"{e.get('temperature')}; expected {checkpoint(run, 'actobs-grpo')} at its evaluation's T = "
                        f"{ev['settings']['temperature']}")
    if t and (Path(t.get("model", "")).resolve() != checkpoint(run, TSTAR).resolve() or not finite(t.get("t_star"))):
        problems.append(f"{where / 'tstar_actionsft-grpo.json'}: T* {t.get('t_star')!r} of {t.get('model')}; expected "
                        f"a number, of {checkpoint(run, TSTAR)}")
    elif t and ts and not math.isclose(ts["settings"]["temperature"], t["t_star"], rel_tol=1e-9):
        problems.append(f"{run / 'eval' / TSTAR}.json: evaluated at T = {ts['settings']['temperature']}, the probe's "
                        f"T* is {t['t_star']}")


def _numbers(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _numbers(v)
    elif isinstance(x, int | float) and not isinstance(x, bool):
        yield float(x)


def expert_lengths(tokenizer, rows):
    """(longest reply, its task, longest episode, its task) in tokens of the expert corpus rows, counted as a rollout
    counts them: a reply is a run of ACTION tokens (what the policy generates, its end-of-turn token included),
    an episode all of its rendered tokens."""
    reply = episode = (0, None)
    for r in rows:
        ids, roles = labels.render(tokenizer, r["conversations"])
        longest = max((len(list(run)) for role, run in itertools.groupby(roles) if role == labels.ACTION), default=0)
        reply, episode = max(reply, (longest, r.get("task"))), max(episode, (len(ids), r.get("task")))
    return (*reply, *episode)


def check_limits(run, st, problems):
    """The rollout limits of GRPO and evaluation must let a policy do what the expert did: a reply cut at
    --max-new-tokens cannot parse, so a kind whose expert writes a longer reply could never be solved, by any arm."""
    tok = labels.load_tokenizer(run / "base" / "model", "native")
    reply, reply_task, episode, episode_task = expert_lengths(tok, read_jsonl(run / "corpus" / "sft.jsonl", problems))
    for stage in ("grpo", "eval"):
        f = flags(st[stage])
        if reply > int(f["--max-new-tokens"]):
            problems.append(f"{stage}: --max-new-tokens {f['--max-new-tokens']} is less than the expert's longest "
                            f"reply, {reply} tokens ({reply_task}): such replies are cut and cannot parse")
        if episode > int(f["--max-len"]):
            problems.append(f"{stage}: --max-len {f['--max-len']} is less than the expert's longest episode, {episode} "
                            f"tokens ({episode_task})")
    return reply, episode
