"""
What a GRPO step leaves for people to read: its row in log.jsonl (step_record: summed over the ranks), its line on
the console (step_line), the run's curves.png (plot_curves), and a solved and a failed episode of it as Markdown,
OUT/transcripts/step_0003.md (write_transcripts): what the policy did, what it was paid, which way the update pushed
it. scripts/report.py links one solved and one failed transcript per GRPO run (pick_transcripts).

Importable without torch: report.py reads the transcripts; grpo.py calls the rest.
"""
import dataclasses
import json
import re
from collections import Counter
from pathlib import Path

from actobs import terminus
from actobs.episode import INFRA_FAILURES, handed_off, solved
from actobs.labels import ACTION


@dataclasses.dataclass
class Step:
    """One GRPO step on this rank, as grpo.main fills it: what its log row and transcripts read."""
    step: int  # 0-based
    task_draw: int  # the step (0-based) whose task draw this one used (--redraw)
    episodes: list = dataclasses.field(default_factory=list)  # every draw's, in order
    advantages: list = dataclasses.field(default_factory=list)  # a (G, S) tensor a draw
    valid: list = dataclasses.field(default_factory=list)  # a (G, S) bool tensor a draw: not lost to the infrastructure
    has_signal: list = dataclasses.field(default_factory=list)  # a (G,) bool tensor a draw
    gen: Counter = dataclasses.field(default_factory=Counter)  # the generator's seconds: wall_s, policy_s, idle_s
    trained: dict = dataclasses.field(default_factory=dict)  # what the update saw: grpo.train_batch's sums
    gnorm: float | None = None  # the last update's grad norm; None: no update
    checksum: float | None = None  # engine.sync_weights' of the weights this rank's engine got; None: no sync
    times: dict = dataclasses.field(default_factory=dict)  # seconds: rollout, train, sync, sync_gather, step


def step_record(s, *, lr, ppo_epochs, device):
    """The log row of Step s, summed over the ranks. -> (the row, what an episode lost to the infrastructure, on any
    rank, said, or None)."""
    import torch  # the trainer's alone (report.py reads the transcripts without it)

    from actobs import common
    episodes, valid, has_signal = s.episodes, torch.cat(s.valid), torch.cat(s.has_signal)
    tot, gnorm, gen, times = s.trained, s.gnorm, s.gen, s.times
    ok = valid.flatten().tolist()
    ep_sums = {"episodes": len(episodes), "valid": sum(ok),
               "reward_sum": sum(e.reward for e, v in zip(episodes, ok) if v),
               "solved": sum(solved(e.reward) for e, v in zip(episodes, ok) if v),
               "signal": int(has_signal.sum()), "groups": len(has_signal), "turns": sum(e.turns for e in episodes),
               "tokens": sum(len(e.token_ids) for e in episodes), "truncated": sum(e.truncated for e in episodes),
               "cut_replies": sum(e.cut_replies for e in episodes),  # at --max-new-tokens (--grammar: closed)
               "handoffs": sum(len(handed_off(e)) for e in episodes),  # at --max-len, the episode went on (--summarize)
               "gen_tokens": sum(e.roles.count(ACTION) for e in episodes),
               "parse_errors": sum(sum(terminus.unparsed_replies(e.messages)) for e in episodes),
               "gen_busy_s": gen["policy_s"], "gen_idle_s": gen["idle_s"], "rollout_s": gen["wall_s"]}
    # per rank: the failures by kind (whichever kinds envs reports), an infrastructure failure's message, its own
    # mean |mismatch| and weights' checksum
    mine = tot.get("act_tokens", 0)
    lost = next((f"{e.task}: {e.failure}: {e.error[:300]}" for e in episodes if e.failure in INFRA_FAILURES), None)
    ranks = common.all_gather({"failures": Counter(e.failure for e in episodes if e.failure), "lost": lost,
                               "weights": s.checksum, "mismatch": tot["mismatch_abs_sum"] / mine if mine else None})
    failures = sum((r["failures"] for r in ranks), Counter())
    keys = sorted(set(ep_sums) | set(tot))
    sums = dict(zip(keys, common.all_reduce([ep_sums.get(k, tot.get(k, 0.0)) for k in keys], device)))
    na, nv, turns = sums.get("act_tokens", 0), max(sums["valid"], 1), max(sums["turns"], 1)
    rec = {"step": s.step + 1, "rollout/task_draw": s.task_draw + 1,  # whose tasks
           "rollout/reward_mean": sums["reward_sum"] / nv, "rollout/solve_rate": sums["solved"] / nv,
           "rollout/episodes_valid": int(sums["valid"]),  # the solve rate's denominator (passk.solved_counts)
           "rollout/groups_drawn": sums["groups"], "rollout/groups_with_signal": sums["signal"],
           "rollout/groups_zero_variance": sums["groups"] - sums["signal"],
           "rollout/infra_excluded": sums["episodes"] - sums["valid"],
           "rollout/turns_mean": sums["turns"] / sums["episodes"],
           "rollout/episode_tokens_mean": sums["tokens"] / sums["episodes"],
           "rollout/response_tokens_mean": sums["gen_tokens"] / turns,
           "rollout/truncated": sums["truncated"], "rollout/handoffs": sums["handoffs"],
           "rollout/parse_error_rate": sums["parse_errors"] / turns,
           "rollout/cut_reply_rate": sums["cut_replies"] / turns,
           **{f"rollout/failures/{k}": n for k, n in sorted(failures.items())},
           "rollout/gen_tok_per_s": sums["gen_tokens"] / max(sums["gen_busy_s"], 1e-9),
           "rollout/generator_idle_frac": sums["gen_idle_s"] / max(sums["rollout_s"], 1e-9),
           "train/episodes_trained": int(sums["episodes_trained"]), "train/action_tokens": int(na),
           "train/optimizer_steps": 0 if gnorm is None else ppo_epochs, "train/lr": lr,
           "time/rollout_s": times["rollout"], "time/generate_s": gen["policy_s"], "time/env_wait_s": gen["idle_s"],
           "time/train_s": times["train"], "time/sync_s": times["sync"],
           "time/sync_gather_s": times["sync_gather"],  # of sync_s, the trainer's side: gathers, checksum, casts
           "time/step_s": times["step"]}
    if gnorm is not None:  # what the trained episodes show (a step without an update scored none)
        rec.update({"train/loss": sums["loss"], "train/pg_loss": sums["pg_loss"], "train/echo_loss": sums["echo_loss"],
                    "train/grad_norm": gnorm, "train/obs_nll": sums["obs_nll_sum"] / max(sums["obs_tokens"], 1)})
    if na:
        rec.update({"train/entropy": sums["entropy_sum"] / na, "train/mismatch": sums["mismatch_sum"] / na,
                    "train/mismatch_abs": sums["mismatch_abs_sum"] / na, "train/clip_frac": sums["clipped_sum"] / na,
                    "train/tis_weight": sums["tis_w_sum"] / na,
                    # the worst rank's: one rank's stale engine is not averaged away by the others
                    "train/mismatch_abs_rank_max": max(r["mismatch"] for r in ranks if r["mismatch"] is not None)})
        if "kl_init_sum" in sums:  # a run with a KL term (--kl-coef): its KL from the initial policy, k1 and k3
            rec.update({"train/kl_init": sums["kl_init_sum"] / na, "train/kl_init_k3": sums["kl_init_k3_sum"] / na})
    if s.checksum is not None:  # every rank's engine should hold the same weights: a spread above 0 says they part
        checks = [r["weights"] for r in ranks]
        rec.update({"train/weights_checksum": checks[0], "train/weights_checksum_spread": max(checks) - min(checks)})
    return rec, next((r["lost"] for r in ranks if r["lost"]), None)


def step_line(rec, steps, lost=None):
    """The step's one line on the console; a second with step_record's `lost`: why episodes left the statistics and
    the loss, or a loaded machine silently shrinks the steps."""
    kl = f"kl {rec['train/kl_init_k3']:.2e} | " if "train/kl_init_k3" in rec else ""
    trained = (f"ent {rec['train/entropy']:.3f} | {kl}mism {rec['train/mismatch_abs']:.1e} | "
               f"gnorm {rec['train/grad_norm']:.3f}"
               if "train/grad_norm" in rec and "train/entropy" in rec else "nothing to learn from: no update")
    return (f"step {rec['step']}/{steps} | reward {rec['rollout/reward_mean']:.3f} | "
            f"solved {rec['rollout/solve_rate']:.2f} | signal {rec['rollout/groups_with_signal']:.0f}/"
            f"{rec['rollout/groups_drawn']:.0f} | {trained} | gen {rec['time/generate_s']:.0f}s "
            f"idle {rec['rollout/generator_idle_frac']:.0%} | train {rec['time/train_s']:.0f}s | "
            f"{rec['time/step_s']:.0f}s" + (f"\n  {rec['rollout/infra_excluded']:.0f} of the step's episodes lost "
                                             f"to the infrastructure, e.g. {lost}" if lost else ""))


# curves.png: the KL from the initial policy is k3's (never below 0; train/kl_init, the k1 estimate, can be)
CURVES = (("rollout/reward_mean", "mean reward"), ("train/entropy", "action-token entropy"),
          ("train/kl_init_k3", "KL from init (k3)"))


def plot_curves(log_path, png):
    """curves.png: a panel per CURVES key, its values in a log.jsonl against the step (integer ticks)."""
    from actobs import common  # matplotlib through common.pyplot: the trainer's alone
    plt = common.pyplot()
    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines()]
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.3 * len(CURVES), 3.5))
    for ax, (k, title) in zip(axes, CURVES):
        pts = [(r["step"], r[k]) for r in rows if k in r]
        if pts:
            ax.plot(*zip(*pts), marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(plt.matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------
# Transcripts

MAX_TEXT = 2000  # bytes of a reply or observation kept in a transcript, head and tail (terminus.truncate_output)
HEADING = re.compile(r"^## (solved|failed): ", re.M)  # an episode's heading, which pick_transcripts reads


def chosen_episodes(episodes, group_size):
    """-> indices of a solved and a failed episode (episode.solved; not solved, not for the infrastructure), from the
    first group that has both (its advantages' two signs side by side), else the first of each; fewer where the
    step has none of a kind."""
    done = [i for i, e in enumerate(episodes) if solved(e.reward)]
    failed = [i for i, e in enumerate(episodes) if not solved(e.reward) and e.failure not in INFRA_FAILURES]
    pairs = [(s, f) for s in done for f in failed if s // group_size == f // group_size]
    return list(pairs[0]) if pairs else done[:1] + failed[:1]


def _text(title, text):
    return [title, "", "````", terminus.truncate_output(text, MAX_TEXT), "````", ""]


# How the context after a hand-off was made (episode.Handoff.fallback)
FALLBACKS = {"summary": "the summary, the next agent's questions and the answers",
             "short": "fallback: a short summary", "state": "fallback: the task and the terminal alone",
             None: "nothing fit: the episode ends at --max-len"}


def handoff_text(h, k, prompt):
    """The k-th hand-off of an episode (episode.Handoff) in its transcript: how its context after was made, its
    calls (free text, not trained) and that context, message by message (the first prompt named, not repeated)."""
    lines = [f"### hand-off {k}: {FALLBACKS[h.fallback]}", "",
             "The observation above did not fit in the context. The unwinding kept "
             + ("the first message" if h.kept == 1 else f"its first {h.kept} messages") + f" for the calls "
             f"({h.seconds:.1f}s in all); " + ("the replies after this answer the new context." if h.context else
                                               "no context fit, and the episode ended."), ""]
    for c in h.calls:
        lines += _text(f"#### {c['name']} call: {c['prompt_tokens']} prompt tokens, reply {c['reply_tokens']} tokens "
                       f"({c['finish']})", c["reply"])
    for i, m in enumerate(h.context, 1):
        text = "(the prompt above)" if m["content"] == prompt else m["content"]
        lines += _text(f"#### new context, message {i} ({m['role']})", text)
    return lines


def transcript(episode, advantage):
    """One episode as Markdown: its heading (solved / failed, task, reward, advantage, turns, hand-offs, how it
    ended), the prompt, then each reply and the observation that answered it, each cut to MAX_TEXT; a hand-off at
    the context limit after the observation that did not fit (handoff_text)."""
    kind = "solved" if solved(episode.reward) else "failed"
    end = episode.failure or ("cut at --max-len" if episode.truncated else "ended by the agent")
    n = len(handed_off(episode))
    lines = [f"## {kind}: {episode.task}, reward {episode.reward:.2f}, advantage {advantage:+.3f}, "
             f"{episode.turns} turns, " + (f"{n} hand-off{'s' * (n > 1)}, " if n else "") + end, ""]
    turn, at = 0, {h.at: (k, h) for k, h in enumerate(episode.handoffs, 1)}
    for i, m in enumerate(episode.messages, 1):
        turn += m["role"] == "assistant"
        title = "prompt" if turn == 0 else f"reply {turn}" if m["role"] == "assistant" else f"observation {turn}"
        lines += _text(f"### {title}", m["content"])
        if i in at:
            lines += handoff_text(at[i][1], at[i][0], episode.messages[0]["content"])
    return "\n".join(lines)


def write_transcripts(folder, step, episodes, advantages, group_size):
    """The step's chosen episodes (chosen_episodes of consecutive groups of group_size; advantages: a float per
    episode) to folder/step_NNNN.md, step 1-based. -> the file's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chosen = chosen_episodes(episodes, group_size)
    text = [f"# Step {step}: {len(chosen)} of the {len(episodes)} episodes rank 0 ran", ""]
    text += [transcript(episodes[i], advantages[i]) for i in chosen] or ["No episode ended solved or failed."]
    path = folder / f"step_{step:04d}.md"
    path.write_text("\n".join(text) + "\n")
    return path


def pick_transcripts(folder):
    """The transcripts a report links: {'solved': path, 'failed': path}, each the last step's file that has one of
    that kind (later steps show the trained policy); a kind no file has is absent."""
    out = {}
    for path in sorted(Path(folder).glob("step_*.md"), reverse=True):
        for kind in set(HEADING.findall(path.read_text())) - set(out):
            out[kind] = path
    return out
