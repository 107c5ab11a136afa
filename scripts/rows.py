"""
A real run's SFT rows (scripts/fetch.py): a seeded draw across a corpus's files, read as a stream; the prompt the rows
were written with; their token counts as the project labels them.

    stats = rows.draw(files, run / "train.jsonl", run / "heldout.jsonl", n=4000, heldout=256, seed=0)
    template, info = rows.prompt_template([run / "train.jsonl", run / "heldout.jsonl"])
    stats |= rows.token_stats(run / "base" / "model", run / "train.jsonl")

The draw: each row of each file gets an index (parquet: counts from the files' footers; JSONL: one pass records each
line's offset; a JSON array, a sample file, is read whole); a permutation of all indices, seeded, ranks them; the first
n + heldout ranks are read a parquet row group (or a run of lines) at a time, each kept row spooled to disk, then
written out in rank order: train.jsonl the first n, heldout.jsonl the last `heldout`. A row that fails labels' checks
is skipped and counted, and the next ranks take its place. Memory: one row group and an offset a kept row.
"""
import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
from array import array
from pathlib import Path

import numpy as np

from actobs import labels

JSONL_BLOCK = 4096  # JSONL lines read together, as a parquet row group is
# Terminus-2's first user turn: its prompt, this line, the task, then these lines and the terminal state
# (Harbor's terminus-json-plain template; the rows of Nemotron-Terminal-Corpus were written with it)
TASK_HEAD = "Task Description:\n"
STATE_HEAD = "\n\nCurrent terminal state:\n"
PAPER = {"rows": 50_000, "tokens": 0.71e9, "observation_share": 0.45}  # the paper's SFT data (the synthetic part)


@dataclasses.dataclass
class Unit:
    """Rows read together: a parquet row group, a run of JSONL lines or a JSON array. read(positions) -> [(where,
    row)], row None when it does not decode (where then says why)."""
    size: int
    read: object


def parquet_units(path):
    import pyarrow.parquet as pq
    meta = pq.ParquetFile(path)
    cols = [c for c in ("conversations", "messages") if c in meta.schema_arrow.names]
    if not cols:
        raise ValueError(f"{path}: no 'conversations' (or 'messages') column; it has "
                         f"{', '.join(meta.schema_arrow.names)}")
    units, first = [], 0
    for g in range(meta.metadata.num_row_groups):
        def read(pos, g=g, first=first):
            try:
                table = pq.ParquetFile(path).read_row_group(g, columns=cols).take(pos)
            except Exception as e:  # a corrupt row group: its rows are bad rows, not the end of the draw
                return [(f"{path}: row {first + p}: {type(e).__name__}: {e}", None) for p in pos]
            return [(f"{path}: row {first + p}", r) for p, r in zip(pos, table.to_pylist())]
        units.append(Unit(meta.metadata.row_group(g).num_rows, read))
        first += units[-1].size
    return units


def jsonl_units(path):
    offsets, lines = array("q"), array("q")  # byte offset and line number of each non-empty line
    with open(path, "rb") as f:
        pos = 0
        for lineno, line in enumerate(f, 1):
            if line.strip():
                offsets.append(pos)
                lines.append(lineno)
            pos += len(line)

    def read(pos, base):
        out = []
        with open(path, "rb") as f:
            for p in pos:
                f.seek(offsets[base + p])
                where = f"{path}:{lines[base + p]}"
                try:
                    out.append((where, json.loads(f.readline())))
                except ValueError as e:
                    out.append((f"{where}: invalid JSON ({e})", None))
        return out
    return [Unit(min(JSONL_BLOCK, len(offsets) - b), lambda pos, b=b: read(pos, b))
            for b in range(0, len(offsets), JSONL_BLOCK)]


def json_units(path):
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON array of rows")
    return [Unit(len(rows), lambda pos: [(f"{path}: row {p}", rows[p]) for p in pos])]


def units_of(path):
    path = str(path)
    if path.endswith(".parquet"):
        return parquet_units(path)
    if path.endswith(".jsonl"):
        return jsonl_units(path)
    if path.endswith(".json"):
        return json_units(path)
    raise ValueError(f"{path}: not a parquet, JSONL or JSON file")


def _write_ranked(spool, kept, ranks, path):
    """The spooled rows of `ranks`, in that order, to path (atomically)."""
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as out:
        for r in ranks:
            spool.seek(kept[r][0])
            out.write(spool.read(kept[r][1]))
    os.replace(tmp, path)


def draw(files, train_path, held_path, n, heldout, seed):
    """train_path: n rows drawn at random (seed) across `files` (n = 0: all rows but the held-out ones);
    held_path: `heldout` more. Rows that fail labels' checks are skipped and counted; each kept row keeps
    `source`, where it came from. -> the draw's statistics."""
    units = [u for f in files for u in units_of(f)]
    starts = np.concatenate([[0], np.cumsum([u.size for u in units], dtype=np.int64)])  # (U + 1,)
    total = int(starts[-1])
    want = min(n + heldout, total) if n else total
    order = np.random.default_rng(seed).permutation(total)  # (total,) rank -> row index
    kept, bad, bad_examples, taken = {}, 0, [], 0  # kept: rank -> (offset, length) in the spool
    spool_path = Path(f"{train_path}.spool")
    with open(spool_path, "w+b") as spool:
        while len(kept) < want and taken < total:
            ranks = np.arange(taken, min(total, taken + want - len(kept)))  # the next ranks, as many as still wanted
            taken = int(ranks[-1]) + 1
            unit = np.searchsorted(starts, order[ranks], side="right") - 1  # (k,) the unit of each rank's row
            by_unit = np.argsort(unit, kind="stable")
            for u, first, count in zip(*np.unique(unit[by_unit], return_index=True, return_counts=True)):
                sel = by_unit[first: first + count]  # the ranks whose rows are in unit u
                for rank, (where, row) in zip(ranks[sel], units[u].read((order[ranks[sel]] - starts[u]).tolist())):
                    try:
                        if row is None:
                            raise ValueError(where)
                        conv = labels.check_row(row, where)
                    except ValueError as e:
                        bad += 1
                        if len(bad_examples) < 10:
                            bad_examples.append(str(e))
                        continue
                    line = (json.dumps({"conversations": conv, "source": where}, ensure_ascii=False) + "\n").encode()
                    kept[int(rank)] = (spool.tell(), len(line))
                    spool.write(line)
        if len(kept) <= heldout:
            raise SystemExit(f"{', '.join(map(str, files))}: {len(kept)} good rows ({bad} bad), need more than "
                             f"--heldout {heldout}")
        ranked = sorted(kept)
        _write_ranked(spool, kept, ranked[len(ranked) - heldout:], held_path)
        _write_ranked(spool, kept, ranked[:len(ranked) - heldout], train_path)
    spool_path.unlink()
    return {"files": [str(f) for f in files], "rows_in_files": total, "seed": seed, "rows": len(kept) - heldout,
            "heldout": heldout, "bad_rows": bad, "bad_examples": bad_examples}


def read_rows(path):
    """(where, conversation) of each row of a JSONL file this module wrote, one at a time."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            yield f"{path}:{lineno}", json.loads(line)["conversations"]


def row_template(conv):
    """The prompt template of a Terminus-2 row (its first user turn with the task and the terminal state replaced by
    {instruction} and {terminal_state}), or None when the row is not laid out so."""
    if not conv or conv[0]["role"] != "user":
        return None
    text = conv[0]["content"]
    i, j = text.find(TASK_HEAD), text.rfind(STATE_HEAD)
    if i < 0 or j < i + len(TASK_HEAD):
        return None
    return text[:i + len(TASK_HEAD)] + "{instruction}" + STATE_HEAD + "{terminal_state}"


def prompt_template(paths):
    """The template most rows of `paths` were written with (row_template), and how many rows agree; the rows that
    differ (another template, or not Terminus-2's layout) are counted and the first ten named."""
    counts, texts, per_row = collections.Counter(), {}, []
    for path in paths:
        for where, conv in read_rows(path):
            t = row_template(conv)
            key = t and hashlib.sha256(t.encode()).hexdigest()
            counts[key] += 1
            texts.setdefault(key, t)
            per_row.append((where, key))
    common = max((k for k in counts if k), key=lambda k: counts[k], default=None)
    differ = [(where, "not Terminus-2's layout" if key is None else f"another template ({key[:12]})")
              for where, key in per_row if key != common]
    info = {"rows": len(per_row), "agree": counts[common] if common else 0, "templates": len(counts) - (None in counts),
            "no_layout": counts[None], "differ": len(differ), "sha256": common,
            "differ_examples": [f"{w}: {why}" for w, why in differ[:10]]}
    return texts.get(common), info


_tok = None


def _load(model):
    global _tok
    _tok = labels.load_tokenizer(model, "prefix")  # sft.py's default chat template: the tokens SFT trains on


def _count(path, offsets):
    """[(tokens, action tokens, observation tokens) or None when labels cannot render the row] of the rows of
    `path` that start at these byte offsets."""
    out = []
    with open(path, "rb") as f:
        for off in offsets:
            f.seek(off)
            try:
                _, roles, _, _ = labels.encode(_tok, json.loads(f.readline())["conversations"])
            except ValueError:  # e.g. a special token's string in a message: sft.py skips such rows (--skip-bad)
                out.append(None)
                continue
            out.append((len(roles), int(np.sum(roles == labels.ACTION)), int(np.sum(roles == labels.OBS))))
    return out


def token_stats(model, path, workers=None, chunk=64):
    """Tokens of the rows of `path` with the model's tokenizer, whole rows (sft.py's --max-len cuts longer ones),
    labelled as labels.py labels them; the observation share is OBS / (ACTION + OBS): of the tokens that carry loss.
    Rendered in `workers` processes (default: every core, at most 16: each holds its own tokenizer), each reading its
    rows from the file."""
    offsets, pos = [], 0
    with open(path, "rb") as f:
        for line in f:
            offsets.append(pos)
            pos += len(line)
    totals, failed = np.zeros(3, dtype=np.int64), 0
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked tokenizer threads
    with concurrent.futures.ProcessPoolExecutor(workers or min(os.cpu_count(), 16), mp_context=ctx, initializer=_load,
                                                initargs=(str(model),)) as pool:
        jobs = [pool.submit(_count, str(path), offsets[i: i + chunk]) for i in range(0, len(offsets), chunk)]
        for job in jobs:
            for c in job.result():
                if c is None:
                    failed += 1
                else:
                    totals += c
    tokens, act, obs = (int(x) for x in totals)
    return {"tokens": tokens, "action_tokens": act, "observation_tokens": obs,
            "observation_share": obs / max(act + obs, 1), "unrenderable_rows": failed, "chat_template": "prefix"}


def summary(stats):
    """The statistics as one printed line, beside the paper's."""
    return (f"data: {stats['rows']:,} rows drawn (seed {stats['seed']}) from {len(stats['files'])} file(s) of "
            f"{stats['rows_in_files']:,} rows, {stats['bad_rows']} bad row(s) skipped, {stats['heldout']} held out | "
            f"{stats['tokens']:,} tokens, {stats['action_tokens'] + stats['observation_tokens']:,} with loss, "
            f"observations {100 * stats['observation_share']:.1f} % of those; {stats['unrenderable_rows']} row(s) "
            f"labels cannot render | paper: {PAPER['rows']:,} rows, {PAPER['tokens'] / 1e9:.2f}B tokens, "
            f"~{100 * PAPER['observation_share']:.0f} % observations")
