"""
Benchmark how ablation.sh should run several evaluations on a CPU: in one evaluate.py process one after another (its
`:::` runs, as ablation.sh's `together` does), or split over two processes at once. An evaluation's engine serves
on one thread and is bound by its per-step overhead, not by the sandboxes (RESULTS.md), so a second
engine may use what the first leaves of the cores. The rounds interleave the two ways on the same checkpoints,
tasks and seeds; the walls are whole commands (process start-up included: ablation.sh pays it), and the rewards
of the two ways are compared attempt by attempt.

Measured on 2 idle cores (RESULTS.md): two GRPO'd policies of the full run, 36 tasks x 2 attempts each,
two rounds: two processes at once took 1.09x the wall of one after another (1.17, 1.01), so ablation.sh keeps one
evaluation at a time. The engines share the cores with their sandboxes; neither waits on the other enough to leave
a core idle.

    python -m bench.eval_pair --models runs/ablation/actionsft/final runs/ablation/actobs/final \\
        --tasks runs/ablation/corpus/eval --prompt-template scripts/toy_prompt.txt
"""
import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from actobs import common

ROOT = Path(__file__).resolve().parents[1]


def get_parser():
    p = argparse.ArgumentParser(description="evaluations one after another in one process, or two processes at once")
    p.add_argument("--models", nargs="+", required=True, help="checkpoints to evaluate (an even number: halves go "
                   "to the two processes)")
    p.add_argument("--tasks", required=True, help="a folder of Harbor tasks")
    p.add_argument("--prompt-template", required=True)
    p.add_argument("--attempts", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both ways")
    p.add_argument("--eval-flags", default="--max-turns 10 --max-new-tokens 384 --max-len 4096 --concurrency 64",
                   help="evaluate.py's other flags (ablation.sh's EVAL)")
    return p


def evaluation_args(args, model, out):
    return ["--model", model, "--tasks", args.tasks, "--out", str(out), "--prompt-template", args.prompt_template,
            "--seed", "0", "--attempts", str(args.attempts), *args.eval_flags.split()]


def launch(runs):
    """One evaluate.py process for `runs` (argument lists, `:::` between them)."""
    argv = [a for i, r in enumerate(runs) for a in ([common.RUN_SEPARATOR] if i else []) + r]
    return subprocess.Popen([sys.executable, "evaluate.py", *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def wall(way, runs, half):
    """Run `runs` one way (one process, or two at once) -> the seconds until every process has ended."""
    t0 = time.time()
    procs = [launch(runs)] if way == "serial" else [launch(runs[:half]), launch(runs[half:])]
    for p in procs:
        err = p.communicate()[1]
        if p.returncode:
            raise RuntimeError(f"evaluate.py failed ({p.returncode}): {err[-2000:]}")
    return time.time() - t0


def rewards(path):
    res = json.loads(Path(path).read_text())
    return {(name, a["attempt"]): a["reward"] for name, e in res["tasks"].items() for a in e["attempts"]}


def main(argv=None):
    args = get_parser().parse_args(argv)
    if len(args.models) % 2:
        raise SystemExit("--models: an even number of checkpoints (half to each process)")
    half = len(args.models) // 2
    total, differ, n = {"serial": 0.0, "pair": 0.0}, 0, 0
    for r in range(args.rounds):
        tmp = Path(tempfile.mkdtemp(prefix="bench_eval_pair_"))
        outs = {way: [tmp / f"{way}-{i}.json" for i in range(len(args.models))] for way in total}
        runs = {way: [evaluation_args(args, m, o) for m, o in zip(args.models, outs[way])] for way in total}
        t = {way: wall(way, runs[way], half) for way in (("serial", "pair") if r % 2 == 0 else ("pair", "serial"))}
        for way in total:
            total[way] += t[way]
        for a, b in zip(outs["serial"], outs["pair"]):
            ra, rb = rewards(a), rewards(b)
            differ += sum(ra[k] != rb.get(k) for k in ra)
            n += len(ra)
        shutil.rmtree(tmp)
        print(f"round {r}: {len(args.models)} evaluations x {args.attempts} attempts | one process, one after "
              f"another: {t['serial']:.0f} s | two processes at once: {t['pair']:.0f} s | "
              f"ratio {t['pair'] / t['serial']:.2f}", flush=True)
    print(json.dumps({"evaluations": len(args.models), "attempts": args.attempts, "rounds": args.rounds,
                      "serial_s": round(total["serial"], 1), "pair_s": round(total["pair"], 1),
                      "pair_over_serial": round(total["pair"] / total["serial"], 3),
                      "attempts_compared": n, "rewards_that_differ": differ}))


if __name__ == "__main__":
    main()
