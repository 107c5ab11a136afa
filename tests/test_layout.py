"""The layout a forker reads: the README's file tree is the repository's, the five stages stand alone at the root,
and imports run one way (no circle, even through an import inside a function; the library imports no stage; a stage
imports no other stage but envs.py)."""
import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"sft", "grpo", "evaluate", "envs", "probes"}


def tracked():
    """The repository's tracked files, as paths relative to the root."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [Path(p) for p in out.splitlines()]


def readme_tree():
    """{path: depth} of the README's file tree (two spaces a level; a folder ends with /)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- tree[^>]*-->\n```text\n(.*?)```", text, re.S)
    assert block, "README.md has no file tree under a `<!-- tree` marker"
    entries, parents = {}, []
    for line in block[1].splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        parents[depth:] = [name.rstrip("/")]
        entries["/".join(parents) + ("/" if name.endswith("/") else "")] = depth
    return entries


def test_readme_tree_is_the_repository():
    """Every entry `ls` shows at the root is in the tree and nothing else is; every folder the tree opens lists
    exactly its files and sub-folders."""
    files = [p for p in tracked() if not p.parts[0].startswith(".")]
    tree = readme_tree()
    top = {p.parts[0] + ("/" if len(p.parts) > 1 else "") for p in files}
    assert {e for e, d in tree.items() if d == 0} == top
    for folder in [e for e in tree if e.endswith("/") and any(k.startswith(e) and k != e for k in tree)]:
        inside = {p.relative_to(folder).parts for p in files if str(p).startswith(folder)}
        listed = {e[len(folder):] for e, d in tree.items() if e.startswith(folder) and d == folder.count("/")}
        assert listed == {parts[0] + ("/" if len(parts) > 1 else "") for parts in inside}, folder


def test_the_stages_alone_at_the_root():
    assert {p.stem for p in tracked() if len(p.parts) == 1 and p.suffix == ".py"} == STAGES


def imports(path):
    """The project modules a file imports anywhere in it (inside functions too), as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    known = {module_name(p) for p in sources()}
    return {m for m in found if m in known}


def module_name(path):
    return ".".join(path.with_suffix("").parts)


def sources():
    return [p for p in tracked() if p.suffix == ".py" and (len(p.parts) == 1 or p.parts[0] == "actobs")
            and p.name != "__init__.py"]


def test_imports_run_one_way():
    graph = {module_name(p): imports(ROOT / p) for p in sources()}
    for mod, deps in graph.items():
        if mod.startswith("actobs"):
            assert not deps & STAGES, f"{mod} (the library) imports a stage: {deps & STAGES}"
        else:
            assert deps & STAGES <= {"envs"}, f"{mod} imports another stage: {deps & STAGES - {'envs'}}"
    # no circle, counting the imports made inside functions
    state = {}

    def visit(mod, path):
        state[mod] = "open"
        for dep in graph[mod]:
            assert state.get(dep) != "open", "import circle: " + " -> ".join(path + [mod, dep])
            if dep not in state:
                visit(dep, path + [mod])
        state[mod] = "done"
    for mod in graph:
        if mod not in state:
            visit(mod, [])
