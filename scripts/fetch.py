"""
The inputs of a real run (ablation.sh --model), fetched once into a cache or taken from local paths, and laid out
in its run folder as the stages read them:

    RUN/base/model            the model (a Hugging Face id, a local folder, or `tiny`: a small random Qwen3 and a
                              BPE built here on the rows, for a rehearsal on CPU)
    RUN/train.jsonl           the first --rows SFT rows of --data (all with 0), RUN/heldout.jsonl the --heldout after
    RUN/tasks/tb2, tasks/aider   the evaluation task sets (folders of Harbor task folders)
    RUN/tasks/rl              the RL tasks that their own solution solves (the oracle pass: Endless Terminals'
                              solvable split), linked from --rl-tasks

    python -m scripts.fetch runs/real --model Qwen/Qwen3-1.7B --rows 4000 --heldout 256   # fetches the defaults
    python -m scripts.fetch runs/rehearsal --model tiny --data tests/fixtures/nemotron_terminal_sample.json \
        --rows 2 --heldout 1 --tb2 tests/fixtures/tb2-tasks --aider tests/fixtures/aider \
        --rl-tasks tests/fixtures/harbor

A value that is a local path is used as it is; the word `fetch` (the task sets' default) downloads: Terminal-Bench
2.0 and Harbor (its aider-polyglot adapter) with git, Endless Terminals and models with huggingface_hub, all into
--cache (ACTOBS_CACHE, default ~/.cache/actobs). What is already there is reused. Licences: docs/training.md.
"""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import envs
from actobs import labels, tiny
from actobs.tasks import load_task

NEMOTRON = "hf://datasets/nvidia/Nemotron-Terminal-Corpus/dataset_adapters/*.parquet"
TB2_GIT = "https://github.com/harbor-framework/terminal-bench-2"
HARBOR_GIT = "https://github.com/harbor-framework/harbor"
POLYGLOT_GIT = "https://github.com/Aider-AI/polyglot-benchmark"
ENDLESS = "obiwan96/endless-terminals"  # a Hugging Face dataset of Harbor task folders


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run", type=Path, help="the run folder")
    p.add_argument("--model", required=True, help="a Hugging Face model id, a local model folder, or `tiny`")
    p.add_argument("--data", default=NEMOTRON, help="SFT rows: JSONL, a JSON array, parquet (hf:// too) or a "
                   "dataset id")
    p.add_argument("--rows", type=int, default=0, help="SFT rows to take, the first ones (0: all)")
    p.add_argument("--heldout", type=int, default=256, help="rows after those, kept out of SFT for the probes")
    p.add_argument("--tb2", default="fetch", help="Terminal-Bench 2.0's task folders, or `fetch`")
    p.add_argument("--aider", default="fetch", help="aider-polyglot as Harbor task folders, or `fetch` (Harbor's "
                   "adapter over the benchmark's repository)")
    p.add_argument("--rl-tasks", default="fetch", help="the RL task folders (their oracle-solvable ones train), or "
                   "`fetch` (Endless Terminals)")
    p.add_argument("--network", metavar="MODE", help="Docker network of the oracle pass, for tasks that allow the "
                   "internet (Endless Terminals' verifiers fetch uv): bridge, host; default none")
    p.add_argument("--concurrency", type=int, default=8, help="sandboxes of the oracle pass at once")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("ACTOBS_CACHE", "~/.cache/actobs")).expanduser())
    return p


def link(path, target):
    """path -> target (absolute), replacing a link; a real folder in the way is an error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        raise SystemExit(f"{path} exists and is not a link: remove it, or use another run folder")
    path.symlink_to(Path(target).resolve())


def git_clone(url, dest):
    if not (dest / ".git").is_dir():
        subprocess.run(["git", "clone", "--depth", "1", url, str(dest)], check=True)
    return dest


def model(spec, dest, cache, texts):
    """RUN/base/model: a link to a local folder or to the hub's download, or a tiny random Qwen3 built here."""
    if dest.exists():
        return
    if spec == "tiny":  # vLLM's CPU attention takes a head size of 32
        tiny.build_tiny(dest, texts, vocab_size=2048, hidden=64, layers=2, heads=2, kv_heads=1)
    elif Path(spec).is_dir():
        link(dest, spec)
    else:
        from huggingface_hub import snapshot_download
        link(dest, snapshot_download(spec, cache_dir=cache / "hf"))


def rows(data, run, n, heldout):
    """RUN/train.jsonl and RUN/heldout.jsonl: the first n rows of `data` (all with 0), then `heldout` more."""
    if (run / "train.jsonl").exists() and (run / "heldout.jsonl").exists():
        return [m["content"] for c in labels.read_trajectories(run / "train.jsonl")[0] for m in c]
    convs, _ = labels.read_trajectories(data)
    take = convs[: n + heldout] if n else convs
    if len(take) <= heldout:
        raise SystemExit(f"{data}: {len(convs)} rows, need more than --heldout {heldout}")
    train, held = take[: len(take) - heldout], take[len(take) - heldout:]
    labels.write_jsonl(run / "heldout.jsonl", [{"conversations": c} for c in held])
    labels.write_jsonl(run / "train.jsonl", [{"conversations": c} for c in train])
    return [m["content"] for c in train for m in c]


def task_set(spec, name, cache):
    """The folder of a task set: a local path as given, or fetched into the cache."""
    if spec != "fetch":
        if not Path(spec).is_dir():
            raise SystemExit(f"--{name}: {spec} is not a folder of Harbor task folders")
        return Path(spec)
    if name == "tb2":
        return git_clone(TB2_GIT, cache / "terminal-bench-2")
    if name == "rl-tasks":
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(ENDLESS, repo_type="dataset", local_dir=cache / "endless-terminals"))
    out = cache / "aider-polyglot"  # aider: Harbor's adapter, run as Harbor's adapters run, next to the benchmark
    if not out.is_dir():
        adapter = git_clone(HARBOR_GIT, cache / "harbor") / "adapters" / "aider_polyglot"
        git_clone(POLYGLOT_GIT, cache / "polyglot-benchmark")
        cmd = ["uv", "run", "run_adapter.py", "--output-dir", str(out)]
        if subprocess.run(cmd, cwd=adapter).returncode != 0 or not any(out.glob("*/task.toml")):
            raise SystemExit(f"Harbor's aider-polyglot adapter did not make the task folders ({' '.join(cmd)} in "
                             f"{adapter}): make the 225 folders as its README says and pass them: --aider DIR")
    return out


def solvable(src, dest, network, concurrency):
    """dest/: links to the task folders of src whose own solution (solution/solve.sh) scores 1, by the oracle pass
    (envs.run_oracle); a task without a solution is left out. Kept in dest/oracle.tsv: each task and its reward."""
    if (dest / "oracle.tsv").exists():
        return
    folders = sorted(p.parent for p in Path(src).glob("*/task.toml"))
    tasks = [load_task(f) for f in folders]
    with_solution = [(f, t) for f, t in zip(folders, tasks) if t.solution]
    eps = envs.run_oracle([t for _, t in with_solution], concurrency=concurrency, network=network)
    dest.mkdir(parents=True, exist_ok=True)
    for (folder, _), ep in zip(with_solution, eps):
        if ep.reward >= 1.0 and ep.failure is None:
            link(dest / folder.name, folder)
    tsv = "".join(f"{f.name}\t{ep.reward:.2f}\t{ep.failure or ''}\n" for (f, _), ep in zip(with_solution, eps))
    (dest / "oracle.tsv.tmp").write_text(tsv)
    os.replace(dest / "oracle.tsv.tmp", dest / "oracle.tsv")
    n = sum(1 for _ in dest.glob("*/task.toml"))
    print(f"oracle pass: {n} of {len(folders)} tasks solvable ({len(folders) - len(with_solution)} without a "
          f"solution) -> {dest}")
    if n == 0:
        raise SystemExit(f"{src}: no task its own solution solves: nothing to train GRPO on")


def main(argv=None):
    args = get_parser().parse_args(argv)
    args.run.mkdir(parents=True, exist_ok=True)
    texts = rows(args.data, args.run, args.rows, args.heldout)
    model(args.model, args.run / "base" / "model", args.cache, texts)
    for name, spec in (("tb2", args.tb2), ("aider", args.aider), ("rl-tasks", args.rl_tasks)):
        link(args.run / "tasks" / ("rl-all" if name == "rl-tasks" else name), task_set(spec, name, args.cache))
    solvable(args.run / "tasks" / "rl-all", args.run / "tasks" / "rl", args.network, args.concurrency)
    print(f"inputs of {args.run}: the model, {args.run / 'train.jsonl'}, tasks/tb2, tasks/aider, tasks/rl")


if __name__ == "__main__":
    sys.exit(main())
