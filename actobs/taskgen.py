"""
The embedded task world of ActObs, pure (envs.py runs everything in Docker; terminus.py holds the protocol):

1. A seeded generator of small terminal tasks (files to set up, an instruction, a bash verifier, a reference
   solution), written out as Harbor folders when needed.
2. A scripted expert policy that solves them the way an agent would, in the Terminus-2 protocol: it looks
   first (ls, cat, grep, head), decides from the observation, sometimes mistypes a path and recovers.

No Docker here: `python envs.py corpus ...` runs the tasks and the expert in sandboxes.

Splits: SFT, RL and evaluation tasks are generated from separate seeds and are disjoint by parameters (task
names are hashes of the parameters, duplicates are redrawn). The kind `archive` is held out of SFT and RL and
only appears in evaluation, so evaluation also measures a task kind never seen in training. Every kind of the world
(GENERATORS) pays 1 or 0; `permissions_graded` (GRADED, outside the splits) pays the share of its checks that pass.
"""
import dataclasses
import hashlib
import json
import random
import re
import shlex
from pathlib import Path

from actobs import terminus

# ----------------------------------------------------------------------------------------------------------
# Task world

# Limits of every generated task: written into its task.toml, and used as they are when envs runs a spec directly.
LIMITS = {"agent_timeout": 300.0, "verifier_timeout": 60.0, "cpus": 1, "memory_mb": 1024, "storage_mb": 1024}
WORDS = ("amber basil cedar delta ember fjord garnet harbor indigo juniper kelp lumen maple nectar onyx pepper "
         "quartz raven sierra tundra umber violet willow xenon yarrow zephyr").split()
HELDOUT_KINDS = ("archive",)


@dataclasses.dataclass
class Spec:
    name: str
    kind: str
    instruction: str
    files: list  # [(absolute path, text, mode)]
    test: str  # tests/test.sh: writes 1 or 0 to /logs/verifier/reward.txt (a graded kind: reward.json, a score a check)
    solve: str  # solution/solve.sh
    params: dict


def _verifier(condition):
    """A test.sh that writes 1 if the bash condition holds, else 0."""
    return (f"#!/bin/bash\nif {condition}; then\n  echo 1 > /logs/verifier/reward.txt\n"
            "else\n  echo 0 > /logs/verifier/reward.txt\nfi\n")


def _graded_verifier(checks):
    """A test.sh that grades: reward.json holds a score per check, 1 where its bash condition holds, else 0 (checks:
    [(name, condition)]); the reward is their mean (verify.json_reward)."""
    lines = ["#!/bin/bash", "out=/logs/verifier/reward.json", "echo '{' > $out"]
    for i, (name, condition) in enumerate(checks):
        comma = "," if i + 1 < len(checks) else ""
        lines.append(f'if {condition}; then s=1; else s=0; fi; echo "  \\"{name}\\": $s{comma}" >> $out')
    return "\n".join(lines + ["echo '}' >> $out"]) + "\n"


def _py_verifier(code):
    """A test.sh whose check is a python3 snippet that exits 0 on success."""
    return _verifier(f"python3 /dev/stdin <<'PY'\n{code}\nPY\n[ $? -eq 0 ]")


def _sentence(rng, n=8):
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ----------------------------------------------------------------------------------------------------------
# Generators: rng -> (instruction, files, test, solve, params)

def gen_find_copy(rng):
    # Harder instances: a longer token, more files, and another file holding a look-alike token (same prefix).
    n = rng.choice([4, 6, 6, 8, 10])
    token = f"TOKEN-{rng.randrange(16**n):0{n}x}"
    dirs = [f"/app/notes/{rng.choice(WORDS)}" for _ in range(rng.randint(2, 4))]
    paths = sorted({f"{rng.choice(dirs)}/{rng.choice(WORDS)}-{i}.txt" for i in range(rng.randint(4, 12))})
    target = rng.choice(paths)
    decoy = rng.choice([p for p in paths if p != target] or [None]) if rng.random() < 0.5 else None
    lookalike = token
    while lookalike == token:  # same length, so neither holds the other: grep for the token finds one file
        lookalike = f"TOKEN-{token[6:8]}{rng.randrange(16**(n - 2)):0{n - 2}x}"
    files = [(p, "\n".join(_sentence(rng) for _ in range(3)) + (f"\nref {token}\n" if p == target else
                                                               f"\nref {lookalike}\n" if p == decoy else "\n"), 0o644)
             for p in paths]
    instr = (f"Exactly one file under /app/notes contains the string {token}. "
             f"Copy that file to /app/found.txt (same content).")
    return instr, files, _verifier(f"cmp -s /app/found.txt {target}"), f"cp {target} /app/found.txt\n", {
        "token": token, "target": target, "decoy": decoy}


def gen_fix_config(rng):
    # Harder instances: more settings around the broken ones, and one more to change (workers).
    port, level = rng.randrange(2000, 9000), rng.choice(["debug", "info", "warning", "error"])
    workers = str(rng.randint(17, 64)) if rng.random() < 0.35 else None
    name = rng.choice(WORDS)
    keep = {"name": name, "workers": str(rng.randint(2, 16)), "root": f"/srv/{rng.choice(WORDS)}"}
    if rng.random() < 0.5:
        keep |= {"timeout": str(rng.randint(5, 120)), "user": rng.choice(WORDS), "retries": str(rng.randint(1, 9))}
    lines = ["[service]", f"name = {name}", f"port = {rng.choice(['eighty', 'none', str(port) + 'x'])}",
             f"workers = {keep['workers']}", f"log_level = {rng.choice(['verbose', 'loud', 'LOTS'])}",
             f"root = {keep['root']}"] + [f"{k} = {keep[k]}" for k in ("timeout", "user", "retries") if k in keep]
    also = f", workers to {workers}" if workers else ""
    instr = (f"The service will not start: /app/config/service.ini is invalid. Set port to {port}{also} and "
             f"log_level to {level} in the [service] section; keep every other setting unchanged.")
    want = keep | {"port": str(port), "log_level": level} | ({"workers": workers} if workers else {})
    check = (f"import configparser\nc = configparser.ConfigParser()\nc.read('/app/config/service.ini')\n"
             f"s = c['service']\nexpect = {json.dumps(want)}\nassert dict(s) == expect, dict(s)")
    solve = (f"sed -i -e 's/^port = .*/port = {port}/' -e 's/^log_level = .*/log_level = {level}/' "
             + (f"-e 's/^workers = .*/workers = {workers}/' " if workers else "") + "/app/config/service.ini\n")
    return instr, [("/app/config/service.ini", "\n".join(lines) + "\n", 0o644)], _py_verifier(check), solve, {
        "port": port, "level": level, "workers": workers}


CSV_MEASURES = {"revenue": "total revenue (sum of units * price), rounded to 2 decimals",
                "units": "total number of units sold (sum of units)"}


def gen_csv_summary(rng):
    # Harder instances: more rows, a column that plays no part, and units asked for instead of revenue.
    cols = ["region", "product", "units", "price"] + (["discount"] if rng.random() < 0.5 else [])
    rng.shuffle(cols)  # the expert must read the header to know the column order
    measure = "units" if rng.random() < 0.35 else "revenue"
    regions = rng.sample(["north", "south", "east", "west", "central"], rng.randint(2, 4))
    rows, totals = [], {r: 0.0 for r in regions}
    for _ in range(rng.randint(6, 24)):
        row = {"region": rng.choice(regions), "product": rng.choice(WORDS), "units": rng.randint(1, 20),
               "price": round(rng.uniform(1, 50), 2), "discount": rng.choice([0, 5, 10, 15])}
        totals[row["region"]] += row["units"] * (row["price"] if measure == "revenue" else 1)
        rows.append(",".join(str(row[c]) for c in cols))
    totals = {r: round(v, 2) for r, v in totals.items() if v}
    instr = ("Summarise /app/data/sales.csv into /app/summary.json: a JSON object that maps each region to its "
             f"{CSV_MEASURES[measure]}.")
    check = (f"import json\ngot = json.load(open('/app/summary.json'))\nexpect = {json.dumps(totals)}\n"
             f"assert set(got) == set(expect) and all(abs(got[k] - v) < 0.011 for k, v in expect.items()), got")
    solve = ("python3 - <<'PY'\nimport csv, json\nt = {}\nfor r in csv.DictReader(open('/app/data/sales.csv')):\n"
             f"    t[r['region']] = t.get(r['region'], 0) + {_CSV_TERM[measure]}\n"
             "json.dump({k: round(v, 2) for k, v in t.items()}, open('/app/summary.json', 'w'))\nPY\n")
    return instr, [("/app/data/sales.csv", ",".join(cols) + "\n" + "\n".join(rows) + "\n", 0o644)], \
        _py_verifier(check), solve, {"columns": cols, "measure": measure}


_CSV_TERM = {"revenue": "int(r['units']) * float(r['price'])", "units": "int(r['units'])"}  # one row's share


def gen_permissions(rng):
    # Harder instances: more names to copy from the listing (one to four, each folder may hold none), and a README
    # beside the scripts that must keep mode 644. The policy types every name it saw, so the count is the difficulty.
    n_scripts, n_keys = rng.choice([(a, b) for a in range(3) for b in range(3) if a + b])
    scripts = [f"/app/bin/{w}.sh" for w in sorted(rng.sample(WORDS, n_scripts))]
    keys = [f"/app/secrets/{w}.key" for w in sorted(rng.sample(WORDS, n_keys))]
    keep = ["/app/bin/README.txt"] if rng.random() < 0.5 else []
    instr = ("Fix the permissions under /app: every .sh file in /app/bin must be executable by everyone "
             "(mode 755) and every .key file in /app/secrets readable and writable by its owner only (mode 600)."
             + (" Leave other files as they are." if keep else ""))
    files = ([(s, "#!/bin/sh\necho ok\n", 0o644) for s in scripts]
             + [(k, f"{rng.randrange(16**16):016x}\n", 0o666) for k in keys]
             + [(k, "notes\n", 0o644) for k in keep])
    test = _verifier(" && ".join(cond for _, cond in _mode_checks(scripts, keys, keep)))
    solve = "".join(f"chmod {mode} {' '.join(names)}\n" for mode, names in ((755, scripts), (600, keys)) if names)
    return instr, files, test, solve, {
        "scripts": scripts, "keys": keys, "keep": keep}


def _mode_checks(scripts, keys, keep):
    """permissions' checks: (path, the bash condition that its mode is the one the task asks for)."""
    want = [(s, 755) for s in scripts] + [(k, 600) for k in keys] + [(k, 644) for k in keep]
    return [(p, f'[ "$(stat -c %a {p})" = {m} ]') for p, m in want]


def gen_permissions_graded(rng):
    # permissions with a verifier that grades: a score per file whose mode the task sets, so a run that fixes some of
    # them earns that share (the instruction is permissions', and so is its expert)
    instr, files, _, solve, params = gen_permissions(rng)
    return instr, files, _graded_verifier(_mode_checks(**params)), solve, params


def gen_log_extract(rng):
    # Harder instances: longer logs, and a second failing status whose requests must be left out.
    code, out = rng.choice([500, 502, 503, 404]), f"/app/{rng.choice(['failed', 'errors', 'bad'])}_requests.txt"
    other = [rng.choice([c for c in (500, 502, 503, 404) if c != code])] if rng.random() < 0.5 else []
    lines, want = [], []
    for i in range(rng.randint(10, 45)):
        rid, status = f"req-{rng.randrange(16**6):06x}", rng.choice([200, 200, 200, 201, 304, code] + other)
        level = "ERROR" if status >= 500 else "INFO"
        lines.append(f"2024-05-{rng.randint(1, 28):02d}T{i % 24:02d}:{rng.randint(0, 59):02d}:00 {level} [{rid}] "
                     f"{rng.choice(['GET', 'POST'])} /api/{rng.choice(WORDS)} status={status}")
        want += [rid] if status == code else []
    if not want:  # the task must have at least one answer
        lines[-1] = re.sub(r"status=\d+", f"status={code}", lines[-1])
        want.append(re.search(r"\[(req-\w+)\]", lines[-1]).group(1))
    instr = (f"Write the request ids (like req-0a1b2c) of all requests in /app/logs/server.log that ended with "
             f"status {code} to {out}, one per line, in the order they appear in the log.")
    test = _verifier(f"[ \"$(cat {out})\" = {shlex.quote(chr(10).join(want))} ]")
    solve = f"grep 'status={code}$' /app/logs/server.log | grep -o 'req-[0-9a-f]*' > {out}\n"
    return instr, [("/app/logs/server.log", "\n".join(lines) + "\n", 0o644)], test, solve, {
        "code": code, "out": out, "other": other}


def count_word(word):
    """word_count's command, the reference solution's and the expert's: the word quoted, as the instruction quotes it
    (see _word_count)."""
    return f'cat /app/texts/*.txt | grep -oiw "{word}" | wc -l > /app/count.txt\n'


def gen_word_count(rng):
    # Harder instances: more files, and longer words that start with the word (not whole-word matches).
    word = rng.choice(WORDS)
    files, count = [], 0
    longer = [word + "s", word + "wood"] if rng.random() < 0.5 else []
    for i in range(rng.randint(2, 7)):
        text = "\n".join(" ".join(rng.choice(WORDS + longer * 2) for _ in range(10)) for _ in range(rng.randint(3, 8)))
        text = " ".join(w.upper() if rng.random() < 0.2 else w for w in text.split(" "))
        count += sum(w.lower() == word for w in text.split())
        files.append((f"/app/texts/{rng.choice(WORDS)}_{i}.txt", text + "\n", 0o644))
    instr = (f"Count how many times the word \"{word}\" occurs in the .txt files in /app/texts (whole words, any "
             f"letter case) and write just the number to /app/count.txt.")
    test = _verifier(f"[ \"$(tr -d ' \\n' < /app/count.txt)\" = {count} ]")
    return instr, files, test, count_word(word), {"word": word, "longer": longer}


def gen_rename(rng):
    # Harder instances: more files, and names that contain the old extension without ending in it.
    old, new = rng.choice([("jpeg", "jpg"), ("txt", "md"), ("htm", "html"), ("yml", "yaml")])
    names = sorted({rng.choice(WORDS) + str(rng.randint(1, 99)) for _ in range(rng.randint(2, 10))})
    others = ["README"] + ([f"{rng.choice(WORDS)}.{old}.bak", f"{old}_list.dat"] if rng.random() < 0.5 else [])
    files = ([(f"/app/photos/{n}.{old}", f"{n}\n", 0o644) for n in names]
             + [(f"/app/photos/{o}", "keep\n", 0o644) for o in others])
    want = " ".join(sorted([f"{n}.{new}" for n in names] + others))
    instr = (f"Rename every file ending in .{old} in /app/photos so that it ends in .{new} instead. "
             "Leave other files alone.")
    test = _verifier(f"[ \"$(cd /app/photos && ls | sort | tr '\\n' ' ' | sed 's/ $//')\" = '{want}' ]")
    solve = f"cd /app/photos && for f in *.{old}; do mv \"$f\" \"${{f%.{old}}}.{new}\"; done\n"
    return instr, files, test, solve, {"old": old, "new": new, "others": others}


def gen_replace_host(rng):
    # Harder instances: more files that hold the old host (one to four; the policy types the name of each), and
    # another database host (a replica) that must stay as it is. One more file may not mention the old host at all.
    a, b, c = rng.sample(WORDS, 3)
    old, new, stay = f"db-{a}.internal", f"db-{b}-{rng.randint(2, 9)}.internal", f"db-{c}.internal"
    replica = rng.random() < 0.5
    n_with = rng.randint(1, 4)
    names = rng.sample(WORDS, n_with + rng.randint(0, 1))
    files, n = [], 0
    for i, name in enumerate(names):
        k = rng.randint(1, 2) if i < n_with else 0
        n += k
        body = ([f"# {name}", f"timeout = {rng.randint(1, 60)}"] + [f"host{j} = {old}" for j in range(k)]
                + ([f"replica = {stay}"] if replica and rng.random() < 0.6 else []))
        files.append((f"/app/conf/{name}.conf", "\n".join(body) + "\n", 0o644))
    files.sort()
    kept = sum(t.count(stay) for _, t, _ in files)
    instr = f"The database moved from {old} to {new}. Update every file in /app/conf that mentions the old host."
    test = _verifier(f"! grep -rq {old} /app/conf && [ \"$(cat /app/conf/*.conf | grep -c {new})\" = {n} ] && "
                     f"[ \"$(cat /app/conf/*.conf | grep -c {stay})\" = {kept} ]")
    return instr, files, test, f"sed -i 's/{old}/{new}/g' /app/conf/*.conf\n", {
        "old": old, "new": new, "kept": kept}


def gen_archive(rng):
    names = sorted(set(rng.sample(WORDS, rng.randint(2, 5))))
    files = [(f"/app/docs/{n}.md", f"# {n}\n{_sentence(rng)}\n", 0o644) for n in names]
    files.append(("/app/docs/draft.tmp", "scratch\n", 0o644))
    want = " ".join(f"{n}.md" for n in names)
    instr = ("Create /app/backup.tar.gz, a gzip-compressed tar archive of the .md files in /app/docs, stored with "
             "paths relative to /app/docs (e.g. notes.md, not app/docs/notes.md).")
    test = _verifier("[ \"$(tar -tzf /app/backup.tar.gz | sed 's|^./||' | sort | tr '\\n' ' ' | sed 's/ $//')\" "
                     f"= '{want}' ]")
    return instr, files, test, "cd /app/docs && tar -czf /app/backup.tar.gz *.md\n", {"names": names}


GENERATORS = {"find_copy": gen_find_copy, "fix_config": gen_fix_config, "csv_summary": gen_csv_summary,
              "permissions": gen_permissions, "log_extract": gen_log_extract, "word_count": gen_word_count,
              "rename": gen_rename, "replace_host": gen_replace_host, "archive": gen_archive}  # the world: its splits
GRADED = {"permissions_graded": gen_permissions_graded}  # kinds whose verifier grades, outside the world's splits


def generate(kind, rng):
    instr, files, test, solve, params = (GENERATORS | GRADED)[kind](rng)
    digest = hashlib.sha256(json.dumps([instr, files], sort_keys=True).encode()).hexdigest()[:10]
    return Spec(f"{kind}-{digest}", kind, instr, files, test, "#!/bin/bash\nset -e\n" + solve, params)


def make_splits(n_sft, n_rl, n_eval, seed=0):
    """Disjoint task lists {"sft", "rl", "eval"}; kinds cycle for balance, held-out kinds only in eval."""
    train_kinds = [k for k in GENERATORS if k not in HELDOUT_KINDS]
    seen, splits = set(), {}
    eval_kinds = list(HELDOUT_KINDS) + train_kinds  # held-out kinds first, so even a small eval set has them
    for split, n, kinds in (("sft", n_sft, train_kinds), ("rl", n_rl, train_kinds), ("eval", n_eval, eval_kinds)):
        rng, out = random.Random(f"{seed}/{split}"), []
        while len(out) < n:
            spec = generate(kinds[len(out) % len(kinds)], rng)
            if spec.name not in seen:  # a redraw keeps splits disjoint even for tiny parameter spaces
                seen.add(spec.name)
                out.append(spec)
        splits[split] = out
    return splits


def write_harbor(spec, path, base_image):
    """Write a spec as a Harbor task folder; the environment copies the task's files onto base_image (envs.py
    builds it and passes its tag)."""
    path = Path(path)
    for rel, text, mode in [("instruction.md", spec.instruction + "\n", 0o644), ("tests/test.sh", spec.test, 0o755),
                            ("solution/solve.sh", spec.solve, 0o755),
                            ("environment/Dockerfile", f"FROM {base_image}\nCOPY files/ /\nWORKDIR /app\n", 0o644)] + \
            [("environment/files" + p, text, mode) for p, text, mode in spec.files]:
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
        (path / rel).chmod(mode)
    (path / "task.toml").write_text(
        f'version = "1.0"\n\n[task]\nname = "actobs/{spec.name}"\n\n[metadata]\nkind = "{spec.kind}"\n\n'
        f"[verifier]\ntimeout_sec = {LIMITS['verifier_timeout']}\n\n"
        f"[agent]\ntimeout_sec = {LIMITS['agent_timeout']}\n\n"
        f"[environment]\ncpus = {LIMITS['cpus']}\nmemory_mb = {LIMITS['memory_mb']}\n"
        f"storage_mb = {LIMITS['storage_mb']}\n"
        "allow_internet = false\n")


# ----------------------------------------------------------------------------------------------------------
# Scripted expert: a policy(states) -> replies in the Terminus-2 JSON format. Each kind has a look step, an act
# step that decides from what the look showed, and a check step; then it claims completion and confirms.

def _lines(obs, pattern):
    return [m.group(1) for m in re.finditer(pattern, obs, re.M)]


def _find_copy(m, obs):
    token = m.group(1)
    look = ("Nothing has been done yet. I need the one file under /app/notes that contains " + token + ".",
            "List the notes tree, then grep recursively for the token to get the file name.",
            ["ls -R /app/notes\n", f"grep -rl {token} /app/notes\n"])
    hits = _lines(obs, r"^(/app/notes/\S+\.txt)$")  # grep's line, not one of ls -R's "dir:" headers
    src = hits[-1] if hits else f"$(grep -rl {token} /app/notes | head -n 1)"
    act = (f"grep reports the token in {src}." if hits else "The grep output was not conclusive.",
           "Copy that file to /app/found.txt.", [f"cp {src} /app/found.txt\n"])
    check = ("The copy ran without errors.", "Confirm the copy has the token and the same size as the source.",
             [f"grep -c {token} /app/found.txt\n", "ls -l /app/found.txt\n"])
    return look, act, check


def _fix_config(m, obs):
    port, workers, level = m.group(1), m.group(2), m.group(3)
    look = ("The config file has to be repaired; I have not seen it yet.", "Print /app/config/service.ini.",
            ["cat /app/config/service.ini\n"])
    bad_port = (_lines(obs, r"^port = (.*)$") or ["?"])[-1]
    bad_level = (_lines(obs, r"^log_level = (.*)$") or ["?"])[-1]
    act = (f"port is '{bad_port}' and log_level is '{bad_level}'; both are invalid. The other keys look fine.",
           f"Rewrite just those lines with sed: port = {port}, log_level = {level}" +
           (f", workers = {workers}." if workers else "."),
           [f"sed -i -e 's/^port = .*/port = {port}/' -e 's/^log_level = .*/log_level = {level}/' " +
            (f"-e 's/^workers = .*/workers = {workers}/' " if workers else "") + "/app/config/service.ini\n"])
    check = ("sed finished.", "Print the file again to check the two lines and that nothing else changed.",
             ["cat /app/config/service.ini\n"])
    return look, act, check


def _csv_summary(m, obs):
    measure = "revenue" if m.group(1) == "revenue" else "units"
    look = ("I need to know the CSV's columns before writing the summary.", "Show the header and size of the file.",
            ["head -n 5 /app/data/sales.csv\n", "wc -l /app/data/sales.csv\n"])
    header = next((ln for ln in _lines(obs, r"^([a-z,]+)$") if "region" in ln and "units" in ln), None)
    seen = (f"The header is {header}; the column order varies, so the script reads columns by name." if header
            else "The header did not show up; reading the columns by name works whatever their order.")
    script = ("cat > /app/summarise.py << 'EOF'\nimport csv, json\n\ntotals = {}\n"
              "with open('/app/data/sales.csv') as f:\n"
              "    for row in csv.DictReader(f):\n        region = row['region']\n"
              f"        totals[region] = totals.get(region, 0) + {_CSV_TERM[measure].replace('r[', 'row[')}\n"
              "with open('/app/summary.json', 'w') as f:\n"
              "    json.dump({k: round(v, 2) for k, v in sorted(totals.items())}, f, indent=2)\nEOF\n")
    act = (seen, f"Write a small Python script that sums {'units*price' if measure == 'revenue' else 'units'} per "
           "region, run it.",
           [script, "python3 /app/summarise.py\n"])
    check = ("The script ran.", "Look at the JSON it wrote.", ["cat /app/summary.json\n"])
    return look, act, check


def _permissions(m, obs):
    # The look lists the two globs, so ls prints each file as the full path the chmod then types: a name is copied
    # after the same "/app/bin/" it follows in the listing. From `ls -l /app/bin` (bare names after a time stamp)
    # the policies copied no name at all: P(name) at the act step was chance over the word list.
    look = ("I have to see the current modes first.", "List the scripts and keys with ls -l.",
            ["ls -l /app/bin/*.sh /app/secrets/*.key\n"])
    scripts, keys = (_lines(obs, rf"^-\S+ .* (/app/{d}/\S+\.{x})$") for d, x in (("bin", "sh"), ("secrets", "key")))
    act = (f"Scripts: {', '.join(scripts) or 'none seen'}; keys: {', '.join(keys) or 'none seen'}. "
           "Their modes are wrong.",
           "chmod 755 the scripts and 600 the keys.",
           [f"chmod {mode} {' '.join(names)}\n" for mode, names in ((755, scripts), (600, keys)) if names])
    check = ("chmod done.", "List again to check the modes.", ["ls -l /app/bin /app/secrets\n"])
    return look, act, check


def _log_extract(m, obs):
    code, out = m.group(1), m.group(2)
    look = ("I need the log's line format.", f"Show the first lines and count lines with status={code}.",
            ["head -n 5 /app/logs/server.log\n", f"grep -c 'status={code}' /app/logs/server.log\n"])
    counts = _lines(obs, r"^(\d+)$")
    act = (f"Each line ends with status=NNN and carries the id in brackets; {counts[-1] if counts else 'some'} lines "
           f"have status {code}.", f"Keep lines ending in status={code}, extract the ids with grep -o, write {out}.",
           [f"grep 'status={code}$' /app/logs/server.log | grep -o 'req-[0-9a-f]*' > {out}\n", f"wc -l {out}\n"])
    check = (f"{out} was written.", "Print it to check the ids.", [f"cat {out}\n"])
    return look, act, check


def _word_count(m, obs):
    word = m.group(1)
    # The word is quoted wherever the expert types it, as in the instruction: a quote then the word is a token of its
    # own, where after a space (`grep -oiw apple`) it is another token, which no copy from the instruction produces.
    look = ("I should see which files there are.", f'List /app/texts and preview the matches of the word "{word}".',
            ["ls /app/texts\n", f'grep -oiw "{word}" /app/texts/*.txt | head -n 5\n'])
    act = ("grep -o -i -w prints one line per whole-word match, in any case.", "Count those lines over all files.",
           [count_word(word)])
    check = ("The count was written.", "Print /app/count.txt.", ["cat /app/count.txt\n"])
    return look, act, check


def _rename(m, obs):
    old, new = m.group(1), m.group(2)
    look = ("I need to see the files in /app/photos.", "List the folder.", ["ls -la /app/photos\n"])
    seen = _lines(obs, rf"(\S+\.{old})$")
    act = (f"There are {len(seen)} .{old} files ({', '.join(seen[:4])}{'...' if len(seen) > 4 else ''}).",
           f"Loop over them in /app/photos and mv each to the .{new} name.",
           ["cd /app/photos\n", f"for f in *.{old}; do mv -- \"$f\" \"${{f%.{old}}}.{new}\"; done\n"])
    check = ("The loop finished.", "List the folder again.", ["ls -la\n"])
    return look, act, check


def _replace_host(m, obs):
    old, new = m.group(1), m.group(2)
    # grep -l prints each file once, and the reply names them in grep's order: a copy of the listing line by line.
    # From `grep -rn` (a line per match) the expert named the files deduplicated and sorted, which no copy produces.
    look = (f"I need the files that mention {old}.", "grep for the old host, one line per file.",
            [f"grep -rl {old} /app/conf\n"])
    files = _lines(obs, r"^(/app/conf/\S+\.conf)$")
    act = (f"The old host appears in {', '.join(files) or 'no file I could see'}.",
           f"Replace it with {new} in place with sed.",
           [f"sed -i 's/{old}/{new}/g' {' '.join(files) or '/app/conf/*.conf'}\n"])
    check = ("sed finished.", "grep for both hosts to check.", [f"grep -rn -e {old} -e {new} /app/conf\n"])
    return look, act, check


def _archive(m, obs):
    look = ("I need the list of documents.", "List /app/docs.", ["ls -la /app/docs\n"])
    mds = _lines(obs, r"(\S+\.md)$")
    act = (f"The markdown files are {', '.join(mds) or 'not visible'}; draft.tmp must stay out.",
           "tar them from inside /app/docs so the paths are relative.",
           ["cd /app/docs\n", f"tar -czf /app/backup.tar.gz {' '.join(mds) or '*.md'}\n"])
    check = ("The archive was written.", "List its contents.", ["tar -tzf /app/backup.tar.gz\n"])
    return look, act, check


EXPERTS = [  # (instruction pattern, expert); the pattern also recovers the task's parameters from the prompt
    (r"contains the string (TOKEN-\w+)", _find_copy),
    (r"Set port to (\d+)(?:, workers to (\d+))? and log_level to (\w+)", _fix_config),
    (r"Summarise /app/data/sales\.csv into /app/summary\.json: a JSON object that maps each region to its total "
     r"(revenue|number of units)", _csv_summary), (r"Fix the permissions under /app", _permissions),
    (r"ended with status (\d+) to (\S+), one per line", _log_extract),
    (r'Count how many times the word "(\w+)"', _word_count),
    (r"ending in \.(\w+) in /app/photos so that it ends in \.(\w+)", _rename),
    (r"The database moved from (\S+) to (\S+)\.", _replace_host), (r"Create /app/backup\.tar\.gz", _archive)]


def _duration(keystrokes):
    # As Terminus-2 agents do: 0.1 s for quick looks, 1.0 s for anything that loops, pipes or writes.
    return 1.0 if re.search(r"\bfor\b|python3|\btar\b|<<|sed -i|\||>", keystrokes) else 0.1


def _reply(analysis, plan, commands, done=False):
    # One line of JSON and no <think> block: the analysis and plan are the reasoning, and every token is one the
    # policy must sample (a think block repeating them doubled an episode's action tokens).
    return json.dumps({"analysis": analysis, "plan": plan,
                       "commands": [{"keystrokes": k, "duration": _duration(k)} for k in commands],
                       "task_complete": done})


def expert_reply(messages):
    prompt, obs = messages[0]["content"], messages[-1]["content"]
    turn = sum(x["role"] == "assistant" for x in messages)
    for pattern, expert in EXPERTS:
        m = re.search(pattern, prompt)
        if m:
            break
    else:
        return _reply("I do not recognise this task.", "Stop here.", [], done=True)
    if turn and terminus.is_completion_check(obs):
        return _reply("The checks passed; nothing is left to do.", "Confirm completion.", [], done=True)
    # One episode in four first mistypes the path of its first look and has to recover from the error.
    clumsy = int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 4 == 0
    step = turn - clumsy
    look, act, check = expert(m, obs)
    if step < 0:
        return _reply(look[0], look[1], [look[2][0].replace("/app/", "/ap/", 1)])
    if step == 0:
        if clumsy:
            seen = "the path was mistyped (/ap/ instead of /app/)" if "No such file" in obs else "that was not useful"
            return _reply(f"The last command failed: {seen}. {look[0]}", look[1], look[2])
        return _reply(*look)
    if step == 1:
        return _reply(*act)
    if step == 2:
        return _reply(*check)
    return _reply(f"The check output looks right. {check[0]}", "The task is complete.", [], done=True)


def expert_policy(states):
    """A policy: a batch of conversations -> one reply each."""
    return [expert_reply(messages) for messages in states]
