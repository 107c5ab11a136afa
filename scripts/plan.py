"""
A real run's plan, printed before its first stage (ablation.sh --model) and kept in its settings.json: per stage the
tokens or episodes it works through, each process's memory (actobs/plan.py: the memory plan, which chooses --fsdp and
--grad-ckpt for the training stages), and a time from FLOPs at a stated MFU (sandboxes and verifiers not counted).
It prints the plan on stderr and the training stages' memory flags on stdout, for ablation.sh to add.

    python -m scripts.plan RUN        # RUN: settings.json, base/model, train.jsonl and tasks/ (scripts.fetch's)
    python -m scripts.plan RUN --gpus 8 --gpu-gib 80 --gpu-name H100   # the same run on another node
"""
import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

import evaluate
import grpo
import probes
import sft
from actobs import labels, plan
from scripts.checks import flags


def devices(gpus=None, gpu_gib=None, gpu_name=None):
    """(kind, count, GiB each, dense bf16 FLOP/s each, name): the GPUs named (gpus, gpu_gib, gpu_name: a node other
    than this one), else the GPUs torchrun will use, else this CPU."""
    import torch
    if gpus:
        flop_s = plan.peak_flop_s(gpu_name)
        if flop_s is None:
            raise SystemExit(f"--gpu-name {gpu_name!r}: one of {', '.join(plan.GPU_PEAK)}")
        return "cuda", gpus, gpu_gib, flop_s, f"{gpu_name} (planned)"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        flop_s = plan.peak_flop_s(props.name)
        if flop_s is None:
            from actobs import common
            flop_s = common.matmul_flop_s(torch.bfloat16)
        return "cuda", torch.cuda.device_count(), props.total_memory / plan.GIB, flop_s, props.name
    from actobs import common
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / plan.GIB
    return "cpu", 1, gib, common.matmul_flop_s(torch.float32), f"{os.cpu_count()} CPU cores"


def sft_tokens(run, model_dir, max_len, sample=256):
    """(rows, mean tokens a row, cut at max_len) of RUN/train.jsonl (scripts.fetch's JSONL), the mean over its first
    `sample` rows; the rest only counted, not read into memory (the paper's 50,000 rows)."""
    path = run / "train.jsonl"
    with open(path) as f:
        head = [labels.check_row(json.loads(line), f"{path}:{i + 1}") for i, line in zip(range(sample), f)]
        rows = len(head) + sum(1 for _ in f)
    tok = labels.load_tokenizer(model_dir, "prefix")
    return rows, statistics.mean(min(len(labels.render(tok, c)[0]), max_len) for c in head)


# Each stage's flags read by the stage's own parser (its defaults included), its required paths standing in
PARSE = {"sft": lambda w: sft.get_parser().parse_args(["--model", "-", "--data", "-", "--out", "-", *w]),
         "grpo": lambda w: grpo.get_parser().parse_args(["--init", "-", "--tasks", "-", "--out", "-", *w]),
         "eval": lambda w: evaluate.parse_args(["--model", "-", "--tasks", "-", *w]),
         "probe": lambda w: probes.get_parser().parse_args(["obs-nll", "--models", "-", "--data", "-", "--out", "-",
                                                            *w])}


def refusals(a, cfg, P, kind, n, gib):
    """Why the run as set cannot run on this node, one line each, naming ablation.sh's array to change (its preset):
    a context beyond the model's positions or an engine's KV cache (plan.length_problems), --tasks-per-step not a
    multiple of the GPUs. a: {stage: its flags as its parser reads them} (PARSE)."""
    cuda = kind == "cuda"
    out = plan.length_problems(cfg, P, {
        "SFT (sft.py)": (a["sft"].max_len, None, None),
        "GRPO (grpo.py)": (a["grpo"].max_len, a["grpo"].max_new_tokens, a["grpo"].gpu_memory if cuda else None),
        "EVAL (evaluate.py)": (a["eval"].max_len, a["eval"].max_new_tokens, a["eval"].gpu_memory if cuda else None),
        "PROBE (probes.py)": (a["probe"].max_len, None, None)}, gpu_gib=gib if cuda else None)
    if cuda and (near := plan.divisible(a["grpo"].tasks_per_step, n)):
        out.append(f"GRPO (grpo.py): --tasks-per-step {a['grpo'].tasks_per_step} does not split over the {n} GPUs "
                   f"(one rank each): {near}")
    return out


def tasks_in(folder):
    return sum(1 for _ in Path(folder).glob("*/task.toml"))


def build(run, node=()):
    """The plan of the run folder (on `node`: devices()' arguments, else this machine): {stages: [{stage, work, GiB a
    process, hours}], memory flags, assumptions}."""
    st = json.loads((run / "settings.json").read_text())["stages"]
    model_dir = run / "base" / "model"
    cfg = plan.shape(model_dir)
    P = plan.n_params(cfg)
    kind, n, gib, flop_s, name = devices(*node)
    a = {k: PARSE[k](shlex.split(st[k])) for k in PARSE}
    arms = st["arms"].split() + st.get("sweep_arms", "").split()
    sft_len, ep_len = a["sft"].max_len, a["grpo"].max_len
    problems = refusals(a, cfg, P, kind, n, gib)
    if problems:
        raise SystemExit("plan: the run cannot start as set (ablation.sh's arrays of the preset "
                         f"{st.get('preset', '')!r}):\n  " + "\n  ".join(problems))
    rows, mean = sft_tokens(run, model_dir, sft_len)
    g = a["grpo"]
    kl = g.kl_coef > 0
    dtype_bytes = 2 if kind == "cuda" else 4
    mem_flags, chosen = (plan.choose(cfg, P, ranks=n, seq_len=max(sft_len, g.micro_tokens), gpu_gib=gib,
                                     kl=kl, gpu_memory=g.gpu_memory) if kind == "cuda" else ([], {}))
    if mem_flags is None:
        raise SystemExit(f"no memory plan fits {n} x {gib:.0f} GiB: SFT {chosen['sft']:.0f} GiB, GRPO "
                         f"{chosen['grpo']:.0f} GiB a rank at the least (a smaller model, or shorter --max-len)")
    kw = dict(ranks=n, dtype_bytes=dtype_bytes, device=kind, fsdp="--fsdp" in mem_flags, kl=kl, gpu_gib=gib,
              grad_ckpt="--grad-ckpt" in mem_flags or kind == "cpu")
    epochs = a["sft"].epochs * (2 if any("obs-then-act" in st.get(f"loss_{arm}", "") for arm in arms) else 1)
    sft_tok = rows * mean * a["sft"].epochs
    episodes = g.steps * g.tasks_per_step * g.group_size
    ep_tokens = ep_len / 2  # assumed: an episode fills half its --max-len
    sets = {s: tasks_in(run / "tasks" / s) for s in ("tb2", "aider")}
    attempts = {k: int(flags(st[k])["--attempts"]) for k in ("eval", "eval_sft", "eval_base")}
    evals = {"eval-sft": sum(sets.values()) * (attempts["eval_base"] + attempts["eval_sft"] * len(st["arms"].split())),
             "eval-grpo": sum(sets.values()) * attempts["eval"] * (len(arms) + bool(st.get("echo")))}

    def hours(**tokens):
        return round(plan.time_s(P, flop_s=flop_s, devices=n, **tokens) / 3600, 2)
    stages = [
        {"stage": "sft", "work": f"{len(arms)} arms x {rows} rows x {mean:.0f} tokens x {epochs} epochs",
         "gib": plan.memory_gib("sft", cfg, P, seq_len=sft_len, **kw),
         "hours": len(arms) * hours(train_tokens=sft_tok)},
        {"stage": "grpo", "work": f"{len(arms) + bool(st.get('echo'))} runs x {episodes} episodes ({g.steps} steps x "
                                  f"{g.tasks_per_step} tasks x {g.group_size}) on {tasks_in(run / 'tasks' / 'rl')} "
                                  "RL tasks",
         "gib": plan.memory_gib("grpo", cfg, P, seq_len=ep_len, max_seqs=g.concurrency, gpu_memory=g.gpu_memory,
                                **kw),
         # a KL term adds the initial policy's forward: 2 P a token beside training's 6 P
         "hours": (len(arms) + bool(st.get("echo"))) * hours(train_tokens=episodes * ep_tokens * (1 + kl / 3),
                                                             generated_tokens=episodes * ep_tokens)},
        *({"stage": k, "work": f"{v} episodes on {', '.join(f'{s} ({c} tasks)' for s, c in sets.items())}",
           "gib": plan.memory_gib("evaluate", cfg, P, seq_len=ep_len, gpu_memory=a["eval"].gpu_memory, **kw),
           "hours": hours(generated_tokens=v * ep_tokens)} for k, v in evals.items()),
        {"stage": "probes", "work": f"{len(st['arms'].split()) + 1} models on the held-out rows",
         "gib": plan.memory_gib("probes", cfg, P, seq_len=sft_len, **kw), "hours": 0.0}]
    return {"model": str(model_dir.resolve()), "params": P, "devices": f"{n} x {name}, {gib:.0f} GiB",
            "memory_flags": mem_flags, "stages": stages,
            "assumptions": f"MFU {plan.MFU['train']} training, {plan.MFU['generate']} sampling, at "
                           f"{flop_s / 1e12:.1f} TFLOP/s a device; an episode half its --max-len ({ep_len}); "
                           "sandboxes, verifiers and weight syncs not counted"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--gpus", type=int, help="plan for a node of this many GPUs instead of this machine")
    p.add_argument("--gpu-gib", type=float, default=80, help="with --gpus: each GPU's memory")
    p.add_argument("--gpu-name", default="H100", help=f"with --gpus: one of {', '.join(plan.GPU_PEAK)}")
    args = p.parse_args(argv)
    out = build(args.run, (args.gpus, args.gpu_gib, args.gpu_name) if args.gpus else ())
    size = f"{out['params'] / 1e9:.2f}B" if out["params"] >= 1e9 else f"{out['params'] / 1e6:.1f}M"
    lines = [f"plan: {size} params on {out['devices']}; training memory flags: "
             f"{' '.join(out['memory_flags']) or 'none'}"]
    for s in out["stages"]:
        lines.append(f"  {s['stage']:<10} {s['work']:<78} {' / '.join(f'{g:.0f}' for g in s['gib'][:2])} GiB a "
                     f"process | ~{s['hours']:.1f} h")
    lines.append(f"  ({out['assumptions']})")
    print("\n".join(lines), file=sys.stderr)
    if not args.gpus:  # the run's own plan, kept with it; another node's is only printed
        path = args.run / "settings.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "plan": out}, indent=2))
    print(" ".join(out["memory_flags"]))


if __name__ == "__main__":
    main()
