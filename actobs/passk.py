"""
pass@k: the unbiased estimator (Chen et al., 2021), and an evaluation's results file read back: per-task counts,
summaries by kind, the settings that make two runs comparable. evaluate.py writes the files; its compare command
(compare.py) and scripts/report.py read them. docs/report.md.
"""
import math
import operator
from collections import Counter

from actobs import episode

# Settings that change what an attempt means; a resumed run must have the same ones.
RESUME_KEYS = ("model", "tasks", "attempts", "protocol", "temperature", "top_p", "top_k", "max_turns",
               "max_parse_errors", "max_new_tokens", "max_len", "prompt", "seed", "dtype", "network",
               "keep_agent_processes", "second_try", "grammar", "summarize")
# absent from older results files: {key: the value they ran with} (the protocol: the project's own, before Harbor's)
NEWER_KEYS = {"network": None, "keep_agent_processes": False, "second_try": False, "grammar": None, "top_p": 1.0,
              "top_k": 0, "max_parse_errors": 3, "protocol": None, "summarize": False}


def pass_at_k(n, c, k):
    """Unbiased pass@k of one task from n attempts with c solved (Chen et al., 2021): 1 - C(n-c, k) / C(n, k),
    the chance that k attempts drawn without replacement include a solved one. Python integers are exact and
    int / int is correctly rounded, so this is the float nearest the exact rational for every n: no overflow,
    no cancellation (the float product 1 - prod(1 - k/i) is off by a few ulps)."""
    n, c, k = operator.index(n), operator.index(c), operator.index(k)
    if not (0 <= c <= n):
        raise ValueError(f"pass@k: need 0 <= c <= n, got n={n} c={c}")
    if not (1 <= k <= n):
        raise ValueError(f"pass@{k}: need 1 <= k <= n, got n={n} attempts")
    total = math.comb(n, k)
    return (total - math.comb(n - c, k)) / total


def mean_pass_at_k(counts, k):
    """Mean pass@k over tasks; counts: [(n, c)] per task. Tasks with fewer than k valid attempts (infra failures
    removed) are left out. Returns (mean or None, number of tasks it averages)."""
    vals = [pass_at_k(n, c, k) for n, c in counts if n >= k]
    return (sum(vals) / len(vals) if vals else None), len(vals)


def rise_z(early, late):
    """How many standard errors the rate of `late` is above `early`'s, each (solved, attempts): the one-sided
    two-proportion z with the pooled rate (0 when every attempt failed or every one passed: no rise to see). A
    GRPO run's learning curve asks for z >= 3 between its first and last steps (p ~ 0.001)."""
    (k1, n1), (k2, n2) = early, late
    pooled = (k1 + k2) / (n1 + n2)
    if pooled in (0.0, 1.0):
        return 0.0
    return (k2 / n2 - k1 / n1) / math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))


def solved_counts(rows):
    """(episodes solved, valid episodes) over GRPO log rows (steps): the counts behind their solve rates, rise_z's
    input."""
    return (sum(round(r["rollout/solve_rate"] * r["rollout/episodes_valid"]) for r in rows),
            sum(r["rollout/episodes_valid"] for r in rows))


def ks_up_to(n):
    return [2 ** i for i in range(n.bit_length()) if 2 ** i <= n]  # 1, 2, 4, 8, 16 for n = 16


def reward_of(a, first=False):
    """An attempt's reward; first: before aider's second try (--second-try), when it had one."""
    return a["first_reward"] if first and a.get("first_reward") is not None else a["reward"]


def task_counts(entry, first=False):
    """(n, c, excluded, agent failures, infra failures) of one task's attempts; c: the solved ones (episode.solved: full
    marks; a graded reward below 1 is not solved), on the first try with first.
    Attempts that failed for want of the network (needs_network) count in agent failures as `needs network`, and
    those whose agent changed what the verifier loads or runs (their reward stands, as under Harbor) as `tampered`."""
    n = c = 0
    agent, infra = Counter(), Counter()
    for a in entry["attempts"]:
        if a["failure"] in episode.INFRA_FAILURES:
            infra[a["failure"]] += 1
            continue
        n += 1
        c += episode.solved(reward_of(a, first))
        if a["failure"]:
            agent[a["failure"]] += 1
        if a.get("needs_network"):
            agent["needs network"] += 1
        if a.get("tampered"):
            agent["tampered"] += 1
    return n, c, sum(infra.values()), agent, infra


def summarize(tasks, ks, first=False):
    """pass@k for each k, distinct tasks solved, excluded attempts and failure counts over a {name: entry} dict;
    with first, of the first try (before aider's second)."""
    counts, agent, infra, excluded = [], Counter(), Counter(), 0
    for entry in tasks.values():
        n, c, x, a, i = task_counts(entry, first)
        counts.append((n, c))
        excluded, agent, infra = excluded + x, agent + a, infra + i
    out = {"tasks": len(tasks), "solved": sum(c > 0 for _, c in counts), "attempts": sum(n for n, _ in counts),
           "excluded": excluded, "failures": dict(agent), "infra": dict(infra), "pass@k": {}, "tasks@k": {}}
    for k in ks:
        out["pass@k"][k], out["tasks@k"][k] = mean_pass_at_k(counts, k)
    return out


def groups(results):
    """(label, {name: entry}) rows of the table: all tasks, the held-out kinds on their own, then every kind
    (each entry's `kind`: the [metadata] field --kind-by names)."""
    tasks = results["tasks"]
    kinds = sorted({e["kind"] for e in tasks.values() if e["kind"]})
    rows = [("all", tasks)]
    if kinds:
        heldout = sorted({e["kind"] for e in tasks.values() if e["heldout"]})
        for k in heldout:
            rows.append((f"{k} (held-out)", {n: e for n, e in tasks.items() if e["kind"] == k}))
        if heldout:
            rows.append(("seen kinds", {n: e for n, e in tasks.items() if e["kind"] not in heldout}))
        rows += [(k, {n: e for n, e in tasks.items() if e["kind"] == k}) for k in kinds if k not in heldout]
    return rows


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def constrained(settings):
    """Whether a run's replies were decoded under the reply grammar (--grammar), in words."""
    grammar = settings.get("grammar")  # absent from older results files: off
    return f"constrained by the reply grammar (--grammar {grammar})" if grammar else "unconstrained"
