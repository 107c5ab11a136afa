"""
The `compare` subcommand of evaluate.py (its docstring says what it gives; `python evaluate.py compare --help`):
the paired bootstrap over tasks, the comparison's tables and its plot of pass@k against k. scripts/report.py makes
its tables with it. Results are read through evaluate.py's estimator (pass_at_k, task_counts): this file imports
evaluate.py, and evaluate.main imports this one only when asked to compare.
"""
import argparse
import json
import math
from pathlib import Path

import numpy as np

from actobs.passk import RESUME_KEYS, groups, ks_up_to, pass_at_k, pct, task_counts


def per_task(results, k):
    """{task: pass@k} for the tasks with at least k valid attempts."""
    out = {}
    for name, entry in results["tasks"].items():
        n, c = task_counts(entry)[:2]
        if n >= k:
            out[name] = pass_at_k(n, c, k)
    return out


def bootstrap_diff(a, b, n_boot=10_000, seed=0, strata=None):
    """Paired bootstrap 95% interval of mean(b - a) over tasks: tasks are resampled with replacement, each
    keeping its pair of values. a, b: (T,) per-task values of two runs on the same tasks. strata: (T,) labels of a
    split drawn as fixed counts per label (the generated world's kinds): tasks are resampled within their
    label, so each resample keeps the split's composition and the spread between labels is not counted as
    the chance of the draw. A label's resampled mean is then moved from the label's mean by sqrt(n / (n - 1)) of
    its deviation: with the few tasks of a label (n), the plain resample's variance is (n - 1) / n of the
    unbiased one, and the interval would be too narrow. That stretch can carry a resample past what a
    difference of two pass rates can be: the interval is clipped to [-1, 1]."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)  # (T,)
    rng = np.random.default_rng(seed)
    if strata is None:
        means = d[rng.integers(0, len(d), size=(n_boot, len(d)))].mean(axis=1)  # (n_boot,)
    else:
        # the labels' weighted means sum to d's mean: each resample is that mean plus the labels' weighted deviations
        labels, means = np.asarray(strata), np.full(n_boot, d.mean())
        for v in np.unique(labels):
            x = d[labels == v]  # (n,)
            dev = x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(axis=1) - x.mean()  # (n_boot,)
            scale = math.sqrt(len(x) / (len(x) - 1)) if len(x) > 1 else 0.0
            means += len(x) / len(d) * scale * dev
    lo, hi = np.clip(np.percentile(means, [2.5, 97.5]), -1.0, 1.0)
    return float(lo), float(hi)


def compare(runs, n_boot=10_000, seed=0, by_kind=False):
    """runs: [(label, results)]; the first is the baseline. For every k up to the smallest n, on the tasks every
    run has with at least k valid attempts: each run's pass@k and, against the baseline, the difference, its
    relative size and a paired bootstrap 95% interval (by_kind: stratified by the baseline's task kinds,
    bootstrap_diff's strata). Distinct tasks solved are counted on the common tasks."""
    ks = ks_up_to(min(r["settings"]["attempts"] for _, r in runs))
    rows = []
    for k in ks:
        vals = [per_task(res, k) for _, res in runs]
        shared = sorted(set.intersection(*(set(v) for v in vals)))
        if not shared:
            continue
        per = [np.array([v[t] for t in shared]) for v in vals]  # per run: (T,) pass@k of the shared tasks
        row = {"k": k, "tasks": len(shared), "pass": [float(p.mean()) for p in per], "diff": [None], "rel": [None],
               "ci": [None]}
        strata = [str(runs[0][1]["tasks"][t].get("kind")) for t in shared] if by_kind else None
        for p in per[1:]:
            d, base = float(p.mean() - per[0].mean()), float(per[0].mean())
            row["diff"].append(d)
            row["rel"].append(d / base if base > 0 else None)
            row["ci"].append(bootstrap_diff(per[0], p, n_boot, seed, strata))
        rows.append(row)
    valid = [{n for n, e in res["tasks"].items() if task_counts(e)[0] > 0} for _, res in runs]
    shared = set.intersection(*valid)
    solved = [sum(task_counts(res["tasks"][t])[1] > 0 for t in shared) for _, res in runs]
    differ = [k for k in RESUME_KEYS if k != "model" and any(r["settings"].get(k) != runs[0][1]["settings"].get(k)
                                                              for _, r in runs)]
    return {"runs": [label for label, _ in runs], "tasks": [len(v) for v in valid], "common": len(shared),
            "ks": [r["k"] for r in rows], "rows": rows, "solved": solved, "n_boot": n_boot, "seed": seed,
            "by_kind": by_kind, "settings_differ": differ}


def compare_by_kind(runs, n_boot=10_000, seed=0, by_kind=False):
    """[(label, compare() on that group's tasks)] for each task-kind group of the first run (held-out kinds first);
    by_kind: as compare's (a group of several kinds, "seen kinds", resamples within each)."""
    return [(label, compare([(name, {**res, "tasks": {t: e for t, e in res["tasks"].items() if t in tasks}})
                             for name, res in runs], n_boot, seed, by_kind))
            for label, tasks in groups(runs[0][1])[1:]]


def compare_table(cmp):
    runs = cmp["runs"]
    lines = [f"[{i}] {label} ({n} tasks)" for i, (label, n) in enumerate(zip(runs, cmp["tasks"]))]
    head = f"{'':8} {'tasks':>5} " + " ".join(f"{f'[{i}]':>6}" for i in range(len(runs)))
    lines.append((head + "".join(f"   [{i}]-[0]     rel   {'95% CI':16}" for i in range(1, len(runs)))).rstrip())
    for r in cmp["rows"]:
        line = f"{'pass@' + str(r['k']):8} {r['tasks']:>5} " + " ".join(f"{pct(p):>6}" for p in r["pass"])
        for d, rel, (lo, hi) in zip(r["diff"][1:], r["rel"][1:], r["ci"][1:]):
            rel = "-" if rel is None else f"{100 * rel:+.1f}%"
            line += f"   {100 * d:+7.1f} {rel:>7}   {f'[{100 * lo:+.1f}, {100 * hi:+.1f}]':16}"
        lines.append(line.rstrip())
    lines.append(f"{'solved':8} {cmp['common']:>5} " + " ".join(f"{s:>6}" for s in cmp["solved"])
                 + "   (distinct tasks with at least one success)")
    lines.append(f"pass@k and differences in points, on the tasks all runs have; paired bootstrap over tasks"
                 f"{' (resampled within each kind)' if cmp.get('by_kind') else ''}, {cmp['n_boot']} resamples, "
                 f"seed {cmp['seed']}: an interval containing 0 is no evidence of a difference")
    if cmp["settings_differ"]:
        lines.append(f"note: the runs differ in more than the model: {', '.join(cmp['settings_differ'])}")
    return "\n".join(lines)


def plot_compare(cmp, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for i, label in enumerate(cmp["runs"]):
        ax.plot(cmp["ks"], [100 * r["pass"][i] for r in cmp["rows"]], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(cmp["ks"], [str(k) for k in cmp["ks"]])
    ax.set(xlabel="k (attempts)", ylabel="pass@k (%)", title=f"pass@k on {cmp['common']} common tasks")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv):
    """`python evaluate.py compare ...`: evaluate.main hands it the arguments after `compare`."""
    p = argparse.ArgumentParser(prog="evaluate.py compare", description="pass@k of evaluation runs side by side, "
                                "differences to the first with paired bootstrap 95% intervals over tasks")
    p.add_argument("results", nargs="+", type=Path, help="results JSON files; the first is the baseline")
    p.add_argument("--png", type=Path, help="plot of pass@k against k")
    p.add_argument("--n-boot", type=int, default=10_000, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--by-kind", action="store_true", help="also compare on each task kind (held-out kinds first)")
    args = p.parse_args(argv)
    runs = [(str(r.with_suffix("")), json.loads(r.read_text())) for r in args.results]
    cmp = compare(runs, args.n_boot, args.seed)
    print(compare_table(cmp))
    if args.png:
        plot_compare(cmp, args.png)
        print(f"-> {args.png}")
    for label, sub in compare_by_kind(runs, args.n_boot, args.seed) if args.by_kind else []:
        print(f"\n== {label}")
        print(compare_table(sub))
    return cmp
