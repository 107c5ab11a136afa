"""
What sft.py and grpo.py share, plain functions a stage calls: batches by token budget, distributed set-up (torchrun:
DDP or FSDP2), the start of a run and its resume rule, autocast, the optimizer step, atomic checkpoints, the run
record (config.json, log.jsonl, optional W&B) and the scripts' entry point (several runs in one process).
"""
import dataclasses
import functools
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from actobs.labels import PROMPT


# ----------------------------------------------------------------------------------------------------------
# Batches by token budget

def collate(examples, pad_id):
    """[(ids, roles)] -> right-padded batch: input_ids, roles (PROMPT on padding), attention_mask; all (B, T)."""
    T = max(len(ids) for ids, _ in examples)
    B = len(examples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    roles = torch.full((B, T), PROMPT, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    for b, (ids, r) in enumerate(examples):
        input_ids[b, : len(ids)] = torch.as_tensor(ids)
        roles[b, : len(r)] = torch.as_tensor(r)
        attention_mask[b, : len(ids)] = 1
    return {"input_ids": input_ids, "roles": roles, "attention_mask": attention_mask}


def micro_batches(lengths, token_budget, n_micro=0):
    """Length-grouped micro-batches: longest first, each with (rows x longest) <= token_budget (a single
    longer trajectory gets its own). With n_micro, split further (or add empty groups) to exactly that many,
    so all ranks run the same number of forward passes (FSDP's collectives require it)."""
    groups = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    while len(groups) < n_micro:
        big = max(range(len(groups)), key=lambda g: len(groups[g])) if groups else None
        if big is None or len(groups[big]) < 2:
            groups.append([])
        else:
            g = groups.pop(big)
            groups[big:big] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups


# ----------------------------------------------------------------------------------------------------------
# Plots (steplog.plot_curves, probes.py)

def pyplot():
    """matplotlib's pyplot on the Agg backend, imported only when a plot is drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# ----------------------------------------------------------------------------------------------------------
# Distributed set-up, the optimizer step

def load_model(path, device):
    """fp32 master weights (autocast does the bf16 math). A dir with a config but no weights is a random init
    of that architecture: train from scratch, or benchmark a large config without downloading it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    p = Path(path)
    if p.is_dir() and not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        with torch.device(device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(p), dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def under_torchrun():
    return "RANK" in os.environ


def world_size():
    """The ranks of the process group, 1 outside one."""
    return dist.get_world_size() if dist.is_initialized() else 1


def init_distributed():
    """-> (distributed, rank, world, device). torchrun sets RANK / WORLD_SIZE / LOCAL_RANK: join the process
    group, one GPU per rank; plain `python` runs one process."""
    distributed = under_torchrun()
    if distributed:
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return distributed, rank, world, device


@dataclasses.dataclass(frozen=True)
class Run:
    """A training run's handles, from start_run."""
    rank: int
    world: int
    device: torch.device
    out: Path  # --out
    ckpt: Path | None  # the checkpoint to go on from (--resume), or None: a fresh start
    state: dict | None  # its trainer state (optimizer, step, flags, ranks)
    print0: Callable  # print on rank 0, nothing on the others


def start_run(out, flags, free_on_resume, *, resume, fsdp):
    """A training run's start: the process group (torchrun), the run dir `out` made, the checkpoint to go on from with
    resume (resume_point, which checks every one of the run's flags, a {name: value} dict, but those in
    free_on_resume). -> Run, or None when the run in out is finished (final/ exists): nothing to do."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # one line per step is the log; no per-save bars
    distributed, rank, world, device = init_distributed()
    print0 = printer(rank)
    if fsdp and not distributed:
        raise ValueError("--fsdp shards across ranks: launch with torchrun")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt, state, finished = resume_point(out, resume, flags, free_on_resume, world)
    if finished:
        print0(f"{out} is finished (final/ exists); nothing to resume")
        close_distributed()
        return None
    if resume and ckpt is None:
        print0(f"--resume: no checkpoint in {out} yet; starting fresh")
    return Run(rank=rank, world=world, device=device, out=out, ckpt=ckpt, state=state, print0=print0)


def close_distributed():
    """Leave the process group init_distributed joined, all ranks together. A no-op in a single process, even when
    a group exists there: an in-process vLLM engine made its own, which is the engine's to tear down (destroying
    it under a live engine leaves vLLM holding a group torch no longer knows, and the process's next engine fails
    with "process group not initialized")."""
    if under_torchrun() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


RUN_SEPARATOR = ":::"  # between the arguments of runs that share one process (run_cli)


def split_runs(argv):
    """A script's command-line arguments cut at RUN_SEPARATOR: one argument list per run."""
    runs = [[]]
    for a in argv:
        if a == RUN_SEPARATOR:
            runs.append([])
        else:
            runs[-1].append(a)
    if len(runs) > 1 and not all(runs):
        raise SystemExit(f"'{RUN_SEPARATOR}' separates the arguments of two runs: a run's arguments are missing")
    return runs


def run_cli(main):
    """Run main() as a script, once per run: `python grpo.py ARGS ::: ARGS ...` runs main(ARGS) for each argument
    list in order, in this process, so the seconds of importing torch, transformers and vLLM are paid once. Each run
    is what it is alone: main() sets up all its state (models, seeds, its own engine) from its own arguments
    (tests/test_runs.py: the same samples). A run that fails stops the ones after it (exit status non-zero);
    re-running resumes. Under torchrun one run a process: each run would join the process group again."""
    # a terminated run unwinds like an exception (as Ctrl-C does): run_episodes removes its sandboxes on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    runs = split_runs(sys.argv[1:])
    if len(runs) > 1 and under_torchrun():
        raise SystemExit(f"'{RUN_SEPARATOR}': several runs in one process, not under torchrun (launch each run)")
    for i, run in enumerate(runs):
        if len(runs) > 1:
            print(f"== run {i + 1}/{len(runs)}: {' '.join(run)}", flush=True)
        main(run)
    if under_torchrun():
        # A rank leaves without the interpreter's shutdown (its atexit hooks too): FSDP2's modules keep the process
        # group alive past destroy_process_group, so gloo's threads still run while the interpreter tears down, and
        # one of them touching Python then aborts, now and then, a rank that has written everything (exit -6).
        # main() has written, flushed and closed what it writes by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def printer(rank):
    """print on rank 0, nothing on the others."""
    return print if rank == 0 else (lambda *a, **k: None)


def matmul_flop_s(dtype, m=1024, k=1024, n=1024, reps=5):
    """FLOP/s of an (m, k) @ (k, n) matmul on the CPU in this process, with its threads: the best of reps after a
    warm-up, the most a model's matmuls of that shape can do here."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best


# The probe's shape: a 512-token micro-batch through a hidden-256 model's MLP (256 -> 768), where the small models'
# training time goes. A CPU without native bf16 runs it ~45x slower in bf16 (~0.2 s); with it, faster than fp32.
DTYPE_PROBE = (512, 256, 768)


@functools.cache
def cpu_bf16_speedup():
    """fp32's matmul time over bf16's at DTYPE_PROBE on this CPU: > 1 where bf16 is the faster (native bf16: AVX512-BF16
    or AMX), ~0.02 where the CPU emulates it. Measured once a process (< 1 s)."""
    return matmul_flop_s(torch.bfloat16, *DTYPE_PROBE, reps=2) / matmul_flop_s(torch.float32, *DTYPE_PROBE, reps=2)


def resolve_dtype(dtype_flag, device):
    """The compute dtype rule, its one home: --dtype bf16 / fp32 as given; auto -> bf16 on CUDA, on a CPU bf16 only
    where its matmuls measure faster than fp32's (cpu_bf16_speedup), else fp32. -> ("bf16" | "fp32", why)."""
    if dtype_flag != "auto":
        return dtype_flag, f"--dtype {dtype_flag}"
    if device.type == "cuda":
        return "bf16", "auto: CUDA"
    speedup = cpu_bf16_speedup()
    return ("bf16" if speedup > 1 else "fp32"), (f"auto: this CPU's bf16 matmul runs at {speedup:.2f}x fp32's "
                                                  f"({torch.backends.cpu.get_cpu_capability()})")


def autocast(dtype_flag, device):
    """--dtype (resolve_dtype's rule) -> (the context the forward passes run in, the compute dtype, why)."""
    name, why = resolve_dtype(dtype_flag, device)
    bf16 = name == "bf16"
    return (torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext(),
            torch.bfloat16 if bf16 else torch.float32, why)


class LossModule(torch.nn.Module):
    """The model `lm` as a module whose forward runs a function over it: wrapped(batch, *a, fn=f) = f(lm, batch, *a),
    a stage's loss or another pass, so that DDP's / FSDP2's hooks on the wrapper's forward see the whole computation
    (FSDP2 gathers its shards for it, DDP readies its gradient reduction)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, batch, *a, fn):
        return fn(self.lm, batch, *a)


def wrap_model(module, lm, device, *, grad_ckpt, fsdp):
    """The module a run trains, around `module` (a LossModule holding the model `lm`): with grad_ckpt activations
    are recomputed in the backward; with fsdp each decoder layer and then the whole are sharded by FSDP2; else under
    torchrun DDP."""
    if grad_ckpt:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if fsdp:
        shard(module, lm)
    elif dist.is_initialized():
        module = torch.nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None)
    return module


def shard(module, lm):
    """FSDP2 over the ranks: each decoder layer of `lm`, then the whole `module` (which holds lm), sharded; a forward
    of module gathers a layer's weights as it reaches it. Every rank must run as many forwards."""
    from torch.distributed.fsdp import fully_shard
    for layer in lm.base_model.layers:
        fully_shard(layer)
    fully_shard(module)
    return module


def load_optimizer_state(wrapped, opt, state, fsdp):
    """The optimizer state save_checkpoint wrote (a full, unsharded state dict) into `opt` of the wrapped module;
    FSDP2 shards it. -> the step to go on from (0 without a state: a fresh start)."""
    if state is None:
        return 0
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(wrapped, opt, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(state["optimizer"])
    return state["step"]


def all_reduce(values, device, op=dist.ReduceOp.SUM):
    """Reduce a list of floats across ranks (identity when not distributed)."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_gather(obj):
    """Every rank's `obj` (any picklable value), in rank order; [obj] when not distributed."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rank_micro_batches(lengths, token_budget, device):
    """micro_batches() of this rank's examples, as many as the rank that needs the most: every rank runs the same
    number of forward passes (DDP's and FSDP's collectives require it)."""
    groups = micro_batches(lengths, token_budget)
    n_micro = int(all_reduce([len(groups)], device, dist.ReduceOp.MAX)[0])
    if n_micro > len(groups):  # another rank needs more passes: split ours to match
        groups = micro_batches(lengths, token_budget, n_micro)
    return groups


def grad_sync(wrapped, last, world, fsdp):
    """The context of one micro-batch's backward. DDP: all-reduce grads once, after the last micro-batch. FSDP2
    reduce-scatters after every micro-batch: skipping that would keep a full unsharded gradient on every rank."""
    return wrapped.no_sync() if world > 1 and not fsdp and not last else nullcontext()


def optimizer_step(wrapped, opt, grad_clip, step, log):
    """Clip, step, zero the grads; -> the grad norm before clipping (the same on every rank). A non-finite norm (an
    overflow or a broken batch) drops the update rather than poison the weights and Adam's moments, and says so
    through log (rank 0's print)."""
    gnorm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
    if math.isfinite(gnorm):
        opt.step()
    else:
        log(f"step {step + 1}: grad norm {gnorm}, update skipped")
    opt.zero_grad(set_to_none=True)
    return gnorm


# ----------------------------------------------------------------------------------------------------------
# Checkpoints, resume, and the record of what ran

def checkpoint_dirs(out):
    """Complete step checkpoints in out, oldest first (a dir is complete once renamed from its .tmp name)."""
    return sorted((p for p in Path(out).glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")
                   and (p / "trainer_state.pt").exists()), key=lambda p: int(p.name.split("-")[1]))


RUN_FLAGS = ("out", "save_every", "keep", "resume", "wandb")  # add_run_flags': free to change on --resume


def add_run_flags(parser, files, save_every):
    """The "run" flag group of a training stage (where its run writes, how often; both stages let --resume change
    them: RUN_FLAGS): --out (config.json, log.jsonl, `files`, step-N/ checkpoints, final/), --save-every, --keep,
    --resume, --wandb. -> the group, for a stage's own run flags."""
    g = parser.add_argument_group("run")
    g.add_argument("--out", required=True, help=f"run dir: config.json, log.jsonl, {files}step-N/ checkpoints, final/")
    g.add_argument("--save-every", type=int, default=save_every, help="checkpoint every N steps (0 = only at the end)")
    g.add_argument("--keep", type=int, default=2, help="step checkpoints kept on disk (final/ is always kept)")
    g.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    g.add_argument("--wandb", metavar="PROJECT", help="also log every log.jsonl row to this Weights & Biases "
                   "project (pip install wandb; offline under OUT/wandb/ when W&B is unreachable)")
    return g


def resume_point(out, resume, flags, free_on_resume, world):
    """-> (newest complete checkpoint dir or None, its trainer state or None, finished). Never mixes two runs in
    one dir: a fresh start needs an unused out; resume continues the newest checkpoint only with every one of the
    run's flags ({name: value}) as it was but those a stage declares free_on_resume (how the run computes, where it
    writes), and as many ranks as wrote it; finished: final/ exists, nothing to resume."""
    ckpts = checkpoint_dirs(out)
    if not resume and (ckpts or (out / "final").exists() or (out / "log.jsonl").exists()):
        raise ValueError(f"{out} already holds a run: pass --resume to continue it, or choose another --out")
    if resume and (out / "final").exists():
        return None, None, True
    if not ckpts:
        return None, None, False
    state = torch.load(ckpts[-1] / "trainer_state.pt", map_location="cpu", mmap=True, weights_only=False)
    changed = [f"--{k.replace('_', '-')} {state['args'].get(k)!r} -> {v!r}" for k, v in flags.items()
               if k not in free_on_resume and state["args"].get(k) != v]
    if changed:
        raise ValueError(f"--resume from {ckpts[-1]} with other settings than it was trained with: "
                         f"{', '.join(changed)}")
    if state["world"] != world:
        raise ValueError(f"{ckpts[-1]} was written by {state['world']} ranks; resume with as many")
    return ckpts[-1], state, False


def save_checkpoint(path, wrapped, lm, tok, opt, step, flags, rank, *, fsdp, rng=True):
    """HF model + tokenizer (chat template included) + optimizer state, the step and the run's flags ({name: value},
    what resume_point checks) (+ each rank's RNG state with rng=True), written to path.tmp then renamed: a crash
    mid-write never leaves a checkpoint that looks complete. fsdp: the model and optimizer are sharded (FSDP2)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if fsdp:  # gather full (unsharded) states onto rank 0's CPU
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(lm, options=opts)
        osd = get_optimizer_state_dict(wrapped, opt, options=opts) if opt is not None else None
    else:
        sd, osd = lm.state_dict(), opt.state_dict() if opt is not None else None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        lm.save_pretrained(tmp, state_dict=sd)
        tok.save_pretrained(tmp)
        if opt is not None:
            torch.save({"optimizer": osd, "step": step, "args": flags,
                        "world": world_size()}, tmp / "optimizer.pt")
    barrier()
    if opt is not None and rng:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        torch.save({"torch": torch.get_rng_state(), "cuda": cuda}, tmp / f"rng-{rank}.pt")
    barrier()
    if rank == 0:
        if opt is not None:  # the marker of a complete checkpoint, written last
            os.replace(tmp / "optimizer.pt", tmp / "trainer_state.pt")
        old = path.with_name(path.name + ".old")
        if path.exists():  # move aside first: at every moment a complete `path` or `path.old` exists
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def prune_checkpoints(out, keep, rank):
    """Delete all but the newest `keep` complete step checkpoints (rank 0)."""
    for old in checkpoint_dirs(out)[: -keep] if rank == 0 else []:
        shutil.rmtree(old)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def adamw(params, *, lr, betas, eps, weight_decay):
    """The optimizer of both training stages: AdamW over params with a stage's --lr, --adam-betas, --adam-eps,
    --weight-decay."""
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)


