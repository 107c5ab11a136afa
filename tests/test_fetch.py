"""scripts/fetch.py and scripts/rows.py, a real run's inputs, on CPU: the SFT rows' seeded draw across files (bad rows
skipped and counted), the prompt the rows were written with, their token counts, downloads retried (faults injected;
local folders stand for the hub), Harbor's aider-polyglot adapter run as its project runs it (a stand-in adapter
project under real uv), and the RL tasks' oracle pass: malformed folders left out, images built concurrently, a
killed pass resumed, the seeded held-out split."""
import json
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actobs import labels, terminus
from actobs.episode import Episode
from scripts import fetch, rows

FIXTURES = Path(__file__).parent / "fixtures"


def conv(i):
    return [{"role": "user", "content": f"task {i}"}, {"role": "assistant", "content": f"reply {i}"},
            {"role": "user", "content": f"output {i}"}]


def write_parquet(path, convs, group):
    """convs (None: a bad row, its role unknown) as a parquet file in row groups of `group` rows."""
    rows_ = [c if c is not None else [{"role": "robot", "content": "x"}] for c in convs]
    pq.write_table(pa.table({"conversations": rows_}), path, row_group_size=group)


def expected_draw(good, n, heldout, seed):
    """The draw by its definition: rows in file order, ranked by a seeded permutation; a bad row gives way to the
    next rank. -> (train rows, held-out rows, bad rows met on the way)."""
    kept, bad = [], 0
    for i in np.random.default_rng(seed).permutation(len(good)):
        if len(kept) == n + heldout:
            break
        if good[i]:
            kept.append(int(i))
        else:
            bad += 1
    return kept[:n], kept[n:], bad


def test_draw_is_a_seeded_shuffle_across_files_bad_rows_skipped_and_counted(tmp_path):
    # 3 parquet files (row groups of 4) and a JSONL file; rows 5, 17 and 30 are bad (an unknown role, invalid JSON)
    ids = list(range(40))
    bad = {5, 17, 30}
    files = []
    for k in range(3):
        part = ids[10 * k: 10 * k + 10]
        files.append(tmp_path / f"part{k}.parquet")
        write_parquet(files[-1], [None if i in bad else conv(i) for i in part], group=4)
    files.append(tmp_path / "part3.jsonl")
    files[-1].write_text("".join(("{not json\n" if i in bad else json.dumps({"conversations": conv(i)}) + "\n")
                                 for i in ids[30:]))
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    stats = rows.draw(files, train, held, n=12, heldout=4, seed=3)
    got = [[int(c[0]["content"].split()[1]) for _, c in rows.read_rows(p)] for p in (train, held)]
    want_train, want_held, want_bad = expected_draw([i not in bad for i in ids], 12, 4, seed=3)
    assert got == [want_train, want_held] and (stats["bad_rows"], stats["rows_in_files"]) == (want_bad, 40)
    assert want_bad > 0  # this seed meets a bad row: the next rank took its place
    assert len({x // 10 for x in got[0]}) > 1 and got[0] != sorted(got[0])  # across files, not in file order
    assert all(e.startswith(str(tmp_path)) for e in stats["bad_examples"])
    assert json.loads(train.read_text().splitlines()[0])["source"].startswith(str(tmp_path))
    # every row (n = 0): all good rows, each bad one counted once, named by file and row or line
    everything = rows.draw(files, train, held, n=0, heldout=4, seed=3)
    assert (everything["rows"], everything["bad_rows"]) == (33, 3)
    assert any(f"{files[0]}: row 5" in e for e in everything["bad_examples"])
    assert any(f"{files[3]}:1: invalid JSON" in e for e in everything["bad_examples"])
    assert sorted(int(c[0]["content"].split()[1]) for p in (train, held) for _, c in rows.read_rows(p)) == \
        [i for i in ids if i not in bad]
    # the same seed draws the same rows; another seed others
    again = [tmp_path / "t2.jsonl", tmp_path / "h2.jsonl"]
    rows.draw(files, *again, n=12, heldout=4, seed=3)
    rows.draw(files, train, held, n=12, heldout=4, seed=3)
    assert again[0].read_bytes() == train.read_bytes() and again[1].read_bytes() == held.read_bytes()
    rows.draw(files, *again, n=12, heldout=4, seed=4)
    assert again[0].read_bytes() != train.read_bytes()
    assert not list(tmp_path.glob("*.spool")) and not list(tmp_path.glob("*.tmp"))


def test_draw_refuses_too_few_good_rows(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"conversations": conv(0)}, {"conversations": "not a list"}]))
    with pytest.raises(SystemExit, match=r"1 good rows \(1 bad\), need more than --heldout 1"):
        rows.draw([path], tmp_path / "t.jsonl", tmp_path / "h.jsonl", n=1, heldout=1, seed=0)


def test_the_prompt_template_is_the_rows_own(tmp_path):
    """Terminus-2's layout read off the real rows reproduces each row's first turn; a row with another prompt and one
    in another layout are counted and named."""
    real = json.loads((FIXTURES / "nemotron_terminal_sample.json").read_text())
    path = tmp_path / "rows.jsonl"
    odd = [dict(m) for m in real[0]["conversations"]]
    odd[0]["content"] = odd[0]["content"].replace("You are an AI assistant", "You are a helpful assistant", 1)
    path.write_text("".join(json.dumps({"conversations": c}) + "\n"
                            for c in [r["conversations"] for r in real] + [odd, conv(9)]))
    template, info = rows.prompt_template([path])
    assert (info["rows"], info["agree"], info["templates"], info["differ"], info["no_layout"]) == (5, 3, 2, 2, 1)
    assert info["differ_examples"][0].startswith(f"{path}:4: another template")
    assert info["differ_examples"][1] == f"{path}:5: not Terminus-2's layout"
    assert template.endswith("Task Description:\n{instruction}\n\nCurrent terminal state:\n{terminal_state}")
    for r in real:
        first = r["conversations"][0]["content"]
        head, rest = first.split("Task Description:\n", 1)
        instruction, state = rest.split("\n\nCurrent terminal state:\n", 1)
        assert terminus.fill_prompt(template, instruction, state) == first


def test_token_stats_count_what_labels_label(tmp_path, tiny_dir, tokenizer):
    real = json.loads((FIXTURES / "nemotron_terminal_sample.json").read_text())
    path = tmp_path / "rows.jsonl"
    bad = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<|im_end|>"}]  # a special token
    convs = [r["conversations"] for r in real] + [bad]
    path.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in convs))
    stats = rows.token_stats(tiny_dir, path, workers=2, chunk=2)
    roles = [labels.encode(tokenizer, r["conversations"])[1] for r in real]
    act, obs = (sum(int(np.sum(r == k)) for r in roles) for k in (labels.ACTION, labels.OBS))
    assert (stats["tokens"], stats["action_tokens"], stats["observation_tokens"], stats["unrenderable_rows"]) == \
        (sum(len(r) for r in roles), act, obs, 1)
    assert stats["observation_share"] == obs / (act + obs)


def test_retry_backs_off_and_stops_on_what_cannot_mend(monkeypatch):
    slept = []
    monkeypatch.setattr(fetch.time, "sleep", slept.append)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset by peer")
        return "done"
    assert fetch.retry(flaky, "download") == "done" and slept == [2.0, 4.0]

    class RepositoryNotFoundError(OSError):
        pass

    def missing():
        calls.append(1)
        raise RepositoryNotFoundError("404")
    calls.clear()
    with pytest.raises(RepositoryNotFoundError):
        fetch.retry(missing, "download")
    assert len(calls) == 1 and slept == [2.0, 4.0]

    def down():
        raise subprocess.CalledProcessError(128, ["git", "clone"])
    with pytest.raises(subprocess.CalledProcessError):
        fetch.retry(down, "git clone", tries=3)
    assert slept == [2.0, 4.0, 2.0, 4.0]


def fake_hub(monkeypatch, source, fail=2):
    """huggingface_hub.snapshot_download served from a local folder, failing `fail` times first; -> its calls."""
    import huggingface_hub
    calls = []

    def snapshot_download(repo, repo_type, local_dir, allow_patterns=None):
        calls.append((repo, repo_type, allow_patterns))
        if len(calls) <= fail:
            raise ConnectionError("connection reset")
        shutil.copytree(source, local_dir, dirs_exist_ok=True)
        return str(local_dir)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(fetch, "RETRY_WAIT", 0.0)
    return calls


def test_the_corpus_and_endless_terminals_download_with_retries(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    for level, domain in (("easy", "security"), ("medium", "model_training"), ("mixed", "data")):
        (hub / "synthetic_tasks" / "skill_based" / level / domain).mkdir(parents=True)
        write_parquet(hub / "synthetic_tasks" / "skill_based" / level / domain / "data_filtered.parquet",
                      [conv(0)], group=1)
    calls = fake_hub(monkeypatch, hub)
    files = fetch.data_files(fetch.NEMOTRON, tmp_path / "cache")
    assert calls == [("nvidia/Nemotron-Terminal-Corpus", "dataset", "synthetic_tasks/*")] * 3
    assert [f.relative_to(tmp_path / "cache" / "hf-datasets" / "nvidia" / "Nemotron-Terminal-Corpus").as_posix()
            for f in files] == [f"synthetic_tasks/skill_based/{p}/data_filtered.parquet"
                                for p in ("easy/security", "medium/model_training", "mixed/data")]
    calls = fake_hub(monkeypatch, FIXTURES / "endless")
    got = fetch.task_set("fetch", "rl-tasks", tmp_path / "cache")
    assert calls == [(fetch.ENDLESS, "dataset", None)] * 3 and sorted(p.name for p in got.iterdir()) == \
        ["config-port", "csv-filter"]
    fake_hub(monkeypatch, FIXTURES / "endless", fail=5)
    with pytest.raises(ConnectionError):
        fetch.task_set("fetch", "rl-tasks", tmp_path / "other")


ADAPTER_MAIN = '''import argparse, pathlib
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--polyglot-root", type=pathlib.Path, required=True)
    p.add_argument("--output-dir", type=pathlib.Path, required=True)
    a = p.parse_args()
    for ex in sorted((a.polyglot_root / "python" / "exercises" / "practice").iterdir()):
        task = a.output_dir / f"polyglot_python_{ex.name}"
        task.mkdir(parents=True)
        (task / "task.toml").write_text("version = '1.0'\\n")
'''


def git_repo(path, files):
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    subprocess.run(["git", "init", "-q", str(path)], check=True)


def test_the_aider_adapter_runs_as_harbor_runs_it_with_the_benchmarks_root(tmp_path):
    """`uv run aider_polyglot --polyglot-root CLONE --output-dir ...` in the adapter's project (src/aider_polyglot of
    Harbor's adapters repository): here a stand-in project with the same entry point, under the real uv."""
    cache = tmp_path / "cache"
    git_repo(cache / "harbor-adapters", {
        "src/aider_polyglot/pyproject.toml": '[project]\nname = "aider-polyglot"\nversion = "0"\n'
        'requires-python = ">=3.10"\n[project.scripts]\naider_polyglot = "aider_polyglot.main:main"\n'
        '[build-system]\nrequires = ["uv_build>=0.8,<1"]\nbuild-backend = "uv_build"\n',
        "src/aider_polyglot/src/aider_polyglot/__init__.py": "",
        "src/aider_polyglot/src/aider_polyglot/main.py": ADAPTER_MAIN})
    git_repo(cache / "polyglot-benchmark", {"python/exercises/practice/two-fer/.meta/config.json": "{}",
                                            "python/exercises/practice/leap/.meta/config.json": "{}"})
    out = fetch.task_set("fetch", "aider", cache)
    assert out == cache / "aider-polyglot" and sorted(p.name for p in out.iterdir()) == \
        ["polyglot_python_leap", "polyglot_python_two-fer"]
    assert not (cache / "aider-polyglot.tmp").exists()
    assert fetch.task_set("fetch", "aider", cache) == out  # made once: reused
    shutil.rmtree(out)
    shutil.rmtree(cache / "polyglot-benchmark" / "python")  # the adapter finds no exercise: no folders, a clear stop
    with pytest.raises(SystemExit, match=r"uv run aider_polyglot --polyglot-root .*polyglot-benchmark --output-dir"):
        fetch.task_set("fetch", "aider", cache)


def rl_source(tmp_path, n=6):
    """n copies of a Harbor fixture task and one malformed folder."""
    src = tmp_path / "endless"
    for i in range(n):
        shutil.copytree(FIXTURES / "harbor" / "workdir", src / f"task_{i}")
    (src / "broken").mkdir()
    (src / "broken" / "task.toml").write_text("[agent\n")
    return src


def test_the_oracle_pass_builds_concurrently_resumes_and_splits(tmp_path, monkeypatch):
    """Images built two at a time (two builds meet at a barrier: one at a time never would), a killed pass resumed
    (the tasks recorded are not run again, a half-written line is, and so is one whose last result was an
    infrastructure failure), malformed folders counted and left out, the solvable tasks less a seeded held-out set
    linked for GRPO."""
    src, tasks = rl_source(tmp_path), tmp_path / "run" / "tasks"
    tasks.mkdir(parents=True)
    real_load = fetch.load_task
    meet, lock, live, peak = threading.Barrier(2, timeout=20), threading.Lock(), [0], [0]

    def load_task(folder, build=True, pull=False):
        if not build:
            return real_load(folder, build=False)
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        meet.wait()
        with lock:
            live[0] -= 1
        task = real_load(folder, build=False)
        task.image = f"image-of-{folder.name}"
        return task
    ran, unsolved = [], {"task_4"}

    def run_oracle(todo, concurrency, network):
        name = Path(todo[0].image).name.removeprefix("image-of-")
        if killed_after is not None and len(ran) == killed_after:
            raise RuntimeError("killed")
        ran.append(name)
        ep = Episode(todo[0].name, [])
        ep.reward = 0.0 if name in unsolved else 1.0
        return [ep]
    monkeypatch.setattr(fetch, "load_task", load_task)
    monkeypatch.setattr(fetch.envs, "run_oracle", run_oracle)
    killed_after = 2
    with pytest.raises(RuntimeError, match="killed"):
        fetch.rl_split(src, tasks, None, False, 2, 7, concurrency=1, build_concurrency=2)
    assert peak[0] == 2
    first = fetch.read_results(tasks / "oracle.jsonl")
    assert len(first) == 2 and not (tasks / "rl" / "oracle.tsv").exists()
    blip = min(first)  # its image did not pull this time: run again, not left out of the split for good
    with open(tasks / "oracle.jsonl", "a") as f:
        f.write(json.dumps({"task": blip, "reward": 0.0, "failure": "image_build_error", "image": None}) + "\n")
        f.write('{"task": "task_5", "rew')  # the line a kill cut short
    killed_after, ran[:], meet = None, [], threading.Barrier(1)  # the builds' concurrency was shown above
    split = fetch.rl_split(src, tasks, None, False, 2, 7, concurrency=2, build_concurrency=2)
    assert set(ran) == {f"task_{i}" for i in range(6)} - set(first) | {blip}  # the recorded ones are not run again
    assert split == {"folders": 7, "malformed": 1, "no_solution": 0, "image_build_error": 0, "solvable": 5,
                     "heldout": 2, "train": 3, "seed": 7}
    assert (tasks / "malformed.tsv").read_text().startswith(f"{src / 'broken'}\t{src / 'broken' / 'task.toml'}: ")
    held = sorted(p.name for p in (tasks / "rl-heldout").iterdir())
    train = sorted(p.name for p in (tasks / "rl").iterdir() if p.is_symlink())
    assert len(held) == 2 and sorted(held + train) == [f"task_{i}" for i in (0, 1, 2, 3, 5)]
    assert (tasks / "rl" / held[0]).exists() is False and (tasks / "rl" / train[0]).resolve() == src / train[0]
    assert "task_4\t0.0\t\n" in (tasks / "rl" / "oracle.tsv").read_text()
    # the same seed holds out the same tasks
    shutil.rmtree(tasks)
    tasks.mkdir()
    fetch.rl_split(src, tasks, None, False, 2, 7, concurrency=2, build_concurrency=2)
    assert sorted(p.name for p in (tasks / "rl-heldout").iterdir()) == held


def test_the_prompt_written_for_rl_and_evaluation(tmp_path):
    """RUN/prompt_template.txt: the rows' (written by the draw's rows), Harbor's current one from its published wheel
    (its str.format braces undone; a line of its instructions differs from the rows'), or a user's file, which must
    have both placeholders."""
    run = tmp_path / "run"
    run.mkdir()
    real = json.loads((FIXTURES / "nemotron_terminal_sample.json").read_text())
    rows.draw([FIXTURES / "nemotron_terminal_sample.json"], run / "train.jsonl", run / "heldout.jsonl", 2, 1, 0)
    assert fetch.prompt("rows", run, tmp_path) == {"source": "rows", **rows.prompt_template(
        [run / "train.jsonl", run / "heldout.jsonl"])[1]}
    ours = (run / "prompt_template.txt").read_text()
    assert ours == rows.row_template(real[0]["conversations"])
    fetch.prompt("harbor", run, tmp_path / "cache")
    harbor = (run / "prompt_template.txt").read_text()
    assert terminus.load_template(run / "prompt_template.txt") == harbor and "{{" not in harbor
    changed = [a for a, b in zip(ours.splitlines(), harbor.splitlines()) if a != b]
    assert len(ours.splitlines()) == len(harbor.splitlines()) and 1 <= len(changed) <= 3
    mine = tmp_path / "mine.txt"
    mine.write_text("Solve {instruction}. Screen: {terminal_state}")
    assert fetch.prompt(str(mine), run, tmp_path)["file"] == str(mine)
    assert (run / "prompt_template.txt").read_text() == mine.read_text()
    mine.write_text("no placeholders")
    with pytest.raises(ValueError, match="lacks the {instruction} placeholder"):
        fetch.prompt(str(mine), run, tmp_path)
    assert (run / "prompt_template.txt").read_text() == "Solve {instruction}. Screen: {terminal_state}"
    # rows of another agent: nothing to take, terminus's own prompt, and the record says why
    (run / "train.jsonl").write_text("".join(json.dumps({"conversations": conv(i)}) + "\n" for i in range(2)))
    (run / "heldout.jsonl").write_text(json.dumps({"conversations": conv(2)}) + "\n")
    info = fetch.prompt("rows", run, tmp_path)
    assert (info["agree"], info["no_layout"], info["default"]) == (0, 3, "no row in Terminus-2's layout")
    assert (run / "prompt_template.txt").read_text() == terminus.DEFAULT_PROMPT


def test_a_run_folder_fetched_with_other_settings_is_refused(tmp_path):
    """The rows and the RL split are fetched once into a run folder: asked for again with another --rows or seed, the
    fetch stops naming what differs instead of keeping the old ones under the new settings."""
    recorded = {"data": "rows.jsonl", "rows_asked": 2, "heldout": 1, "seed": 0, "rows": 2, "bad_rows": 0}
    fetch.refuse_other(tmp_path / "data_stats.json", recorded, {"data": "rows.jsonl", "rows_asked": 2, "heldout": 1,
                                                                "seed": 0}, "the rows")
    with pytest.raises(SystemExit, match=r"data_stats.json: the rows were fetched with other settings \(rows_asked 2 "
                                         r"there, 4 now; seed 0 there, 1 now\)"):
        fetch.refuse_other(tmp_path / "data_stats.json", recorded, {"data": "rows.jsonl", "rows_asked": 4,
                                                                    "heldout": 1, "seed": 1}, "the rows")
