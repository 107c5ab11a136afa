"""
The CUDA paths that CPU CI cannot run, checked as the stages run them, on every GPU this node gives the job (all, or
CUDA_VISIBLE_DEVICES's): a real run's first stage (ablation.sh). Every line it prints names the GPUs it used and ends
in PASS or FAIL; it exits 1 if any check failed. Nothing is downloaded: the tokenizer is trained here and the
weights are a random init of a real architecture (Qwen3-0.6B's config: bench/realshape.py). ~10 min on 8 H100s.

1. SFT under FSDP2 (torchrun over every GPU, sft.py in bf16 with gradient checkpointing on long synthetic
   trajectories): the loss is finite and falls; tokens/s and peak memory from the run's own log; each rank's work on
   its own GPU.
2. The engine on one GPU (engine.make_engine with sleep mode): sleep frees memory, a training step while it sleeps,
   wake_up and engine.sync_weights after it change what it samples, and the rollout/trainer log-prob mismatch on its
   own samples (grpo.py's train/mismatch_abs; <= 0.01).
3. GRPO under torchrun over every GPU (grpo.py for two steps on toy tasks in sandboxes, one group a rank; needs the
   Docker daemon the run starts): each rank's engine on its own GPU (vLLM's worker device; no process of the run on
   two GPUs), sleep and wake every step, the weight sync's checksums equal across ranks, the mismatch every step.
4. One evaluation per GPU at once (evaluate.py, one process a GPU as ablation.sh spreads them): each on its own GPU,
   each finished with its results.

    python -m bench.gpu_check                     # all four (ablation.sh runs this first on a GPU node)
    python -m bench.gpu_check --skip grpo eval    # without the checks that need Docker
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from actobs import engine, taskgen
from actobs.sandbox import daemon
from bench import realshape
from bench.train import long_trajectory

ROOT = Path(__file__).resolve().parents[1]
FAILED = []


def check(name, ok, detail):
    print(f"{name:<46} {detail:<78} {'PASS' if ok else 'FAIL'}", flush=True)
    if not ok:
        FAILED.append(name)


def gpus():
    """[(torch's index, uuid, name)] of the GPUs this process sees, as nvidia-smi names them (CUDA_VISIBLE_DEVICES's
    order where it is set: indices or UUIDs)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"], capture_output=True,
                         text=True, check=True).stdout
    rows = [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        keys = [v.strip() for v in visible.split(",")]
        rows = [next(r for r in rows if k in (r[0], r[1])) for k in keys]
    return [(i, uuid, name) for i, (_, uuid, name) in enumerate(rows)]


class GPUWatch:
    """nvidia-smi's compute processes polled once a second while a check runs: {pid: {uuid: peak MiB}}. A process's
    pids as nvidia-smi sees them are this machine's unless the job runs in a container with its own pid namespace;
    then none of the run's pids show, and the watch says so (mine() is empty) rather than pass."""

    def __init__(self):
        self.seen, self._stop = {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            for line in out.splitlines():
                pid, uuid, mib = (x.strip() for x in line.split(","))
                if mib.isdigit():
                    per = self.seen.setdefault(int(pid), {})
                    per[uuid] = max(per.get(uuid, 0), int(mib))
            self._stop.wait(1.0)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def mine(self, pids):
        """{pid: {uuid: peak MiB}} of the processes `pids` (the run's), as seen."""
        return {p: self.seen[p] for p in pids if p in self.seen}


def descendants(pid):
    """Every process started under `pid` (children, recursively), from /proc."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in Path(f"/proc/{p}/task").iterdir() for c in (t / "children").read_text().split()]
        except OSError:
            continue
        out.update(kids)
        todo += kids
    return out


def run_watched(cmds, envs, watch):
    """Run the commands at once, recording each one's process tree while it runs. -> [(rc, output tail)], {every pid
    of the runs}."""
    procs = [subprocess.Popen(c, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c, e in zip(cmds, envs)]
    pids, outs = set(p.pid for p in procs), [[] for _ in procs]
    readers = [threading.Thread(target=lambda p=p, o=o: o.extend(p.stdout), daemon=True) for p, o in zip(procs, outs)]
    for r in readers:
        r.start()
    while any(p.poll() is None for p in procs):
        for p in procs:
            pids |= descendants(p.pid)
        time.sleep(0.5)
    for r in readers:
        r.join()
    return [(p.returncode, "".join(o)[-3000:]) for p, o in zip(procs, outs)], pids


def placement(watch, pids, want, uuids):
    """(ok, detail) of where the run's processes held GPU memory: want (a number) GPUs in use, each by processes of
    the run, and no process of the run on two GPUs."""
    mine = watch.mine(pids)
    if not mine:
        return False, "none of the run's processes seen by nvidia-smi (a container with its own pid namespace?)"
    two = {p: sorted(u) for p, u in mine.items() if len(u) > 1}
    used = {u for per in mine.values() for u in per}
    names = {u: i for i, u, _ in uuids}
    where = ", ".join(f"gpu {names.get(u, u)}: {max(per[u] for per in mine.values() if u in per)} MiB"
                      for u in sorted(used, key=lambda u: names.get(u, 99)))
    return not two and len(used) == want, (f"{len(mine)} processes on {len(used)} GPUs ({where})"
                                           + (f"; on two GPUs: {two}" if two else ""))


def sft_check(root, model_dir, convs, args, visible, watch):
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in convs))
    out = root / "sft"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={len(visible)}",
           str(ROOT / "sft.py"), "--model", str(model_dir), "--data", str(data), "--out", str(out),
           "--max-len", str(args.seq_len), "--micro-tokens", str(args.seq_len), "--batch-size", str(4 * len(visible)),
           "--val-size", "1", "--fsdp", "--grad-ckpt", "--dtype", "bf16", "--warmup-ratio", "0", "--eval-every", "0",
           "--save-every", "0", "--stop-after", str(args.sft_steps), "--lr", "3e-4"]
    t0 = time.time()
    [(rc, text)], pids = run_watched([cmd], [dict(os.environ)], watch)
    gpu_list = f"gpus 0-{len(visible) - 1}"
    check(f"sft: FSDP2 on {len(visible)} GPUs runs", rc == 0, f"exit {rc}" + (f": {text[-200:]}" if rc else ""))
    if rc:
        return
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    timed = [r for r in rows if "train/tok_per_s" in r][2:]  # the first steps include allocator warm-up
    tok_s = sum(r["train/tokens"] for r in timed) / max(sum(r["train/step_s"] for r in timed), 1e-9)
    peak = max((r.get("train/peak_mem_gb", 0.0) for r in rows), default=0.0)
    check("sft: loss finite", all(map(math.isfinite, losses)), f"{len(losses)} steps, {gpu_list}")
    check("sft: loss falls (bf16, FSDP2, grad ckpt)", losses[-1] < losses[0], f"{losses[0]:.3f} -> {losses[-1]:.3f}")
    check("sft: throughput", tok_s > 0, f"{tok_s:,.0f} tok/s, peak {peak:.1f} GiB (rank 0), {time.time() - t0:.0f}s")
    check("sft: each rank on its own GPU", *placement(watch, pids, len(visible), visible))


def engine_check(model_dir, visible):
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev)
    llm = engine.make_engine(model_dir, max_model_len=2048, max_seqs=8, dtype="bf16", gpu_memory=0.3, sleep=True)
    on = f"gpu 0 ({visible[0][2]})"
    check("engine: worker on this process's GPU", llm.collective_rpc(engine.worker_device) == [dev], on)
    prompts = [[random.Random(i).randrange(5, 4000) for _ in range(64)] for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=32, top_k=0, top_p=1.0)
    before = [o.outputs[0].token_ids
              for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]

    # a training step with the engine asleep, then wake and sync: the engine must follow the trainer
    free0 = torch.cuda.mem_get_info()[0]
    llm.sleep(level=1)
    freed = (torch.cuda.mem_get_info()[0] - free0) / 2**30
    check("engine: sleep(level=1) frees memory", freed > 0.5, f"{freed:.1f} GiB freed on {on}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.tensor(prompts, device=dev)  # (8, 64)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    torch.cuda.empty_cache()
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
    del llm, model, opt
    torch.cuda.empty_cache()


def toy_tasks(root):
    tasks = root / "tasks"
    for i, kind in enumerate(("rename", "word_count")):
        spec = taskgen.generate(kind, random.Random(i))
        taskgen.write_harbor(spec, tasks / spec.name, daemon.BASE_IMAGE)
    return tasks


# toy limits: a random model's replies rarely parse, so its episodes end at the turn cap
EPISODE = ["--max-turns", "3", "--max-new-tokens", "64", "--max-len", "4096"]


def grpo_check(root, model_dir, visible, watch, steps=2):
    out, n = root / "grpo", len(visible)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           str(ROOT / "grpo.py"), "--init", str(model_dir), "--chat-template", "prefix",
           "--tasks", str(toy_tasks(root)), "--out", str(out), "--steps", str(steps), "--tasks-per-step", str(n),
           "--group-size", "4", *EPISODE, "--lr", "1e-6", "--save-every", str(steps),
           "--echo-coef", "0.05"]  # ECHO: every step updates, signal or not
    [(rc, text)], pids = run_watched([cmd], [dict(os.environ)], watch)
    check(f"grpo.py: torchrun on {n} GPUs runs", rc == 0, f"exit {rc}" + (f": {text[-300:]}" if rc else ""))
    if rc:
        return
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    check("grpo.py: steps logged", [r["step"] for r in rows] == list(range(1, steps + 1)), f"{len(rows)} rows")
    check("grpo.py: each rank's engine on its own GPU", *placement(watch, pids, n, visible))
    spread = max(r.get("train/weights_checksum_spread", math.inf) for r in rows)
    check("grpo.py: weight sync equal on every rank", spread == 0, f"checksum spread {spread} over {n} ranks")
    worst = max(r.get("train/mismatch_abs_rank_max", math.inf) for r in rows)
    check("grpo.py: mismatch every step, worst rank", worst <= 0.01, f"max {worst:.4f} (<= 0.01), after sleep/wake")
    check("grpo.py: final checkpoint", (out / "final" / "config.json").exists(), str(out / "final"))


def eval_check(root, model_dir, visible, watch):
    tasks = root / "tasks" if (root / "tasks").exists() else toy_tasks(root)
    cmds = [[sys.executable, str(ROOT / "evaluate.py"), "--model", str(model_dir), "--tasks", str(tasks),
             "--attempts", "2", *EPISODE, "--out", str(root / f"eval{i}.json")] for i, _, _ in visible]
    envs = [dict(os.environ, CUDA_VISIBLE_DEVICES=uuid) for _, uuid, _ in visible]
    results, pids = run_watched(cmds, envs, watch)
    bad = [f"gpu {i}: exit {rc}: {text[-150:]}" for (i, _, _), (rc, text) in zip(visible, results) if rc]
    check(f"evaluate.py: {len(visible)} at once, one a GPU", not bad, "; ".join(bad) or "every process exit 0")
    done = sum(bool(json.loads((root / f"eval{i}.json").read_text()).get("summary")) for i, _, _ in visible
               if (root / f"eval{i}.json").exists())
    check("evaluate.py: results written", done == len(visible), f"{done}/{len(visible)} results with a summary")
    check("evaluate.py: each process on its own GPU", *placement(watch, pids, len(visible), visible))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per SFT trajectory")
    p.add_argument("--sft-steps", type=int, default=8)
    p.add_argument("--skip", nargs="+", default=[], choices=["sft", "engine", "grpo", "eval"], help="checks not run")
    p.add_argument("--out", default=None, help="work dir (default: a temp dir)")
    args = p.parse_args(argv)
    os.environ.update(engine.IN_PROCESS_ENV)  # the engine in this process, as grpo.py's
    if not torch.cuda.is_available():
        sys.exit("bench.gpu_check needs a CUDA GPU (CPU paths are covered by the test suite)")
    root = Path(args.out or tempfile.mkdtemp(prefix="actobs_gpu_check_"))
    visible = gpus()
    if len(visible) != torch.cuda.device_count():
        sys.exit(f"nvidia-smi names {len(visible)} GPUs, torch sees {torch.cuda.device_count()}")
    rng = random.Random(0)
    convs = [long_trajectory(rng, 4 * args.seq_len) for _ in range(4 * len(visible) * args.sft_steps + 1)]
    model_dir = realshape.checkpoint(root / "model", [m["content"] for c in convs[:20] for m in c], realshape.QWEN3_06B)
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) | work dir {root}")
    for i, uuid, name in visible:
        print(f"  gpu {i}: {name} ({uuid}), {torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB")
    with GPUWatch() as watch:
        if "sft" not in args.skip:
            sft_check(root, model_dir, convs, args, visible, watch)
        if "engine" not in args.skip:
            engine_check(model_dir, visible)
        if "grpo" not in args.skip:
            grpo_check(root, model_dir, visible, watch)
        if "eval" not in args.skip:
            eval_check(root, model_dir, visible, watch)
    print(f"{'all checks passed' if not FAILED else 'FAILED: ' + ', '.join(FAILED)}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
