"""
Benchmark how grpo.py should cut a CPU update into forward passes (--micro-tokens): its default packs episodes of
similar length into padded micro-batches of up to 32,768 tokens (rows x longest, the GPU's way), or one episode a
pass (--micro-tokens 1: no padding). Both ways run grpo.train_batch (the KL reference's forward, the loss's forward
and backward, the optimizer step) from the same weights on the same synthetic step: --episodes episodes whose
lengths spread like the toy world's (700-2,200 tokens: a prompt, then replies and terminal outputs), half of the
groups with signal. The rounds interleave the ways; the ratio is of their summed update times in this same run, and
the largest difference of the updated weights between the ways shows that both took the same step.

    python -m bench.grpo_micro                     # 32 episodes (the ablation's 4 x 8), 2 rounds
    python -m bench.grpo_micro --episodes 64 --rounds 3
"""
import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

import grpo
from actobs import batches, common, tiny
from actobs.labels import ACTION, OBS, PROMPT

WAYS = {"padded micro-batches (default)": 32768, "one episode a pass": 1}  # name -> --micro-tokens


def get_parser():
    p = argparse.ArgumentParser(description="GRPO update time on CPU: padded micro-batches or one episode a pass")
    p.add_argument("--episodes", type=int, default=32, help="episodes of the step (groups of --group-size)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both ways")
    p.add_argument("--tokens", type=int, nargs=2, default=[700, 2200], help="range of an episode's tokens")
    return p


def synthetic_examples(rng, n, group_size, tokens, vocab):
    """n training examples' fields (batches.Example's but behav) shaped like the toy world's episodes: a 350-token
    prompt, then replies (~90 tokens, ACTION) and terminal outputs (~120, OBS) up to a length drawn from `tokens`;
    every second group has signal (advantages of +-1 in it), the others 0 (they carry only the KL term)."""
    out = []
    for i in range(n):
        length = rng.randint(*tokens)
        roles = [PROMPT] * 350
        while len(roles) < length:
            roles += [ACTION] * rng.randint(40, 140) + [OBS] * rng.randint(40, 200)
        roles = roles[:length]
        signal = (i // group_size) % 2 == 0
        adv = (1.0 if i % 2 else -1.0) if signal else 0.0
        out.append({"ids": [rng.randrange(vocab) for _ in roles], "roles": roles, "wrapper": [False] * length,
                    "adv": [adv] * length})
    return out


def trainer(model_dir, flags):
    """grpo.py's trainer on this CPU, from the weights in model_dir under grpo.py's `flags`: -> (its flags parsed,
    the autocast context, the policy (in train mode), the initial policy in the compute dtype, what trains, the
    optimizer). bench/grpo_update.py's too."""
    args = grpo.get_parser().parse_args(["--init", str(model_dir), "--tasks", "-", "--out", "-", *flags])
    ctx, dtype, _ = common.autocast(args.dtype, torch.device("cpu"))
    lm = common.load_model(model_dir, torch.device("cpu"))
    init_lm = common.load_model(model_dir, torch.device("cpu")).to(dtype).requires_grad_(False).eval()
    wrapped = common.LossModule(lm)
    opt = common.adamw(wrapped.parameters(), lr=args.lr, betas=args.adam_betas, eps=args.adam_eps,
                       weight_decay=args.weight_decay)
    lm.train()
    return args, ctx, lm, init_lm, wrapped, opt


def update(model_dir, examples, micro_tokens, behav):
    """One grpo.train_batch from the weights in model_dir at --micro-tokens micro_tokens.
    -> (seconds, the updated weights)."""
    args, ctx, lm, init_lm, wrapped, opt = trainer(model_dir, ["--lr", "1e-4", "--kl-coef", "0.05", "--micro-tokens",
                                                               str(micro_tokens)])
    device = torch.device("cpu")
    exs = [batches.Example(**ex, behav=b) for ex, b in zip(examples, behav)]
    t = time.perf_counter()
    grpo.train_batch(wrapped, init_lm, opt, exs, grpo.objective(args), 0, device, ctx, 0, print,
                     ppo_epochs=args.ppo_epochs, micro_tokens=args.micro_tokens, grad_clip=args.grad_clip, fsdp=False)
    return time.perf_counter() - t, {k: v.detach().clone() for k, v in lm.state_dict().items()}


def main(argv=None):
    args = get_parser().parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="bench_grpo_micro_"))
    # the base model's architecture (scripts/base_model.py's defaults), random weights; no tokenizer is needed
    from transformers import Qwen3ForCausalLM
    model_dir, config = out / "model", tiny.tiny_config(4096, 256, 4, 4, 2)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(model_dir)
    examples = synthetic_examples(random.Random(0), args.episodes, args.group_size, args.tokens, config.vocab_size)
    # the behaviour log-probs: the policy's own (the importance ratio starts at 1, as after a rollout)
    behav = batches.policy_logprobs(common.load_model(model_dir, torch.device("cpu")),
                                    [batches.Example(**ex, behav=None) for ex in examples], 1.0, 1, 0,
                                    torch.device("cpu"), common.autocast("auto", torch.device("cpu"))[0])
    total, weights = dict.fromkeys(WAYS, 0.0), {}
    for r in range(args.rounds):
        line = []
        for name, micro in WAYS.items():
            t, weights[name] = update(model_dir, examples, micro, behav)
            total[name] += t
            line.append(f"{name}: {t:.1f} s")
        print(f"round {r}: " + " | ".join(line), flush=True)
    a, b = weights.values()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    base, new = total.values()
    print(json.dumps({"cores": os.cpu_count(), "threads": torch.get_num_threads(), "episodes": args.episodes,
                      "tokens": sum(len(e["ids"]) for e in examples), **{f"{k} (s)": round(v, 1) for k, v in
                                                                          total.items()},
                      "ratio": round(new / base, 3), "max |weight difference|": diff}))


if __name__ == "__main__":
    main()
