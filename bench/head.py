"""
Benchmark: the head's gradients formed in the forward pass (head.token_loss) against the same head with its
backward recomputing the logits (head.token_logprobs: what every loss used before, and what a loss that is not a
sum of per-token terms still uses) and against naive full logits, at a small and at Qwen3's vocabulary; and sft.py's
tokens/s with either kernel and a bare PyTorch loop on full logits (the model's own cross-entropy from
model(labels=...), the loss TRL's SFTTrainer takes) on the same trajectories. The model is the base model's
architecture (hidden 256, 4 layers) with a random init. Everything runs in this process, interleaved; prints time and
peak-memory ratios against the recompute.

    python -m bench.head                                          # both parts, V = 4,096 and 151,936
    python -m bench.head --part head --vocab 151936 --tokens 883  # the head alone at Qwen3's vocabulary
    python -m bench.head --clock cpu                              # on a machine other jobs share
    python -m bench.head --part peak --vocab 151936 --tokens 2048 --hidden 1024   # peaks at Qwen3-0.6B's width

Time: wall-clock seconds, or with --clock cpu this process's CPU seconds (all its threads; sft.py's step_s is then
read on that clock too), which other processes' load disturbs far less. Peak memory, on CPU: the process's
resident-set high-water mark above its level before the pass, sampled every 0.2 ms by a thread (bench.loss.PeakRSS),
measured in a fresh process after all timing (--part peak), with glibc made to map every allocation over 64 KiB on
its own and unmap it when freed (it otherwise keeps freed blocks of up to 32 MiB resident for reuse, and the resident
set would not follow the tensors; the setting slows allocation, so no timing runs under it); on CUDA
torch.cuda.max_memory_allocated above the same baseline. Each line also gives the bound the kernel's docstring
states: one block of logits, the fp32 gradients of the head and of the rows.
"""
import argparse
import ctypes
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

import sft
from actobs import common, labels, tiny
from actobs.head import CHUNK_BYTES, head_chunk, token_logprobs, token_loss
from bench.loss import PeakCUDA, PeakRSS
from bench.train import long_trajectory, random_model_dir


def get_parser():
    p = argparse.ArgumentParser(description="the head's gradients in the forward pass vs recomputed in the backward vs "
                                            "full logits; sft.py's tokens/s with each and a bare full-logits loop")
    p.add_argument("--part", choices=["head", "sft", "both", "peak"], default="both",
                   help="what to measure (head: its time, then its peak memory in a fresh process, the part `peak`)")
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 151936], help="vocabulary sizes")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 883],
                   help="rows through the head alone, one per --vocab (883: one chunk at Qwen3's vocabulary)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every variant (median reported)")
    p.add_argument("--sft-len", type=int, nargs="+", default=[1024, 256],
                   help="tokens per trajectory in the SFT runs, one per --vocab (every trajectory cut to it)")
    p.add_argument("--sft-steps", type=int, default=3, help="optimizer steps per SFT run (the first is warm-up)")
    p.add_argument("--sft-rounds", type=int, default=2, help="interleaved rounds of the SFT variants")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="autocast dtype (sft.py's CPU default)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="wall-clock or this process's CPU seconds")
    p.add_argument("--hidden", type=int, default=256, help="width of the rows through the head alone")
    p.add_argument("--json", help="with --part peak: also write each variant's peak bytes (and the bound) here")
    return p


def recompute_loss(h, W, targets, terms, entropy=False, chunk=None):
    """head.token_loss's contract through head.token_logprobs: the backward recomputes each chunk's logits."""
    logp, ent = token_logprobs(h, W, targets, entropy=entropy, chunk=chunk)
    return terms(logp, slice(0, len(logp))).sum(), logp.detach(), ent


def full_logits_loss(h, W, targets, terms, entropy=False, chunk=None):
    """The same loss through the (N, V) log-softmax."""
    logp = torch.log_softmax((h @ W.T).float(), -1).gather(1, targets[:, None]).squeeze(1)  # (N,)
    return terms(logp, slice(0, len(logp))).sum(), logp.detach(), None


HEADS = {"forward grads": token_loss, "recompute": recompute_loss, "full logits": full_logits_loss}


def head_inputs(V, N, device, H=256):
    """Rows h (N, H), a head W (V, H), targets and SFT's per-token weights (N,), seeded."""
    torch.manual_seed(0)
    h = torch.randn(N, H, device=device, requires_grad=True)
    W = (torch.randn(V, H, device=device) * 0.05).requires_grad_()
    return h, W, torch.randint(0, V, (N,), device=device), torch.rand(N, device=device)


def head_pass(head, h, W, t, w, ctx, device):
    """Forward + backward of SFT's loss (a constant weight per token) through `head`; -> the loss."""
    h.grad = W.grad = None
    with ctx:
        loss = head(h, W, t, lambda lp, rows: -w[rows] * lp)[0]
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return loss.item()


def time_head(V, N, args, device, ctx, clock):
    """The head alone: each variant's median seconds over --rounds interleaved passes (after a warm-up pass)."""
    h, W, t, w = head_inputs(V, N, device, args.hidden)
    times, losses = {k: [] for k in HEADS}, {}
    for r in range(args.rounds + 1):  # round 0: warm-up
        for name, head in HEADS.items():
            t0 = clock()
            losses[name] = head_pass(head, h, W, t, w, ctx, device)
            if r:
                times[name].append(clock() - t0)
    base = statistics.median(times["recompute"])
    for name in HEADS:
        tm = statistics.median(times[name])
        print(f"head | V {V:>7,} | N {N:>5} | {name:>13} | {tm:7.3f} s | {tm / base:5.2f}x the recompute | loss diff "
              f"{abs(losses[name] - losses['recompute']):.1e}", flush=True)


def peak_head(V, N, device, ctx, H=256):
    """The head alone: each variant's peak memory above its start, against the recompute's and the stated bound.
    -> {variant: peak bytes, "bound": the stated bound's bytes}."""
    h, W, t, w = head_inputs(V, N, device, H)
    peaks = {}
    for name, head in HEADS.items():
        head_pass(head, h, W, t, w, ctx, device)  # the first pass's one-off allocations (thread pools) out of the way
        h.grad = W.grad = None  # freed before the baseline is read
        with PeakCUDA() if device.type == "cuda" else PeakRSS() as mem:
            head_pass(head, h, W, t, w, ctx, device)
        peaks[name] = mem.peak
    bound = 4 * (min(head_chunk(V), N) * V + W.numel() + h.numel())  # one block, the fp32 grads of W and h
    for name, pk in peaks.items():
        print(f"peak | V {V:>7,} | N {N:>5} | {name:>13} | {pk / 2**30:6.3f} GiB | {pk / peaks['recompute']:5.2f}x the "
              f"recompute | stated bound {bound / 2**30:.3f} GiB", flush=True)
    return {**peaks, "bound": bound}


def rss_follows_tensors():
    """glibc: every allocation over 64 KiB mapped on its own and unmapped when freed (M_MMAP_THRESHOLD, fixed)."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)


def bare_loop(model_dir, examples, steps, batch_size, device, ctx, clock):
    """A bare PyTorch SFT loop on full logits: the model's mean cross-entropy over the supervised tokens of each
    trajectory (one a forward pass), AdamW, clipping at 1. -> (tokens, seconds) of the steps after the first."""
    model = common.load_model(model_dir, device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = seconds = 0.0
    for step in range(steps):
        t0 = clock()
        n = 0
        for ids, roles in examples[step * batch_size: (step + 1) * batch_size]:
            x = torch.as_tensor(ids, device=device)[None]  # (1, T)
            y = x.masked_fill(torch.as_tensor(roles, device=device)[None] == labels.PROMPT, -100)
            with ctx:
                (model(input_ids=x, labels=y).loss / batch_size).backward()
            n += len(ids)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:
            tokens, seconds = tokens + n, seconds + clock() - t0
    return tokens, seconds


def sft_run(model_dir, data, out, L, args, clock, head):
    """sft.py for --sft-steps steps, one trajectory a pass, its step times on `clock`, its loss through `head` ->
    (tokens, seconds) of the steps after the first."""
    with mock.patch.object(sft, "time", SimpleNamespace(time=clock)), mock.patch("head.token_loss", head):
        sft.main(["--model", str(model_dir), "--data", str(data), "--out", str(out), "--lam", "1", "--batch-size", "4",
                  "--max-len", str(L), "--micro-tokens", "1", "--dtype", args.dtype, "--val-size", "1",
                  "--warmup-ratio", "0", "--eval-every", "0", "--save-every", "0", "--stop-after", str(args.sft_steps)])
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/step_s" in r and r["step"] > 1]
    shutil.rmtree(out)
    return sum(r["train/tokens"] for r in rows), sum(r["train/step_s"] for r in rows)


def bench_sft(V, L, args, device, ctx, clock, tmp):
    """sft.py's tokens/s with the head's gradients in the forward pass, with the recompute, and a bare loop."""
    rng = random.Random(0)
    convs = [long_trajectory(rng, 6 * L) for _ in range(4 * args.sft_steps + 1)]  # every one cut to L tokens
    out = tmp / f"v{V}"
    out.mkdir()
    model_dir = random_model_dir(out, convs, tiny.tiny_config(V, 256, 4, 4, 2))
    examples = [labels.render(labels.load_tokenizer(model_dir), c, L) for c in convs]
    variants = {"sft.py, forward grads": lambda run: sft_run(model_dir, out / "data.jsonl", run, L, args, clock,
                                                             token_loss),
                "sft.py, recompute": lambda run: sft_run(model_dir, out / "data.jsonl", run, L, args, clock,
                                                         recompute_loss),
                "bare full-logits loop": lambda run: bare_loop(model_dir, examples, args.sft_steps, 4, device, ctx,
                                                               clock)}
    tot = {k: [0.0, 0.0] for k in variants}
    for r in range(args.sft_rounds):
        for i, (name, run) in enumerate(variants.items()):
            tokens, seconds = run(out / f"run{r}-{i}")
            tot[name][0] += tokens
            tot[name][1] += seconds
            print(f"sft  | V {V:>7,} | round {r} | {name:>21} | {tokens / seconds:8.1f} tok/s", flush=True)
    base = tot["sft.py, recompute"][0] / tot["sft.py, recompute"][1]
    for name, (tokens, seconds) in tot.items():
        print(f"sft  | V {V:>7,} | {int(tokens):>6} tokens | {name:>21} | {tokens / seconds:8.1f} tok/s | "
              f"{tokens / seconds / base:5.2f}x the recompute", flush=True)


def main(argv=None):
    args = get_parser().parse_args(argv)
    if len(args.tokens) != len(args.vocab) or len(args.sft_len) != len(args.vocab):
        raise SystemExit("--tokens and --sft-len need one value per --vocab")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"device {device} | {torch.get_num_threads()} threads | {args.dtype} | {args.clock} clock | "
          f"head.CHUNK_BYTES {CHUNK_BYTES / 2**30:.2f} GiB", flush=True)
    if args.part == "peak":  # a process of its own: a heap that earlier work left behind would serve the blocks
        if device.type == "cpu":
            rss_follows_tensors()
        peaks = [{"vocab": V, "tokens": N, "hidden": args.hidden, **peak_head(V, N, device, ctx, args.hidden)}
                 for V, N in zip(args.vocab, args.tokens)]
        if args.json:
            Path(args.json).write_text(json.dumps(peaks, indent=2))
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench_head_"))
    try:
        for V, N, L in zip(args.vocab, args.tokens, args.sft_len):
            if args.part in ("head", "both"):
                time_head(V, N, args, device, ctx, clock)
            if args.part in ("sft", "both"):
                bench_sft(V, L, args, device, ctx, clock, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.part in ("head", "both"):
        subprocess.run([sys.executable, "-m", "bench.head", "--part", "peak", "--dtype", args.dtype,
                        "--hidden", str(args.hidden), "--vocab", *map(str, args.vocab),
                        "--tokens", *map(str, args.tokens), "--sft-len", *map(str, args.sft_len)],
                       check=True, cwd=Path(__file__).resolve().parents[1])


if __name__ == "__main__":
    main()
