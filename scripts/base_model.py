"""
A base model that has seen terminals: record generic shell sessions in the sandboxes, fit a byte-level BPE to
them, and pre-train a small random Qwen3 on them with sft.py's loop (commands and outputs both supervised).

    python scripts/base_model.py --out runs/base            # -> runs/base/model (HF dir, prefix chat template)

What it sees: random file trees (notes, CSV, JSON, INI/YAML configs, logs, small scripts) explored and changed
by a scripted user who types generic commands (ls, find, cat, head, tail, wc, grep, sort, uniq, cut, awk, sed,
mkdir, cp, mv, rm, chmod, tar, jq, python3 one-liners, for loops, typos and their errors), each mostly about a
name an earlier output showed. A session is kept as the episode the runner recorded: the Terminus-2 prompt
(instruction: explore the files), the user's replies as protocol JSON with an empty analysis and plan, and the
terminal's real output. Nothing of the toy tasks (taskgen.py): the base model knows the shell and the reply
format, as a real base model knows shells and JSON, and must learn the tasks from SFT. Pre-training is sft.py
with --lam 1 (prompt masked; commands and outputs weighted alike), the plain language-model loss.

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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, when run as a script

import torch  # noqa: E402

import common  # noqa: E402
import envs  # noqa: E402
import labels  # noqa: E402
import sft  # noqa: E402
import terminus  # noqa: E402
from taskgen import WORDS  # noqa: E402


REFRESH_ROWS, REFRESH_ROW = 2, 128  # the refresh's rows a step and their length (the repeat metric's)
# Settings added after builds were made, and the value that reproduces such a build: a build's settings.json without
# the key was made with it
BEFORE = {"refresh_steps": 0, "dtype": "bf16"}


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    p.add_argument("--split", default="qwen", choices=sorted(common.SPLITS), help="the BPE's pre-tokenizer: qwen "
                   "(Qwen's) or names (a name's tokens the same wherever it stands; common.NAME_SPLIT)")
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
                   "else fp32: the circuit forms in either (RESULTS.md, 2026-12-05)")
    return p


# ----------------------------------------------------------------------------------------------------------
# Literal values: the instruction names a few, the files hold some, and the user's commands quote them

REF_PREFIXES = ("REF", "KEY", "TAG", "JOB", "CASE", "RUN", "BUILD", "ORDER", "TICKET", "ISSUE")
TLDS = ("internal", "local", "lan", "example.com", "corp")
FACTS = {  # key -> (draw a value, ways the instruction says it); the key word is in every phrasing
    "ticket": (lambda r: f"{r.choice(REF_PREFIXES)}-{_hex(r, r.randint(4, 12))}",
               ("The ticket for this work is {v}.", "Tag what you change with the ticket {v}.", "ticket: {v}")),
    "port": (lambda r: str(r.randrange(1024, 65536)),
             ("The service listens on port {v}.", "Use port {v} from now on.", "port: {v}")),
    "limit": (lambda r: str(r.choice([r.randint(2, 99), r.randint(100, 99999)])),
              ("The limit is {v}.", "Set the limit to {v}.", "limit: {v}")),
    "host": (lambda r: f"{r.choice(WORDS)}-{r.choice(WORDS)}{r.choice(['', '-' + str(r.randint(1, 99))])}.{r.choice(TLDS)}",
             ("The server host is now {v}.", "Point the host settings at {v}.", "host: {v}")),
    "backup": (lambda r: r.choice(["/tmp", "/srv", "/var/tmp", "/opt"]) + f"/{r.choice(WORDS)}_{r.randint(1, 999)}",
               ("Keep backup copies in {v}.", "The backup folder is {v}.", "backup: {v}")),
    "owner": (lambda r: f"{r.choice(WORDS)}{r.randint(1, 9999)}",
              ("The owner of these files is {v}.", "owner: {v}")),
    "version": (lambda r: ".".join(str(r.randint(0, 30)) for _ in range(r.randint(2, 3))),
                ("The release version is {v}.", "version: {v}")),
}


def _hex(rng, n):
    return f"{rng.randrange(16**n):0{n}x}"


def session_facts(seed, i):
    """[(key, value)] the session's instruction names: 3-6 of FACTS, short and long."""
    rng = random.Random(f"{seed}/facts/{i}")
    return [(k, FACTS[k][0](rng)) for k in rng.sample(sorted(FACTS), rng.randint(3, 6))]


def session_instruction(seed, i):
    rng = random.Random(f"{seed}/say/{i}")
    said = [rng.choice(FACTS[k][1]).format(v=v) for k, v in session_facts(seed, i)]
    return f"Explore and tidy the files on this machine (session {seed}-{i}). " + " ".join(said)


# ----------------------------------------------------------------------------------------------------------
# Random file trees

ROOTS = ["/app", "/srv/data", "/home/dev/project", "/var/log/svc", "/opt/tool", "/etc/svc"]


def _text(rng, lines):
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) for _ in range(lines)) + "\n"


GENERATED = ("keys", "sha256", "env")  # file types that hold only generated values (keys, checksums, env secrets)


def _file(rng, ext):
    """Content of a random file of one type."""
    if ext in ("txt", "md"):
        return (f"# {rng.choice(WORDS)}\n" if ext == "md" else "") + _text(rng, rng.randint(1, 12))
    if ext == "csv":
        cols = rng.sample(["id", "name", "qty", "price", "city", "score", "day"], rng.randint(2, 5))
        val = {"id": lambda: str(rng.randint(1, 999)), "name": lambda: rng.choice(WORDS),
               "qty": lambda: str(rng.randint(0, 50)), "price": lambda: f"{rng.uniform(0.5, 99):.2f}",
               "city": lambda: rng.choice(["oslo", "lima", "kyiv", "pune", "rome"]),
               "score": lambda: str(rng.randint(0, 100)), "day": lambda: f"2024-0{rng.randint(1, 9)}-{rng.randint(10, 28)}"}
        return ",".join(cols) + "\n" + "".join(",".join(val[c]() for c in cols) + "\n" for _ in range(rng.randint(2, 15)))
    if ext == "json":
        obj = {rng.choice(WORDS): rng.choice([rng.randint(0, 500), rng.choice(WORDS), True, [rng.randint(1, 9)] * 2])
               for _ in range(rng.randint(1, 6))}
        return json.dumps(obj, indent=rng.choice([None, 2])) + "\n"
    if ext in ("ini", "conf", "yaml"):
        sep = ": " if ext == "yaml" else rng.choice([" = ", "="])
        head = f"[{rng.choice(WORDS)}]\n" if ext == "ini" else ""
        return head + "".join(f"{rng.choice(WORDS)}{sep}{rng.choice([str(rng.randint(1, 9000)), rng.choice(WORDS)])}\n"
                              for _ in range(rng.randint(2, 8)))
    if ext == "log":
        return "".join(f"2024-0{rng.randint(1, 9)}-{rng.randint(10, 28)} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} "
                       f"{rng.choice(['INFO', 'INFO', 'WARN', 'ERROR', 'DEBUG'])} {rng.choice(WORDS)}: "
                       f"id={_hex(rng, rng.randint(5, 10))} {_text(rng, 1)}"
                       for _ in range(rng.randint(3, 20)))
    if ext in GENERATED:  # generated values: nothing but copying an earlier sight of them predicts them
        return "".join({"keys": lambda: f"{_hex(rng, rng.choice([16, 24, 32]))}\n",
                        "sha256": lambda: f"{_hex(rng, 64)}  {_stem(rng)}.{rng.choice(['tar.gz', 'bin', 'txt'])}\n",
                        "env": lambda: f"{rng.choice(WORDS).upper()}_{rng.choice(['KEY', 'TOKEN', 'ID'])}={_hex(rng, rng.randint(8, 20))}\n"}[ext]()
                       for _ in range(rng.randint(2, 6)))
    if ext == "py":
        w = rng.choice(WORDS)
        return f"import sys\n\n\ndef {w}(n):\n    return n * {rng.randint(2, 9)}\n\n\nprint({w}({rng.randint(1, 20)}))\n"
    return f"#!/bin/sh\necho {rng.choice(WORDS)} {rng.randint(1, 99)}\n"  # sh


def _stem(rng):
    """A file or folder name. Half are words (with a number), half carry random letters and digits that only
    copying them from an earlier output can predict: what a real tree's hashed, dated and generated names ask."""
    r = rng.random()
    if r < 0.3:
        return rng.choice(WORDS)
    if r < 0.5:
        return f"{rng.choice(WORDS)}_{rng.randint(1, 99)}"
    if r < 0.75:
        return f"{rng.choice(WORDS)}-{_hex(rng, rng.randint(3, 6))}"
    return "".join(rng.choice("bcdfghjklmnprstvwz" if k % 2 == 0 else "aeiou0123456789") for k in range(rng.randint(4, 8)))


def random_tree(rng, facts=()):
    """[(absolute path, text, mode)]: 2-4 folders under one or two roots, 5-16 files of mixed types and 1-3 of
    generated values (GENERATED). Each fact's
    key is set to another value in one config file (the user's commands may set it to the instruction's), and a
    note or two mention the ticket, so that greps for the facts find something."""
    roots = rng.sample(ROOTS, rng.randint(1, 2))
    dirs = [r for r in roots] + [f"{rng.choice(roots)}/{_stem(rng)}" for _ in range(rng.randint(1, 3))]
    files = {}
    for _ in range(rng.randint(5, 16)):
        ext = rng.choice(["txt", "txt", "md", "csv", "json", "ini", "conf", "yaml", "log", "log", "py", "sh"])
        files[f"{rng.choice(dirs)}/{_stem(rng)}.{ext}"] = ext
    for _ in range(rng.randint(1, 3)):  # a file of generated values: keys, checksums, an env file
        ext = rng.choice(GENERATED)
        files[f"{rng.choice(dirs)}/{_stem(rng)}.{ext}"] = ext
    texts = {p: _file(rng, ext) for p, ext in sorted(files.items())}
    configs = [p for p, ext in sorted(files.items()) if ext in ("ini", "conf", "yaml")]
    for key, value in facts:
        if key == "ticket":
            for p in rng.sample(sorted(texts), rng.randint(1, 2)):
                texts[p] += f"see {value}\n"
        elif configs and key != "backup":
            p = rng.choice(configs)
            texts[p] += f"{key}{': ' if p.endswith('.yaml') else ' = '}{FACTS[key][0](rng)}\n"
    return [(p, texts[p], 0o755 if ext == "sh" else rng.choice([0o644, 0o644, 0o600, 0o664]))
            for p, ext in sorted(files.items())]


def session_tree(seed, i):
    return random_tree(random.Random(f"{seed}/tree/{i}"), session_facts(seed, i))


def tree_ids(tree):
    """The random ids the tree's files hold (log lines' id=..., keys, checksums, env values): values an output shows
    and a command may quote."""
    return sorted({m for _, t, _ in tree for m in re.findall(r"\bid=([0-9a-f]+)|^([0-9a-f]{16,64})\b|^[A-Z_]+=([0-9a-f]+)$",
                                                              t, re.M) for m in m if m})


def copy_chats(seed, n):
    """n copy chats: a user turn of 6-24 values of the kinds sessions quote (hex ids, file stems, numbers, hosts,
    tickets), the assistant's reply the same values rotated by a random shift. The reply is all copy by content, in
    the chat format the sessions use: mixed into the sessions' pre-training, it keeps the circuit train_copy formed
    in use while the model learns the shell. Nothing of any task."""
    rng = random.Random(f"{seed}/copy-chats")
    kinds = [lambda: _hex(rng, rng.randint(4, 16)), lambda: _stem(rng), lambda: str(rng.randint(0, 99999)),
             lambda: FACTS["host"][0](rng), lambda: FACTS["ticket"][0](rng), lambda: FACTS["backup"][0](rng)]
    chats = []
    for _ in range(n):
        values = [rng.choice(kinds)() for _ in range(rng.randint(6, 24))]
        shift = rng.randrange(1, len(values))
        sep = rng.choice([" ", "\n", ", "])
        chats.append([{"role": "user", "content": sep.join(values)},
                      {"role": "assistant", "content": sep.join(values[shift:] + values[:shift])}])
    return chats


# ----------------------------------------------------------------------------------------------------------
# The scripted user: each command is drawn from the session's own tree, mostly about names already on screen

def _command(rng, tree, seen):
    """One shell command line. `seen`: paths of the tree whose name an earlier output showed."""
    paths = [p for p, _, _ in tree]
    dirs = sorted({os.path.dirname(p) for p in paths})
    f = rng.choice(seen or paths)
    d, ext = os.path.dirname(f), f.rsplit(".", 1)[1]
    text = next(t for p, t, _ in tree if p == f)
    word = rng.choice(re.findall(r"[a-z]{4,}", text) or WORDS)
    n = rng.randint(1, 8)
    if not seen:  # look around first
        return rng.choice([f"ls {d}", f"ls -l {d}", f"ls -R {rng.choice(dirs).rsplit('/', 1)[0] or '/'}",
                           f"find {d} -type f", f"find / -name '*.{ext}' -not -path '/proc/*' 2>/dev/null | head",
                           f"ls -la {d}"])
    generated = [p for p in seen if p.rsplit(".", 1)[1] in GENERATED]
    if generated and rng.random() < 0.3:  # show generated values, again and again: repeats that only copying predicts
        g = rng.choice(generated)
        return rng.choice([f"cat {g}", f"cat {g}", f"sort {g}", f"head -n 3 {g}", f"tail -n 2 {g}", f"cat -n {g}",
                           f"cp {g} /tmp/ && cat /tmp/{os.path.basename(g)}", f"grep -v '^#' {g}"])
    if rng.random() < 0.2:  # look again at a file already on screen: an output much of which repeats an earlier one
        return rng.choice([f"cat {f}", f"head -n {n} {f}", f"grep -n {word} {f}", f"ls -l {d}", f"md5sum {f}"])
    choices = [
        f"cat {f}", f"head -n {n} {f}", f"tail -n {n} {f}", f"wc -l {f}", f"wc -w {f}", f"wc -c {d}/*",
        f"md5sum {f}", f"sha1sum {d}/* | head -n {n}", f"cksum {f}", f"ls -i {d}",
        f"ls {d}", f"ls -l {d}", f"ls -lh {f}", f"stat -c '%a %s %n' {f}", f"file {f}" if rng.random() < 0.2 else f"du -sh {d}",
        f"grep -n {word} {f}", f"grep -c {word} {f}", f"grep -rl {word} {d}", f"grep -rn {word} {rng.choice(dirs)}",
        f"grep -i {word.upper()} {f}", f"grep -v {word} {f} | head -n {n}", f"grep -oiw {word} {f} | wc -l",
        f"sort {f} | head -n {n}", f"sort -r {f} | uniq | tail -n 3", f"cat {f} | tr ' ' '\\n' | sort | uniq -c | sort -rn | head -n 5",
        f"nl {f} | head", f"sed -n '2,{n + 2}p' {f}", f"awk '{{print NF}}' {f} | head -n 5",
        f"find {d} -name '*.{ext}'", f"find {rng.choice(dirs)} -type f | wc -l", f"find {d} -newer {f}",
        f"cp {f} {f}.bak", f"cp {f} /tmp/", f"mkdir -p {d}/{word}", f"mv {f} {d}/{word}_{n}.{ext}",
        f"rm -f {f}.bak", f"chmod {rng.choice(['644', '600', '755', '640'])} {f}", f"touch {d}/{word}.tmp",
        f"echo {word} >> {f}", f"echo '{word} {n}' > /tmp/{word}.txt", f"sed -i 's/{word}/{word.upper()}/' {f}",
        f"sed -i 's/{word}/{rng.choice(WORDS)}/g' {f}", f"diff {f} {rng.choice(paths)}",
        f"tar -czf /tmp/{word}.tar.gz -C {d} .", f"tar -cf /tmp/{word}.tar {f}",
        f"cd {d} && tar -czf /tmp/{word}.tgz *.{ext} && tar -tzf /tmp/{word}.tgz", f"tar -tzf /tmp/{word}.tar.gz",
        f"for x in {d}/*; do echo \"$x $(wc -l < \"$x\")\"; done", f"for x in {d}/*.{ext}; do head -n 1 \"$x\"; done",
        f"cd {d}", "pwd", "cd /app && ls", f"ls -d {d}/*/ 2>/dev/null", "echo $?", f"basename {f} .{ext}",
        f"python3 -c \"print(len(open({f!r}).read().split()))\"", f"python3 -c 'print({n} * {rng.randint(2, 99)})'",
        f"python3 -c \"import os; print(sorted(os.listdir({d!r})))\"",
        f"cat {f.replace('/', '/x', 1)}", f"cd {d}/missing", f"{rng.choice(['lss', 'cta', 'gerp'])} {f}",
        f"grep {word} {d}/nothere.txt", "python3 -c 'import nosuchmod'",
    ]
    if ext == "csv":
        choices += [f"head -n 1 {f}", f"cut -d, -f1 {f} | sort | uniq -c", f"awk -F, 'NR>1 {{n++}} END {{print n}}' {f}",
                    f"awk -F, 'NR>1 {{print $2}}' {f} | sort | head -n 3", f"column -s, -t < {f} | head",
                    f"python3 -c \"import csv; r=list(csv.DictReader(open({f!r}))); print(len(r), list(r[0]) if r else [])\""]
    if ext == "json":
        choices += [f"jq . {f}", f"jq 'keys' {f}", f"python3 -m json.tool {f}",
                    f"python3 -c \"import json; print(sorted(json.load(open({f!r}))))\""]
    if ext in ("ini", "conf", "yaml"):
        choices += [f"grep -n '=' {f}", f"grep -n ':' {f}", f"sed -i 's/^{word}.*/{word} = {n}/' {f} && cat {f}"]
    if ext == "log":
        choices += [f"grep -c ERROR {f}", f"grep ERROR {f} | head -n 3", f"awk '{{print $3}}' {f} | sort | uniq -c",
                    f"grep -o '[A-Z]*' {f} | sort | uniq -c"]
    if ext in ("py", "sh"):
        choices += [f"python3 {f}" if ext == "py" else f"sh {f}", f"ls -l {f} && {f}"]
    return rng.choice(choices)


def _session_rng(prompt):
    sid = re.search(r"\(session (\d+)-(\d+)\)", prompt)
    return int(sid.group(1)), int(sid.group(2))


def _quoting_command(rng, tree, seen, facts, ids):
    """A command that quotes a literal value: a fact of the instruction (found by its key) or an id an earlier
    output showed."""
    paths = [p for p, _, _ in tree]
    f = rng.choice(seen or paths)
    d, root = os.path.dirname(f), f.split("/")[1]
    if ids and (not facts or rng.random() < 0.35):
        v = rng.choice(ids)
        return rng.choice([f"grep -n {v} {f}", f"grep -rl {v} /{root}", f"grep -rn id={v} {d}", f"echo {v} >> /tmp/ids.txt",
                           f"grep -c {v} {f}", f"sed -i '/{v}/d' {f}", f"grep -B1 -A1 {v} {f}"])
    key, v = rng.choice(facts)
    configs = [p for p, t, _ in tree if re.search(rf"^{key}\b", t, re.M)]
    keyed = [f"echo '{key} = {v}' >> {f}", f'echo "{key}: {v}" > /tmp/{key}.txt', f"printf '{key}=%s\\n' {v} >> {f}",
             f"grep -rn {key} {d} ; echo {key} {v}"]
    if configs:
        c = rng.choice(configs)
        sep = ": " if c.endswith(".yaml") else " = "
        keyed += [f"sed -i 's/^{key}{sep}.*/{key}{sep}{v}/' {c} && grep -n {key} {c}"] * 3
    plain = [f"grep -rn {v} /{root}", f"grep -rl {v} {d}", f"echo {v} >> {f}", f"echo {v} > /tmp/{rng.choice(WORDS)}.txt"]
    if key == "backup":
        plain += [f"mkdir -p {v} && cp {f} {v}/ && ls {v}", f"mkdir -p {v}", f"cp {f} {v}/", f"ls -l {v}",
                  f"tar -czf {v}.tar.gz -C {d} . && ls -l {v}.tar.gz"]
    if key == "host":
        old = rng.choice(re.findall(r"^host\s*[=:]\s*(\S+)$", "".join(t for _, t, _ in tree), re.M) or [rng.choice(WORDS)])
        plain += [f"sed -i 's/{old}/{v}/g' {f}", f"grep -rl {old} /{root} | xargs sed -i 's/{old}/{v}/g'",
                  f"ping -c 1 {v}", f"getent hosts {v} || echo unknown {v}"]
    if key in ("port", "limit"):
        plain += [f"python3 -c 'print({v} + 1)'", f"seq {v} {v}", f"grep -rw {v} /{root}"]
    if key == "ticket":
        plain += [f"touch /tmp/{v}.done && ls /tmp", f"grep -rl {v} /{root} | head -n 1", f"git log --grep {v} 2>&1"]
    if key in ("owner", "version"):
        plain += [f"id {v}", f"echo {v} > {d}/{key}.txt && cat {d}/{key}.txt"]
    return rng.choice(keyed if rng.random() < 0.5 else plain)


def user_policy(n_commands):
    """A batch policy for envs.run_episodes that types n_commands generic commands (1-3 per reply), then
    claims completion and confirms it, in Terminus-2 JSON with an empty analysis and plan. Every choice follows
    from the session's seed and what the terminal printed."""
    def reply(messages):
        seed, i = _session_rng(messages[0]["content"])
        tree, facts = session_tree(seed, i), session_facts(seed, i)
        turn = sum(m["role"] == "assistant" for m in messages)
        typed = sum(len(json.loads(m["content"])["commands"]) for m in messages if m["role"] == "assistant")
        if typed >= n_commands:
            return json.dumps({"analysis": "", "plan": "", "commands": [], "task_complete": True})
        shown = "\n".join(m["content"] for m in messages[1:] if m["role"] == "user")
        seen = [p for p, _, _ in tree if os.path.basename(p) in shown]
        # Ids on screen: the logs' ids and the checksums md5sum / sha1sum printed.
        ids = sorted({v for v in tree_ids(tree) if v in shown} | set(re.findall(r"^([0-9a-f]{32,40})  ", shown, re.M)))
        rng = random.Random(f"{seed}/cmd/{i}/{turn}")
        # Most commands after the first look quote a value: one of the instruction's facts or an id on screen.
        cmds = [_quoting_command(rng, tree, seen, facts, ids) if turn and rng.random() < 0.6 else _command(rng, tree, seen)
                for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        return json.dumps({"analysis": "", "plan": "", "task_complete": False,
                           "commands": [{"keystrokes": c + "\n", "duration": 2.0} for c in cmds]})
    return lambda states: [reply(m) for m in states]


def session_tasks(n, seed):
    """Generated tasks of the runner: a random tree each, nothing to verify (the verifier always passes)."""
    return [envs.Task(f"session-{seed}-{i}", session_instruction(seed, i), agent_timeout=600.0, memory_mb=512,
                      files=tuple((p, t.encode(), m) for p, t, m in session_tree(seed, i)),
                      tests={"test.sh": b"#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"})
            for i in range(n)]


def record_sessions(n, n_commands, seed, concurrency=8, template=None, start=0):
    """Run sessions start..n-1 in real sandboxes -> their conversations (sessions that failed in Docker are
    dropped)."""
    from tqdm import tqdm
    with tqdm(total=n - start, desc="sessions", dynamic_ncols=True) as bar:
        eps = envs.run_episodes(session_tasks(n, seed)[start:], user_policy(n_commands), max_turns=n_commands + 4,
                                concurrency=concurrency, template=template, on_episode=lambda i, ep: bar.update())
    bad = [e for e in eps if e.failure]
    for e in bad[:5]:
        print(f"  {e.task}: {e.failure} {e.error[:200]}")
    return [e.messages for e in eps if not e.failure]


# ----------------------------------------------------------------------------------------------------------
# Copy accuracy: does the model type a literal value exactly where the session's user did?

VALUE_END = r"(?![\w-]|\.\w)"  # where a quoted value ends: not inside a longer name (d8n8n.ini, not d8n8n.ini.bak)


def value_events(conv):
    """[(assistant message index, start, end, source)]: each place a reply's text holds one of the session's
    values (an instruction fact, a file's id or a file's name) that an earlier message showed; source is
    "instruction" when the first message (the prompt) holds it, else "output"."""
    seed, i = _session_rng(conv[0]["content"])
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
    ids, `tokens` a step (rows of the schedule's length: short rows first, where the circuit forms soonest), linear warm-up then
    constant lr, gradient clip 1.0; `dtype` an autocast dtype or None (fp32). `also`: None, or a function of no
    arguments that returns another loss to add to every step's (session_loss: the refresh). Every `every` steps (and
    at the end) logs the held-out copy accuracy on rows of `probe_lengths` -> [(step, {length: accuracy})].

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
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("out", "concurrency")}
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
        split = [_session_rng(c[0]["content"])[1] >= args.sessions for c in convs]
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
        f"{s} {c['all']['exact']:.1%} of {c['all']['n']} (after the first token {c['all']['rest']:.1%}; once determined "
        f"{c['all']['determined']:.1%} of {c['all']['det_n']}; short "
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
        common.build_tiny(init, [m["content"] for c in convs for m in c], vocab_size=args.vocab, hidden=args.hidden,
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
        # (RESULTS.md, 2026-12-04).
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
