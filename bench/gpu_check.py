"""
The CUDA paths that CPU CI cannot run, checked in one script on one GPU (~5 min on an H100/H200): every line it
prints ends in PASS or FAIL, and it exits 1 if any check failed. Nothing is downloaded: the tokenizer is trained
here and the weights are a random init of a real architecture (Qwen3-0.6B's config: bench/realshape.py).

1. SFT (no Docker): sft.py's loop in bf16 with gradient checkpointing on long synthetic trajectories — the loss
   is finite and falls, tokens/s, MFU and peak memory from the run's own log.jsonl.
2. The GRPO engine path (no Docker): engine.make_engine with sleep mode, sleep / wake_up around a training step,
   engine.sync_weights after it, and the rollout/trainer log-prob mismatch on the engine's own samples (the
   quantity grpo.py logs as train/mismatch_abs; prime-rl's CI asks <= 0.01), greedy continuations equal
   before and after a sleep.
3. With a Docker daemon (optional, --grpo-steps > 0): `grpo.py` itself for a few steps on toy tasks in
   sandboxes (the whole loop: rollouts, sleep, training, wake, sync) — its log rows are checked.

    python -m bench.gpu_check                          # parts 1 and 2
    python -m bench.gpu_check --grpo-steps 2           # and part 3 (needs `. .ci/dockerd.sh start` first)
"""
import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

import grpo
import sft
from actobs import engine
from actobs.sandbox import daemon
from bench import realshape
from bench.train import long_trajectory

FAILED = []


def check(name, ok, detail):
    print(f"{name:<44} {detail:<60} {'PASS' if ok else 'FAIL'}", flush=True)
    if not ok:
        FAILED.append(name)


def sft_check(root, model_dir, convs, args):
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in convs))
    t0 = time.time()
    sft.main(["--model", str(model_dir), "--data", str(data), "--out", str(root / "sft"),
              "--max-len", str(args.seq_len), "--micro-tokens", str(args.seq_len), "--batch-size", "4",
              "--val-size", "1", "--grad-ckpt", "--dtype", "bf16", "--warmup-ratio", "0", "--eval-every", "0",
              "--save-every", "0", "--stop-after", str(args.sft_steps), "--lr", "3e-4"])
    rows = [json.loads(x) for x in (root / "sft" / "log.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    timed = [r for r in rows if "train/tok_per_s" in r][2:]  # the first steps include allocator warm-up
    tok_s = sum(r["train/tokens"] for r in timed) / max(sum(r["train/step_s"] for r in timed), 1e-9)
    peak = max((r.get("train/peak_mem_gb", 0.0) for r in rows), default=0.0)
    check("sft: loss finite", all(map(math.isfinite, losses)), f"{len(losses)} steps")
    check("sft: loss falls (bf16, grad ckpt)", losses[-1] < losses[0], f"{losses[0]:.3f} -> {losses[-1]:.3f}")
    check("sft: throughput", tok_s > 0, f"{tok_s:,.0f} tok/s, peak {peak:.1f} GiB, {time.time() - t0:.0f}s")


def engine_check(model_dir):
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    dev = torch.device("cuda")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev)
    llm = engine.make_engine(model_dir, max_model_len=2048, max_seqs=8, dtype="bf16", gpu_memory=0.3)
    prompts = [[random.Random(i).randrange(5, 4000) for _ in range(64)] for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=32, top_k=0, top_p=1.0)
    before = [o.outputs[0].token_ids
              for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]

    # a training step with the engine asleep, then wake and sync: the engine must follow the trainer
    free0 = torch.cuda.mem_get_info()[0]
    llm.sleep(level=1)
    freed = (torch.cuda.mem_get_info()[0] - free0) / 2**30
    check("engine: sleep(level=1) frees memory", freed > 0.5, f"{freed:.1f} GiB freed")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.tensor(prompts, device=dev)  # (8, 64)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    llm.wake_up()
    t0 = time.time()
    _, gather_s = engine.sync_weights(llm, model)
    check("engine: wake_up + sync_weights", True, f"sync {time.time() - t0:.2f}s (the trainer's side {gather_s:.2f}s)")
    after = [o.outputs[0].token_ids
             for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    check("engine: sync changes what it samples", after != before,
          f"{sum(a != b for a, b in zip(after, before))}/8 greedy continuations changed")

    # the mismatch grpo.py logs: engine log-probs of its own samples vs the trainer's, at T = 1
    sample = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=64, logprobs=0, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sample, use_tqdm=False)
    diffs = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for p, o in zip(prompts, outs):
            c = o.outputs[0]
            seq = torch.tensor([p + list(c.token_ids)], device=dev)
            lp = torch.log_softmax(model(seq).logits[0, len(p) - 1:-1].float(), -1)
            mine = lp.gather(1, seq[0, len(p):, None]).squeeze(1)
            theirs = torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)], device=dev)
            diffs.append((mine - theirs).abs())
    mism = torch.cat(diffs).mean().item()
    check("engine: rollout/trainer log-prob mismatch", mism <= 0.01,
          f"mean |dlogp| {mism:.4f} over {sum(map(len, diffs))} tokens (<= 0.01)")
    del llm


def grpo_check(root, model_dir, steps):
    import random as pyrandom
    from actobs import taskgen
    tasks = root / "tasks"
    for i, kind in enumerate(("rename", "word_count")):
        spec = taskgen.generate(kind, pyrandom.Random(i))
        taskgen.write_harbor(spec, tasks / spec.name, daemon.BASE_IMAGE)
    out = root / "grpo"
    grpo.main(["--init", str(model_dir), "--chat-template", "prefix", "--tasks", str(tasks), "--out", str(out),
               "--steps", str(steps), "--tasks-per-step", "2", "--group-size", "4", "--max-turns", "3",
               "--max-new-tokens", "64", "--max-len", "4096", "--lr", "1e-6", "--save-every", str(steps),
               "--echo-coef", "0.05"])  # every step trains (and logs the mismatch), whether or not a group has signal
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    check("grpo.py: steps logged", [r["step"] for r in rows] == list(range(1, steps + 1)), f"{len(rows)} rows")
    worst = max(r["train/mismatch_abs"] for r in rows)
    check("grpo.py: mismatch every step", worst <= 0.01, f"max train/mismatch_abs {worst:.4f}")
    check("grpo.py: final checkpoint", (out / "final" / "model.safetensors").exists(), str(out / "final"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per SFT trajectory")
    p.add_argument("--sft-steps", type=int, default=8)
    p.add_argument("--grpo-steps", type=int, default=0, help="steps of grpo.py on toy tasks (needs Docker; 0 = skip)")
    p.add_argument("--out", default=None, help="work dir (default: a temp dir)")
    args = p.parse_args(argv)
    os.environ.update(engine.IN_PROCESS_ENV)  # the engine in this process, as grpo.py's
    if not torch.cuda.is_available():
        sys.exit("bench.gpu_check needs a CUDA GPU (CPU paths are covered by the test suite)")
    root = Path(args.out or tempfile.mkdtemp(prefix="actobs_gpu_check_"))
    rng = random.Random(0)
    convs = [long_trajectory(rng, 4 * args.seq_len) for _ in range(4 * args.sft_steps + 1)]
    model_dir = realshape.checkpoint(root / "model", [m["content"] for c in convs[:20] for m in c], realshape.QWEN3_06B)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | work dir {root}")
    sft_check(root, model_dir, convs, args)
    engine_check(model_dir)
    if args.grpo_steps:
        grpo_check(root, model_dir, args.grpo_steps)
    print(f"{'all checks passed' if not FAILED else 'FAILED: ' + ', '.join(FAILED)}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
