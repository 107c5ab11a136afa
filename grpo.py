"""
Multi-turn GRPO of a terminal agent: episodes sampled by an in-process vLLM engine in Docker sandboxes, the clipped
policy gradient with an optional KL and ECHO term.

Each step rolls out --group-size episodes of each of --tasks-per-step tasks (envs.py, engine.py), rewards them by
their verifiers, takes --ppo-epochs optimizer steps on the loss below and loads the new weights into the engine:

    L = -sum_{i in ACTION} n_i w_i min(rho_i A, clip(rho_i, 1 - eps_low, 1 + eps_high) A)
        + kl * sum_{i in ACTION} n_i k3_i + echo * mean_seq[ sum_{i in OBS(seq)} NLL_i / |OBS(seq)| ]
    A = r - mean(r_group), rho_i = pi(a_i) / pi_behaviour(a_i)

pg_loss writes it out on the per-token log-probs of the chunked head (head.token_logprobs); its terms and flags, the
memory plan: docs/training.md. Log rows and transcripts: steplog.py.

An episode handed off at --max-len (--summarize, Harbor's Terminus-2 summarisation: actobs/handoff.py) trains as the
contexts the policy sampled its replies in: the context before each hand-off and the one after are each a sequence of
their own (group_examples), every token with the episode's advantage, each reply at the log-probs it was sampled with
in its context. The hand-off's own calls (summary, questions, answers, a fallback's short summary) are not trained;
why, and how the normalisers then weigh such an episode: docs/training.md#a-handed-off-episode.

CPU toy run (tasks from `python envs.py corpus --out data/corpus`, an SFT checkpoint from sft.py):
    python grpo.py --init runs/actobs/final --tasks data/corpus/rl --out runs/grpo-actobs \
        --steps 20 --tasks-per-step 4 --group-size 4 --lr 1e-5 --max-len 4096 --max-new-tokens 512 \
        --max-turns 10 --max-parse-errors 3
1 GPU, the paper's settings (the flag defaults: lr 1e-6, 135 steps, 32 tasks x 16 episodes, binary reward, no turn
cap; the paper's rollout temperature, the rows' prompt and the sandboxes' network as ablation.sh's real presets give):
    python grpo.py --init runs/q4b-actobs/final --tasks tasks/rl --out runs/q4b-actobs-grpo --temperature 0.6 \
        --prompt-template runs/real-paper/prompt_template.txt --network egress
8 GPUs (each rank: its own engine and 4 of the 32 groups; FSDP2 shards the model):
    torchrun --standalone --nproc_per_node 8 grpo.py --init runs/q4b-actobs/final --tasks tasks/rl \
        --fsdp --grad-ckpt --micro-tokens 16384 --out runs/q4b-actobs-grpo --temperature 0.6 ... (as above)
Resume: the same command plus --resume. Several runs, one process: `python grpo.py ARGS ::: ARGS ...`.
"""
import argparse
import dataclasses
import gc
import os
import time

import numpy as np
import torch

import envs
from actobs import batches, common, engine, episode, grammar, head, runlog, steplog, terminus
from actobs.labels import ACTION, OBS, load_tokenizer
from actobs.sandbox import network
from actobs.tasks import load_tasks


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("recipe", "the flags ablation.sh's runs and the paper set; theirs too: --concurrency, "
                             "--micro-tokens, --fsdp, --grad-ckpt (execution), --out, --save-every, --keep (run)")
    g.add_argument("--init", required=True, help="HF checkpoint to start from (sft.py's final/ has its template)")
    g.add_argument("--tasks", required=True, help="folder of Harbor task folders (e.g. the toy world's rl/ split)")
    g.add_argument("--steps", type=int, default=135, help="steps: each rolls out, updates and syncs the engine")
    g.add_argument("--tasks-per-step", type=int, default=32, help="groups per step (global, across ranks)")
    g.add_argument("--group-size", type=int, default=16, help="episodes per task per step")
    g.add_argument("--lr", type=float, default=1e-6, help="constant learning rate")
    g.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL penalty to the initial policy (0 = off)")
    g.add_argument("--scale-std", action="store_true", help="divide advantages by the group's std (+1e-6)")
    g.add_argument("--echo-coef", type=float, default=0.0, help="ECHO: weight of the observation NLL of the "
                   "policy's own rollouts (0.05 in its reference setting)")
    g.add_argument("--redraw", type=int, default=0, metavar="K", help="the last K steps draw the tasks the first K "
                   "drew (fresh episodes of them): the solve rate, first steps against last, then compares the same "
                   "tasks (scripts/report.py; bench/draw_noise.py measures what the draw adds)")
    for flag, kw in envs.EPISODE_FLAGS.items():  # --max-turns, --max-parse-errors, --summarize
        g.add_argument(flag, **kw)
    g.add_argument("--max-new-tokens", type=int, default=4096, help="tokens per reply")
    g.add_argument("--max-len", type=int, default=16384, help="tokens per context: where an episode's next reply has "
                   "no room, it is handed off (--summarize) or cut and flagged")
    g.add_argument("--prompt-template", help="file with {instruction} and {terminal_state} (default: terminus's)")
    g.add_argument("--network", choices=(network.EGRESS, network.HOST), help="a network for the tasks that allow the "
                   "internet: egress or host (evaluate.py --network); default: none for any task")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; log-probs use logits / T")
    g.add_argument("--seed", type=int, default=0, help="seeds the task draws and the sampling")
    g = p.add_argument_group("tasks and rollouts")
    g.add_argument("--chat-template", default="native", help="'native' (the checkpoint's), 'prefix', or a .jinja")
    g.add_argument("--kinds", type=lambda v: v.split(","), metavar="KIND,...", help="train only on the tasks of "
                   "these kinds (task.toml's [metadata] kind), e.g. the ones the policy solves sometimes")
    g.add_argument("--grammar", **grammar.GRAMMAR_FLAG)
    g.add_argument("--dynamic-sampling", type=int, default=0, metavar="MAX_GROUPS", help="drop groups without "
                   "signal and draw more, --tasks-per-step at a time, until --tasks-per-step have signal or "
                   "MAX_GROUPS (a multiple of --tasks-per-step) were drawn; 0 = off")
    g.add_argument("--overlong", default="keep", choices=["keep", "mask", "penalty"], help="episodes cut at "
                   "--max-len: keep (the verifier's reward), mask (in their group's statistics, out of the loss), "
                   "penalty (reward - --overlong-penalty)")
    g.add_argument("--overlong-penalty", type=float, default=1.0, help="what --overlong penalty subtracts")
    g = p.add_argument_group("objective", "the loss's variants (pg_loss; docs/training.md#the-grpo-objective)")
    g.add_argument("--clip", type=float, default=0.2, help="PPO clip epsilon on the importance ratio (both sides)")
    g.add_argument("--clip-low", type=float, help="lower clip epsilon: rho is clipped to [1 - clip-low, 1 + "
                   "clip-high] (default --clip); DAPO's clip-higher: --clip-low 0.2 --clip-high 0.28")
    g.add_argument("--clip-high", type=float, help="upper clip epsilon (default --clip)")
    g.add_argument("--loss-norm", default="token", choices=["token", "sequence", "constant"],
                   help="n_i of the module docstring: token, sequence or constant (Dr. GRPO)")
    g.add_argument("--ppo-epochs", type=int, default=1, help="optimizer steps per batch of rollouts (1 = on-policy)")
    g.add_argument("--tis-cap", type=float, default=0.0, help="truncated importance weight cap (0 = off)")
    g.add_argument("--echo-payload-only", action="store_true", help="ECHO on the environment's own text only, not "
                   "the protocol's fixed wrapper text and end-of-turn tokens")
    g = p.add_argument_group("optimizer")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW decoupled weight decay")
    g.add_argument("--adam-betas", type=float, nargs=2, default=[0.9, 0.999], metavar=("B1", "B2"), help="AdamW betas")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    g = p.add_argument_group("execution", "how the run computes, not what: free to change on --resume")
    g.add_argument("--concurrency", type=int, default=64, help="sandboxes live at once per rank")
    g.add_argument("--micro-tokens", type=int, default=32768, help="token budget of a micro-batch (rows x length)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="autocast and engine dtype; "
                   "auto = bf16 on CUDA and on a CPU where it measures faster than fp32 (common.resolve_dtype)")
    g.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (recompute activations in "
                   "backward)")
    g.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP under torchrun")
    g.add_argument("--gpu-memory", type=float, default=0.35, help="GPU memory share of the vLLM engine")
    g.add_argument("--kv-cache-gb", type=float, help="vLLM's KV cache on CPU (GiB); default: room for "
                   "--concurrency sequences of --max-len tokens")
    common.add_run_flags(p, "curves.png, ", save_every=10)
    return p


# What --resume lets change: how the run computes and where it writes. Every other flag must be the checkpoint's
# (common.resume_point), a new one too unless it is added here.
FREE_ON_RESUME = ("concurrency", "micro_tokens", "dtype", "grad_ckpt", "fsdp", "gpu_memory", "kv_cache_gb",
                  *common.RUN_FLAGS)


# ----------------------------------------------------------------------------------------------------------
# The objective

@dataclasses.dataclass(frozen=True)
class Objective:
    """The loss's settings, from the flags (objective()): what pg_loss computes."""
    weights: dict  # each term's coefficient, {"pg": 1, "kl": --kl-coef, "echo": --echo-coef}; may_skip reads them
    temperature: float  # the action tokens' log-probs are of logits / T, the distribution they were sampled from
    clip_low: float  # eps_low, eps_high: rho is clipped to [1 - eps_low, 1 + eps_high]
    clip_high: float
    tis_cap: float  # > 0: rho against the trainer before the step's first update, times min(pi_old / pi_behav, cap)
    loss_norm: str  # n_i: "token", "sequence" or "constant"
    max_len: int  # constant's n_i = 1 / (max_len * sequences)
    echo_payload_only: bool  # ECHO on the environment's own text only


def objective(args):
    """The Objective of the run's flags. A new term: its coefficient in weights, its value in pg_loss (may_skip reads
    the weights, so the term reaches groups without signal)."""
    return Objective(weights={"pg": 1.0, "kl": args.kl_coef, "echo": args.echo_coef}, temperature=args.temperature,
                     clip_low=args.clip if args.clip_low is None else args.clip_low,
                     clip_high=args.clip if args.clip_high is None else args.clip_high, tis_cap=args.tis_cap,
                     loss_norm=args.loss_norm, max_len=args.max_len, echo_payload_only=args.echo_payload_only)


@dataclasses.dataclass(frozen=True)
class Normalisers:
    """The step's counts the loss divides by, over every rank (train_batch)."""
    act_tokens: float  # action tokens that carry loss (loss_tokens) in the step, at least 1
    seqs: float  # the step's examples, at least 1
    echo_seqs: float  # the examples with ECHO tokens (the loss divides by at least 1)


def echo_mask(roles, wrapper, payload_only):
    """roles, wrapper (..., T) -> (..., T-1) bool: the positions whose next token carries ECHO: OBS (payload_only:
    the environment's own text alone)."""
    m = roles[..., 1:] == OBS
    return m & ~wrapper[..., 1:] if payload_only else m


def loss_tokens(example):
    """How many of an example's tokens carry the policy-gradient loss: its action tokens but the forced ones."""
    forced = example.forced or [False] * len(example.roles)
    return sum(r == ACTION and not f for r, f in zip(example.roles[1:], forced[1:]))


def may_skip(example, obj):
    """Whether the loss adds nothing on `example`, so it need not be forwarded: its advantage is 0 at every token
    (a group without signal: the policy-gradient term is 0) and every other term weighs 0."""
    return not any(example.adv) and not any(c for term, c in obj.weights.items() if term != "pg")


def pg_loss(lm, batch, obj, norm):
    """The module docstring's L on one micro-batch (batches.collate's), this micro-batch's part of the step's loss.
    lm: the policy (a Hugging Face causal LM), obj: Objective, norm: the step's Normalisers. The log-probs come from
    the chunked head, differentiable (the (N, V) logits never exist); the objective is tensor code on them.
    -> (the loss (autograd), stats of sums: the terms, entropy, KL, mismatch between the engine's and the trainer's
    log-probs, clipping)."""
    echo = echo_mask(batch["roles"], batch["wrapper"], obj.echo_payload_only) & (obj.weights["echo"] != 0)  # (B, T-1)
    r = batches.selected_rows(lm, batch, obj.temperature, echo)  # the N positions that carry loss
    # each row's log-prob of its token: action rows at T (under a grammar, of the distribution masked to the tokens it
    # allowed, renormalised: what vLLM sampled from), ECHO rows at 1; and the entropies, detached
    lp, ent = head.token_logprobs(r.h, lm.get_output_embeddings().weight, r.targets, entropy=True,
                                  allowed=batches.allowed_rows(batch, r.sel))  # (N,), (N,)
    act, B = r.act, len(batch["input_ids"])  # (N,) bool: the action rows, the sampled tokens that carry loss
    logp, behav, adv, seq = lp[act], r.behav[act], r.adv[act], r.seq[act]  # (n,) each
    # rho against the behaviour policy (the log-prob vLLM sampled with); with --tis-cap against the trainer before
    # the step's first update (old; this policy at the first epoch), weighted by the truncated IS weight w
    old = r.old[act] if r.old is not None else logp.detach()  # (n,)
    if obj.tis_cap > 0:
        rho, w = (logp - old).exp(), (old - behav).exp().clamp(max=obj.tis_cap)
    else:
        rho, w = (logp - behav).exp(), torch.ones_like(logp)
    unclipped, clipped = rho * adv, rho.clamp(1 - obj.clip_low, 1 + obj.clip_high) * adv  # (n,) each
    surrogate = torch.minimum(unclipped, clipped)
    if obj.loss_norm == "token":  # n_i: 1 / (the step's action tokens)
        n = 1.0 / norm.act_tokens
    elif obj.loss_norm == "sequence":  # 1 / (|ACTION(seq)| * the step's sequences)
        n = 1.0 / (torch.bincount(seq, minlength=B)[seq] * norm.seqs)  # (n,)
    else:  # constant (Dr. GRPO): 1 / (--max-len * the step's sequences), however long the sequence
        n = 1.0 / (obj.max_len * norm.seqs)
    pg = -(n * w * surrogate).sum()
    # the k3 estimate of the KL to the initial policy, whose log-probs are ref: e^d - d - 1, d = ref - logp
    d = r.ref[act] - logp if r.ref is not None else torch.zeros_like(logp)  # (n,)
    k3 = d.exp() - d - 1
    kl = (n * k3).sum()
    # ECHO: the observation tokens' NLL at T = 1 (the model's own prediction of the environment, unmasked), a mean
    # per sequence, summed over the sequences and divided by the step's sequences that have such tokens
    nll, obs_seq = -lp[~act], r.seq[~act]  # (N - n,) each
    echo = (nll / torch.bincount(obs_seq, minlength=B)[obs_seq]).sum() / max(norm.echo_seqs, 1)
    loss = obj.weights["pg"] * pg + obj.weights["kl"] * kl + obj.weights["echo"] * echo
    stats = {"loss": loss.item(), "pg_loss": obj.weights["pg"] * pg.item(),
             "echo_loss": obj.weights["echo"] * echo.item(), "act_tokens": len(logp),
             "entropy_sum": ent[act].sum().item(),
             # with a KL term, on every rank (a rank with no examples forwards one without ref: its sums are 0)
             **({"kl_init_sum": -d.sum().item(), "kl_init_k3_sum": k3.sum().item()} if obj.weights["kl"] else {}),
             "mismatch_sum": (behav - old).sum().item(), "mismatch_abs_sum": (behav - old).abs().sum().item(),
             # clipped: the min took the clipped branch, where the gradient stops
             "clipped_sum": ((unclipped > clipped) & (adv != 0)).sum().item(), "tis_w_sum": w.sum().item(),
             "obs_tokens": len(nll), "obs_nll_sum": nll.sum().item()}
    return loss, stats


def train_batch(wrapped, init, opt, examples, obj, pad_id, device, ctx, step, log, *, ppo_epochs, micro_tokens,
                grad_clip, fsdp):
    """ppo_epochs optimizer steps of `wrapped` (common.LossModule around the policy, under DDP / FSDP2) on this
    rank's examples (batches.Example) by the loss of Objective obj, in micro-batches of micro_tokens; init: the
    initial policy for the KL (a full copy, or a LossModule sharded like the policy under fsdp; None without a KL
    term). -> (stats summed over the first epoch's micro-batches, the last grad norm (clipped to grad_clip) or None).
    The normalisers count every example of every rank; those the loss adds nothing on are not forwarded (may_skip).
    With none left on any rank, no optimizer step either: Adam's moments would move the weights with a gradient
    of 0."""
    n_echo = sum(bool(echo_mask(torch.tensor(ex.roles), torch.tensor(ex.wrapper), obj.echo_payload_only).any())
                 for ex in examples) if obj.weights["echo"] != 0 else 0
    n_tok, n_seq, n_echo = common.all_reduce([sum(map(loss_tokens, examples)), len(examples), n_echo], device)
    norm = Normalisers(act_tokens=max(n_tok, 1), seqs=max(n_seq, 1), echo_seqs=n_echo)
    examples = [ex for ex in examples if not may_skip(ex, obj)]
    if common.all_reduce([len(examples)], device)[0] == 0:
        return {"episodes_trained": 0}, None
    if init is not None:  # sharded, every rank runs as many forwards, examples or not
        refs = batches.policy_logprobs(init, examples, obj.temperature, micro_tokens, pad_id, device, ctx, wrapped=fsdp)
        examples = [dataclasses.replace(ex, ref=lp) for ex, lp in zip(examples, refs)]
    if ppo_epochs > 1 and obj.tis_cap > 0:  # the trainer before the step's first update, on every rank
        olds = batches.policy_logprobs(wrapped, examples, obj.temperature, micro_tokens, pad_id, device, ctx,
                                       wrapped=True)
        examples = [dataclasses.replace(ex, old=lp) for ex, lp in zip(examples, olds)]
    # micro-batches by token budget, as many on every rank; the loss is already normalised over the step and every
    # rank, and DDP averages gradients over ranks: each backward is of loss * world
    world, tot = common.world_size(), {"episodes_trained": len(examples)}
    groups = common.rank_micro_batches([len(ex.ids) for ex in examples], micro_tokens, device)
    for epoch in range(ppo_epochs):
        for k, g in enumerate(groups):
            batch = batches.micro_batch(examples, g, pad_id, device)
            with common.grad_sync(wrapped, k == len(groups) - 1, world, fsdp), ctx:
                loss, st = wrapped(batch, obj, norm, fn=pg_loss)  # pg_loss(policy, ...) under DDP's / FSDP2's hooks
                (loss * world).backward()
            if epoch == 0:
                for key, v in {**st, "tokens": int(batch["attention_mask"].sum()) if g else 0}.items():
                    tot[key] = tot.get(key, 0.0) + v
        gnorm = common.optimizer_step(wrapped, opt, grad_clip, step, log)
    return tot, gnorm


# ----------------------------------------------------------------------------------------------------------
# Episodes to examples: the step's draws, rewards and advantages

def step_groups(n_tasks, tasks_per_step, step, seed, draw=0):
    """Task indices of one draw of a step, without replacement, seeded by (seed, step) for the first draw and (seed,
    step, draw) for dynamic sampling's further ones: a resumed run draws the same."""
    rng = np.random.default_rng([seed, step] + ([draw] if draw else []))
    return rng.choice(n_tasks, tasks_per_step, replace=tasks_per_step > n_tasks).tolist()


def task_step(step, steps, redraw):
    """The step whose task draw step (0-based) uses: its own, or with --redraw K in the last K steps of the run the
    one steps - K back, so that the last K steps draw the first K steps' tasks in order."""
    return step - (steps - redraw) if step >= steps - redraw else step


def step_seed(seed, step, rank, draw=0):
    """The sampling seed of one rank's rollouts in one draw of a step (each turn's derives from it): of (seed, step,
    rank, draw) alone, so a resumed run samples as the uninterrupted one would with no RNG state saved; the first
    draw's is that of a run without dynamic sampling."""
    return (seed * 100_003 + step) * 64 + rank + (draw << 40)


def draw_episodes(llm, tok, tasks, template, args, step, rank, gen, draw, groups):
    """The episodes of one draw's groups on this rank (--group-size of each task, in order), sampled by the engine's
    policy in sandboxes, scored by their verifiers; the generator's seconds are added to the Counter gen."""
    from tqdm import tqdm
    desc = f"step {step + 1} rollouts" + (f" (draw {draw + 1})" if draw else "")
    bar = tqdm(total=len(groups) * args.group_size, desc=desc, leave=False, disable=rank != 0, dynamic_ncols=True)
    policy = engine.VLLMPolicy(llm, tok, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                               max_len=args.max_len, seed=step_seed(args.seed, step, rank, draw), grammar=args.grammar,
                               summarize=args.summarize)
    with engine.engine_threads():
        episodes = envs.run_episodes([tasks[g] for g in groups for _ in range(args.group_size)], policy,
                                     max_turns=args.max_turns, max_parse_errors=args.max_parse_errors,
                                     concurrency=args.concurrency, template=template,
                                     on_episode=lambda i, e: bar.update(), stats=gen, network=args.network)
    bar.close()
    return episodes


def group_rewards(episodes, group_size, overlong, overlong_penalty):
    """Episodes of consecutive groups (group_size each) -> (rewards, valid, trains), (G, S) each: the verifier's
    rewards (graded or not: taken as they are), less overlong_penalty for an episode cut at --max-len under --overlong
    penalty; valid: not an infrastructure failure (those are out of the group's statistics); trains: the valid
    episodes the loss sees (--overlong mask: not the cut ones)."""
    cut = torch.tensor([e.truncated for e in episodes]).view(-1, group_size)  # (G, S)
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32).view(-1, group_size)
    if overlong == "penalty":
        rewards = rewards - overlong_penalty * cut
    valid = torch.tensor([e.failure not in episode.INFRA_FAILURES for e in episodes]).view(-1, group_size)
    return rewards, valid, valid & ~cut if overlong == "mask" else valid


def group_advantages(rewards, valid=None, scale_std=False, eps=1e-6):
    """rewards (G, S) -> (advantages (G, S), signal (G,) bool). A = r - mean of the group's valid episodes; with
    scale_std, / (std + eps), std being the population std (ddof 0) of those valid rewards. Invalid episodes
    (infrastructure failures) get 0 and stay out of the statistics; a group whose valid rewards are all equal, or
    with fewer than two valid episodes, has no signal: all its advantages are 0."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    n = valid.sum(1, keepdim=True).clamp(min=1)  # (G, 1)
    mean = (rewards * valid).sum(1, keepdim=True) / n
    dev = (rewards - mean) * valid  # (G, S)
    std = (dev.pow(2).sum(1, keepdim=True) / n).sqrt()
    has_signal = (std.squeeze(1) > 0) & (valid.sum(1) >= 2)  # (G,)
    adv = dev / (std + eps) if scale_std else dev
    return adv * has_signal[:, None], has_signal


def token_advantages(episode, adv, replies):
    """The advantage of each of an episode's tokens (a list, one per token; the loss reads it at the action
    tokens) from its group-relative advantage `adv` (a float) and its turn boundaries `replies` (engine.reply_spans:
    the [start, end) of each reply in turn order). GRPO's outcome reward gives every token the same; a per-turn or
    per-token advantage (turn rewards, a value model) is a change to this function alone."""
    return [adv] * len(episode.token_ids)


def group_examples(episodes, adv, trains):
    """Episodes of consecutive groups, their advantages (G, S) and whether each trains (G, S) -> each group's
    training examples (batches.Example), one per context an episode sampled replies in (episode.segments: one, or
    one more after each hand-off at --max-len): its tokens, roles, wrapper, the log-probs vLLM sampled them with,
    token_advantages; under a grammar its masks and forced tokens, which carry no loss."""
    groups = [[] for _ in range(len(adv))]
    for i, e in enumerate(episodes):
        g, j = divmod(i, adv.shape[1])
        if not trains[g, j]:
            continue
        advs = token_advantages(e, float(adv[g, j]), engine.reply_spans(e.roles))
        forced = engine.forced_tokens(e.masks, e.mask_ids) if e.masks else None  # decoded under a grammar
        for a, b in episode.segments(e):
            if ACTION not in e.roles[a:b]:
                continue
            masked = dict(masks=e.masks, mask_ids=e.mask_ids[a:b], forced=forced[a:b]) if e.masks else {}
            groups[g].append(batches.Example(ids=e.token_ids[a:b], roles=e.roles[a:b], wrapper=e.obs_wrapper[a:b],
                                             behav=e.logprobs[a:b], adv=advs[a:b], **masked))
    return groups


# ----------------------------------------------------------------------------------------------------------
# The run

def main(argv=None):
    args = get_parser().parse_args(argv)

    if args.keep < 1 or args.ppo_epochs < 1 or args.temperature <= 0:
        raise ValueError("--keep and --ppo-epochs must be >= 1, --temperature > 0")
    if not 0 <= 2 * args.redraw <= args.steps:
        raise ValueError(f"--redraw {args.redraw}: the last steps redraw the first steps' tasks, at most half of "
                         f"--steps {args.steps}")
    if args.dynamic_sampling % args.tasks_per_step:
        raise ValueError(f"--dynamic-sampling {args.dynamic_sampling} must be a multiple of --tasks-per-step "
                         f"{args.tasks_per_step} (0 = off)")
    run = common.start_run(args.out, vars(args), FREE_ON_RESUME, resume=args.resume, fsdp=args.fsdp)
    if run is None:
        return
    rank, world, device, print0 = run.rank, run.world, run.device, run.print0
    if args.tasks_per_step % world:
        raise ValueError(f"--tasks-per-step {args.tasks_per_step} must be a multiple of the {world} ranks")

    tok = load_tokenizer(run.ckpt or args.init, "native" if run.ckpt else args.chat_template)
    template = terminus.load_template(args.prompt_template)
    tasks = load_tasks(args.tasks, args.kinds)
    ctx, dtype, why = common.autocast(args.dtype, device)
    lm = common.load_model(run.ckpt or args.init, device)  # the policy, fp32 master weights
    # the initial policy, only for a KL term (--kl-coef): in the autocast dtype, sharded like the policy under --fsdp,
    # else a full copy per rank. Without it no KL is computed, nor logged
    init = None
    if args.kl_coef:
        init = common.load_model(args.init, device).to(dtype).requires_grad_(False).eval()
        init = common.shard(common.LossModule(init), init) if args.fsdp else init
    # what trains: DDP / FSDP2 around lm
    wrapped = common.wrap_model(common.LossModule(lm), lm, device, grad_ckpt=args.grad_ckpt, fsdp=args.fsdp)
    opt = common.adamw(wrapped.parameters(), lr=args.lr, betas=args.adam_betas, eps=args.adam_eps,
                       weight_decay=args.weight_decay)
    start = common.load_optimizer_state(wrapped, opt, run.state, args.fsdp)
    os.environ.update(engine.IN_PROCESS_ENV)  # vLLM's engine in this process: the weight sync hands it tensors
    llm = engine.make_engine(run.ckpt or args.init, max_model_len=args.max_len, seed=args.seed,
                             max_seqs=args.concurrency, dtype="bf16" if dtype == torch.bfloat16 else "fp32",
                             gpu_memory=args.gpu_memory, kv_cache_gb=args.kv_cache_gb, sleep=True)
    log = runlog.open_run_log(run.out, vars(args), start, rank, resume=args.resume, wandb=args.wandb,
                              compute_dtype={"dtype": str(dtype), "why": why})
    print0(f"{len(tasks)} tasks | {sum(p.numel() for p in lm.parameters()) / 1e6:.1f}M params | {args.steps} steps "
           f"x {args.tasks_per_step} tasks x {args.group_size} episodes | {str(dtype)[6:]} ({why}) | world {world} | "
           + (f"resumed at step {start}" if start else "fresh start"))

    lm.train()
    per_rank = args.tasks_per_step // world  # this rank's groups of a draw
    for step in range(start, args.steps):
        t0, s = time.time(), steplog.Step(step, task_draw=task_step(step, args.steps, args.redraw))
        examples, kept = [], 0
        for draw in range(max(args.dynamic_sampling // args.tasks_per_step, 1)):  # one, or --dynamic-sampling's
            groups = step_groups(len(tasks), args.tasks_per_step, s.task_draw, args.seed,
                                 draw)[rank * per_rank: (rank + 1) * per_rank]
            # rollout -> rewards -> advantages -> examples
            drawn = draw_episodes(llm, tok, tasks, template, args, step, rank, s.gen, draw, groups)
            rewards, ok, trains = group_rewards(drawn, args.group_size, args.overlong, args.overlong_penalty)  # (G, S)
            adv, sig = group_advantages(rewards, ok, args.scale_std)  # (G, S), (G,)
            by_group = group_examples(drawn, adv, trains)
            s.episodes += drawn
            s.advantages.append(adv), s.valid.append(ok), s.has_signal.append(sig)
            if not args.dynamic_sampling:
                examples = [ex for g in by_group for ex in g]
                break
            # dynamic sampling: groups with signal, in rank order, until the step has --tasks-per-step of them
            counts = common.all_reduce([int(sig.sum()) if r == rank else 0 for r in range(world)], device)  # (world,)
            take = max(0, min(int(sig.sum()), args.tasks_per_step - kept - int(sum(counts[:rank]))))
            examples += [ex for g in sig.nonzero().flatten().tolist()[:take] for ex in by_group[g]]
            kept = min(kept + int(sum(counts)), args.tasks_per_step)
            if kept >= args.tasks_per_step:
                break
        if device.type == "cuda":  # the engine's weights go to host memory and its KV cache is freed while training
            llm.sleep(level=1)
        t_roll = time.time()
        # update: --ppo-epochs optimizer steps on this batch, micro-batches by token budget
        s.trained, s.gnorm = train_batch(wrapped, init, opt, examples, objective(args), tok.pad_token_id, device, ctx,
                                         step, print0, ppo_epochs=args.ppo_epochs, micro_tokens=args.micro_tokens,
                                         grad_clip=args.grad_clip, fsdp=args.fsdp)
        t_train = time.time()
        # sync: the new weights into the engine (a step without an update leaves them as they are)
        if device.type == "cuda":  # the engine wakes into what the trainer released: its cached blocks too
            torch.cuda.empty_cache()
            llm.wake_up()
        s.checksum, t_gather = engine.sync_weights(llm, lm) if s.gnorm is not None else (None, 0.0)
        t_sync = time.time()
        # log: one row a step, summed over ranks; save: a checkpoint every --save-every steps
        s.times = {"rollout": t_roll - t0, "train": t_train - t_roll, "sync": t_sync - t_train,
                   "sync_gather": t_gather, "step": t_sync - t0}
        rec, lost = steplog.step_record(s, lr=args.lr, ppo_epochs=args.ppo_epochs, device=device)
        log.write(rec)
        print0(steplog.step_line(rec, args.steps, lost))
        if rank == 0:  # a solved and a failed episode to read
            steplog.write_transcripts(run.out / "transcripts", step + 1, s.episodes,
                                      torch.cat(s.advantages).flatten().tolist(), args.group_size)
        done = step + 1
        if (args.save_every and done % args.save_every == 0) or done == args.steps:
            common.save_checkpoint(run.out / f"step-{done:06d}", wrapped, lm, tok, opt, done, vars(args), rank,
                                   fsdp=args.fsdp, rng=False)
            common.prune_checkpoints(run.out, args.keep, rank)
            if rank == 0:
                steplog.plot_curves(run.out / "log.jsonl", run.out / "curves.png")
    common.save_checkpoint(run.out / "final", wrapped, lm, tok, None, args.steps, vars(args), rank,
                           fsdp=args.fsdp)  # weights, tokenizer
    print0(f"final model: {run.out / 'final'}")
    log.close()
    del llm  # the engine's shutdown also tears down the process group it joined (torchrun): before ours, not after
    gc.collect()
    common.close_distributed()


if __name__ == "__main__":
    common.run_cli(main)
