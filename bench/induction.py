"""
Calibration: how many steps a random Qwen3 of a given size needs to learn a copy by content, the circuit that
quoting a value from the task text needs. It trains on scripts/base_model.py's `repeats` (random ids, one segment
repeated at a random offset, loss on the repeat only: nothing but a copy lowers it) and prints the probe on held-
out rows every --every steps, beside a fixed-offset control whose look-back a model can learn without copying by
content. Use it to choose a base model's size and budget before pre-training one.

    python -m bench.induction                                  # ablation.sh's base size, 1,000 steps
    python -m bench.induction --hidden 512 --layers 6 --steps 3000
    python -m bench.induction --layers 2 --vocab 512 --data rotations --batch-size 32 --lr 1e-3
"""
import argparse
import sys
import time
from pathlib import Path

import torch

import common

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import base_model  # noqa: E402


def get_parser():
    p = argparse.ArgumentParser(description="steps a random Qwen3 needs to copy by content (base_model.repeats)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16, help="rows per step")
    p.add_argument("--length", type=int, default=128, help="tokens per row")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--data", default="repeats", choices=["repeats", "rotations"], help="repeats: base_model.repeats "
                   "(one segment a row comes back); rotations: every row's second half repeats its first, rotated")
    p.add_argument("--qk-norm-init", type=float, default=1.0, help="start Qwen3's per-head q/k norm weights here (a "
                   "larger value allows sharper attention from the first step)")
    p.add_argument("--every", type=int, default=100, help="probe every N steps")
    p.add_argument("--seed", type=int, default=0)
    return p


def rotations(gen, n, length, vocab):
    """n rows: `length // 2` random ids, then the same ids rotated by a random shift (1..half-1, per row) ->
    (ids (n, length), labels: the second half after its first token, -100 elsewhere). Every label is a copy by
    content, at an offset that differs from row to row; a row holds ~3x the labels of `repeats`' (63 against 7-31
    at length 128)."""
    half = length // 2
    a = vocab[torch.randint(len(vocab), (n, half), generator=gen)]  # (n, half)
    shift = torch.randint(1, half, (n, 1), generator=gen)
    b = torch.gather(a, 1, (torch.arange(half) + shift) % half)  # (n, half): a rotated
    ids = torch.cat([a, b], 1)  # (n, 2 * half)
    lab = ids.clone()
    lab[:, :half + 1] = -100
    return ids, lab


@torch.no_grad()
def fixed_offset_accuracy(model, vocab, gen, n=16, half=48):
    """The control: rows [a, a] of `half` random ids; a model that attends `half` back gets it right."""
    a = vocab[torch.randint(len(vocab), (n, half), generator=gen)]
    ids = torch.cat([a, a], 1)  # (n, 2 * half)
    pred = model(ids).logits[:, half:-1].argmax(-1)  # (n, half - 1): predictions of the second copy's tokens 2..
    return (pred == ids[:, half + 1:]).float().mean().item()


def main(argv=None):
    args = get_parser().parse_args(argv)
    from transformers import Qwen3ForCausalLM
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(common.tiny_config(args.vocab, args.hidden, args.layers, args.heads, args.kv_heads))
    for name, w in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            w.data.fill_(args.qk_norm_init)
    opt = torch.optim.AdamW(model.parameters(), args.lr)
    vocab = torch.arange(256, args.vocab)  # past the byte alphabet, as base_model.plain_ids would give
    gen = torch.Generator().manual_seed(args.seed)
    rows = base_model.repeats if args.data == "repeats" else rotations
    t0, first = time.time(), None
    for step in range(args.steps + 1):
        if step % args.every == 0:
            model.eval()
            acc = base_model.repeat_accuracy(model, vocab, seed=args.seed + 1)
            ctrl = fixed_offset_accuracy(model, vocab, torch.Generator().manual_seed(args.seed + 2))
            model.train()
            first = step if first is None and acc >= 0.5 else first
            print(f"step {step:5d} | copy by content {acc:.3f} | fixed offset {ctrl:.3f} | {time.time() - t0:.0f}s", flush=True)
        if step == args.steps:
            break
        ids, lab = rows(gen, args.batch_size, args.length, vocab)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    print(f"copy by content >= 0.5 from step {first}" if first is not None else
          f"copy by content stayed below 0.5 for {args.steps} steps ({args.steps * args.batch_size * args.length:,} tokens)")


if __name__ == "__main__":
    main()
