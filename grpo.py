"""
ActObs GRPO: multi-turn RL of a terminal agent with rollouts from a vLLM engine in the same process, in real
Docker sandboxes (envs.py), token-in/token-out, with an optional observation-prediction term (ECHO).

CPU toy run (tasks from `python envs.py corpus --out data/corpus`, an SFT checkpoint from sft.py):
    python grpo.py --init runs/actobs/final --tasks data/corpus/rl --out runs/grpo-actobs \
        --steps 20 --tasks-per-step 4 --group-size 4 --lr 1e-5 --max-len 4096 --max-new-tokens 512
1 GPU, the paper's settings (the flag defaults: lr 1e-6, 135 steps, 32 tasks x 16 episodes, binary reward):
    python grpo.py --init runs/q4b-actobs/final --tasks tasks/rl --out runs/q4b-actobs-grpo
8 GPUs (each rank: its own engine, 4 of the 32 groups; FSDP2 shards a 4B model, docs/training.md's memory plan):
    torchrun --standalone --nproc_per_node 8 grpo.py --init runs/q4b-actobs/final --tasks tasks/rl \
        --fsdp --grad-ckpt --micro-tokens 16384 --out ...
Resume: the same command plus --resume. Several runs, one process: `python grpo.py ARGS ::: ARGS ...` (run_cli).

One step (main): roll out --group-size episodes of each of --tasks-per-step tasks (up to --concurrency sandboxes
at once), reward each by its task's verifier, and take --ppo-epochs optimizer steps on

    A_i = r_i - mean(r_group)                          (/ (std(r_group) + 1e-6) with --scale-std; population std)
    L   = -sum_{i in ACTION} n_i * w_i * min(rho_i A, clip(rho_i, 1-eps_low, 1+eps_high) A)
          + echo * mean_seq[ sum_{i in OBS(seq)} NLL_i / |OBS(seq)| ]  + kl * sum_{i in ACTION} n_i * k3_i

with rho_i = pi(a_i) / pi_behaviour(a_i) (the vLLM log-prob the token was sampled with), all log-probs at the
sampling temperature (logits / T, top-p 1, top-k off) and, with --grammar, of the distribution masked to the tokens
the reply's grammar allowed, renormalised (the ratio, the KL and the entropy alike; ACTION then leaves out the
forced tokens, those the grammar allowed alone: they carry no loss); eps_low = eps_high = --clip unless --clip-low /
--clip-high say otherwise (DAPO's clip-higher); n_i = 1 / (action tokens in the step) for `--loss-norm token`,
1 / (|ACTION(seq)| * sequences in the step) for `sequence`, 1 / (--max-len * sequences) for `constant` (Dr. GRPO).
k3_i = e^(ref_i - logp_i) - (ref_i - logp_i) - 1, ref: the initial policy's log-prob. With --tis-cap C, rho_i is
against the trainer's log-prob before the step's first update and w_i = min(pi_old / pi_behaviour, C) corrects the
trainer/vLLM mismatch; else w_i = 1. Infrastructure failures (envs.INFRA_FAILURES) are out of their group's mean and
of the loss; the normalisers count every other episode, groups without signal included (an episode the loss adds
nothing on, may_skip, is not forwarded; a step with none left makes no optimizer step). An episode cut at --max-len
keeps its verifier's reward, is masked out of the loss, or is penalised (--overlong). After every optimizer step the
weights go into the engine in place (engine.py). Log rows, transcripts: steplog.py; GPU memory: docs/training.md.
"""
import argparse
import gc
import os
import time
from collections import Counter

import numpy as np
import torch

import common
import engine
import envs
import head
import steplog
import terminus
from labels import ACTION, OBS, PROMPT, load_tokenizer
from tasks import load_tasks


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and tasks")
    g.add_argument("--init", required=True, help="HF checkpoint to start from (sft.py's final/ has its template)")
    g.add_argument("--chat-template", default="native", help="'native' (the checkpoint's), 'prefix', or a .jinja")
    g.add_argument("--tasks", required=True, help="folder of Harbor task folders (e.g. the toy world's rl/ split)")
    g.add_argument("--kinds", type=lambda v: v.split(","), metavar="KIND,...", help="train only on the tasks of "
                   "these kinds (task.toml's [metadata] kind), e.g. the ones the policy solves sometimes")
    g.add_argument("--prompt-template", help="file with {instruction} and {terminal_state} (default: terminus's)")
    g = p.add_argument_group("rollouts")
    g.add_argument("--tasks-per-step", type=int, default=32, help="groups per step (global, across ranks)")
    g.add_argument("--group-size", type=int, default=16, help="episodes per task per step")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; log-probs use logits / T")
    g.add_argument("--max-turns", type=int, default=30)
    g.add_argument("--max-new-tokens", type=int, default=4096, help="tokens per reply")
    g.add_argument("--max-len", type=int, default=16384, help="tokens per episode; longer ones are cut and flagged")
    g.add_argument("--network", metavar="MODE", help="Docker network for the tasks that allow the internet: bridge, "
                   "host or a network's name (evaluate.py --network); default: none for any task")
    g.add_argument("--grammar", **terminus.GRAMMAR_FLAG)
    g = p.add_argument_group("objective")
    g.add_argument("--clip", type=float, default=0.2, help="PPO clip epsilon on the importance ratio (both sides)")
    g.add_argument("--clip-low", type=float, help="lower clip epsilon: rho is clipped to [1 - clip-low, 1 + "
                   "clip-high] (default --clip); DAPO's clip-higher: --clip-low 0.2 --clip-high 0.28")
    g.add_argument("--clip-high", type=float, help="upper clip epsilon (default --clip)")
    g.add_argument("--ppo-epochs", type=int, default=1, help="optimizer steps per batch of rollouts (1 = on-policy)")
    g.add_argument("--loss-norm", default="token", choices=["token", "sequence", "constant"],
                   help="n_i of the module docstring: token, sequence or constant (Dr. GRPO)")
    g.add_argument("--scale-std", action="store_true", help="divide advantages by the group's std (+1e-6)")
    g.add_argument("--redraw", type=int, default=0, metavar="K", help="the last K steps draw the tasks the first K "
                   "drew (fresh episodes of them): the solve rate, first steps against last, then compares the same "
                   "tasks (scripts/report.py; bench/draw_noise.py measures what the draw adds)")
    g.add_argument("--dynamic-sampling", type=int, default=0, metavar="MAX_GROUPS", help="drop groups without "
                   "signal and draw more, --tasks-per-step at a time, until --tasks-per-step have signal or "
                   "MAX_GROUPS (a multiple of --tasks-per-step) were drawn; 0 = off")
    g.add_argument("--overlong", default="keep", choices=["keep", "mask", "penalty"], help="episodes cut at "
                   "--max-len: keep (the verifier's reward), mask (in their group's statistics, out of the loss), "
                   "penalty (reward - --overlong-penalty)")
    g.add_argument("--overlong-penalty", type=float, default=1.0, help="what --overlong penalty subtracts")
    g.add_argument("--tis-cap", type=float, default=0.0, help="truncated importance weight cap (0 = off)")
    g.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL penalty to the initial policy (0 = off)")
    g.add_argument("--echo-coef", type=float, default=0.0, help="ECHO: weight of the observation NLL of the "
                   "policy's own rollouts (0.05 in its reference setting)")
    g.add_argument("--echo-payload-only", action="store_true", help="ECHO on the environment's own text only, not "
                   "the protocol's fixed wrapper text and end-of-turn tokens")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=135)
    g.add_argument("--lr", type=float, default=1e-6, help="constant learning rate")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--adam-betas", type=float, nargs=2, default=[0.9, 0.999], metavar=("B1", "B2"), help="AdamW betas")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group(common.EXECUTION, "how the run computes, not what: free to change on --resume")
    g.add_argument("--concurrency", type=int, default=64, help="sandboxes live at once per rank")
    g.add_argument("--micro-tokens", type=int, default=32768, help="token budget of a micro-batch (rows x length)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="autocast and engine dtype; "
                   "auto = bf16 on CUDA and on a CPU where it measures faster than fp32 (common.resolve_dtype)")
    g.add_argument("--grad-ckpt", action="store_true")
    g.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP under torchrun")
    g.add_argument("--gpu-memory", type=float, default=0.35, help="GPU memory share of the vLLM engine")
    g.add_argument("--kv-cache-gb", type=float, help="vLLM's KV cache on CPU (GiB); default: room for "
                   "--concurrency sequences of --max-len tokens")
    common.add_run_flags(p, "curves.png, ", save_every=10)
    return p


# ----------------------------------------------------------------------------------------------------------
# The objective

def collate(examples, pad_id):
    """Episodes (dicts of per-token lists: ids, roles, wrapper, adv, behav, [old, ref], and under a grammar
    forced, with the masks and mask_ids) -> right-padded (B, T) tensors (PROMPT on padding, so padding never
    carries loss), and under a grammar mask_table and mask_row (engine.mask_batch)."""
    out = common.collate([(e["ids"], e["roles"]) for e in examples], pad_id)  # input_ids, roles, attention_mask
    out.update(engine.mask_batch(examples, out["input_ids"].shape))
    for key, dtype in (("wrapper", torch.bool), ("forced", torch.bool), ("adv", torch.float32),
                       ("behav", torch.float32), ("old", torch.float32), ("ref", torch.float32)):
        if key in examples[0]:
            out[key] = torch.zeros(out["input_ids"].shape, dtype=dtype)
            for b, e in enumerate(examples):
                out[key][b, :len(e[key])] = torch.as_tensor(e[key], dtype=dtype)
    return out


def echo_mask(roles, wrapper, payload_only):
    """roles, wrapper (..., T) -> (..., T-1) bool: the positions whose next token carries the ECHO loss, OBS
    tokens (only the environment's own text when payload_only)."""
    m = roles[..., 1:] == OBS
    return m & ~wrapper[..., 1:] if payload_only else m


def selected_rows(model, batch, temperature, echo):
    """Hidden states of the positions that carry loss: those predicting ACTION tokens (scaled by 1/T: the head gives
    logits / T) but the forced ones (a grammar allowed them alone) and, where echo, OBS tokens (at T = 1: the model's
    own prediction of the environment). -> (rows (N, H), targets (N,), is_act (N,), row (N,) sequence, sel (B, T-1))."""
    ids, roles = batch["input_ids"], batch["roles"]  # (B, T)
    hidden = model.base_model(input_ids=ids, attention_mask=batch["attention_mask"],
                              use_cache=False).last_hidden_state  # (B, T, H)
    is_act = roles[:, 1:] == ACTION  # (B, T-1): the role of the token each position predicts
    if "forced" in batch:
        is_act &= ~batch["forced"][:, 1:]
    sel = is_act | (roles[:, 1:] == OBS) & echo
    h, act = hidden[:, :-1][sel], is_act[sel]  # (N, H), (N,)
    scale = torch.where(act, 1.0 / temperature, 1.0).to(h.dtype)
    row = torch.arange(len(ids), device=ids.device)[:, None].expand_as(sel)[sel]
    return h * scale[:, None], ids[:, 1:][sel], act, row, sel


def loss_tokens(example):
    """How many of an example's tokens carry the policy-gradient loss: its action tokens but the forced ones."""
    forced = example.get("forced") or [False] * len(example["roles"])
    return sum(r == ACTION and not f for r, f in zip(example["roles"][1:], forced[1:]))


def clip_range(args):
    """-> (1 - eps_low, 1 + eps_high): the interval the importance ratio is clipped to."""
    low = args.clip if args.clip_low is None else args.clip_low
    high = args.clip if args.clip_high is None else args.clip_high
    return 1 - low, 1 + high


def loss_coefs(args):
    """The weight of each term of the loss (the module docstring's L): the policy gradient's, the KL's, ECHO's.
    pg_loss sums its terms with these and may_skip reads them, so a term added to both reaches every example."""
    return {"pg": 1.0, "kl": args.kl_coef, "echo": args.echo_coef}


def may_skip(example, coefs):
    """Whether pg_loss adds nothing on `example`, so it need not be forwarded: its advantage is 0 at every token
    (a group without signal: the policy-gradient term is 0) and every other term weighs 0."""
    return not any(example["adv"]) and not any(c for term, c in coefs.items() if term != "pg")


def pg_loss(model, batch, args, coefs, n_tok, n_seq, n_echo):
    """-> (this micro-batch's part of the step's loss, stats of sums): the objective of the module docstring, a sum
    of per-token terms, each a function of its own token's log-prob, so head.token_loss forms the head's gradients
    in the forward pass (the chunked head: the (N, V) logits never exist). coefs: loss_coefs, each term's weight.
    n_tok, n_seq, n_echo: the normalisers, the step's action tokens, sequences and sequences with ECHO tokens."""
    echo = echo_mask(batch["roles"], batch["wrapper"], args.echo_payload_only) & (coefs["echo"] != 0)  # (B, T-1)
    h, targets, act, row, sel = selected_rows(model, batch, args.temperature, echo)
    a_row, o_row = row[act], row[~act]

    def at_rows(key):  # a (B, T) per-token field at the selected positions, (N,)
        return batch[key][:, 1:][sel]
    adv, behav = at_rows("adv"), at_rows("behav")
    old = at_rows("old") if "old" in batch else None  # None: the trainer before this step's first update is this one
    ref = at_rows("ref") if "ref" in batch else None
    w = torch.zeros(len(targets), device=h.device)  # (N,): n_i on action rows, ECHO's weight on observation rows
    if args.loss_norm == "token":
        w[act] = 1.0 / n_tok
    elif args.loss_norm == "sequence":
        w[act] = 1.0 / (torch.bincount(a_row, minlength=len(sel)).float()[a_row] * n_seq)
    else:  # constant (Dr. GRPO): every action token weighs the same, however long its sequence
        w[act] = 1.0 / (args.max_len * n_seq)
    w[~act] = coefs["echo"] / (torch.bincount(o_row, minlength=len(sel)).float()[o_row] * max(n_echo, 1))

    def act_parts(lp, i):  # the objective's parts at action rows i (indices into the N rows), lp their log-probs
        o = old[i] if old is not None else lp.detach()
        if args.tis_cap > 0:
            ratio, w_is = (lp - o).exp(), (o - behav[i]).exp().clamp(max=args.tis_cap)
        else:
            ratio, w_is = (lp - behav[i]).exp(), torch.ones_like(o)
        unclipped, clipped = ratio * adv[i], ratio.clamp(*clip_range(args)) * adv[i]
        d_ref = ref[i] - lp if ref is not None else torch.zeros_like(lp)  # log pi_init - log pi
        k3 = d_ref.exp() - d_ref - 1
        flows = unclipped <= clipped  # the min takes the unclipped branch: the gradient flows through the ratio
        return {"pg": -coefs["pg"] * w[i] * w_is * torch.minimum(unclipped, clipped), "kl": coefs["kl"] * w[i] * k3,
                "k3": k3, "d_ref": d_ref, "w_is": w_is, "old": o, "flows": flows}

    def terms(lp, rows):  # (c,) the loss of rows `rows`, each row's from its own log-prob
        a = act[rows]
        t = torch.zeros_like(lp)
        p = act_parts(lp[a], a.nonzero().squeeze(1) + rows.start)
        t[a] = p["pg"] + p["kl"]
        t[~a] = -w[rows][~a] * lp[~a]
        return t
    W = model.get_output_embeddings().weight
    loss, logp_all, ent = head.token_loss(h, W, targets, terms, entropy=True,  # (), (N,) at T or 1, (N,)
                                            allowed=engine.allowed_rows(batch, sel))
    p, obs_logp = act_parts(logp_all[act], act.nonzero().squeeze(1)), logp_all[~act]  # the stats, detached
    pg, echo_term = p["pg"].sum(), -(w[~act] * obs_logp).sum()
    stats = {"loss": loss.item(), "pg_loss": pg.item(), "echo_loss": echo_term.item(), "act_tokens": int(act.sum()),
             "entropy_sum": float(ent[act].sum()), "kl_init_sum": float(-p["d_ref"].sum()),
             "kl_init_k3_sum": float(p["k3"].sum()), "mismatch_sum": float((behav[act] - p["old"]).sum()),
             "mismatch_abs_sum": float((behav[act] - p["old"]).abs().sum()),
             "clipped_sum": float((~p["flows"] & (adv[act] != 0)).sum()), "tis_w_sum": float(p["w_is"].sum()),
             "obs_tokens": len(obs_logp), "obs_nll_sum": float(-obs_logp.sum())}
    return loss, stats


def action_logprobs(model, batch, args):
    """-> (B, T-1) the log-prob (at T) of each next token that is an action under `model`, 0 elsewhere."""
    no_echo = torch.zeros_like(batch["wrapper"][:, 1:])  # (B, T-1)
    h, targets, act, row, sel = selected_rows(model, batch, args.temperature, no_echo)
    logp, _ = head.token_logprobs(h, model.get_output_embeddings().weight, targets,
                                    allowed=engine.allowed_rows(batch, sel))
    full = torch.zeros(sel.shape, dtype=torch.float32, device=logp.device)
    full[sel] = logp
    return full


def empty_example(pad_id):
    """A 1-token example that carries no loss: a rank without examples left forwards it, so that every rank runs as
    many forward passes (the collectives of DDP and FSDP2 require it)."""
    return {"ids": [pad_id], "roles": [PROMPT], "behav": [0.0], "wrapper": [False], "adv": [0.0]}


@torch.no_grad()
def policy_logprobs(model, examples, args, pad_id, device, ctx, trainer=False):
    """Per-token log-probs (at T) of each example's tokens under `model` (a list per example, 0 where a token is not
    an action), e.g. the initial policy's for the KL, or with trainer=True the trainer's before a multi-epoch step:
    `model` is then the wrapped common.LossModule, whose forward gathers FSDP2's shards, and every rank runs as
    many forwards, one on an empty example where it has none."""
    lengths = [len(e["ids"]) for e in examples]
    out = []
    for g in (common.rank_micro_batches(lengths, args.micro_tokens, device) if trainer else
              common.micro_batches(lengths, args.micro_tokens)):
        rows = [examples[i] for i in g] or [empty_example(pad_id)]
        batch = {k: v.to(device) for k, v in collate(rows, pad_id).items()}
        with ctx:
            full = model(batch, args, fn=action_logprobs) if trainer else action_logprobs(model, batch, args)
        for j, i in enumerate(g):
            out.append((i, [0.0] + full[j, : len(examples[i]["ids"]) - 1].tolist()))
    return [lp for _, lp in sorted(out)]


def train_batch(model, ref, opt, examples, args, pad_id, device, ctx, step, log):
    """--ppo-epochs optimizer steps of `model` (common.LossModule of pg_loss around the policy) on this rank's
    examples; ref: the initial policy. -> (stats summed over the first epoch's micro-batches, grad norm of the
    last update or None). The normalisers count every example of every rank; those pg_loss adds nothing on
    (may_skip) are not forwarded. With none left on any rank nothing runs, no optimizer step either: Adam's moments
    would move the weights on the memory of earlier gradients (and weight decay shrink them) with a gradient of 0."""
    coefs = loss_coefs(args)
    n_echo = sum(bool(echo_mask(torch.tensor(ex["roles"]), torch.tensor(ex["wrapper"]), args.echo_payload_only).any())
                 for ex in examples) if coefs["echo"] != 0 else 0
    n_tok, n_seq, n_echo = common.all_reduce([sum(map(loss_tokens, examples)), len(examples), n_echo], device)
    examples = [ex for ex in examples if not may_skip(ex, coefs)]
    if common.all_reduce([len(examples)], device)[0] == 0:
        return {"episodes_trained": 0}, None
    for ex, lp in zip(examples, policy_logprobs(ref, examples, args, pad_id, device, ctx) if examples else []):
        ex["ref"] = lp
    if args.ppo_epochs > 1 and args.tis_cap > 0:  # the trainer before the step's first update, on every rank
        for ex, lp in zip(examples, policy_logprobs(model, examples, args, pad_id, device, ctx, trainer=True)):
            ex["old"] = lp
    tot = {"episodes_trained": len(examples)}
    for epoch in range(args.ppo_epochs):
        st = common.micro_batch_passes(model, [len(ex["ids"]) for ex in examples],
                                       lambda g: collate([examples[i] for i in g] or [empty_example(pad_id)], pad_id),
                                       (args, coefs, max(n_tok, 1), max(n_seq, 1), n_echo), args, device, ctx)
        if epoch == 0:
            tot.update(st)
        gnorm = common.optimizer_step(model, opt, args.grad_clip, step, log)
    return tot, gnorm


# ----------------------------------------------------------------------------------------------------------
# Episodes to examples: the step's draws, rewards and advantages

def step_groups(n_tasks, tasks_per_step, step, seed, draw=0):
    """Task indices of one draw of a step: without replacement within a draw, seeded by (seed, step) for the
    first draw and (seed, step, draw) for dynamic sampling's further ones, so a resumed run draws the same."""
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
                               max_len=args.max_len, seed=step_seed(args.seed, step, rank, draw), grammar=args.grammar)
    with engine.engine_threads():
        episodes = envs.run_episodes([tasks[g] for g in groups for _ in range(args.group_size)], policy,
                                     max_turns=args.max_turns, concurrency=args.concurrency, template=template,
                                     on_episode=lambda i, e: bar.update(), stats=gen, network=args.network)
    bar.close()
    return episodes


def group_rewards(episodes, args):
    """Episodes of consecutive groups (--group-size each) -> (rewards, valid, trains), (G, S) each: the verifier's
    rewards, less --overlong-penalty for an episode cut at --max-len under --overlong penalty; valid: not an
    infrastructure failure (those are out of the group's statistics); trains: the valid episodes the loss sees."""
    cut = torch.tensor([e.truncated for e in episodes]).view(-1, args.group_size)  # (G, S)
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32).view(-1, args.group_size)
    if args.overlong == "penalty":
        rewards = rewards - args.overlong_penalty * cut
    valid = torch.tensor([e.failure not in envs.INFRA_FAILURES for e in episodes]).view(-1, args.group_size)
    return rewards, valid, valid & ~cut if args.overlong == "mask" else valid


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
    training examples: an episode's per-token lists (ids, roles, behav: the vLLM log-probs, wrapper, adv:
    token_advantages; under a grammar its masks, mask_ids and forced tokens, which carry no loss)."""
    groups = [[] for _ in range(len(adv))]
    for i, e in enumerate(episodes):
        g, j = divmod(i, adv.shape[1])
        if trains[g, j] and ACTION in e.roles:
            ex = {"ids": e.token_ids, "roles": e.roles, "behav": e.logprobs, "wrapper": e.obs_wrapper,
                  "adv": token_advantages(e, float(adv[g, j]), engine.reply_spans(e.roles))}
            if e.masks:  # decoded under a grammar
                ex.update(masks=e.masks, mask_ids=e.mask_ids, forced=engine.forced_tokens(e.masks, e.mask_ids))
            groups[g].append(ex)
    return groups


# ----------------------------------------------------------------------------------------------------------
# The run

RESUME_KEYS = common.resume_keys(get_parser())  # the flags that fix what the run computes


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
    run = common.start_run(args, RESUME_KEYS)
    if run is None:
        return
    rank, world, device, out, ckpt, state, print0 = run
    if args.tasks_per_step % world:
        raise ValueError(f"--tasks-per-step {args.tasks_per_step} must be a multiple of the {world} ranks")

    tok = load_tokenizer(ckpt or args.init, "native" if ckpt else args.chat_template)
    template = terminus.load_template(args.prompt_template)
    tasks = load_tasks(args.tasks, args.kinds)
    ctx, dtype, why = common.autocast(args.dtype, device)
    raw = common.load_model(ckpt or args.init, device)
    # the initial policy, for the KL from init: a full copy per rank, in the autocast dtype
    ref = common.load_model(args.init, device).to(dtype).requires_grad_(False).eval()
    model = common.wrap_model(common.LossModule(pg_loss, raw), raw, args, device)
    opt = common.adamw(model, args)
    start = common.load_optimizer_state(model, opt, state, args.fsdp)
    os.environ.update(engine.IN_PROCESS_ENV)  # vLLM's engine in this process: the weight sync hands it tensors
    llm = engine.make_engine(ckpt or args.init, max_model_len=args.max_len, seed=args.seed, max_seqs=args.concurrency,
                             dtype="bf16" if dtype == torch.bfloat16 else "fp32", gpu_memory=args.gpu_memory,
                             kv_cache_gb=args.kv_cache_gb)
    log = common.open_run_log(out, args, start, rank, compute_dtype={"dtype": str(dtype), "why": why})
    print0(f"{len(tasks)} tasks | {sum(p.numel() for p in raw.parameters()) / 1e6:.1f}M params | {args.steps} steps "
           f"x {args.tasks_per_step} tasks x {args.group_size} episodes | {str(dtype)[6:]} ({why}) | world {world} | "
           + (f"resumed at step {start}" if start else "fresh start"))

    raw.train()
    per_rank = args.tasks_per_step // world  # this rank's groups of a draw
    for step in range(start, args.steps):
        t0, gen = time.time(), Counter()  # gen: the generator's wall / busy / idle seconds over the step's draws
        episodes, advs, valid, has_signal, examples, kept = [], [], [], [], [], 0
        for draw in range(max(args.dynamic_sampling // args.tasks_per_step, 1)):  # one, or --dynamic-sampling's
            groups = step_groups(len(tasks), args.tasks_per_step, task_step(step, args.steps, args.redraw), args.seed,
                                 draw)[rank * per_rank: (rank + 1) * per_rank]
            # rollout -> rewards -> advantages -> examples
            eps = draw_episodes(llm, tok, tasks, template, args, step, rank, gen, draw, groups)
            rewards, ok, trains = group_rewards(eps, args)  # (G, S) each
            adv, sig = group_advantages(rewards, ok, args.scale_std)  # (G, S), (G,)
            by_group = group_examples(eps, adv, trains)
            episodes, advs, valid, has_signal = episodes + eps, advs + [adv], valid + [ok], has_signal + [sig]
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
        tot, gnorm = train_batch(model, ref, opt, examples, args, tok.pad_token_id, device, ctx, step, print0)
        t_train = time.time()
        # sync: the new weights into the engine (a step without an update leaves them as they are)
        if device.type == "cuda":
            llm.wake_up()
        checksum, t_gather = engine.sync_weights(llm, raw) if gnorm is not None else (None, 0.0)
        t_sync = time.time()
        # log: one row a step, summed over ranks; save: a checkpoint every --save-every steps
        times = {"rollout": t_roll - t0, "train": t_train - t_roll, "sync": t_sync - t_train, "sync_gather": t_gather,
                 "step": t_sync - t0}
        rec, lost = steplog.step_record(step, task_step(step, args.steps, args.redraw), episodes, torch.cat(valid),
                                        torch.cat(has_signal), tot, gnorm, gen, times, args, device, checksum)
        log.write(rec)
        print0(steplog.step_line(rec, args, lost))
        if rank == 0:  # a solved and a failed episode to read
            steplog.write_transcripts(out / "transcripts", step + 1, episodes, torch.cat(advs).flatten().tolist(),
                                      args.group_size)
        done = step + 1
        if (args.save_every and done % args.save_every == 0) or done == args.steps:
            common.save_checkpoint(out / f"step-{done:06d}", model, raw, tok, opt, done, args, rank, rng=False)
            common.prune_checkpoints(out, args.keep, rank)
            if rank == 0:
                common.plot_log(out / "log.jsonl", out / "curves.png", steplog.CURVES)
    common.save_checkpoint(out / "final", model, raw, tok, None, args.steps, args, rank)  # weights + tokenizer only
    print0(f"final model: {out / 'final'}")
    log.close()
    del llm  # the engine's shutdown also tears down the process group it joined (torchrun): before ours, not after
    gc.collect()
    common.close_distributed()


if __name__ == "__main__":
    common.run_cli(main)
