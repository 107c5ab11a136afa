"""Beyond one node: sft.py and grpo.py under `torchrun --nnodes 2`, rehearsed as two "nodes" on this machine: two
torchrun launches of one process each and one rendezvous (node 0's address and port), as the README's command runs
them on two machines. SFT gives the single launch's curve; GRPO's ranks each run their engine and their sandboxes on
their own node's Docker daemon (a daemon of its own each here), and both engines get the same weights each step."""
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actobs import taskgen
from actobs.sandbox import daemon
from conftest import nemotron_rows, synthetic_trajectory

ROOT = Path(__file__).parent.parent
DOCKERD = ROOT / ".ci" / "dockerd.sh"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(script, argv, envs=({}, {})):
    """`script argv` under torchrun --nnodes 2 --nproc_per_node 1, one launch a node (node_rank 0 and 1), both at once
    against node 0's address; envs: each node's extra environment. -> both launches' output; both must succeed."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
                               str(ROOT / script), *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
             for node, env in enumerate(envs)]
    out = [p.communicate(timeout=1200)[0] for p in procs]
    for node, (p, text) in enumerate(zip(procs, out)):
        assert p.returncode == 0, f"node {node}:\n{text[-3000:]}"
    return out


def one_node(script, argv):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(ROOT / script), *argv], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]


def log(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_on_two_nodes_trains_as_on_one(tiny_dir, tmp_path):
    """The same DDP run as one launch of two processes: the same loss at every step, the same final weights."""
    from safetensors.torch import load_file
    rng = random.Random(7)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in nemotron_rows()
                            + [{"conversations": synthetic_trajectory(rng)} for _ in range(29)]))

    def argv(out):
        return ["--model", str(tiny_dir), "--data", str(data), "--out", str(tmp_path / out), "--lr", "3e-3",
                "--batch-size", "8", "--val-size", "8", "--max-len", "768", "--micro-tokens", "2048",
                "--eval-every", "0", "--save-every", "0", "--dtype", "fp32"]
    one_node("sft.py", argv("one"))
    two_nodes("sft.py", argv("two"))
    curve = {k: [r["train/loss"] for r in log(tmp_path / k) if "train/loss" in r] for k in ("one", "two")}
    assert len(curve["one"]) >= 3 and curve["two"] == pytest.approx(curve["one"], rel=1e-6)
    a, b = (load_file(str(tmp_path / k / "final" / "model.safetensors")) for k in ("one", "two"))
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= 1e-6 for k in a)


@pytest.fixture
def node_daemons(base_image, tmp_path_factory):
    """Two Docker daemons, one a "node" (this machine's shared daemon would also hold other runs' sandboxes): each of
    .ci/dockerd.sh's default kind with a store of 4 GB and the base image; stopped and removed after. -> their
    DOCKER_HOSTs."""
    envs = []
    try:
        for node in (0, 1):
            root = tmp_path_factory.mktemp(f"node{node}-dockerd")
            envs.append(dict(os.environ, ACTOBS_DOCKER_ROOT=str(root), ACTOBS_DOCKER_DISK_GB="4",
                             ACTOBS_DOCKER_STORAGE="overlay2"))
            subprocess.run(["bash", str(DOCKERD), "start"], env=envs[-1], check=True, capture_output=True,
                           timeout=120)
            save = subprocess.Popen(["docker", "save", base_image], stdout=subprocess.PIPE, env=daemon.docker_env())
            subprocess.run(["docker", "-H", f"unix://{root}/docker.sock", "load", "-q"], stdin=save.stdout,
                           check=True, capture_output=True)
            assert save.wait() == 0
        yield [f"unix://{env['ACTOBS_DOCKER_ROOT']}/docker.sock" for env in envs]
    finally:
        for env in envs:
            subprocess.run(["bash", str(DOCKERD), "stop"], env=env, capture_output=True, timeout=120)
            for img in Path(env["ACTOBS_DOCKER_ROOT"]).glob("*.img"):
                img.unlink()


def sandbox_owners(host, since):
    """The owner labels (host:pid) of the sandboxes created on the daemon at `host` since `since` (epoch seconds)."""
    r = subprocess.run(["docker", "-H", host, "events", "--since", str(int(since)),
                        "--until", str(int(time.time()) + 1), "--filter", "type=container", "--filter", "event=create",
                        "--format", "{{json .}}"],
                       capture_output=True, text=True, check=True, timeout=60)
    events = [json.loads(line) for line in r.stdout.splitlines()]
    return {e["Actor"]["Attributes"][daemon.LABEL] for e in events if daemon.LABEL in e["Actor"]["Attributes"]}


@pytest.mark.slow
def test_grpo_on_two_nodes_runs_each_nodes_sandboxes_on_its_own_daemon(vllm_dir, tmp_path, node_daemons):
    """Two GRPO steps, one rank a node, each node on its own daemon: both ranks roll out (each step's row counts both
    groups' episodes), each daemon created the sandboxes of one rank alone, and the two engines' weights agree after
    every step (the weight sync's checksums, all-gathered: spread 0)."""
    tasks = tmp_path / "tasks"
    for kind in ("find_copy", "rename"):
        spec = taskgen.generate(kind, random.Random(3))
        taskgen.write_harbor(spec, tasks / spec.name, daemon.BASE_IMAGE)
    out = tmp_path / "run"
    t0 = time.time()
    two_nodes("grpo.py", ["--init", str(vllm_dir), "--chat-template", "prefix", "--tasks", str(tasks),
                          "--out", str(out), "--steps", "2", "--tasks-per-step", "2", "--group-size", "2",
                          "--max-turns", "2", "--max-new-tokens", "24", "--max-len", "1024", "--lr", "1e-3",
                          "--save-every", "1", "--concurrency", "4", "--dtype", "fp32", "--echo-coef", "0.05"],
              envs=[{"DOCKER_HOST": host} for host in node_daemons])
    rows = log(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/groups_drawn"] == 2 and r["rollout/episodes_valid"] == 4 for r in rows), rows
    assert all(r["train/weights_checksum_spread"] == 0 for r in rows)  # ECHO's term: every step updates
    owners = [sandbox_owners(host, t0) for host in node_daemons]
    assert len(owners[0]) == len(owners[1]) == 1 and owners[0] != owners[1], owners
