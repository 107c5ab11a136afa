"""
Benchmark GRPO's update time (grpo.train_batch: the KL reference's forward, the loss's forward and backward, the
optimizer step) with grpo.pg_loss, whose objective is tensor code on the chunked head's differentiable log-probs
(head.token_logprobs: the backward recomputes each chunk's logits), against the same objective as per-token terms
through head.token_loss (the head's gradients formed in its forward pass, no recompute: how grpo.py computed the loss
before it was written on log-probs; only a sum of per-token terms fits it). Both from the same weights on the same
synthetic step (bench.grpo_micro's toy-world-shaped episodes) under the ablation's recipe (a KL term, one episode a
pass), at the toy world's vocabulary and at Qwen3's (151,936), with the base model's hidden size. The rounds
interleave the two ways; the ratio is of their median update times in this run; the step's loss by each and the
largest difference of the updated weights show both took the same step.

    python -m bench.grpo_update                                     # V 4,096 (32 episodes) and 151,936 (8)
    python -m bench.grpo_update --vocab 151936 --episodes 4 --rounds 5
    nice -n 15 python -m bench.grpo_update --clock cpu             # on a machine other jobs share

Time: wall-clock seconds, or with --clock cpu this process's CPU seconds (all its threads), which other processes'
load disturbs far less.
"""
import argparse
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

import grpo
from actobs import batches, common, head, tiny
from bench.grpo_micro import synthetic_examples, trainer


def get_parser():
    p = argparse.ArgumentParser(description="GRPO's update time: its loss on the head's log-probs (recompute in the "
                                            "backward) vs per-token terms with the head's gradients in the forward")
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 151936], help="vocabulary sizes")
    p.add_argument("--episodes", type=int, nargs="+", default=[32, 8], help="episodes of the step, one per --vocab")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both ways (median reported)")
    p.add_argument("--tokens", type=int, nargs=2, default=[700, 2200], help="range of an episode's tokens")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="grpo.py's --dtype")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="wall-clock or this process's CPU seconds")
    return p


def per_token_loss(lm, batch, obj, norm):
    """grpo.pg_loss's objective as a sum of per-token terms, each a function of its own row's log-prob, so that
    head.token_loss forms the head's gradients in its forward pass. -> (the loss, {"loss": its value})."""
    echo = grpo.echo_mask(batch["roles"], batch["wrapper"], obj.echo_payload_only) & (obj.weights["echo"] != 0)
    r = batches.selected_rows(lm, batch, obj.temperature, echo)
    act, B = r.act, len(batch["input_ids"])  # (N,)
    counts = torch.bincount(r.seq[act], minlength=B)[r.seq]  # (N,) the action rows of each row's sequence
    n = {"token": torch.full(act.shape, 1.0 / norm.act_tokens), "sequence": 1.0 / (counts * norm.seqs),
         "constant": torch.full(act.shape, 1.0 / (obj.max_len * norm.seqs))}[obj.loss_norm]  # (N,) n_i
    echo_w = obj.weights["echo"] / (torch.bincount(r.seq[~act], minlength=B)[r.seq] * max(norm.echo_seqs, 1))

    def terms(lp, rows):  # (c,) the terms of rows `rows` from their log-probs lp (c,)
        a = act[rows]
        logp, behav, adv, n_a = lp[a], r.behav[rows][a], r.adv[rows][a], n[rows][a]  # (n,) each
        old = r.old[rows][a] if r.old is not None else logp.detach()
        if obj.tis_cap > 0:
            rho, w = (logp - old).exp(), (old - behav).exp().clamp(max=obj.tis_cap)
        else:
            rho, w = (logp - behav).exp(), torch.ones_like(logp)
        surrogate = torch.minimum(rho * adv, rho.clamp(1 - obj.clip_low, 1 + obj.clip_high) * adv)
        d = r.ref[rows][a] - logp if r.ref is not None else torch.zeros_like(logp)
        t = torch.zeros_like(lp)
        t[a] = -obj.weights["pg"] * n_a * w * surrogate + obj.weights["kl"] * n_a * (d.exp() - d - 1)
        t[~a] = -echo_w[rows][~a] * lp[~a]  # ECHO, at T = 1
        return t

    loss, _, _ = head.token_loss(r.h, lm.get_output_embeddings().weight, r.targets, terms, entropy=True,
                                 allowed=batches.allowed_rows(batch, r.sel))
    return loss, {"loss": loss.item()}


LR = 1e-4  # the ablation's recipe: lr, a KL term, one episode a pass
RECIPE = ["--lr", str(LR), "--kl-coef", "0.05", "--micro-tokens", "1"]
WAYS = {"per-token terms, head's grads in forward": per_token_loss, "grpo.pg_loss on log-probs": grpo.pg_loss}


def update(model_dir, examples, loss, dtype, clock):
    """One grpo.train_batch of the ablation's recipe from the weights in model_dir, its loss computed by `loss`.
    -> (seconds on clock, the step's loss, the updated weights)."""
    args, ctx, lm, init_lm, wrapped, opt = trainer(model_dir, [*RECIPE, "--dtype", dtype])
    device = torch.device("cpu")
    with mock.patch.object(grpo, "pg_loss", loss):
        t = clock()
        tot, _ = grpo.train_batch(wrapped, init_lm, opt, examples, grpo.objective(args), 0, device, ctx, 0, print,
                                  ppo_epochs=args.ppo_epochs, micro_tokens=args.micro_tokens,
                                  grad_clip=args.grad_clip, fsdp=False)
        seconds = clock() - t
    return seconds, tot["loss"], {k: v.detach().clone() for k, v in lm.state_dict().items()}


def bench_vocab(V, episodes, args, out, clock):
    """Both ways at vocabulary V: -> a dict of the median seconds, their ratio, the step's loss by each and the updated
    weights' largest difference in units of the learning rate (Adam's first step moves a weight by about lr, either
    way: 2 where a gradient element near 0 has another sign in the other way's rounding)."""
    from transformers import Qwen3ForCausalLM
    model_dir = out / f"v{V}"
    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny.tiny_config(V, 256, 4, 4, 2)).save_pretrained(model_dir)  # the base model's shape
    examples = [batches.Example(**ex, behav=None) for ex in
                synthetic_examples(random.Random(0), episodes, args.group_size, args.tokens, V)]
    # the behaviour log-probs: the policy's own (the importance ratio starts at 1, as after a rollout)
    ctx = common.autocast(args.dtype, torch.device("cpu"))[0]
    behav = batches.policy_logprobs(common.load_model(model_dir, torch.device("cpu")), examples, 1.0, 1, 0,
                                    torch.device("cpu"), ctx)
    examples = [dataclasses.replace(ex, behav=b) for ex, b in zip(examples, behav)]
    times, losses, weights = {name: [] for name in WAYS}, {}, {}
    for r in range(args.rounds):
        line = []
        for name, loss in WAYS.items():
            t, losses[name], weights[name] = update(model_dir, examples, loss, args.dtype, clock)
            times[name].append(t)
            line.append(f"{name}: {t:.1f} s")
        print(f"V {V:,} round {r}: " + " | ".join(line), flush=True)
    a, b = weights.values()
    before, after = (statistics.median(t) for t in times.values())
    return {"vocab": V, "episodes": episodes, "tokens": sum(len(e.ids) for e in examples),
            "action tokens": sum(grpo.loss_tokens(e) for e in examples),
            "before: per-token terms (s)": round(before, 2), "after: grpo.pg_loss (s)": round(after, 2),
            "after / before": round(after / before, 3), "loss": list(losses.values()),
            "max |weight difference| / lr": max(float((a[k] - b[k]).abs().max()) for k in a) / LR}


def main(argv=None):
    args = get_parser().parse_args(argv)
    if len(args.episodes) != len(args.vocab):
        raise SystemExit("--episodes needs one value per --vocab")
    out = Path(tempfile.mkdtemp(prefix="bench_grpo_update_"))
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    dtype, why = common.resolve_dtype(args.dtype, torch.device("cpu"))
    print(f"{os.cpu_count()} cores | {torch.get_num_threads()} threads | {dtype} ({why}) | {args.clock} clock | "
          f"head.CHUNK_BYTES {head.CHUNK_BYTES / 2**20:.0f} MiB", flush=True)
    for V, n in zip(args.vocab, args.episodes):
        print(json.dumps(bench_vocab(V, n, args, out, clock)), flush=True)


if __name__ == "__main__":
    main()
