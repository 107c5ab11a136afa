"""
The scripted terminal sessions the base model is pre-trained on (scripts/base_model.py): per session a random file
tree, an instruction that names a few literal values, and a scripted user who explores and changes the files with
generic shell commands, mostly about names an earlier output showed, quoting the instruction's values and the ids
on screen; recorded in real sandboxes (envs.run_episodes). Everything follows from the seed, the session's index and
what the terminal printed.
"""
import json
import os
import random
import re

import envs
from actobs.taskgen import WORDS
from actobs.tasks import Task

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
    "host": (lambda r: f"{r.choice(WORDS)}-{r.choice(WORDS)}"
                       f"{r.choice(['', '-' + str(r.randint(1, 99))])}.{r.choice(TLDS)}",
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
               "score": lambda: str(rng.randint(0, 100)),
               "day": lambda: f"2024-0{rng.randint(1, 9)}-{rng.randint(10, 28)}"}
        return ",".join(cols) + "\n" + "".join(",".join(val[c]() for c in cols) + "\n"
                                                for _ in range(rng.randint(2, 15)))
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
        return "".join(f"2024-0{rng.randint(1, 9)}-{rng.randint(10, 28)} "
                       f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} "
                       f"{rng.choice(['INFO', 'INFO', 'WARN', 'ERROR', 'DEBUG'])} {rng.choice(WORDS)}: "
                       f"id={_hex(rng, rng.randint(5, 10))} {_text(rng, 1)}"
                       for _ in range(rng.randint(3, 20)))
    if ext in GENERATED:  # generated values: nothing but copying an earlier sight of them predicts them
        return "".join({"keys": lambda: f"{_hex(rng, rng.choice([16, 24, 32]))}\n",
                        "sha256": lambda: f"{_hex(rng, 64)}  {_stem(rng)}.{rng.choice(['tar.gz', 'bin', 'txt'])}\n",
                        "env": lambda: f"{rng.choice(WORDS).upper()}_{rng.choice(['KEY', 'TOKEN', 'ID'])}="
                                       f"{_hex(rng, rng.randint(8, 20))}\n"}[ext]()
                       for _ in range(rng.randint(2, 6)))
    if ext == "py":
        w = rng.choice(WORDS)
        return (f"import sys\n\n\ndef {w}(n):\n    return n * {rng.randint(2, 9)}\n\n\n"
                f"print({w}({rng.randint(1, 20)}))\n")
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
    return "".join(rng.choice("bcdfghjklmnprstvwz" if k % 2 == 0 else "aeiou0123456789")
                   for k in range(rng.randint(4, 8)))


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
    return sorted({m for _, t, _ in tree
                   for m in re.findall(r"\bid=([0-9a-f]+)|^([0-9a-f]{16,64})\b|^[A-Z_]+=([0-9a-f]+)$", t, re.M)
                   for m in m if m})


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
        f"ls {d}", f"ls -l {d}", f"ls -lh {f}", f"stat -c '%a %s %n' {f}",
        f"file {f}" if rng.random() < 0.2 else f"du -sh {d}",
        f"grep -n {word} {f}", f"grep -c {word} {f}", f"grep -rl {word} {d}", f"grep -rn {word} {rng.choice(dirs)}",
        f"grep -i {word.upper()} {f}", f"grep -v {word} {f} | head -n {n}", f"grep -oiw {word} {f} | wc -l",
        f"sort {f} | head -n {n}", f"sort -r {f} | uniq | tail -n 3",
        f"cat {f} | tr ' ' '\\n' | sort | uniq -c | sort -rn | head -n 5",
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
        choices += [f"head -n 1 {f}", f"cut -d, -f1 {f} | sort | uniq -c",
                    f"awk -F, 'NR>1 {{n++}} END {{print n}}' {f}",
                    f"awk -F, 'NR>1 {{print $2}}' {f} | sort | head -n 3", f"column -s, -t < {f} | head",
                    f"python3 -c \"import csv; r=list(csv.DictReader(open({f!r}))); "
                    "print(len(r), list(r[0]) if r else [])\""]
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


def session_rng(prompt):
    """(seed, i) of the session a prompt's instruction names (session_instruction: "(session SEED-I)")."""
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
        return rng.choice([f"grep -n {v} {f}", f"grep -rl {v} /{root}", f"grep -rn id={v} {d}",
                           f"echo {v} >> /tmp/ids.txt", f"grep -c {v} {f}", f"sed -i '/{v}/d' {f}",
                           f"grep -B1 -A1 {v} {f}"])
    key, v = rng.choice(facts)
    configs = [p for p, t, _ in tree if re.search(rf"^{key}\b", t, re.M)]
    keyed = [f"echo '{key} = {v}' >> {f}", f'echo "{key}: {v}" > /tmp/{key}.txt', f"printf '{key}=%s\\n' {v} >> {f}",
             f"grep -rn {key} {d} ; echo {key} {v}"]
    if configs:
        c = rng.choice(configs)
        sep = ": " if c.endswith(".yaml") else " = "
        keyed += [f"sed -i 's/^{key}{sep}.*/{key}{sep}{v}/' {c} && grep -n {key} {c}"] * 3
    plain = [f"grep -rn {v} /{root}", f"grep -rl {v} {d}", f"echo {v} >> {f}",
             f"echo {v} > /tmp/{rng.choice(WORDS)}.txt"]
    if key == "backup":
        plain += [f"mkdir -p {v} && cp {f} {v}/ && ls {v}", f"mkdir -p {v}", f"cp {f} {v}/", f"ls -l {v}",
                  f"tar -czf {v}.tar.gz -C {d} . && ls -l {v}.tar.gz"]
    if key == "host":
        old = rng.choice(re.findall(r"^host\s*[=:]\s*(\S+)$", "".join(t for _, t, _ in tree), re.M)
                         or [rng.choice(WORDS)])
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
        seed, i = session_rng(messages[0]["content"])
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
        cmds = [_quoting_command(rng, tree, seen, facts, ids) if turn and rng.random() < 0.6
                else _command(rng, tree, seen)
                for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        return json.dumps({"analysis": "", "plan": "", "task_complete": False,
                           "commands": [{"keystrokes": c + "\n", "duration": 2.0} for c in cmds]})
    return lambda states: [reply(m) for m in states]


def session_tasks(n, seed):
    """Generated tasks of the runner: a random tree each, nothing to verify (the verifier always passes)."""
    return [Task(f"session-{seed}-{i}", session_instruction(seed, i), agent_timeout=600.0, memory_mb=512,
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
