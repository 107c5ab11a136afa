"""
Benchmark how ablation.sh should spend the CPU's cores on several SFT arms: one sft.py at a time with every core's
thread, or one sft.py per arm at once with one thread each. Each way trains the same steps of the base model's
architecture (a random init) on synthetic trajectories of the corpus's length; the rounds interleave the two ways,
and the ratio is of the machine's steps per second, one way against the other in this same run. Times are the
runs' own step times (log.jsonl, the first step left out: warm-up), so process start-up counts in neither: one
after another, the sum of the runs' times; at once, the longest run's.

    python -m bench.sft_threads                       # 2 arms, 8 steps each, 2 rounds
    python -m bench.sft_threads --arms 3 --steps 12
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from actobs import tiny
from bench.train import long_trajectory, random_model_dir


def get_parser():
    p = argparse.ArgumentParser(description="machine-wide SFT steps/s: arms one after another on all threads, "
                                            "or at once on one thread each")
    p.add_argument("--arms", type=int, default=2, help="SFT runs per way")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per SFT run")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both ways")
    p.add_argument("--chars", type=int, default=6000,
                   help="characters per trajectory (the corpus's episodes: ~1,500 tokens)")
    return p


def sft_run(model_dir, data, out, steps, threads, micro_tokens=1):
    """sft.py with the full run's SFT settings (ablation.sh: --dtype auto, the machine's) for `steps` steps, on
    `threads` torch threads."""
    cmd = [sys.executable, "sft.py", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--lam", "1",
           "--batch-size", "4", "--max-len", "3072", "--micro-tokens", str(micro_tokens),
           "--val-size", "1", "--warmup-ratio", "0", "--eval-every", "0", "--save-every", "0",
           "--stop-after", str(steps)]
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])


def train_seconds(procs_and_dirs):
    """Wait for the sft.py runs -> each one's summed step time, its first step left out."""
    times = []
    for p, out in procs_and_dirs:
        err = p.communicate()[1]
        if p.returncode:
            raise RuntimeError(f"sft.py failed ({p.returncode}): {err[-2000:]}")
        rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
        times.append(sum(r["train/step_s"] for r in rows if "train/step_s" in r and r["step"] > 1))
    return times


def main(argv=None):
    args = get_parser().parse_args(argv)
    cores = os.cpu_count()
    out = Path(tempfile.mkdtemp(prefix="bench_sft_threads_"))
    rng = random.Random(0)
    convs = [long_trajectory(rng, args.chars) for _ in range(4 * args.steps + 1)]
    # the base model's architecture (scripts/base_model.py's defaults)
    model_dir = random_model_dir(out, convs, tiny.tiny_config(4096, 256, 4, 4, 2))
    total = {"serial": 0.0, "parallel": 0.0}
    for r in range(args.rounds):
        run = lambda name, threads: (sft_run(model_dir, out / "data.jsonl", out / name, args.steps, threads),
                                     out / name)
        serial = sum(sum(train_seconds([run(f"s{r}-{a}", cores)])) for a in range(args.arms))  # one after another
        parallel = max(train_seconds([run(f"p{r}-{a}", 1) for a in range(args.arms)]))  # at once
        total["serial"] += serial
        total["parallel"] += parallel
        print(f"round {r}: {args.arms} x {args.steps} steps | one at a time, {cores} threads: {serial:.1f} s | "
              f"at once, 1 thread each: {parallel:.1f} s | ratio {serial / parallel:.2f}x", flush=True)
    steps = args.rounds * args.arms * (args.steps - 1)
    print(json.dumps({"cores": cores, "arms": args.arms, "steps": steps,
                      "serial_steps_per_s": steps / total["serial"], "parallel_steps_per_s": steps / total["parallel"],
                      "parallel_over_serial": total["serial"] / total["parallel"]}))


if __name__ == "__main__":
    main()
