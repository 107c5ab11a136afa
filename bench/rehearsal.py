"""
A CPU rehearsal of the README's real run ("A real run") at Qwen3-0.6B's shape, before GPU time is spent on it: each
stage's script launched as the README launches it (torchrun where the README uses ranks: here 2 gloo ranks, one
thread each), with the README's memory flags, on a random init of Qwen3-0.6B's config (bench/realshape.py: a BPE
trained here with Qwen's special tokens, a few thousand tokens, the model's 151,936-row vocabulary padded past it;
Qwen3's chat template; the published Nemotron-Terminal-Corpus rows of tests/fixtures). Not in CI.

    python -m bench.rehearsal                    # Qwen3-0.6B's shape; a stage planned past the free memory is skipped
    python -m bench.rehearsal --hidden 512       # its vocabulary and 28 layers, hidden narrowed: GRPO's ranks fit 24 GB
    python -m bench.rehearsal --plan             # the memory plan of every stage; nothing runs
    python -m bench.rehearsal --tiny             # a toy shape: a smoke run of this script (minutes)
    python -m bench.rehearsal --stages sft,probes                  # some stages (a later one reuses an earlier output)

By the plan (fp32 on a CPU without native bf16, --len 2048), GRPO's two ranks at hidden 1,024 need ~28 GiB: on a
24 GB machine the default run skips that stage, and --hidden 512 (~14 GiB) runs it; SFT needs ~17 GiB.

Stages, in order, each writing under --out (default runs/rehearsal/<shape>), each reading the one before's output:
  head      bench.head's peak part: the chunked head (head.token_loss) vs full logits, V rows x --len tokens
  sft       torchrun sft.py --fsdp --grad-ckpt --micro-tokens LEN --max-len LEN: 2 steps of one Nemotron row per rank,
            a checkpoint after step 2 (the optimizer state gathered on rank 0, as every --save-every), then final/
  grpo      torchrun grpo.py --init sft/final --fsdp --grad-ckpt --micro-tokens LEN --echo-coef 0.05: 1 step on toy
            tasks, a group of 2 a rank, 2 turns of 32 tokens (ECHO makes the step train and sync: a random policy's
            groups have no signal), a checkpoint; each rank's trainer, reference copy and engine   [Docker]
  evaluate  python evaluate.py --model grpo/final: 1 attempt of each toy task   [Docker]
  probes    python probes.py obs-nll --models base sft/final on 2 Nemotron rows

Each row: the exit status; each rank's peak resident memory (VmHWM from /proc, polled) and the stage's peak total
(its processes' VmRSS summed, sampled every 0.2 s; shared pages count in every process that maps them; Docker's
sandboxes are not in it); the plan (plan_gib); the step times from the script's own log (sft: train/step_s, grpo:
time/step_s, evaluate: seconds an attempt); GRPO's weight sync (time/sync_s, and of it the trainer's side:
FSDP2's gathers, the checksum, the casts: time/sync_gather_s); the engine's KV cache (the tokens vLLM
logs, the bytes engine.py gives it); the head's peaks. The table is printed at the end (markdown) and written with
everything to OUT/rehearsal.json. Smaller than the real run, for the CPU's sake: 2 ranks, --len 2048 (not 16,384;
it must pass the Nemotron rows' prompts, ~1.4k tokens with the 4,096-token BPE, or SFT has nothing to learn),
steps, tasks, replies, concurrency 2.
"""
import argparse
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from actobs import common, plan, runlog
from actobs.sandbox import daemon
from bench import realshape

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("head", "sft", "grpo", "evaluate", "probes")
# the tests' vLLM-sized model (tests/conftest.py vllm_dir), its vocabulary padded past a 1,024-token BPE as the real one
TINY = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, vocab_size=4096, tie_word_embeddings=True, rope_theta=1000000, max_position_embeddings=32768,
            rms_norm_eps=1e-6)
SFT_STEPS, GRPO_STEPS = 2, 1
ROLLOUT = dict(group=2, turns=2, new_tokens=32, concurrency=2)  # GRPO's and evaluate's episodes, per rank
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size")


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("shape")
    g.add_argument("--hidden", type=int, help="narrow the hidden size (MLP 3x it; heads, head size, layers and "
                   "vocabulary kept), e.g. 512 where two GRPO ranks at 1,024 do not fit")
    g.add_argument("--layers", type=int, help="another number of layers")
    g.add_argument("--tiny", action="store_true", help="a toy model (hidden 64, 2 layers, vocab 4,096 over a 1,024 "
                   "BPE) and --len 3072: a smoke run of this script")
    g = p.add_argument_group("run")
    g.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    g.add_argument("--len", type=int, help="tokens of a trajectory, an episode, a micro-batch and the head's rows "
                   "(default 2048; --tiny 3072)")
    g.add_argument("--ranks", type=int, default=2, help="torchrun ranks of sft and grpo")
    g.add_argument("--tasks", type=int, default=2, choices=[1, 2], help="toy tasks for grpo and evaluate")
    g.add_argument("--out", type=Path, help="work dir (default runs/rehearsal/<shape>); a stage's folder is replaced")
    g.add_argument("--plan", action="store_true", help="print the memory plan and stop")
    g.add_argument("--force", action="store_true", help="run a stage even where its plan exceeds the free memory")
    return p


# ----------------------------------------------------------------------------------------------------------
# The plan: memory from parameter counts

def plan_gib(stage, cfg, P, args, dtype_bytes):
    """Planned peak resident GiB of each process of a stage (rank 0 first), from the parameter count P: the head's
    full logits (its logits, their softmax and its gradient) against the chunked head's block; every other stage
    as plan.memory_gib plans it on a CPU (--fsdp --grad-ckpt, grpo.py without a KL term: no initial policy)."""
    if stage == "head":
        V, H, T = cfg["vocab_size"], cfg["hidden_size"], args.len
        return [round((plan.RUNTIME_GIB["torch"] * plan.GIB + 3 * 4 * T * V + 2 * 4 * V * H) / plan.GIB, 2)]
    return plan.memory_gib(stage, cfg, P, ranks=args.ranks, seq_len=args.len, dtype_bytes=dtype_bytes, device="cpu",
                           max_seqs=ROLLOUT["concurrency"])


def fits(stage, cfg, args, dtype_bytes, free):
    """-> None if the stage's plan fits 90% of `free` GiB (the plan is rough), else why not and the widest --hidden
    whose plan does."""
    need, avail = sum(plan_gib(stage, cfg, plan.n_params(cfg), args, dtype_bytes)), 0.9 * free
    if need <= avail:
        return None
    ok = [h for h in (768, 512, 384, 256, 128) if h < cfg["hidden_size"] and sum(plan_gib(
        stage, realshape.narrow(cfg, h), plan.n_params(realshape.narrow(cfg, h)), args, dtype_bytes)) <= avail]
    return f"plan {need:.1f} GiB > 90% of {free:.1f} GiB free" + (f": --hidden {ok[0]} fits" if ok else "")


def mem_available_gib():
    return int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text())[1]) / 2 ** 20


# ----------------------------------------------------------------------------------------------------------
# A stage: a subprocess, its memory polled from /proc

def proc_tree(pid):
    """pid and all its descendants (those alive now)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(c) for t in Path(f"/proc/{p}/task").iterdir() for c in (t / "children").read_text().split()]
        except OSError:  # gone while read
            pass
    return out


def status_kib(pid, key):
    try:
        return int(re.search(rf"{key}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())[1])
    except (OSError, TypeError):
        return 0


def rank_of(pid, launcher):
    """The RANK of a worker torchrun started (a child of the launcher with a RANK; their children inherit it), or
    None."""
    if status_kib(pid, "PPid") != launcher:
        return None
    try:
        env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        return int(env["RANK"]) if "RANK" in env else None
    except OSError:
        return None


def run_stage(cmd, log, ranked, env=None):
    """cmd to completion, its output to `log`; ranked: torchrun's workers are the ranks, else the process is rank 0.
    -> (exit status, wall seconds, {rank: peak VmHWM GiB}, peak of the processes' summed VmRSS in GiB)."""
    peaks, total = {}, 0
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        ranks = {} if ranked else {proc.pid: 0}
        try:
            while proc.poll() is None:
                tree = proc_tree(proc.pid)
                if ranked:  # torchrun's workers, once they exist
                    ranks.update({p: r for p in tree if p not in ranks and (r := rank_of(p, proc.pid)) is not None})
                for p, r in ranks.items():
                    peaks[r] = max(peaks.get(r, 0), status_kib(p, "VmHWM"))
                total = max(total, sum(status_kib(p, "VmRSS") for p in tree))
                time.sleep(0.2)
        except BaseException:  # Ctrl-C: the stage unwinds as on SIGTERM (its sandboxes removed), then we stop
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
    return proc.returncode, time.time() - t0, {r: round(k / 2 ** 20, 2) for r, k in sorted(peaks.items())}, \
        round(total / 2 ** 20, 2)


# ----------------------------------------------------------------------------------------------------------
# Inputs, the stages' commands, what their outputs say

def inputs(root, cfg, args):
    """root/base (the random-init checkpoint, rebuilt when its config is another), root/rows.jsonl (the Nemotron
    rows, repeated to one per rank per SFT step plus one held out), root/tasks (toy Harbor tasks) -> their paths."""
    rows = realshape.nemotron_rows()
    base = root / "base"
    saved = json.loads((base / "config.json").read_text()) if (base / "config.json").exists() else {}
    if any(saved.get(k) != cfg[k] for k in SHAPE_KEYS):
        shutil.rmtree(base, ignore_errors=True)
        print(f"building {base}: a BPE on the Nemotron rows, a random init of the config", flush=True)
        realshape.checkpoint(base, [m["content"] for c in rows for m in c], cfg, bpe_vocab=args.bpe_vocab)
    data = root / "rows.jsonl"
    n = args.ranks * SFT_STEPS + 1  # exactly SFT_STEPS steps of one row a rank, and one held out
    data.write_text("".join(json.dumps({"conversations": c}) + "\n"
                            for c in itertools.islice(itertools.cycle(rows), n)))
    tasks = root / "tasks"
    shutil.rmtree(tasks, ignore_errors=True)
    from actobs import taskgen
    for i, kind in enumerate(("rename", "word_count")[: args.tasks]):
        spec = taskgen.generate(kind, random.Random(i))
        taskgen.write_harbor(spec, tasks / spec.name, daemon.BASE_IMAGE)
    return base, data, tasks


def commands(root, base, data, tasks, cfg, args):
    """{stage: (argv, ranked)}: each script with the README's flags for its stage, at this rehearsal's sizes."""
    L, W = str(args.len), str(args.ranks)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={W}"]
    sft_final, grpo_final = root / "sft" / "final", root / "grpo" / "final"
    r = {k: str(v) for k, v in ROLLOUT.items()}
    rollout = ["--max-turns", r["turns"], "--max-new-tokens", r["new_tokens"], "--max-len", L,
               "--concurrency", r["concurrency"]]
    return {
        "head": ([sys.executable, "-m", "bench.head", "--part", "peak", "--vocab", str(cfg["vocab_size"]),
                  "--tokens", L, "--sft-len", L, "--hidden", str(cfg["hidden_size"]),
                  "--json", str(root / "head" / "peaks.json")], False),
        "sft": ([*torchrun, "sft.py", "--model", str(base), "--data", str(data), "--out", str(root / "sft"),
                 "--lam", "1.0", "--max-len", L, "--fsdp", "--grad-ckpt", "--micro-tokens", L, "--batch-size", W,
                 "--val-size", "1", "--save-every", str(SFT_STEPS)], True),
        "grpo": ([*torchrun, "grpo.py", "--init", str(sft_final), "--tasks", str(tasks), "--out", str(root / "grpo"),
                  "--fsdp", "--grad-ckpt", "--micro-tokens", L, "--steps", str(GRPO_STEPS), "--tasks-per-step", W,
                  "--group-size", r["group"], *rollout, "--echo-coef", "0.05", "--save-every", str(GRPO_STEPS)], True),
        "evaluate": ([sys.executable, "evaluate.py", "--model", str(grpo_final if grpo_final.exists() else sft_final),
                      "--tasks", str(tasks), "--attempts", "1", *rollout,
                      "--out", str(root / "evaluate" / "results.json")], False),
        "probes": ([sys.executable, "probes.py", "obs-nll", "--models", str(base), str(sft_final), "--data", str(data),
                    "--n", "2", "--max-len", L, "--out", str(root / "probes" / "obs.json")], False)}


def needs(stage, root, docker):
    """Why the stage cannot run now, or None."""
    if stage in ("grpo", "probes") and not (root / "sft" / "final").exists():
        return "needs sft/final: run the sft stage"
    if stage == "evaluate" and not any((root / s / "final").exists() for s in ("grpo", "sft")):
        return "needs grpo/final or sft/final"
    if stage in ("grpo", "evaluate") and docker:
        return docker
    return None


def docker_missing():
    """None when a Docker daemon answers and holds the sandboxes' base image, else why not."""
    try:
        daemon.docker_client().images.get(daemon.BASE_IMAGE)
        return None
    except Exception as e:  # no daemon, no SDK, no image
        return f"no Docker: {str(e)[:80]}"


def kv_cache(log_text, cfg, args, dtype_bytes):
    """The engine's KV cache: the size vLLM logs (tokens, each rank's once) and the bytes engine.py gives it."""
    from actobs import engine
    from transformers import Qwen3Config
    tokens = re.findall(r"KV cache size: ([\d,]+) tokens", log_text)
    size = engine.kv_cache_bytes(Qwen3Config(**cfg), max_model_len=args.len, max_seqs=ROLLOUT["concurrency"],
                                 dtype_bytes=dtype_bytes)
    return f"{' / '.join(tokens) or '?'} tok, {size / 2 ** 30:.2f} GiB"


def results(stage, root, log_text, cfg, args, dtype_bytes):
    """What a finished stage's own outputs say: step_s, sync_s (lists), kv, head; missing outputs leave them out."""
    def log_rows(d):
        f = root / d / "log.jsonl"
        return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []
    out = {}
    if stage == "sft":
        out["step_s"] = [r["train/step_s"] for r in log_rows("sft") if "train/step_s" in r]
    elif stage == "grpo":
        rows = log_rows("grpo")
        out.update(step_s=[r["time/step_s"] for r in rows], sync_s=[r["time/sync_s"] for r in rows],
                   sync_gather_s=[r["time/sync_gather_s"] for r in rows],
                   times=[{k: r[k] for k in r if k.startswith("time/")} for r in rows])
    elif stage == "evaluate" and (root / "evaluate" / "results.json").exists():
        t = json.loads((root / "evaluate" / "results.json").read_text())["configs"][-1].get("time", {})
        out["step_s"] = [t["phases"]["attempt_s"]["mean_s"]] if t else []
        out["setup_s"] = t.get("setup_s")
    elif stage == "head" and (root / "head" / "peaks.json").exists():
        h = json.loads((root / "head" / "peaks.json").read_text())[0]
        out["head"] = (f"chunked {h['forward grads'] / 2 ** 30:.2f} / full logits {h['full logits'] / 2 ** 30:.2f} "
                       f"GiB ({h['tokens']} rows)")
        out["head_bytes"] = h
    if stage in ("grpo", "evaluate"):
        out["kv"] = kv_cache(log_text, cfg, args, dtype_bytes)
    return out


def table(rows):
    """The rows as a markdown table."""
    cols = ("stage", "rc", "wall s", "peak RSS per rank, GiB", "peak total, GiB", "plan, GiB", "step s",
            "sync s (trainer's side)", "KV cache", "head peak", "note")

    def cell(r):
        nums = lambda xs: " / ".join(f"{x:.1f}" for x in xs) if xs else "-"  # noqa: E731
        return [r["stage"], str(r.get("rc", "-")), f"{r['wall_s']:.0f}" if "wall_s" in r else "-",
                " / ".join(f"{v:.2f}" for v in r.get("rank_peak_gib", {}).values()) or "-",
                f"{r['total_peak_gib']:.2f}" if "total_peak_gib" in r else "-",
                " / ".join(f"{v:.1f}" for v in r["plan_gib"]), nums(r.get("step_s")),
                f"{nums(r.get('sync_s'))} ({nums(r.get('sync_gather_s'))})" if r.get("sync_s") else "-",
                r.get("kv", "-"), r.get("head", "-"), r.get("note", "")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r)) + " |" for r in rows])


# ----------------------------------------------------------------------------------------------------------

def main(argv=None):
    args = get_parser().parse_args(argv)
    stages = args.stages.split(",")
    if set(stages) - set(STAGES):
        raise SystemExit(f"--stages: unknown {', '.join(sorted(set(stages) - set(STAGES)))}; of {', '.join(STAGES)}")
    args.len = args.len or (3072 if args.tiny else 2048)  # past the Nemotron rows' prompts, ~2.1k and ~1.4k tokens
    args.bpe_vocab = 1024 if args.tiny else 4096  # the BPE's tokens; the model's vocabulary is the config's
    cfg = realshape.narrow(TINY if args.tiny else realshape.QWEN3_06B, args.hidden, args.layers)
    shape = f"{'tiny-' if args.tiny else ''}h{cfg['hidden_size']}-l{cfg['num_hidden_layers']}"
    root = (args.out or ROOT / "runs" / "rehearsal" / shape).resolve()
    P = plan.n_params(cfg)
    import torch
    dtype, why = common.resolve_dtype("auto", torch.device("cpu"))  # what the stages' --dtype auto will choose
    dtype_bytes = 2 if dtype == "bf16" else 4
    header = (f"{'toy shape (--tiny)' if args.tiny else 'Qwen3-0.6B shape'}: {cfg['num_hidden_layers']} layers, "
              f"hidden {cfg['hidden_size']}, MLP {cfg['intermediate_size']}, {cfg['num_attention_heads']} heads / "
              f"{cfg['num_key_value_heads']} kv of {cfg['head_dim']}, vocab {cfg['vocab_size']:,} (a BPE of "
              f"{args.bpe_vocab:,} padded) | {P / 1e6:.1f}M params | {dtype} ({why}) | len {args.len} | "
              f"{args.ranks} ranks | {mem_available_gib():.1f} GiB free")
    print(f"{header} | {root}", flush=True)
    plans = {s: plan_gib(s, cfg, P, args, dtype_bytes) for s in STAGES}
    if args.plan:
        for s in STAGES:
            print(f"{s:<9} plan {' / '.join(f'{x:.1f}' for x in plans[s])} GiB (rank 0 first), {sum(plans[s]):.1f} "
                  f"in all")
        return
    root.mkdir(parents=True, exist_ok=True)
    base, data, tasks = inputs(root, cfg, args)
    docker = docker_missing() if {"grpo", "evaluate"} & set(stages) else None
    rows = []
    for stage in stages:
        row = {"stage": stage, "plan_gib": plans[stage]}
        cmd, ranked = commands(root, base, data, tasks, cfg, args)[stage]
        why_not = needs(stage, root, docker) or (None if args.force else fits(stage, cfg, args, dtype_bytes,
                                                                              mem_available_gib()))
        if why_not:
            print(f"== {stage}: skipped: {why_not}", flush=True)
            rows.append({**row, "note": f"skipped: {why_not}"})
            continue
        shutil.rmtree(root / stage, ignore_errors=True)
        (root / stage).mkdir()
        log = root / stage / "stage.log"
        print(f"== {stage}: {' '.join(cmd)}\n   log: {log}", flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1"} if ranked else None  # one thread a rank (the tests' setting)
        rc, wall, peaks, total = run_stage(cmd, log, ranked, env)
        text = log.read_text(errors="replace")
        row.update(rc=rc, wall_s=wall, rank_peak_gib=peaks, total_peak_gib=total,
                   **results(stage, root, text, cfg, args, dtype_bytes))
        if rc:
            row["note"] = "failed: see its log"
            print(text[-3000:])
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
    summary = f"{header}\n\n{table(rows)}"
    print("\n" + summary)
    (root / "rehearsal.json").write_text(json.dumps(
        {"config": cfg, "params": P, "dtype": dtype, "why": why, "args": vars(args) | {"out": str(root)},
         "commit": runlog.code_state()["git"], "rows": rows, "table": summary}, indent=2, default=str))
    print(f"-> {root / 'rehearsal.json'}")
    sys.exit(1 if any(r.get("rc") for r in rows) else 0)


if __name__ == "__main__":
    main()
