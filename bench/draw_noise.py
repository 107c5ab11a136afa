"""
Calibration: how much of a GRPO run's learning measure is the task draw. report.py's rise compares the solve rate of
a run's first steps with its last steps' (a one-sided two-proportion z, passk.rise_z; a learning claim asks z >= 3), but
each step draws its own tasks, and the tasks differ far more than the attempts on one task do. This takes per-task
solve rates from an evaluation (an SFT checkpoint on the evaluation split: the kinds and spread of the RL split) and
simulates runs that learn nothing, drawing the first and last steps' tasks as grpo.py does, one task of each kind,
or the same tasks twice: every z it prints is noise, so its spread is what a z has to clear.

    python -m bench.draw_noise runs/ablation/eval/actobs.json     # ablation.sh's GRPO: 2 of 8 steps, 4 tasks x 8

Measured on a seed-1 full run's SFT evaluations (RESULTS.md): under grpo.py's draw z has a standard
deviation of ~1.7 with no learning and exceeds 3 in ~4 % of runs; drawing one task of each kind leaves ~1.2-1.4;
the last steps drawing the first steps' tasks again ~0.85 (the pooled rate's variance then overstates the
difference's).
"""
import argparse
import json

import numpy as np

from actobs import passk


def task_rates(results):
    """{kind: [solve rate of each task]} over the seen kinds of an evaluation's results, shrunk toward their mean so
    that their variance is the tasks' own: a rate from n attempts adds p(1 - p) / n of its own, which would count as
    draw (estimated without bias by p̂(1 - p̂) / (n - 1)). Each kind keeps its place relative to the others."""
    seen = [(e["kind"], *passk.task_counts(e)[:2]) for e in results["tasks"].values() if not e["heldout"]]
    seen = [(k, c / n, n) for k, n, c in seen if n > 1]
    if not seen:
        return {}
    p = np.array([r for _, r, _ in seen])  # (tasks,)
    noise = np.mean([r * (1 - r) / (n - 1) for _, r, n in seen])
    shrink = np.sqrt(max(p.var() - noise, 0.0) / p.var()) if p.var() > 0 else 0.0
    rates = {}
    for kind, r, _ in seen:
        rates.setdefault(kind, []).append(p.mean() + shrink * (r - p.mean()))
    return rates


def null_z(rates, draw, rng, steps, tasks_per_step, group_size):
    """One run that learns nothing: its first and last `steps` steps' solved counts, binomial on the drawn tasks'
    rates; draw is 'grpo' (each step tasks_per_step tasks without replacement, steps independent), 'kinds' (one
    task of each kind in both) or 'same' (the last steps draw the first steps' tasks). -> passk.rise_z."""
    flat = np.array([r for k in sorted(rates) for r in rates[k]])

    def pick():  # (tasks,) solve rates of one side's draw
        if draw == "kinds":
            return np.array([rng.choice(rates[k]) for k in sorted(rates)])
        return np.concatenate([rng.choice(flat, tasks_per_step, replace=False) for _ in range(steps)])
    first = pick()
    last = first if draw == "same" else pick()
    counts = [(int(rng.binomial(group_size, p).sum()), len(p) * group_size) for p in (first, last)]
    return passk.rise_z(*counts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results", help="evaluate.py's results JSON of a checkpoint (the RL split's stand-in)")
    p.add_argument("--steps", type=int, default=2, help="steps on each side of the comparison (report.py: a third "
                   "of the run's, at most 3)")
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--runs", type=int, default=20_000, help="simulated runs per way of drawing")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rates = task_rates(json.load(open(args.results)))
    if not rates:
        raise SystemExit(f"{args.results}: no task of a seen kind with an attempt")
    print("seen kinds' solve rates (shrunk):",
          ", ".join(f"{k} {np.mean(v):.2f} ({len(v)})" for k, v in sorted(rates.items())))
    rng = np.random.default_rng(args.seed)
    for draw, what in [("grpo", "grpo.py's draw"), ("kinds", "one task of each kind"),
                       ("same", "the last steps draw the first steps' tasks")]:
        z = np.array([null_z(rates, draw, rng, args.steps, args.tasks_per_step, args.group_size)
                      for _ in range(args.runs)])
        print(f"{what:<45} z with no learning: sd {z.std():.2f} | P(z >= 3) {np.mean(z >= 3):.3f} | "
              f"P(|z| >= 2) {np.mean(abs(z) >= 2):.3f}")


if __name__ == "__main__":
    main()
