"""
A base model that has seen terminals: record generic shell sessions in the sandboxes, fit a byte-level BPE to
them, and pre-train a small random Qwen3 on them with sft.py's loop (commands and outputs both supervised).

    python -m scripts.base_model --out runs/base            # -> runs/base/model (HF dir, prefix chat template)

What it sees: random file trees (notes, CSV, JSON, INI/YAML configs, logs, small scripts) explored and changed by
a scripted user who types generic commands (ls, find, cat, head, tail, wc, grep, sort, uniq, cut, awk, sed,
mkdir, cp, mv, rm, chmod, tar, jq, python3 one-liners, for loops, typos and their errors), each mostly about a
name an earlier output showed (scripts/sessions.py). A session is kept as the episode the runner recorded: the
Terminus-2 prompt (instruction: explore the files), the user's replies as protocol JSON with an empty analysis
and plan, and the terminal's real output. Nothing of the toy tasks (taskgen.py): the base model knows the shell
and the reply format, as a real base model knows shells and JSON, and must learn the tasks from SFT. Pre-training
is sft.py with --lam 1 (prompt masked; commands and outputs weighted alike), the plain language-model loss.

Steps, each reused when its output exists (an interrupted pre-training resumes from its last checkpoint):
    OUT/sessions.jsonl   recorded sessions: {"conversations": [prompt, reply, observation, ...]}
    OUT/pretrain/        sft.py run dir: init/ (tokenizer fit to the sessions + random Qwen3), step-N/, final/
    OUT/copy/            the random model after copy practice on random ids, where the pre-training starts
    OUT/model/           the base model: pretrain/final after the refresh (rows and sessions together)
OUT/settings.json holds the settings it was built with; another build into the same OUT must use the same
ones. The trees and commands follow from --seed; the outputs are the real ones, so only what Docker picks
(container ids in the shell prompt, file times) differs between two builds.
"""
import argparse
import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import torch

import sft
from actobs import common, labels, terminus, tiny
from scripts.sessions import copy_chats, record_sessions, session_facts, session_rng, session_tree, tree_ids


REFRESH_ROWS, REFRESH_ROW = 2, 128  # the refresh's rows a step and their length (the repeat metric's)
# Settings added after builds were made, and the value that reproduces such a build: a build's settings.json without
# the key was made with it
BEFORE = {"refresh_steps": 0, "dtype": "bf16"}


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="build dir: sessions.jsonl, pretrain/, model/")
    p.add_argument("--seed", type=int, default=0, help="seeds the trees, the commands, the init and the data order")
    # data
    p.add_argument("--sessions", type=int, default=256, help="terminal sessions to record")
    p.add_argument("--commands", type=int, default=16, help="commands typed per session (about)")
    p.add_argument("--heldout", type=int, default=16, help="more sessions, recorded but not trained on: the copy "
                   "accuracy of the base model is measured on them")
    p.add_argument("--concurrency", type=int, default=16, help="sandboxes live at once while recording")
    p.add_argument("--prompt-template", type=Path, help="file with {instruction} and {terminal_state} (default: "
                   "Terminus-2's); give the one SFT, RL and evaluation use")
    # model
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary, Qwen's special tokens included")
    p.add_argument("--split", default="qwen", choices=sorted(tiny.SPLITS), help="the BPE's pre-tokenizer: qwen "
                   "(Qwen's) or names (a name's tokens the same wherever it stands; tiny.NAME_SPLIT)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    # copy practice first (train_copy): rows of random ids whose second half repeats the first, rotated
    p.add_argument("--copy-steps", type=int, default=900, help="steps of copy practice before the sessions (0: none)")
    p.add_argument("--copy-schedule", default="64:700,128:0", help="row lengths over the copy steps, LENGTH:STEPS,... "
                   "(the last runs on): rows of 64 form the circuit by step ~700 (rows of 32 first only delay it), "
                   "rows of 128 then carry it to that length")
    p.add_argument("--copy-tokens", type=int, default=2048, help="tokens a copy step (rows = this / row length)")
    p.add_argument("--copy-lr", type=float, default=1e-3, help="copy practice's lr (AdamW betas "
                   "0.9/0.95, no weight decay, 50 warm-up steps)")
    p.add_argument("--copy-chats", type=float, default=0.5, help="copy chats mixed into the sessions' pre-training, "
                   "per session: a user turn of values, the reply the same values rotated (keeps the circuit in use)")
    # the refresh after the sessions (train_copy with session_loss): rows of random ids and sessions in every step
    p.add_argument("--refresh-steps", type=int, default=200, help=f"steps of {REFRESH_ROWS} rotated rows of "
                   f"{REFRESH_ROW} ids and 2 sessions each after the pre-training (0: none; AdamW betas "
                   "0.9/0.95, no weight decay, 10 warm-up steps)")
    p.add_argument("--refresh-lr", type=float, default=1e-4)
    # pre-training on the sessions (sft.py flags)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-len", type=int, default=2048, help="tokens kept of a session")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="compute dtype of every phase; "
                   "auto = bf16 on CUDA, and on a CPU where bf16 measures faster than fp32 (common.resolve_dtype), "
                   "else fp32: the circuit forms in either (RESULTS.md)")
    return p


# ----------------------------------------------------------------------------------------------------------
# Copy accuracy: does the model type a literal value exactly where the session's user did?

VALUE_END = r"(?![\w-]|\.\w)"  # where a quoted value ends: not inside a longer name (d8n8n.ini, not d8n8n.ini.bak)


def value_events(conv):
    """[(assistant message index, start, end, source)]: each place a reply's text holds one of the session's
    values (an instruction fact, a file's id or a file's name) that an earlier message showed; source is
    "instruction" when the first message (the prompt) holds it, else "output"."""
    seed, i = session_rng(conv[0]["content"])
    tree = session_tree(seed, i)
    values = [v for _, v in session_facts(seed, i)] + tree_ids(tree) + sorted({os.path.basename(p) for p, _, _ in tree})
    events = []
    for j, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        before = [x["content"] for x in conv[:j]]
        for v in values:
            for hit in re.finditer(rf"(?<![\w.-]){re.escape(v)}{VALUE_END}", m["content"]):
                if any(v in b for b in before):
                    events.append((j, hit.start(), hit.end(), "instruction" if v in before[0] else "output"))
    return events


def determined_at(context, value):
    """Characters of `value` typed before its rest is determined by `context` (the text before it): the shortest
    prefix whose every earlier occurrence at a word start (not inside a longer word) goes on as the whole value.
    A copier that has read `context` knows the rest once that prefix is typed; before it, the user's choice (which
    of the values on screen, which path under "/") is a guess no model can be scored on. len(value) when
    never determined (an earlier occurrence of the whole value goes on as a longer word)."""
    whole = re.compile(rf"{re.escape(value)}{VALUE_END}")
    for n in range(1, len(value) + 1):
        at = [m.start() for m in re.finditer(rf"(?<![\w]){re.escape(value[:n])}", context)]
        if at and all(whole.match(context, i) for i in at):
            return n
    return len(value)


@torch.no_grad()
def copy_accuracy(model, tok, convs, max_len, events=value_events):
    """Exact copies of the values `events(conv)` finds (value_events' form) under greedy decoding, teacher-forced
    on the conversation's own text: a value counts as copied when every token of it is the model's argmax given
    what precedes it (what greedy decoding of that reply would type). A session's user often quotes one of several
    values, so the first tokens of a value can be a choice rather than a copy: "rest" counts the values whose
    tokens after the first are all the argmax, and "determined" those whose tokens after the point where the
    context determines the value (determined_at; the token the choice ends in excluded) are, over the "det_n"
    values that have such tokens. Values within the first max_len tokens; by source and length (short: up to 6
    characters) -> {source: {"all" | "short" | "long": {"n", "exact", "rest", "det_n", "determined"}}}."""
    tally = {}
    for conv in convs:
        text = tok.apply_chat_template(conv, tokenize=False)
        enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
        ids, offsets = enc["input_ids"][:max_len], enc["offset_mapping"][:max_len]
        pred = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()  # (T,): argmax next token at each position
        cursor, starts = 0, {}
        for j, m in enumerate(conv):  # the prefix template writes each message's content once, in order
            cursor = text.index(m["content"], cursor)
            starts[j] = cursor
        for j, a, b, source in events(conv):
            a, b = starts[j] + a, starts[j] + b
            span = [t for t, (s0, s1) in enumerate(offsets) if s0 < b and s1 > a]
            if not span or span[-1] >= len(ids) - 1 or span[0] == 0:
                continue
            ok = [pred[t - 1] == ids[t] for t in span]
            d = a + determined_at(text[:a], text[a:b])
            det = [o for t, o in zip(span, ok) if offsets[t][0] >= d]
            key = (source, "short" if b - a <= 6 else "long")
            n, k, rest, det_n, det_k = tally.get(key, (0, 0, 0, 0, 0))
            tally[key] = (n + 1, k + all(ok), rest + all(ok[1:]), det_n + bool(det), det_k + (bool(det) and all(det)))
    out = {}
    for source in ("instruction", "output"):
        rows = {x: tally.get((source, x), (0, 0, 0, 0, 0)) for x in ("short", "long")}
        rows["all"] = tuple(map(sum, zip(rows["short"], rows["long"])))
        out[source] = {x: {"n": n, "exact": k / max(n, 1), "rest": r / max(n, 1), "det_n": dn,
                           "determined": dk / max(dn, 1)} for x, (n, k, r, dn, dk) in rows.items()}
    return out


def repeats(gen, n, length, vocab):
    """n rows of `length` random token ids from `vocab` (a 1-D tensor of ids) in which one segment of 8-32 ids
    of the first half comes back at a random place of the second, so the offset between the two differs from row
    to row -> (ids (n, length), labels (n, length): the repeat's ids after its first, -100 elsewhere). Only a copy
    by content (find the earlier occurrence of the current token, type what followed it) predicts the labels;
    a fixed look-back does not."""
    ids = vocab[torch.randint(len(vocab), (n, length), generator=gen)]  # (n, length)
    lab = torch.full_like(ids, -100)
    half = length // 2
    for row in range(n):
        k = int(torch.randint(8, min(33, half), (), generator=gen))
        src = int(torch.randint(0, half - k + 1, (), generator=gen))
        dst = int(torch.randint(half, length - k + 1, (), generator=gen))
        ids[row, dst:dst + k] = ids[row, src:src + k]
        lab[row, dst + 1:dst + k] = ids[row, dst + 1:dst + k]
    return ids, lab


def rotations(gen, n, length, vocab):
    """n rows: `length // 2` random ids of `vocab`, then the same ids rotated by a random shift (1..half-1, per row)
    -> (ids (n, length), labels (n, length): the second half after its first token, -100 elsewhere). Every label is a
    copy by content at an offset that differs from row to row: the densest copy practice (63 labels a row of 128,
    against 7-31 in `repeats`)."""
    half = length // 2
    a = vocab[torch.randint(len(vocab), (n, half), generator=gen)]  # (n, half)
    shift = torch.randint(1, half, (n, 1), generator=gen)  # (n, 1)
    b = torch.gather(a, 1, (torch.arange(half) + shift) % half)  # (n, half): a rotated
    ids = torch.cat([a, b], 1)  # (n, 2 * half)
    lab = ids.clone()
    lab[:, :half + 1] = -100  # the rotation's first token is a guess: its shift is unknown until it is seen
    return ids, lab


@torch.no_grad()
def repeat_accuracy(model, vocab, n=64, length=128, seed=0, rows=repeats):
    """The share of `rows`' labels (`repeats` or `rotations`) that are the model's argmax: ~0 for a model without
    a copy by content."""
    ids, lab = rows(torch.Generator().manual_seed(seed), n, length, vocab)
    pred = model(ids).logits[:, :-1].argmax(-1)  # (n, length - 1): the prediction of each next token
    keep = lab[:, 1:] != -100
    return (pred[keep] == lab[:, 1:][keep]).float().mean().item()


def parse_schedule(spec):
    """'32:600,64:400,128:0' -> [(32, 600), (64, 400), (128, 0)]: row lengths and their steps; 0 (last only) runs on."""
    try:
        parts = [tuple(int(x) for x in part.split(":")) for part in spec.split(",")]
        assert parts and all(len(p) == 2 and p[0] >= 4 and p[1] >= 0 for p in parts)
        assert all(n > 0 for _, n in parts[:-1])
    except (ValueError, AssertionError):
        raise ValueError(f"--copy-schedule {spec!r}: expected LENGTH:STEPS,... (lengths >= 4, steps > 0 but the "
                         "last, whose 0 runs on), e.g. 32:600,64:400,128:0") from None
    return parts


def schedule_length(schedule, step):
    """The row length of `step` (0-based) under parse_schedule's list; the last length runs on."""
    for length, n in schedule:
        if step < n or n == 0:
            return length
        step -= n
    return schedule[-1][0]


def train_copy(model, vocab, steps, schedule, tokens=2048, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, warmup=50,
               dtype=None, seed=0, every=0, probe_lengths=(128,), rows=rotations, also=None, log=print):
    """Copy practice: train `model` in place for `steps` AdamW steps on `rows` (`rotations` or `repeats`) of `vocab`
    ids, `tokens` a step (rows of the schedule's length: short rows first, where the circuit forms soonest), linear
    warm-up then constant lr, gradient clip 1.0; `dtype` an autocast dtype or None (fp32). `also`: None, or a function
    of no arguments that returns another loss to add to every step's (session_loss: the refresh). Every `every` steps
    (and at the end) logs the held-out copy accuracy on rows of `probe_lengths` -> [(step, {length: accuracy})].

    The defaults are the settings the measured runs formed the circuit with (bench/induction.py's docstring): a
    larger lr or weight decay (which pulls Qwen3's q/k norm gains towards 0, blunting the attention that finds the
    earlier occurrence) lengthens the plateau before it forms."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    gen, curve, t0 = torch.Generator().manual_seed(seed), [], time.time()
    ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False)
    model.train()
    for step in range(steps + 1):
        if (every and step % every == 0) or step == steps:
            model.eval()
            acc = {n: repeat_accuracy(model, vocab, length=n, seed=seed + 1, rows=rows) for n in probe_lengths}
            model.train()
            curve.append((step, acc))
            log(f"copy step {step:5d}/{steps} | rows of {schedule_length(schedule, step)} | " +
                " | ".join(f"copy@{n} {a:.3f}" for n, a in acc.items()) + f" | {time.time() - t0:.0f}s")
        if step == steps:
            break
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        length = schedule_length(schedule, step)
        ids, lab = rows(gen, max(1, tokens // length), length, vocab)  # (tokens // length, length)
        with ctx:
            loss = model(input_ids=ids, labels=lab, use_cache=False).loss
            if also is not None:
                loss = loss + also()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return curve


def session_loss(model, tok, convs, max_len, seed, per_step=2):
    """-> a function of no arguments: the language-model loss (sft.py's with λ=1, the pre-training's) of `per_step`
    sessions of `convs` drawn at random (seeded), a forward pass each; the refresh's second objective."""
    examples = [labels.render(tok, c, max_len) for c in convs]
    rng = random.Random(f"{seed}/refresh")

    def loss():
        return sum(sft.actobs_loss(model, common.collate([ex], tok.pad_token_id), 1.0, n_traj=per_step)[0]
                   for ex in rng.sample(examples, per_step))
    return loss


def save_model(model, tok, dst, files=None):
    """Write `model` and `tok` (and `files`: {name: text}) to `dst` whole: into dst.tmp, renamed once complete, so an
    interrupted build never finds a `dst` that looks done."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    for name, text in (files or {}).items():
        (tmp / name).write_text(text)
    os.replace(tmp, dst)


def plain_ids(tok):
    """The tokenizer's ids other than its special and added tokens (what `repeats` draws from)."""
    special = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
    return torch.tensor([i for i in range(len(tok)) if i not in special])


# ----------------------------------------------------------------------------------------------------------

def main(argv=None):
    args = get_parser().parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                if k not in ("out", "concurrency")}
    if (out / "settings.json").exists():
        old = json.loads((out / "settings.json").read_text())
        # a setting added after the build was made: the value such builds had (BEFORE), else its default
        parser = get_parser()
        was = {k: old.get(k, BEFORE.get(k, parser.get_default(k))) for k in settings}
        changed = [f"--{k.replace('_', '-')} {was[k]!r} -> {v!r}" for k, v in settings.items() if was[k] != v]
        if changed:
            raise ValueError(f"{out} holds a base model built with other settings ({', '.join(changed)}); "
                             "choose another --out")
    else:
        (out / "settings.json").write_text(json.dumps(settings, indent=2))
    if (out / "model" / "config.json").exists() and (out / "metrics.json").exists():
        print(f"base model reused: {out / 'model'}")
        return str(out / "model")

    data, heldout = out / "sessions.jsonl", out / "heldout.jsonl"
    if not data.exists():
        t0 = time.time()
        # Sessions and held-out sessions are one recording: indices >= --sessions are held out (other trees, facts).
        convs = record_sessions(args.sessions + args.heldout, args.commands, args.seed, args.concurrency,
                                terminus.load_template(args.prompt_template))
        split = [session_rng(c[0]["content"])[1] >= args.sessions for c in convs]
        labels.write_jsonl(heldout, [{"conversations": c} for c, h in zip(convs, split) if h])
        labels.write_jsonl(data, [{"conversations": c} for c, h in zip(convs, split) if not h])
        print(f"recorded {len(convs)}/{args.sessions + args.heldout} sessions ({sum(split)} held out, "
              f"{sum(len(m['content']) for c in convs for m in c) / 1e6:.2f} MB) -> {data} | {time.time() - t0:.0f}s")
    if not (out / "model" / "config.json").exists():
        pretrain(args, data)
    tok, model = labels.load_tokenizer(out / "model"), common.load_model(out / "model", "cpu").eval()
    copy = copy_accuracy(model, tok, labels.read_trajectories(heldout)[0], args.max_len)
    repeat = repeat_accuracy(model, plain_ids(tok))
    rotation = repeat_accuracy(model, plain_ids(tok), rows=rotations)
    curve = out / "copy" / "copy_curve.json"
    (out / "metrics.json").write_text(json.dumps({
        "copy_accuracy": copy, "repeat_accuracy": repeat, "rotation_accuracy": rotation,
        "copy_practice": json.loads(curve.read_text()) if curve.exists() else []}, indent=2))
    print("copy accuracy (greedy, held-out sessions): " + " | ".join(
        f"{s} {c['all']['exact']:.1%} of {c['all']['n']} (after the first token {c['all']['rest']:.1%}; "
        f"once determined {c['all']['determined']:.1%} of {c['all']['det_n']}; short "
        f"{c['short']['exact']:.1%}, long {c['long']['exact']:.1%})" for s, c in copy.items())
          + f" | random ids on rows of 128: a repeated segment {repeat:.1%}, a rotated half {rotation:.1%}"
          f" -> {out / 'metrics.json'}")
    return str(out / "model")


def pretrain(args, data):
    """Fit the BPE, build the random model, pre-train it on the sessions -> OUT/model."""
    out = args.out
    run = out / "pretrain"
    init = run / "init"
    convs = labels.read_trajectories(data)[0]
    if not (init / "config.json").exists():
        # The BPE is fit to everything the model will read and write: prompt, JSON replies, terminal output.
        tiny.build_tiny(init, [m["content"] for c in convs for m in c], vocab_size=args.vocab, hidden=args.hidden,
                          layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, seed=args.seed,
                          split=args.split)
    start = init
    # a CPU without native bf16 runs bf16 15-45x slower than fp32; with it, bf16 is 0.75x fp32's step time
    name, why = common.resolve_dtype(args.dtype, torch.device("cpu"))
    dtype = torch.bfloat16 if name == "bf16" else None
    print(f"compute dtype {name} ({why})")
    if args.copy_steps:
        start = out / "copy"
        if not (start / "config.json").exists():  # copy practice is short: an interrupted one starts again
            t0 = time.time()
            tok, model = labels.load_tokenizer(init), common.load_model(init, "cpu")
            torch.manual_seed(args.seed)
            curve = train_copy(model, plain_ids(tok), args.copy_steps, parse_schedule(args.copy_schedule),
                               args.copy_tokens, args.copy_lr, dtype=dtype, seed=args.seed, every=100,
                               probe_lengths=(64, 128))
            save_model(model, tok, start, {"copy_curve.json": json.dumps(
                [{"step": k, **{f"copy@{n}": a for n, a in acc.items()}} for k, acc in curve])})
            print(f"copy practice: {start} | {time.time() - t0:.0f}s")
    mixed = out / "pretrain.jsonl"  # the sessions and the copy chats, in sft.py's seeded order
    if not mixed.exists():
        chats = copy_chats(args.seed, round(args.copy_chats * len(convs)))
        labels.write_jsonl(mixed, [{"conversations": c} for c in convs + chats])
    t0 = time.time()
    sft.main(["--model", str(start), "--data", str(mixed), "--out", str(run), "--lam", "1", "--seed", str(args.seed),
              "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
              "--warmup-ratio", "0.05", "--dtype", name, "--max-len", str(args.max_len), "--micro-tokens", "1",
              "--val-size", str(min(16, len(convs) // 10)), "--eval-every", "0", "--save-every", "20", "--keep", "1",
              "--resume"])
    print(f"pre-training on the sessions {time.time() - t0:.0f}s")
    if args.refresh_steps:
        # The sessions keep about half of the random-id copy circuit (0.97 -> 0.45 on rows of 128). A short phase of
        # rows and sessions together brings it back without costing the sessions' copies, which rows alone halve
        # (RESULTS.md).
        t0 = time.time()
        tok, model = labels.load_tokenizer(run / "final"), common.load_model(run / "final", "cpu")
        torch.manual_seed(args.seed)
        train_copy(model, plain_ids(tok), args.refresh_steps, [(REFRESH_ROW, 0)], REFRESH_ROWS * REFRESH_ROW,
                   args.refresh_lr, warmup=10, dtype=dtype, seed=args.seed + 2, every=50,
                   also=session_loss(model, tok, convs, args.max_len, args.seed))
        save_model(model, tok, out / "model")
        print(f"refresh: {time.time() - t0:.0f}s")
    else:
        os.replace(run / "final", out / "model")
    print(f"base model: {out / 'model'}")


if __name__ == "__main__":
    common.run_cli(main)
