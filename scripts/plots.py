"""
The run folder's plots (scripts/report.py build): pass@k of every checkpoint, the GRPO runs' curves, SFT's gradient
geometry and, with a λ sweep, the advantage over ActionSFT against λ.
"""
from actobs import compare
from scripts.checks import finite

def plot_runs(path, panels, series):
    """panels: [(key, title)]; series: {label: rows with "step" and the keys} -> one PNG, a panel per key."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5))
    for ax, (key, title) in zip(axes, panels):
        for i, (label, rows) in enumerate(series.items()):
            pts = sorted((r["step"], r[key]) for r in rows if r.get("step") is not None and finite(r.get(key)))
            if pts:  # a series keeps its colour in every panel, also where the ones before it have no points
                ax.plot(*zip(*pts), marker=".", label=label, color=f"C{i}")
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(path, cmp, lams):
    """pass@1 and pass@n advantage over the baseline (points) against λ, with the 95% intervals as error bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = {r["k"]: r for r in cmp["rows"]}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, k in zip(axes, [cmp["ks"][0], cmp["ks"][-1]]):
        r = rows[k]
        d = [0.0] + [100 * x for x in r["diff"][1:]]
        # clipped at 0: a percentile interval need not contain its point estimate
        err = [[0.0] + [max(0.0, 100 * (x - lo)) for x, (lo, _) in zip(r["diff"][1:], r["ci"][1:])],
               [0.0] + [max(0.0, 100 * (hi - x)) for x, (_, hi) in zip(r["diff"][1:], r["ci"][1:])]]
        ax.errorbar(lams, d, yerr=err, marker="o", capsize=3)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(title=f"pass@{k} advantage over {cmp['runs'][0]}", xlabel="λ (SFT observation-loss weight)",
               ylabel="points")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(run, names, arm_label, results, grpo, geo, points, swept):
    """The report's plots: pass_at_k.png (every evaluated checkpoint), grpo_curves.png (reward, entropy and KL from
    the SFT checkpoint per GRPO run), geometry.png (cos(g_act, g_obs) and r during SFT per arm) and, with a λ sweep,
    lambda_sweep.png."""
    compare.plot_compare(compare.compare([(names[m], r) for m, r in results.items()]), run / "pass_at_k.png")
    plot_runs(run / "grpo_curves.png", [("rollout/reward_mean", "mean reward"),
                                        ("train/entropy", "action-token entropy"),
                                        ("train/kl_init", "KL from the SFT checkpoint")],
              {names[m]: g for m, g in grpo.items()})
    plot_runs(run / "geometry.png", [("probe/cos", "cos(g_act, g_obs) during SFT"),
                                     ("probe/r", "r = |g_obs| / |g_act|")],
              {arm_label[a]: g for a, g in geo.items()})
    if swept:
        plot_sweep(run / "lambda_sweep.png", swept, [lam for lam, _ in points])
