"""
The inputs of a real run (ablation.sh --model), fetched once into a cache or taken from local paths, and laid out
in its run folder as the stages read them:

    RUN/base/model            the model (a Hugging Face id, a local folder, or `tiny`: a small random Qwen3 and a
                              BPE built here on the rows, for a rehearsal on CPU)
    RUN/train.jsonl           --rows SFT rows drawn at random (--seed) across --data's files (0: all), and
                              RUN/heldout.jsonl --heldout more, for the probes (scripts/rows.py)
    RUN/prompt_template.txt   the prompt RL and evaluation give the policy: the one the rows were written with
                              (--prompt-template rows), Harbor's current Terminus-2 template (harbor), or a file
    RUN/data_stats.json       the rows' counts, tokens and observation share, and how the prompt was found
    RUN/tasks/tb2, tasks/aider   the evaluation task sets (folders of Harbor task folders), their images built
    RUN/tasks/rl              the RL tasks: those of --rl-tasks (Endless Terminals) that their own solution solves
                              (the oracle pass, resumable: tasks/oracle.jsonl), less --rl-heldout of them drawn with
                              --seed (tasks/rl-heldout); tasks/malformed.tsv names the folders left out
    RUN/tasks/tasks.json      where each set's images came from, the RL split's counts (RUN/settings.json keeps
                              this and data_stats.json as `inputs`)

    python -m scripts.fetch runs/real --model Qwen/Qwen3-1.7B --rows 4000 --heldout 256   # fetches the defaults
    python -m scripts.fetch runs/rehearsal --model tiny --data tests/fixtures/nemotron_terminal_sample.json \
        --rows 2 --heldout 1 --tb2 tests/fixtures/tb2-tasks --aider tests/fixtures/aider \
        --rl-tasks tests/fixtures/harbor --rl-heldout 1 --offline-images

A value that is a local path is used as it is; the defaults download: Nemotron-Terminal-Corpus's synthetic part and
Endless Terminals with huggingface_hub, Terminal-Bench 2.0, Harbor's aider-polyglot adapter and the polyglot
benchmark with git (the adapter runs under uv), all into --cache (ACTOBS_CACHE, default ~/.cache/actobs), each
download retried with backoff; what is already there is reused. Task images are the benchmarks' own: task.toml's
prebuilt docker_image, else environment/Dockerfile on its FROM images, pulled (actobs/tasks.py); --offline-images
takes the images that are here instead (the stand-in: `python envs.py base-image --standin`). Licences:
docs/training.md.
"""
import argparse
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

import envs
from actobs import terminus, tiny
from actobs.episode import INFRA_FAILURES, solved
from actobs.sandbox import network
from actobs.tasks import load_task
from scripts import rows

# Nemotron-Terminal-Corpus's synthetic part (its skill_based easy / medium / mixed configs): what the paper trains on
NEMOTRON = "hf://datasets/nvidia/Nemotron-Terminal-Corpus/synthetic_tasks"
TB2_GIT = "https://github.com/harbor-framework/terminal-bench-2"
# Harbor's adapters live in their own repository: src/<name>/, a uv project run as `uv run <name>` (its
# docs/adapters.mdx); aider_polyglot's entry point as read at this commit
ADAPTERS_GIT = "https://github.com/harbor-framework/adapters"
ADAPTERS_COMMIT = "f35e93b3dd0bee0d69045f7c9e02b3ea5540c6a5"
POLYGLOT_GIT = "https://github.com/Aider-AI/polyglot-benchmark"
ENDLESS = "obiwan96/endless-terminals"  # a Hugging Face dataset of Harbor task folders
HARBOR_TEMPLATE = "harbor/agents/terminus_2/templates/terminus-json-plain.txt"
RETRY_WAIT = 2.0  # seconds before a download's second try; doubled for each one after
# Errors that another try cannot mend (a name that does not exist, a gated repository, the hub switched off)
PERMANENT = {"RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError", "GatedRepoError",
             "LocalEntryNotFoundError", "OfflineModeIsEnabled"}


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run", type=Path, help="the run folder")
    p.add_argument("--model", required=True, help="a Hugging Face model id, a local model folder, or `tiny`")
    p.add_argument("--seed", type=int, default=0, help="the draw of the rows and of the RL held-out tasks")
    g = p.add_argument_group("the SFT rows")
    g.add_argument("--data", default=NEMOTRON, help="parquet, JSONL or JSON-array files: a file, a folder (its "
                   "parquet files), a glob, or hf://datasets/ID/PATH (downloaded)")
    g.add_argument("--rows", type=int, default=0, help="SFT rows to draw (0: all)")
    g.add_argument("--heldout", type=int, default=256, help="rows more, kept out of SFT for the probes")
    g.add_argument("--prompt-template", default="rows", help="the prompt of RL and evaluation: `rows` (the one the "
                   "rows were written with), `harbor` (Harbor's current Terminus-2 template) or a file")
    g = p.add_argument_group("the task sets")
    g.add_argument("--tb2", default="fetch", help="Terminal-Bench 2.0's task folders, or `fetch`")
    g.add_argument("--aider", default="fetch", help="aider-polyglot as Harbor task folders, or `fetch` (Harbor's "
                   "adapter over the benchmark's repository)")
    g.add_argument("--rl-tasks", default="fetch", help="the RL task folders (their oracle-solvable ones train), or "
                   "`fetch` (Endless Terminals)")
    g.add_argument("--rl-heldout", type=int, default=100, help="solvable RL tasks drawn (--seed) and kept out of "
                   "GRPO (tasks/rl-heldout)")
    g.add_argument("--offline-images", action="store_true", help="use the task images' FROM and prebuilt images as "
                   "they are here (the stand-in) instead of pulling them")
    g.add_argument("--network", choices=(network.EGRESS, network.HOST), help="the network of the oracle pass, for "
                   "tasks that allow the internet (Endless Terminals' verifiers fetch uv): egress (the internet "
                   "through NAT, nothing of the host's), host; default none")
    g.add_argument("--concurrency", type=int, default=8, help="sandboxes of the oracle pass at once")
    g.add_argument("--build-concurrency", type=int, default=4, help="task images built at once")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("ACTOBS_CACHE", "~/.cache/actobs")).expanduser())
    return p


def retry(fn, what, tries=5):
    """fn() until it returns, at most `tries` times, waiting RETRY_WAIT, then twice as long each time; a network
    error (OSError, a failed git) is retried, one another try cannot mend (PERMANENT) is raised at once."""
    for attempt in range(tries):
        try:
            return fn()
        except (OSError, subprocess.CalledProcessError) as e:
            if type(e).__name__ in PERMANENT or attempt + 1 == tries:
                raise
            wait = RETRY_WAIT * 2 ** attempt
            print(f"{what}: {type(e).__name__}: {e}; try {attempt + 2} of {tries} in {wait:.0f}s", file=sys.stderr)
            time.sleep(wait)


def link(path, target):
    """path -> target (absolute), replacing a link; a real folder in the way is an error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        raise SystemExit(f"{path} exists and is not a link: remove it, or use another run folder")
    path.symlink_to(Path(target).resolve())


def git_clone(url, dest, commit=None):
    """dest: a clone of url (at commit, else the default branch's head), made in dest.tmp and renamed when whole;
    a clone already there is reused as it is."""
    if (dest / ".git").is_dir():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")

    def clone():
        shutil.rmtree(tmp, ignore_errors=True)
        if commit:
            for cmd in (["init", "-q", str(tmp)], ["-C", str(tmp), "fetch", "-q", "--depth", "1", url, commit],
                        ["-C", str(tmp), "checkout", "-q", "FETCH_HEAD"]):
                subprocess.run(["git", *cmd], check=True)
        else:
            subprocess.run(["git", "clone", "-q", "--depth", "1", url, str(tmp)], check=True)
    retry(clone, f"git clone {url}")
    os.replace(tmp, dest)
    return dest


def hub_dataset(repo, dest, patterns=None):
    """A Hugging Face dataset's files (those matching `patterns`, fnmatch) in dest; files already there are kept."""
    from huggingface_hub import snapshot_download
    return Path(retry(lambda: snapshot_download(repo, repo_type="dataset", local_dir=dest, allow_patterns=patterns),
                      f"download of {repo}"))


def data_files(spec, cache):
    """The local files of --data: hf://datasets/ID/PATH downloaded into the cache (PATH a file, a folder or a glob),
    a folder's parquet files, a glob's matches or one file; sorted."""
    if spec.startswith("hf://datasets/"):
        owner, name, *rest = spec[len("hf://datasets/"):].split("/")
        path = "/".join(rest)
        pattern = path if path.endswith(".parquet") or "*" in path else f"{path}/*" if path else None
        spec = str(hub_dataset(f"{owner}/{name}", cache / "hf-datasets" / owner / name, pattern) / path)
    p = Path(spec)
    files = sorted(p.rglob("*.parquet")) if p.is_dir() else sorted(Path(f) for f in glob.glob(spec, recursive=True))
    if not files:
        raise SystemExit(f"--data {spec}: no such file, or a folder without parquet files")
    return files


def model(spec, dest, cache, train):
    """RUN/base/model: a link to a local folder or to the hub's download, or a tiny random Qwen3 built here."""
    if dest.exists():
        return
    if spec == "tiny":  # vLLM's CPU attention takes a head size of 32; its BPE learns the SFT rows' text
        texts = [m["content"] for _, conv in rows.read_rows(train) for m in conv]
        tiny.build_tiny(dest, texts, vocab_size=2048, hidden=64, layers=2, heads=2, kv_heads=1)
    elif Path(spec).is_dir():
        link(dest, spec)
    else:
        from huggingface_hub import snapshot_download
        link(dest, retry(lambda: snapshot_download(spec, cache_dir=cache / "hf"), f"download of {spec}"))


def harbor_template(cache):
    """Harbor's current Terminus-2 prompt template, read from its published wheel (downloaded here)."""
    wheels = cache / f"harbor-{terminus.HARBOR_VERSION}"
    if not any(wheels.glob("*.whl")):
        retry(lambda: subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary",
                                      ":all:", "--python-version", "3.12", "-d", str(wheels),
                                      f"harbor=={terminus.HARBOR_VERSION}"], check=True),
              f"pip download harbor=={terminus.HARBOR_VERSION}")
    with zipfile.ZipFile(next(wheels.glob("*.whl"))) as whl:
        text = whl.read(HARBOR_TEMPLATE).decode()
    return text.replace("{{", "{").replace("}}", "}")  # Harbor fills it with str.format: {{ }} are braces


def prompt(spec, run, cache):
    """RUN/prompt_template.txt from --prompt-template; -> how it was found (data_stats.json's prompt_template)."""
    if spec == "rows":
        text, info = rows.prompt_template([run / "train.jsonl", run / "heldout.jsonl"])
        print(f"prompt: {info['agree']} of {info['rows']} rows share one template; {info['differ']} differ "
              f"({info['no_layout']} not in Terminus-2's layout)", *info["differ_examples"], sep="\n  ")
        if text is None:  # rows of another agent: nothing to take; RL and evaluation then prompt as terminus does
            print("prompt: no row has Terminus-2's layout (its first user turn: the prompt, 'Task Description:', the "
                  "task, 'Current terminal state:'); terminus.DEFAULT_PROMPT is used, which SFT never saw: pass "
                  "--prompt-template FILE or harbor", file=sys.stderr)
            text, info = terminus.DEFAULT_PROMPT, {**info, "default": "no row in Terminus-2's layout"}
    elif spec == "harbor":
        text, info = harbor_template(cache), {"harbor": terminus.HARBOR_VERSION}
    else:
        text, info = Path(spec).read_text(), {"file": str(Path(spec).resolve())}
    tmp = run / "prompt_template.txt.tmp"
    tmp.write_text(text)
    terminus.load_template(tmp)  # both placeholders, or the error names them
    os.replace(tmp, run / "prompt_template.txt")
    return {"source": spec, **info}


def aider_set(cache):
    """aider-polyglot's 225 task folders, made by Harbor's adapter (`uv run aider_polyglot` in its project) from the
    benchmark's clone, into a temporary folder renamed when the adapter is done."""
    out = cache / "aider-polyglot"
    if any(out.glob("*/task.toml")):
        return out
    project = git_clone(ADAPTERS_GIT, cache / "harbor-adapters", ADAPTERS_COMMIT) / "src" / "aider_polyglot"
    polyglot = git_clone(POLYGLOT_GIT, cache / "polyglot-benchmark")
    tmp = cache / "aider-polyglot.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "uv", "run", "aider_polyglot", "--polyglot-root", str(polyglot.resolve()),
           "--output-dir", str(tmp.resolve())]
    if subprocess.run(cmd, cwd=project).returncode != 0 or not any(tmp.glob("*/task.toml")):
        raise SystemExit(f"Harbor's aider-polyglot adapter did not make the task folders ({' '.join(cmd)} in "
                         f"{project}): make them as its README says and pass them: --aider DIR")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def task_set(spec, name, cache):
    """The folder of a task set: a local path as given, or fetched into the cache."""
    if spec != "fetch":
        if not Path(spec).is_dir():
            raise SystemExit(f"--{name}: {spec} is not a folder of Harbor task folders")
        return Path(spec)
    if name == "tb2":
        return git_clone(TB2_GIT, cache / "terminal-bench-2")
    if name == "rl-tasks":
        return hub_dataset(ENDLESS, cache / "endless-terminals")
    return aider_set(cache)


def task_folders(root):
    """(the Harbor task folders under root, at any depth, by name; [(folder, why)] of those that do not load)."""
    good, bad, names = [], [], {}
    for folder in sorted(p.parent for p in Path(root).rglob("task.toml")):
        try:
            if folder.name in names:
                raise ValueError(f"its name is also {names[folder.name]}'s")
            load_task(folder, build=False)
            names[folder.name] = folder
            good.append(folder)
        except ValueError as e:
            bad.append((folder, str(e)))
    return good, bad


def built(folders, pull, concurrency):
    """The tasks of `folders` with their images (load_task: pulled, or the local ones), `concurrency` at a time."""
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(lambda f: load_task(f, pull=pull), folders))


def images_summary(tasks):
    """How many of the tasks run on a prebuilt image (task.toml's docker_image), on one built from environment/
    (tagged actobs-task/...), or on none (their build failed)."""
    failed = [f"{t.name}: {t.build_error.splitlines()[0]}" for t in tasks if t.build_error]
    built_here = sum(t.image is not None and t.image.startswith("actobs-task/") for t in tasks)
    return {"tasks": len(tasks), "prebuilt": len(tasks) - built_here - len(failed), "built": built_here,
            "failed": len(failed), "failed_examples": failed[:10]}


def write_json(path, value):
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(value, indent=2))
    os.replace(tmp, path)


def read_results(path):
    """{task: result} of an oracle pass's JSONL; a line that does not parse (half written) is ignored."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
                out[r["task"]] = r
            except (ValueError, KeyError, TypeError):
                continue
    return out


def oracle_pass(folders, results, network, pull, concurrency, build_concurrency):
    """Each task's own solution run and verified (envs.run_oracle), its result appended to `results` as it ends, one
    line a task (a task without a solution is recorded without a run): a killed pass goes on where it stopped.
    Images are built `build_concurrency` at a time while `concurrency` sandboxes run."""
    if results.exists() and not results.read_bytes().endswith(b"\n"):  # a line a killed pass left half written:
        data = results.read_bytes()                                      # dropped, so the next one starts whole
        results.with_suffix(".tmp").write_bytes(data[:data.rfind(b"\n") + 1])
        os.replace(results.with_suffix(".tmp"), results)
    # an infrastructure failure (an image that did not pull or build, a sandbox that did not start) is run again
    done = {k: r for k, r in read_results(results).items() if r["failure"] not in INFRA_FAILURES}
    todo = [f for f in folders if f.name not in done]
    print(f"oracle pass: {len(done)} of {len(folders)} tasks done before, {len(todo)} to run")
    lock, progress = threading.Lock(), tqdm(total=len(todo), desc="oracle pass", unit="task")

    def record(folder, **fields):
        line = json.dumps({"task": folder.name, **fields}) + "\n"
        with lock, open(results, "a") as f:  # one write of a whole line, flushed to disk before the next
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
            progress.update()

    def run(folder, task):
        ep, = envs.run_oracle([task], concurrency=1, network=network)
        record(folder, reward=ep.reward, failure=ep.failure, image=task.image)

    def build(folder):
        task = load_task(folder, build=False)
        return task if not task.solution else load_task(folder, pull=pull)

    with ThreadPoolExecutor(max(1, build_concurrency)) as builds, ThreadPoolExecutor(max(1, concurrency)) as sandboxes:
        runs = []
        for folder, task in zip(todo, builds.map(build, todo)):
            if task.solution:
                runs.append(sandboxes.submit(run, folder, task))
            else:
                record(folder, reward=None, failure="no_solution", image=None)
        for r in runs:
            r.result()
    progress.close()
    return read_results(results)


def rl_split(src, tasks, network, pull, heldout, seed, concurrency, build_concurrency):
    """tasks/rl: links to the RL tasks of src their own solution solves, less `heldout` of them drawn with seed
    (tasks/rl-heldout); tasks/malformed.tsv: the folders that do not load, left out; tasks/rl/oracle.tsv (written
    last: the split is done): each task's reward. -> the split's record."""
    folders, bad = task_folders(src)
    (tasks / "malformed.tsv").write_text("".join(f"{f}\t{why}\n" for f, why in bad))
    if bad:
        print(f"RL tasks: {len(bad)} malformed folder(s) left out (tasks/malformed.tsv), e.g. {bad[0][0]}: {bad[0][1]}")
    res = oracle_pass(folders, tasks / "oracle.jsonl", network, pull, concurrency, build_concurrency)
    solvable = sorted(f.name for f in folders if res[f.name]["reward"] is not None and solved(res[f.name]["reward"])
                      and res[f.name]["failure"] is None)
    if len(solvable) <= heldout:
        raise SystemExit(f"{src}: {len(solvable)} tasks their own solution solves, need more than --rl-heldout "
                         f"{heldout}: nothing would be left to train GRPO on")
    held = set(random.Random(seed).sample(solvable, heldout))
    for name in ("rl", "rl-heldout"):
        (tasks / name).mkdir(parents=True, exist_ok=True)
        for old in (tasks / name).iterdir():  # the links of an earlier, unfinished split
            if old.is_symlink():
                old.unlink()
    for f in folders:
        if f.name in solvable:
            link(tasks / ("rl-heldout" if f.name in held else "rl") / f.name, f)
    tsv = "".join(f"{f.name}\t{'' if res[f.name]['reward'] is None else res[f.name]['reward']}\t"
                  f"{res[f.name]['failure'] or ''}\n" for f in folders)
    (tasks / "rl" / "oracle.tsv.tmp").write_text(tsv)
    os.replace(tasks / "rl" / "oracle.tsv.tmp", tasks / "rl" / "oracle.tsv")
    count = {k: sum(res[f.name]["failure"] == k for f in folders) for k in ("no_solution", "image_build_error")}
    print(f"RL split: {len(solvable)} of {len(folders)} tasks solvable ({count['no_solution']} without a solution, "
          f"{count['image_build_error']} whose image did not build, {len(bad)} malformed); {heldout} held out (seed "
          f"{seed}) -> {tasks / 'rl-heldout'}; {len(solvable) - heldout} train GRPO -> {tasks / 'rl'}")
    return {"folders": len(folders) + len(bad), "malformed": len(bad), **count, "solvable": len(solvable),
            "heldout": heldout, "train": len(solvable) - heldout, "seed": seed}


def refuse_other(path, recorded, asked, what):
    """A run folder's inputs are fetched once: asked for otherwise (another --data, --rows, seed...), the fetch stops
    naming what differs rather than keep the old ones."""
    differ = [f"{k} {recorded.get(k)!r} there, {v!r} now" for k, v in asked.items() if recorded.get(k) != v]
    if differ:
        raise SystemExit(f"{path}: {what} were fetched with other settings ({'; '.join(differ)}): fetch into another "
                         "run folder, or with the settings it has")


def keep_in_settings(run, inputs):
    """inputs (what the fetch decided) into RUN/settings.json, beside the stages' settings, when the run has one."""
    path = run / "settings.json"
    if path.exists():
        write_json(path, {**json.loads(path.read_text()), "inputs": inputs})


def main(argv=None):
    args = get_parser().parse_args(argv)
    run, pull = args.run, not args.offline_images
    run.mkdir(parents=True, exist_ok=True)
    train, held, stats_path = run / "train.jsonl", run / "heldout.jsonl", run / "data_stats.json"
    asked = {"data": args.data, "rows_asked": args.rows, "heldout": args.heldout, "seed": args.seed}
    if not (train.exists() and held.exists() and stats_path.exists()):  # the draw is seeded: a redo draws the same
        write_json(stats_path, asked | rows.draw(data_files(args.data, args.cache), train, held, args.rows,
                                                 args.heldout, args.seed))
    stats = json.loads(stats_path.read_text())
    refuse_other(stats_path, stats, asked, "the rows")
    model(args.model, run / "base" / "model", args.cache, train)
    if "tokens" not in stats:
        stats |= rows.token_stats(run / "base" / "model", train)
        write_json(stats_path, stats)
    if stats.get("prompt_template", {}).get("source") != args.prompt_template \
            or not (run / "prompt_template.txt").exists():
        stats["prompt_template"] = prompt(args.prompt_template, run, args.cache)
        write_json(stats_path, stats)
    print(rows.summary(stats))

    tasks = run / "tasks"
    record = {"images": "own (pulled)" if pull else "standin (offline: the images here)"}
    for name, spec in (("tb2", args.tb2), ("aider", args.aider)):
        link(tasks / name, task_set(spec, name, args.cache))
        folders, bad = task_folders(tasks / name)
        if bad:  # an evaluation set is the benchmark whole or not at all
            raise SystemExit(f"--{name}: {len(bad)} malformed task folder(s), e.g. {bad[0][0]}: {bad[0][1]}")
        record[name] = images_summary(built(folders, pull, args.build_concurrency))
        print(f"{name}: {len(folders)} tasks; images: {record[name]}")
    link(tasks / "rl-all", task_set(args.rl_tasks, "rl-tasks", args.cache))
    if (tasks / "rl" / "oracle.tsv").exists() and (tasks / "tasks.json").exists():
        record["rl"] = json.loads((tasks / "tasks.json").read_text())["rl"]
        refuse_other(tasks / "tasks.json", record["rl"], {"heldout": args.rl_heldout, "seed": args.seed},
                     "the RL split")
    else:
        record["rl"] = rl_split(tasks / "rl-all", tasks, args.network, pull, args.rl_heldout, args.seed,
                                args.concurrency, args.build_concurrency)
    write_json(tasks / "tasks.json", record)
    keep_in_settings(run, {"data": stats, "tasks": record})
    print(f"inputs of {run}: the model, {train}, prompt_template.txt, tasks/tb2, tasks/aider, tasks/rl")


if __name__ == "__main__":
    sys.exit(main())
