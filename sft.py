"""
ActObs SFT: supervise the agent's actions AND the environment's observations in terminal trajectories.

    L_lam = -[ sum_{i in A} log p(y_i | y_<i) + lam * sum_{i in O} log p(y_i | y_<i) ] / (|A| + lam |O|)

per trajectory, averaged over the batch; the prompt (system + first user turn) is masked. lam=0 is ActionSFT,
lam=1 is ActObs, `--schedule obs-then-act` trains an observation-only phase, then an action-only phase.

CPU toy run (tiny random Qwen3 + a tokenizer trained on the data, no downloads):
    python sft.py --model tiny --data data/corpus/sft.jsonl --out runs/actobs --lr 1e-3 --batch-size 8
1 GPU:
    python sft.py --model Qwen/Qwen3-4B --data nemotron.jsonl --out runs/q4b-actobs --max-len 16384
8 GPUs (FSDP2 shards params, grads and optimizer state):
    torchrun --standalone --nproc_per_node 8 sft.py --model Qwen/Qwen3-4B --data nemotron.jsonl \
        --out runs/q4b-actobs --max-len 16384 --fsdp --grad-ckpt
Resume an interrupted run: the same command plus --resume. Several runs in one process, the imports paid once
(common.run_cli): `python sft.py ARGS ::: ARGS ...`.
"""
import argparse
import dataclasses
import math
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

from actobs import common, geometry, head, runlog, tiny
from actobs.labels import ACTION, OBS, PROMPT, load_tokenizer, read_trajectories, render


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data", required=True, help="trajectories, {'conversations'|'messages': [{role, content}]} "
                   "rows: a JSONL file (or JSON array), a parquet file, or a Hugging Face dataset id ID[:SPLIT] (e.g. "
                   "nvidia/Nemotron-Terminal-Corpus)")
    g.add_argument("--max-len", type=int, default=16384, help="truncate trajectories to this many tokens")
    g.add_argument("--val-size", type=int, default=16, help="trajectories held out for evaluation")
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, help="HF model dir/id, or 'tiny': a random ~4M-param Qwen3 with a "
                   "tokenizer trained on --data")
    g.add_argument("--chat-template", default="prefix", help="'prefix' (prefix-preserving ChatML, Qwen family), "
                   "'native' (the tokenizer's own), or a .jinja path")
    g = p.add_argument_group("objective")
    g.add_argument("--lam", type=float, default=1.0, help="observation weight lambda (0 = ActionSFT, 1 = ActObs)")
    g.add_argument("--schedule", default="mixed", choices=["mixed", "obs-then-act"], help="obs-then-act: "
                   "observation-only epochs, then action-only epochs, each phase with its own warm-up, cosine and "
                   "fresh Adam moments (--lam ignored)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=1, help="passes over the data (per phase with obs-then-act)")
    g.add_argument("--batch-size", type=int, default=64,
                   help="trajectories per optimizer step (global, across ranks)")
    g.add_argument("--lr", type=float, default=1e-5, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.0, help="final lr as a fraction of --lr (cosine floor)")
    g.add_argument("--warmup-ratio", type=float, default=0.03, help="fraction of steps of linear warm-up")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW decoupled weight decay")
    g.add_argument("--adam-betas", type=float, nargs=2, default=[0.9, 0.95], metavar=("B1", "B2"), help="AdamW betas")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    g.add_argument("--seed", type=int, default=0, help="seeds the init of --model tiny, the split and the data order")
    g = p.add_argument_group("execution", "how the run computes, not what: free to change on --resume")
    g.add_argument("--skip-bad", action="store_true", help="skip (and count) malformed rows instead of stopping")
    g.add_argument("--micro-tokens", type=int, default=32768, help="token budget of one micro-batch per rank "
                   "(padded batch x length); on CPU 1 (a pass per trajectory, no padding) is faster: "
                   "bench/sft_micro.py")
    g.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="autocast dtype; auto = bf16 on CUDA, and on a CPU where bf16 measures faster than fp32 "
                   "(common.resolve_dtype), else fp32")
    g.add_argument("--grad-ckpt", action="store_true",
                   help="gradient checkpointing (recompute activations in backward)")
    g.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP under torchrun")
    g = common.add_run_flags(p, "", save_every=200)
    g.add_argument("--eval-every", type=int, default=50,
                   help="held-out action/obs NLL every N steps (0 = only at the end)")
    g.add_argument("--probe-every", type=int, default=0, help="log the action/obs gradient cosine and norm ratio "
                   "(probes.py) on held-out batches every N steps; single process")
    g.add_argument("--stop-after", type=int, default=0, help="stop (with a checkpoint) once the run reaches this "
                   "step, keeping the full run's schedule; for time-sliced jobs")
    return p


# What --resume lets change: how the run computes, where it writes and what it logs. Every other flag must be the
# checkpoint's (common.resume_point), a new one too unless it is added here.
FREE_ON_RESUME = ("skip_bad", "micro_tokens", "dtype", "grad_ckpt", "fsdp", *common.RUN_FLAGS, "eval_every",
                  "probe_every", "stop_after")


# ----------------------------------------------------------------------------------------------------------
# Batching and the loss

def loss_denominator(roles, lam, w_act=1.0):
    """w_act |A| + lam |O| of one trajectory; token 0 is never predicted, so it never counts."""
    r = np.asarray(roles[1:])
    return w_act * int((r == ACTION).sum()) + lam * int((r == OBS).sum())


def actobs_loss(model, batch, lam, w_act=1.0, n_traj=None, chunk=None):
    """-> (loss, stats). loss = sum over the batch's trajectories of -sum_i w_i log p_i / sum_i w_i, the token
    weights w_i w_act on actions and lam on observations: -[w_act sum_A log p + lam sum_O log p] / (w_act |A| +
    lam |O|), divided by n_traj (default: the number of trajectories with a non-zero denominator here; pass the whole
    step's count when accumulating). Log-probs come from the final hidden states through head.token_loss: the
    (tokens, vocab) logits are never materialised. stats: per-token action and observation NLL (sums, counts, means),
    whatever lam is."""
    ids, roles = batch["input_ids"], batch["roles"]  # (B, T)
    B = ids.shape[0]
    hidden = model.base_model(input_ids=ids, attention_mask=batch["attention_mask"],
                              use_cache=False).last_hidden_state  # (B, T, H)
    tgt_roles = roles[:, 1:]  # (B, T-1): role of the token each position predicts
    sel = tgt_roles != PROMPT  # (B, T-1)
    h = hidden[:, :-1][sel]  # (N, H): only supervised positions reach the head
    targets = ids[:, 1:][sel]  # (N,)
    r = tgt_roles[sel]  # (N,)
    traj = torch.arange(B, device=ids.device)[:, None].expand_as(sel)[sel]  # (N,) trajectory of each token
    is_act, is_obs = r == ACTION, r == OBS
    w = torch.where(is_act, w_act, lam)  # (N,) each supervised token's weight
    denom = torch.zeros(B, device=w.device).index_add_(0, traj, w)  # (B,) each trajectory's sum of weights
    valid = denom > 0
    n = float(n_traj) if n_traj is not None else max(int(valid.sum()), 1)
    tok_w = w / denom.clamp(min=1e-12)[traj] / n  # (N,); 0 where denom = 0
    loss, logp, _ = head.token_loss(h, model.get_output_embeddings().weight, targets,
                                    lambda lp, rows: -tok_w[rows] * lp, chunk=chunk)  # (), (N,)
    nll = -logp
    stats = {"act_nll_sum": nll[is_act].sum().item(), "act_tokens": int(is_act.sum()),
             "obs_nll_sum": nll[is_obs].sum().item(), "obs_tokens": int(is_obs.sum()), "n_traj": int(valid.sum())}
    stats["act_nll"] = stats["act_nll_sum"] / max(stats["act_tokens"], 1)
    stats["obs_nll"] = stats["obs_nll_sum"] / max(stats["obs_tokens"], 1)
    return loss, stats


# ----------------------------------------------------------------------------------------------------------
# Training loop helpers

def lr_at(step, total, warmup, max_lr, min_ratio):
    """Linear warm-up to max_lr over `warmup` steps, then cosine decay to min_ratio * max_lr at `total`."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    t = (step - warmup) / max(total - warmup, 1)
    return max_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def phase_weights(schedule, lam, step, steps_per_phase):
    """(lam, w_act) of this step under --schedule: mixed, the paper's (--lam, 1), or obs-then-act: obs-only then
    action-only phases (each a full SFT run)."""
    if schedule == "mixed":
        return lam, 1.0
    return (1.0, 0.0) if step < steps_per_phase else (0.0, 1.0)


def step_indices(n, batch_size, step, steps_per_epoch, seed):
    """Trajectory indices of one optimizer step: a seeded permutation per epoch, so a resumed run sees the same."""
    epoch, k = divmod(step, steps_per_epoch)
    perm = np.random.default_rng(seed + epoch).permutation(n)
    return perm[k * batch_size: (k + 1) * batch_size].tolist()


def run_micro_batches(model, examples, pad_id, lam, w_act, n_traj, device, ctx, train, *, micro_tokens, fsdp):
    """Forward (and backward when train) of actobs_loss through `model` (common.LossModule, wrapped; fsdp: under
    FSDP2) over this rank's examples in length-grouped micro-batches of micro_tokens, as many on every rank (an empty
    group: a 1-token pass without loss); -> summed stats, with loss and tokens (the real tokens forwarded). The loss is
    already normalised over the step and every rank, and DDP averages over ranks: each backward is of loss * world."""
    world = common.world_size()
    groups = common.rank_micro_batches([len(ids) for ids, _ in examples], micro_tokens, device)
    tot = dict.fromkeys(STAT_KEYS, 0.0)
    for k, g in enumerate(groups):
        batch = common.collate([examples[i] for i in g] or [([pad_id], [PROMPT])], pad_id)
        batch = {key: v.to(device) for key, v in batch.items()}
        sync = common.grad_sync(model, k == len(groups) - 1, world, fsdp) if train else nullcontext()
        with sync, ctx, (nullcontext() if train else torch.no_grad()):
            loss, st = model(batch, lam, w_act, n_traj, fn=actobs_loss)
            if train:
                (loss * world).backward()
        st = {**st, "loss": loss.item(), "tokens": int(batch["attention_mask"].sum()) if g else 0}
        for key in STAT_KEYS:
            tot[key] += st[key]
    return tot


STAT_KEYS = ("loss", "act_nll_sum", "act_tokens", "obs_nll_sum", "obs_tokens", "n_traj", "tokens")


def reduce_stats(tot, device):
    keys = sorted(tot)
    tot = dict(zip(keys, common.all_reduce([tot[k] for k in keys], device)))
    tot["act_nll"] = tot["act_nll_sum"] / max(tot["act_tokens"], 1)
    tot["obs_nll"] = tot["obs_nll_sum"] / max(tot["obs_tokens"], 1)
    return tot


def render_share(tok, convs, where, max_len, skip_bad, rank, world):
    """This rank's share of the trajectories (every world-th) rendered to (ids, roles), gathered from every rank in
    file order -> (the examples with a token to learn from, rows that did not render (skip_bad; else the error names
    the row), rows with nothing left to learn once cut at max_len: counted, never a NaN)."""
    mine, failed = [], 0
    for i in range(rank, len(convs), world):
        try:
            ids, roles = render(tok, convs[i], max_len)
        except ValueError as e:
            if not skip_bad:
                raise ValueError(f"{where[i]}: {e}") from None
            failed += 1
            continue
        mine.append((i, np.asarray(ids, dtype=np.int32), np.asarray(roles, dtype=np.int8)))  # 5 bytes a token
    if dist.is_initialized():
        parts = [None] * world
        dist.all_gather_object(parts, (mine, failed))
        mine, failed = sorted((x for p, _ in parts for x in p), key=lambda x: x[0]), sum(f for _, f in parts)
    examples = [(ids, roles) for _, ids, roles in mine if (roles[1:] != PROMPT).any()]
    return examples, failed, len(mine) - len(examples)


def check_flags(args):
    """Flag values the parser cannot refuse alone: a clear error before anything is loaded."""
    for bad_flag, msg in ((args.keep < 1, "--keep must be at least 1"), (args.lam < 0, "--lam must be >= 0"),
                          (args.probe_every and common.under_torchrun(), "--probe-every runs in a single process; "
                           "under torchrun, run `probes.py geometry` on the step checkpoints")):
        if bad_flag:
            raise ValueError(msg)


@dataclasses.dataclass
class Data:
    """What main trains on (load_data)."""
    tok: object  # the tokenizer, with the chat template the run renders with
    model_path: object  # where the model starts from (--model; with `tiny`, the random one built in OUT/init)
    train: list  # [(ids, roles)] the training trajectories
    val: list  # [(ids, roles)] the held-out ones (--val-size)
    bad: int  # rows skipped (--skip-bad): unreadable or not rendered
    empty: int  # rows with nothing left to learn once cut at --max-len


def load_data(args, run):
    """--data read and rendered (a share per rank, gathered), the tokenizer (a checkpoint's own chat template when
    resuming), the model to start from, the seeded held-out split."""
    where = []
    convs, bad = read_trajectories(args.data, args.skip_bad, where)
    model_path = args.model
    if args.model == "tiny":
        model_path = run.out / "init"
        if run.rank == 0 and not (model_path / "config.json").exists():
            tiny.build_tiny(model_path, [m["content"] for c in convs for m in c], seed=args.seed)
        common.barrier()
    tok = load_tokenizer(run.ckpt, "native") if run.ckpt else load_tokenizer(model_path, args.chat_template)
    examples, failed, empty = render_share(tok, convs, where, args.max_len, args.skip_bad, run.rank, run.world)
    if len(examples) <= args.val_size:
        raise ValueError(f"{args.data}: {len(examples)} usable trajectories, need more than --val-size {args.val_size}")
    perm = np.random.default_rng(args.seed).permutation(len(examples))
    return Data(tok, model_path, train=[examples[i] for i in perm[args.val_size:]],
                val=[examples[i] for i in perm[: args.val_size]], bad=bad + failed, empty=empty)


def restore_rng(ckpt, rank):
    """This rank's torch (and CUDA) RNG state as the checkpoint saved it: a resumed run draws as the uninterrupted
    one would."""
    rng = torch.load(ckpt / f"rng-{rank}.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"])


def step_row(step, tot, lr, gnorm, lam, w_act, dt, device):
    """A training step's row of log.jsonl (tot: its reduce_stats)."""
    return {"step": step, "train/loss": tot["loss"], "train/act_nll": tot["act_nll"], "train/obs_nll": tot["obs_nll"],
            "train/lr": lr, "train/grad_norm": gnorm, "train/w_act": w_act, "train/lam": lam,
            "train/tokens": tot["tokens"], "train/tok_per_s": tot["tokens"] / dt, "train/step_s": dt,
            **({"train/peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30} if device.type == "cuda" else {})}


def step_line(row, total):
    """A training step's console line."""
    return (f"step {row['step']}/{total} | loss {row['train/loss']:.4f} | act {row['train/act_nll']:.4f} | "
            f"obs {row['train/obs_nll']:.4f} | lr {row['train/lr']:.2e} | gnorm {row['train/grad_norm']:.3f} | "
            f"{row['train/tok_per_s']:.0f} tok/s | {row['train/step_s'] * 1000:.0f} ms")


# ----------------------------------------------------------------------------------------------------------

def main(argv=None):
    args = get_parser().parse_args(argv)
    from tqdm import tqdm

    check_flags(args)
    run = common.start_run(args.out, vars(args), FREE_ON_RESUME, resume=args.resume, fsdp=args.fsdp)
    if run is None:
        return
    rank, world, device = run.rank, run.world, run.device
    torch.manual_seed(args.seed)

    # data -> (ids, roles), rendered a share per rank, held-out split
    d = load_data(args, run)
    tok, model_path, train, val = d.tok, d.model_path, d.train, d.val
    if args.batch_size < world:
        raise ValueError(f"--batch-size {args.batch_size} is smaller than the {world} ranks")
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    steps_per_phase = steps_per_epoch * args.epochs
    total = steps_per_phase * (2 if args.schedule == "obs-then-act" else 1)
    phase_len = steps_per_phase if args.schedule == "obs-then-act" else total  # the lr schedule restarts per phase
    warmup = int(args.warmup_ratio * phase_len)
    stop = min(args.stop_after, total) if args.stop_after else total

    # model, optimizer, resume
    ctx, dtype, why = common.autocast(args.dtype, device)
    raw = common.load_model(run.ckpt or model_path, device)
    model = common.wrap_model(common.LossModule(raw), raw, device, grad_ckpt=args.grad_ckpt, fsdp=args.fsdp)
    opt = common.adamw(model.parameters(), lr=args.lr, betas=args.adam_betas, eps=args.adam_eps,
                       weight_decay=args.weight_decay)
    start = common.load_optimizer_state(model, opt, run.state, args.fsdp)
    if run.state is not None:
        restore_rng(run.ckpt, rank)
    n_params = sum(p.numel() for p in raw.parameters())
    run.print0(f"{len(train)} train / {len(val)} val trajectories ({d.bad} bad rows, {d.empty} with nothing to learn "
           f"skipped) | {n_params / 1e6:.1f}M params | {total} steps x {args.batch_size} traj | warmup {warmup} | "
           f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} ({why}) | world {world} | "
           + (f"resumed at step {start}" if start else "fresh start"))
    log = runlog.open_run_log(run.out, vars(args), start, rank, resume=args.resume, wandb=args.wandb,
                              compute_dtype={"dtype": str(dtype), "why": why})
    record = log.write

    def evaluate(step):
        model.eval()
        tot = run_micro_batches(model, val[rank::world], tok.pad_token_id, 1.0, 1.0, None, device, ctx, train=False,
                                micro_tokens=args.micro_tokens, fsdp=args.fsdp)
        tot = reduce_stats(tot, device)
        model.train()
        record({"step": step, "eval/act_nll": tot["act_nll"], "eval/obs_nll": tot["obs_nll"]})
        if rank == 0:
            tqdm.write(f"step {step}/{total} | eval | act {tot['act_nll']:.4f} | obs {tot['obs_nll']:.4f}")

    def save(step):
        common.save_checkpoint(run.out / f"step-{step:06d}", model, raw, tok, opt, step, vars(args), rank,
                               fsdp=args.fsdp)
        common.prune_checkpoints(run.out, args.keep, rank)  # args.keep >= 1, checked at start

    if args.probe_every:  # the held-out batches the gradient geometry is measured on, built once
        probe_batches = [{k: v.to(device) for k, v in common.collate([val[i] for i in g], tok.pad_token_id).items()}
                         for g in common.micro_batches([len(ids) for ids, _ in val], args.micro_tokens)]

    def probe(step):  # the paper's cos and r curves
        with ctx:
            geo = geometry.grad_geometry(raw, probe_batches)
        record({"step": step, **{f"probe/{k}": v for k, v in geo.items()}})
        tqdm.write(f"step {step}/{total} | probe | cos {geo['cos']:.4f} | r {geo['r']:.3f}")

    model.train()
    if args.probe_every and start == 0:
        probe(0)
    pbar = tqdm(range(start, stop), initial=start, total=total, disable=rank != 0, dynamic_ncols=True)
    for step in pbar:
        t0 = time.time()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if step == steps_per_phase < total:  # obs-then-act: the action phase starts like a new run, with fresh moments
            opt.state.clear()
        lam, w_act = phase_weights(args.schedule, args.lam, step, steps_per_phase)
        lr = lr_at(step % phase_len, phase_len, warmup, args.lr, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = step_indices(len(train), args.batch_size, step, steps_per_epoch, args.seed)
        n_traj = max(sum(loss_denominator(train[i][1], lam, w_act) > 0 for i in idx), 1)  # global: same on all ranks
        tot = run_micro_batches(model, [train[i] for i in idx[rank::world]], tok.pad_token_id, lam, w_act, n_traj,
                                device, ctx, train=True, micro_tokens=args.micro_tokens, fsdp=args.fsdp)
        gnorm = common.optimizer_step(model, opt, args.grad_clip, step, run.print0)
        tot = reduce_stats(tot, device)
        dt = time.time() - t0
        row = step_row(step + 1, tot, lr, gnorm, lam, w_act, dt, device)
        record(row)
        if rank == 0:
            tqdm.write(step_line(row, total))
        done = step + 1
        if args.eval_every and done % args.eval_every == 0 and done != total:
            evaluate(done)
        if args.probe_every and done % args.probe_every == 0:
            probe(done)
        if (args.save_every and done % args.save_every == 0) or done == stop < total:
            save(done)
    pbar.close()
    if args.probe_every:
        geometry.plot_geometry(run.out / "log.jsonl", run.out / "probe_geometry.png")
    if stop == total:
        evaluate(total)
        common.save_checkpoint(run.out / "final", model, raw, tok, None, total, vars(args), rank, fsdp=args.fsdp)
        run.print0(f"final model: {run.out / 'final'}")
    log.close()
    common.close_distributed()


if __name__ == "__main__":
    common.run_cli(main)
