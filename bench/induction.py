"""
Calibration: how many steps a random Qwen3 of a given size needs to learn a copy by content, the circuit that
quoting a value from the task text needs, under the settings that decide it. It runs scripts/base_model.py's copy
practice (`train_copy`: `rotations` rows, random ids then the same ids rotated by a random shift, loss on the rotated
half; or `repeats`, one segment of a row repeated at a random offset) and prints the held-out copy accuracy on rows
of the trained length and of longer ones every --every steps, then the first step it reached 0.5.

    python -m bench.induction                                  # the base model's copy practice (base_model.py)
    python -m bench.induction --layers 2 --kv-heads 4 --vocab 512 --schedule 64:0 --steps 750
    python -m bench.induction --lr 3e-3 --weight-decay 0.01 --betas 0.9 0.999 --dtype bf16   # the old settings

Settings that formed the circuit on a 2-core CPU (RESULTS.md has the runs): AdamW lr 1e-3,
betas (0.9, 0.95), no weight decay, 50 warm-up steps, clip 1.0, 2,048 tokens a step in short rows. 2 layers / 4 KV
heads on rows of 64, fp32: ~500 steps; the base model's shape (4 layers, 2 KV heads) on rows of 64: ~750 in fp32,
600-700 in bf16 (`--dtype bf16 --schedule 64:0`: 0.82 at step 700, at 0.75x fp32's step time); the schedule
32:600,64:400,128:0 forms it at 600-800 too (rows of 32 alone do not), copying rows of 128 by step ~1,200. At lr
3e-3, or on rows of 128 from the start, the plateau before the circuit outlasts 1,000+ steps.
"""
import argparse
import inspect

import torch

from actobs import tiny
from scripts import base_model


def get_parser():
    # the defaults are the base model's copy practice: its flags, and train_copy's own settings
    default = {a.dest: a.default for a in base_model.get_parser()._actions}
    # only the parameters with defaults: train_copy's positional `vocab` (a tensor of ids) is not the --vocab size
    default.update((k, v.default) for k, v in inspect.signature(base_model.train_copy).parameters.items()
                   if v.default is not inspect.Parameter.empty)
    p = argparse.ArgumentParser(description="steps a random Qwen3 needs to copy by content (base_model.train_copy)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--vocab", type=int, default=default["vocab"])
    p.add_argument("--hidden", type=int, default=default["hidden"])
    p.add_argument("--layers", type=int, default=default["layers"])
    p.add_argument("--heads", type=int, default=default["heads"])
    p.add_argument("--kv-heads", type=int, default=default["kv_heads"])
    p.add_argument("--steps", type=int, default=default["copy_steps"])
    p.add_argument("--schedule", default=default["copy_schedule"], help="row lengths over steps, LENGTH:STEPS,... "
                   "(the last runs on); '128:0' is rows of 128 throughout")
    p.add_argument("--tokens", type=int, default=default["copy_tokens"], help="tokens a step")
    p.add_argument("--data", default="rotations", choices=["rotations", "repeats"])
    p.add_argument("--lr", type=float, default=default["copy_lr"])
    p.add_argument("--betas", type=float, nargs=2, default=list(default["betas"]), metavar=("B1", "B2"))
    p.add_argument("--weight-decay", type=float, default=default["weight_decay"])
    p.add_argument("--warmup", type=int, default=default["warmup"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast")
    p.add_argument("--every", type=int, default=100, help="probe every N steps")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    from transformers import Qwen3ForCausalLM
    schedule = base_model.parse_schedule(args.schedule)
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(tiny.tiny_config(args.vocab, args.hidden, args.layers, args.heads, args.kv_heads))
    vocab = torch.arange(256, args.vocab)  # past the byte alphabet, as base_model.plain_ids would give
    longest = max(n for n, _ in schedule)
    probes = sorted({longest, 2 * longest, 128})
    rows = base_model.rotations if args.data == "rotations" else base_model.repeats
    curve = base_model.train_copy(model, vocab, args.steps, schedule, args.tokens, args.lr, args.betas,
                                  args.weight_decay, args.warmup, torch.bfloat16 if args.dtype == "bf16" else None,
                                  args.seed, args.every, probes, rows=rows)
    first = next((k for k, acc in curve if acc[longest] >= 0.5), None)
    print(f"copy by content on rows of {longest} >= 0.5 from step {first}" if first is not None else
          f"copy by content on rows of {longest} stayed below 0.5 for {args.steps} steps")
    print(f"settings: {vars(args)}")


if __name__ == "__main__":
    main()
