"""
Benchmark how sft.py should cut a CPU step into forward passes (--micro-tokens): the 4 trajectories of a step
padded into one batch (--micro-tokens 8192), or one trajectory per pass
(--micro-tokens 1: no padding). Both ways train the same steps of the base model's architecture (a random init) on
synthetic trajectories whose lengths spread like the corpus's (~700-1,750 tokens); the rounds interleave the ways,
and the ratio is of their summed step times in this same run (log.jsonl, the first step left out: warm-up).

    python -m bench.sft_micro                  # 12 steps a run, 2 rounds
    python -m bench.sft_micro --steps 30 --rounds 3
"""
import argparse
import json
import os
import random
import tempfile
from pathlib import Path

from actobs import tiny
from bench.sft_threads import sft_run, train_seconds
from bench.train import long_trajectory, random_model_dir

WAYS = {"padded batch of 4": 8192, "one trajectory a pass": 1}  # name -> --micro-tokens


def get_parser():
    p = argparse.ArgumentParser(
        description="SFT step time on CPU: a step's trajectories padded into one pass, or one pass each")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per SFT run")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both ways")
    p.add_argument("--chars", type=int, nargs=2, default=[2900, 7000],
                   help="range of characters per trajectory (~4 a token: the corpus's 724-1,738 tokens)")
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="bench_sft_micro_"))
    rng = random.Random(0)
    convs = [long_trajectory(rng, rng.randint(*args.chars)) for _ in range(4 * args.steps + 1)]
    # the base model's architecture (scripts/base_model.py's defaults)
    model_dir = random_model_dir(out, convs, tiny.tiny_config(4096, 256, 4, 4, 2))
    total = dict.fromkeys(WAYS, 0.0)
    for r in range(args.rounds):
        line = []
        for name, micro in WAYS.items():
            run_dir = out / f"r{r}-{micro}"
            proc = sft_run(model_dir, out / "data.jsonl", run_dir, args.steps, os.cpu_count(), micro)
            t = sum(train_seconds([(proc, run_dir)]))
            total[name] += t
            line.append(f"{name}: {t:.1f} s")
        print(f"round {r}: {args.steps - 1} steps | " + " | ".join(line), flush=True)
    base, new = total.values()
    print(json.dumps({"cores": os.cpu_count(), "steps": args.rounds * (args.steps - 1),
                      **{f"{k} (s)": round(v, 1) for k, v in total.items()}, "ratio": round(new / base, 3)}))


if __name__ == "__main__":
    main()
