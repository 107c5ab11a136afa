"""
Benchmark sft.py's training loop on a randomly initialised model of a real architecture (default: the
Qwen3-4B config) with long synthetic trajectories: tokens/s, MFU and peak GPU memory, read from the run's own
log.jsonl. Nothing is downloaded: the tokenizer is trained here, the weights are a random init.

    python -m bench.train                                  # one GPU: Qwen3-4B config, 16k-token trajectories
    python -m bench.train --config tiny --seq-len 2048     # CPU smoke run of the same path

MFU = (6 N + 12 L a T) tokens/s / peak FLOP/s (tiny.forward_flops, times 3), N = the matmul weights (the head
included, the embedding lookup not), L layers, a attention heads x head dim, T sequence length (the attention
term); peak defaults to an H100/H200's dense bf16 989 TFLOP/s.
"""
import argparse
import json
import random
import tempfile
from pathlib import Path

import sft
from actobs import terminus, tiny

QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                rope_theta=1000000, max_position_embeddings=40960, rms_norm_eps=1e-6)
TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=4096, tie_word_embeddings=True,
            max_position_embeddings=32768)


def get_parser():
    p = argparse.ArgumentParser(description="tokens/s, MFU and peak memory of sft.py on a random-init model")
    p.add_argument("--config", default="qwen3-4b", choices=["qwen3-4b", "tiny"], help="architecture to initialise")
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per trajectory")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="trajectories per step")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the accelerator's dense bf16 peak")
    p.add_argument("--out", default=None, help="run dir (default: a temp dir)")
    return p


def long_trajectory(rng, n_chars):
    """A Terminus-2-looking trajectory of roughly n_chars characters."""
    msgs = [{"role": "user", "content": "Solve the task in the terminal. Reply in JSON.\nroot@box:/app# "}]
    while sum(len(m["content"]) for m in msgs) < n_chars:
        cmd = f"grep -rn pattern{rng.randint(0, 999)} /srv/data/{rng.randint(0, 99)}"
        msgs.append({"role": "assistant", "content": json.dumps({"analysis": "look", "plan": cmd, "commands": [
            {"keystrokes": cmd + "\n", "duration": 0.1}], "task_complete": False})})
        out = "\n".join(f"/srv/data/f{rng.randint(0, 9999)}.log:{rng.randint(1, 500)}: value={rng.random():.6f}"
                        for _ in range(40))
        msgs.append({"role": "user",
                     "content": terminus.OUTPUT_HEADER + f"root@box:/app# {cmd}\n{out}\nroot@box:/app# "})
    return msgs


def random_model_dir(out, convs, config):
    """OUT/data.jsonl of the conversations and OUT/model: a tokenizer trained here on them, `config` and no weights
    (sft.py then initialises the model randomly). -> the model dir."""
    (out / "data.jsonl").write_text("".join(json.dumps({"conversations": c}) + "\n" for c in convs))
    model_dir = out / "model"
    tiny.build_tiny(model_dir, [m["content"] for c in convs[:20] for m in c], vocab_size=4096, hidden=64, layers=1)
    for f in model_dir.glob("model*.safetensors"):
        f.unlink()
    config.save_pretrained(model_dir)
    return model_dir


def main(argv=None):
    args = get_parser().parse_args(argv)
    from transformers import Qwen3Config
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_train_"))
    rng = random.Random(0)
    convs = [long_trajectory(rng, 4 * args.seq_len) for _ in range(args.batch_size * args.steps + 1)]
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(QWEN3_4B if args.config == "qwen3-4b" else TINY)
    model_dir = random_model_dir(out, convs, Qwen3Config(**cfg))
    sft.main(["--model", str(model_dir), "--data", str(out / "data.jsonl"), "--out", str(out / "run"),
              "--max-len", str(args.seq_len), "--micro-tokens", str(args.seq_len),
              "--batch-size", str(args.batch_size), "--val-size", "1",
              "--grad-ckpt", "--warmup-ratio", "0", "--eval-every", "0", "--save-every", "0",
              "--stop-after", str(args.steps), "--lr", "1e-5"])
    rows = [json.loads(x) for x in (out / "run" / "log.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/tok_per_s" in r][2:]  # the first steps include compilation and allocator warm-up
    tok_s = sum(r["train/tokens"] for r in rows) / sum(r["train/step_s"] for r in rows)
    flops_per_tok = 3 * tiny.forward_flops(cfg, args.seq_len)  # forward and backward at full context
    mfu = flops_per_tok * tok_s / (args.peak_tflops * 1e12)
    peak = max((r.get("train/peak_mem_gb", 0.0) for r in rows), default=0.0)
    print(f"{args.config} | seq {args.seq_len} | {len(rows)} timed steps | {tok_s:,.0f} tok/s | MFU {mfu:.1%} "
          f"(of {args.peak_tflops:.0f} TFLOP/s) | peak GPU memory {peak:.1f} GiB")


if __name__ == "__main__":
    main()
