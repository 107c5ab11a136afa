"""Shared fixtures: a tiny random Qwen3 with a byte-level BPE trained here (Qwen's special tokens, so the real
Qwen3 chat template renders with it), and synthetic Terminus-2-style trajectories. No hub access."""
import json
import os
import random
import re
import time
from pathlib import Path

import pytest
import torch

from actobs import labels, terminus, tiny
from actobs.sandbox import daemon, images

FIXTURES = Path(__file__).parent / "fixtures"
QWEN3_TEMPLATE = (FIXTURES / "qwen3_chat_template.jinja").read_text()


# What a test needs beyond torch and transformers, as markers, so a machine without Docker or vLLM runs the rest:
# `pytest -m "not docker and not vllm"`. A test gets the marker from the fixture that provides the resource (every
# Docker test uses the base image, every vLLM test the vLLM-sized model), so a new test cannot forget it.
NEEDS = {"base_image": "docker", "vllm_dir": "vllm"}


# A directory's entries come in the file system's own order: on ext4 a hash seeded when the file system is made, so it
# differs between machines, and a test that reads a listing in order passes on one and fails on another. The suite
# therefore lists in an order of its own: every os.scandir and os.listdir in this process (and through them pathlib's
# iterdir and glob, glob.glob, os.walk, shutil) gives the names sorted, then, by ACTOBS_LISTING_ORDER:
# `shuffle:SEED` (the default, with a fresh SEED each run, printed in the header: set it to replay a failure)
# shuffled by SEED and their count, the same on any machine; `reverse` in reverse name order (a test that takes a
# listing to be sorted fails every time); `native` the file system's order, untouched. The product sorts where its
# order matters (a walk, a listing a user sees): there this changes nothing. It reaches this process only: the
# commands a test starts (torchrun, ablation.sh, python -m ...) list in the file system's order.
LISTING_ORDER = os.environ.get("ACTOBS_LISTING_ORDER") or f"shuffle:{random.SystemRandom().randrange(10**6)}"
_LISTERS = {"scandir": os.scandir, "listdir": os.listdir}


def _reordered(order, items, name):
    """items (names, or DirEntry objects named by name(item)) in the order ACTOBS_LISTING_ORDER asks."""
    kind, _, seed = order.partition(":")
    items = sorted(items, key=name, reverse=kind == "reverse")
    if kind == "shuffle":
        random.Random(f"{seed}:{len(items)}").shuffle(items)
    return items


class _ReorderedScandir:
    """os.scandir's iterator (a context manager too), its entries read at once and reordered."""

    def __init__(self, order, *args):
        with _LISTERS["scandir"](*args) as it:
            self.entries = iter(_reordered(order, it, lambda e: e.name))

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.entries)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def close(self):
        pass


def _reorder_listings(order):
    kind, _, seed = order.partition(":")
    if kind == "native":
        return
    if not (kind == "reverse" and not seed or kind == "shuffle" and seed):
        raise pytest.UsageError(f"ACTOBS_LISTING_ORDER={order}: 'shuffle:SEED', 'reverse' or 'native'")
    os.scandir = lambda *a: _ReorderedScandir(order, *a)
    os.listdir = lambda *a: _reordered(order, _LISTERS["listdir"](*a), lambda n: n)


def pytest_report_header():
    return f"listing order: {LISTING_ORDER} (ACTOBS_LISTING_ORDER; conftest.py)"


def pytest_terminal_summary(terminalreporter):
    # also under -q, which drops the header: the order to set to replay a failure
    terminalreporter.write_line(f"listing order: {LISTING_ORDER} (ACTOBS_LISTING_ORDER to replay it)")


def pytest_unconfigure():
    os.scandir, os.listdir = _LISTERS["scandir"], _LISTERS["listdir"]


def pytest_configure(config):
    _reorder_listings(LISTING_ORDER)
    # The tests' models are tiny: one intra-op thread computes them fastest, and on a shared machine more threads
    # spin against each other (the pure subset under load: 10 min with torch's default 2 threads, 45 s with one).
    # vLLM's CPU engine sets its own threads; torchrun'd tests set OMP_NUM_THREADS=1 themselves.
    torch.set_num_threads(1)
    config.addinivalue_line("markers", "slow: end-to-end tests (CI runs them; `-m 'not slow'` is the quick subset)")
    config.addinivalue_line("markers", "docker: needs a Docker daemon and the docker SDK (its fixture: base_image)")
    config.addinivalue_line("markers", "vllm: needs vLLM installed (its fixture: vllm_dir)")
    config.addinivalue_line("markers", "quota: needs a daemon with a disk quota (.ci/dockerd.sh's default where the "
                                       "kernel has XFS quotas, else ACTOBS_DOCKER_STORAGE=btrfs; .ci/run runs these)")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    for item in items:
        for fixture, marker in NEEDS.items():
            if fixture in item.fixturenames:
                item.add_marker(marker)


def nemotron_rows():
    """The three real Nemotron-Terminal-Corpus rows, exactly as published."""
    return json.loads((FIXTURES / "nemotron_terminal_sample.json").read_text())


def synthetic_trajectory(rng, turns=None):
    """A Terminus-2-looking episode: prompt, then assistant JSON replies and terminal observations."""
    files = [f"{rng.choice(['data', 'log', 'notes', 'conf'])}_{rng.randint(0, 99)}.{rng.choice(['txt', 'csv', 'json'])}"
             for _ in range(rng.randint(2, 5))]
    msgs = [{"role": "user", "content": "You are an AI assistant solving command-line tasks. Reply in JSON.\n\n"
             f"Task Description:\nFind the file that contains 'key{rng.randint(0, 9)}' and copy it to /app/out.\n\n"
             "Current terminal state:\nroot@box:/app# "}]
    for t in range(turns or rng.randint(2, 4)):
        cmd = rng.choice([f"cat {rng.choice(files)}", "ls -la", f"grep -rl key{rng.randint(0, 9)} .", "wc -l *"])
        reply = {"analysis": f"Step {t}: inspect the directory.", "plan": f"Run {cmd}.",
                 "commands": [{"keystrokes": cmd + "\n", "duration": 0.1}], "task_complete": False}
        msgs.append({"role": "assistant",
                     "content": f"<think>\nI should run {cmd}.\n</think>\n\n" + json.dumps(reply, indent=2)})
        out = "\n".join(rng.choice(files) + f" {rng.randint(1, 999)}" for _ in range(rng.randint(1, 4)))
        msgs.append({"role": "user",
                     "content": terminus.OUTPUT_HEADER + f"root@box:/app# {cmd}\n{out}\nroot@box:/app# "})
    return msgs


class ScriptedAsync:
    """A submit/poll policy with fixed replies per episode, not lock-step: it answers whatever is queued."""
    lockstep = False

    def __init__(self, replies):
        self.replies, self.queue, self.asked = replies, [], []

    def submit(self, key, ep):
        self.asked.append((time.time(), key))
        self.queue.append((key, sum(m["role"] == "assistant" for m in ep.messages)))

    def pending(self):
        return len(self.queue)

    def poll(self):
        out, self.queue = [(k, self.replies[k][turn]) for k, turn in self.queue], []
        return out

    def abort(self):
        self.queue = []


# Every literal piece of the observation templates (text between their {fields}), as a wrapper recogniser must
# remove it from the payload; short pieces such as 'bytes;' could occur in real terminal output.
TEMPLATE_PIECES = [p.strip() for t in (terminus.OUTPUT_HEADER, terminus.SCREEN_HEADER, terminus.TRUNCATION,
                                       terminus.WARNING_LIST, terminus.PARSE_ERRORS, terminus.WARNINGS,
                                       terminus.COMPLETION_CHECK, terminus.CUT_REPLY, terminus.CUT_WARNINGS)
                   for p in re.split(r"\{\w+\}", t) if len(p.strip()) >= 8]


def split_observation(obs):
    """-> (wrapper text, payload pieces) of one observation turn, checked: it is in a Terminus-2 form and no
    template text is left in its payload."""
    spans = terminus.wrapper_spans(obs)
    assert spans is not None, f"not a Terminus-2 observation: {obs[:300]!r}"
    cuts = [0] + [x for s in spans for x in s] + [len(obs)]
    payload = [obs[a:b] for a, b in zip(cuts[::2], cuts[1::2]) if b > a]
    for piece in TEMPLATE_PIECES:
        assert not any(piece in p for p in payload), f"{piece!r} left in the payload of {obs[:300]!r}"
    return "".join(obs[s:e] for s, e in spans), payload


@pytest.fixture(scope="session")
def synthetic():
    rng = random.Random(0)
    return [synthetic_trajectory(rng) for _ in range(40)]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, synthetic):
    """A saved tiny random Qwen3 (+ tokenizer) dir; the tokenizer is trained on real and synthetic text."""
    texts = [m["content"] for row in nemotron_rows() for m in row["conversations"]]
    texts += [m["content"] for c in synthetic for m in c]
    return tiny.build_tiny(tmp_path_factory.mktemp("tiny"), texts, vocab_size=2048, hidden=64, layers=2, heads=4,
                           kv_heads=2)


@pytest.fixture(scope="session")
def vllm_dir(tmp_path_factory, synthetic):
    """A tiny random Qwen3 whose head size (32) vLLM's CPU attention supports, its tokenizer trained like
    tiny_dir's and saved with its chat template."""
    texts = [m["content"] for row in nemotron_rows()
             for m in row["conversations"]] + [m["content"] for c in synthetic for m in c]
    return tiny.build_tiny(tmp_path_factory.mktemp("vllm-tiny"), texts, vocab_size=2048, hidden=64, layers=2, heads=2,
                           kv_heads=1)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    return labels.load_tokenizer(tiny_dir, "prefix")


@pytest.fixture(scope="session")
def qwen3_tokenizer(tiny_dir):
    """The same tokenizer with the real Qwen3 chat template (not prefix-preserving)."""
    tok = labels.load_tokenizer(tiny_dir, "native")
    tok.chat_template = QWEN3_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def model(tiny_dir):
    """The tiny model moved away from its near-uniform random init, so losses, gradients and entropies differ."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


@pytest.fixture(scope="session")
def base_image():
    """The project's base image; and the offline Terminal-Bench stand-in (trixie + uv, tagged ubuntu:24.04,
    python:3.13-slim-bookworm and ubuntu:22.04) so Harbor Dockerfiles build offline. Both are reused when present."""
    images.build_base_image()
    images.build_base_image(images.STANDIN_SUITE, images.STANDIN_TAGS, with_uv=True)
    return daemon.BASE_IMAGE


@pytest.fixture
def no_leftovers(base_image):
    """Docker tests use this: every test must leave no container of this process behind."""
    yield
    assert daemon.my_containers() == []


@pytest.fixture
def no_quota(base_image, monkeypatch):
    """The daemon as one without a disk quota: where it has one, its sandboxes are created without it."""
    from actobs.sandbox import disk
    disk.quota()  # found first, with whether the daemon applies seccomp
    monkeypatch.setattr(disk, "_quota", False)
