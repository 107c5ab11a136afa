"""The disk budget where no kernel quota holds it (this machine's default daemon: overlay2 on ext4; forced so where
the daemon has one), attacked as a reward-hacking agent would: the project's own attacks on the watch (bench.disk:
a deep tree, many entries, a folder renamed under the walk, many files), idle and on a busy host; an exception inside
the measurement; a watch that stops looking; the verifier's own walk of the layer; and, with the watch off, the
daemon's store of fixed size (.ci/dockerd.sh), which keeps the host from filling."""
import multiprocessing
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

import envs
from actobs.sandbox import container_files, daemon, disk, sandbox
from actobs.tasks import Task
from bench.disk import ATTACKS, CHECK, attack, reply, spin

pytestmark = pytest.mark.usefixtures("no_leftovers")
SCRIPT = Path(__file__).parent.parent / ".ci" / "dockerd.sh"


@pytest.mark.parametrize("load", [0, 4], ids=["idle", "busy host"])
def test_every_attack_ends_disk_limit_with_the_host_under_its_budget(no_quota, load):
    """Each attack in a sandbox of 256 MB ends `disk_limit`, reward 0, with the disk under the daemon never more than
    the budget + 512 MB up; the honest writer's 200 MB are scored 1. Busy host: `load` processes spin on the host's
    cores throughout."""
    hogs = multiprocessing.Pool(load) if load else None
    if hogs:
        hogs.map_async(spin, range(load))
    peaks = {}
    try:
        for name in ATTACKS:
            ep, peak = attack(name)
            peaks[name] = f"{peak:.0f} MB, {ep.failure or 'none'}"
            assert (ep.failure, ep.reward) == ((None, 1.0) if name == "honest" else ("disk_limit", 0.0)), \
                (name, ep.failure, ep.error)
            assert peak < 256 + 512, (name, peak, ep.error)
    finally:
        if hogs:
            hogs.terminate()
    print("host disk rise peaks:", peaks)
    deep, many = (attack(n)[0].error for n in ("deep", "many"))
    assert "deeper than 128 levels" in deep and "more than 16384 entries" in many  # the inode budget: 256 MB / 16 KiB


@pytest.mark.parametrize("where", ["layer_usage", "fs_used", "unlinked_bytes"])
def test_an_exception_inside_the_measurement_stops_the_sandbox(no_quota, monkeypatch, where):
    """A measurement that raises (here: on its third call) stops the sandbox as over its budget; the watch never
    just stops watching."""
    real, calls = getattr(disk, where), []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(*a, **k)
    monkeypatch.setattr(disk, where, failing)
    ep, peak = attack("files")
    assert (ep.failure, ep.reward) == ("disk_limit", 0.0) and "RuntimeError: injected" in ep.error, ep.error
    assert peak < 256 + 512


def test_a_watch_that_stops_looking_ends_the_episode(no_quota, monkeypatch):
    """The watch fell behind (here: its loop ends at once, as a thread stuck or starved would look): the next
    terminal step ends the episode `disk_limit`."""
    monkeypatch.setattr(disk, "WATCH_STALE_S", 1.0)
    monkeypatch.setattr(disk.Budget, "_watch_layer", lambda self, container, pid, upper: None)
    task = Task("late", "late\n", storage_mb=256, tests={"test.sh": CHECK})
    turns = [reply("sleep 2\n"), reply("echo right > /app/answer\n", True), reply("", True)]
    ep, = envs.run_episodes([task], lambda convs: [turns[len(c) // 2] for c in convs], max_turns=3)
    assert (ep.failure, ep.reward) == ("disk_limit", 0.0) and "fell behind" in ep.error, ep.error


def test_the_verifiers_walk_is_held_to_the_inode_budget(no_quota, monkeypatch):
    """With no watch at all, a layer past its inode budget at verification ends `disk_limit`, unverified: the
    verifier's reading of the layer (Sandbox.changes) is bounded as the watch's is. A walk of a deep tree from this
    host passes PATH_MAX, which no longer matters: each folder is opened relative to its parent."""
    monkeypatch.setattr(disk.Budget, "watch", lambda self, container, upper: None)
    monkeypatch.setattr(disk, "WATCH_STALE_S", 1e9)
    pay = {"test.sh": b"echo 1 > /logs/verifier/reward.txt\n"}
    many = Task("many", "x", storage_mb=256, inodes=500, tests=pay,
                solution={"solve.sh": b"mkdir /app/m && cd /app/m && touch $(seq 1000)\n"})
    ep, = envs.run_oracle([many])
    assert (ep.failure, ep.reward) == ("disk_limit", 0.0) and "more than 500 entries" in ep.error, ep.error
    with sandbox.Sandbox(daemon.BASE_IMAGE, storage_mb=256) as sb:
        code, _ = sb.exec("cd /app && for i in $(seq 100); do mkdir dddddddddddddddddddddddddddddddddddddddd && "
                          "cd dddddddddddddddddddddddddddddddddddddddd; done && echo x > f")
        assert code == 0
        upper = container_files.overlay_dirs(sb.container)[0]
        found = [(rel, name) for _, rel, name, _ in container_files.walk_layer(upper, 10**6)]
        deep = [rel for rel, name in found if name == "f"]  # the file at the bottom, past PATH_MAX from this host
        assert len(deep) == 1 and len(f"{upper}{deep[0]}") > 4096 and deep[0].count("/d") == 100, deep


def test_a_command_started_while_a_walk_holds_the_sandbox_frozen_runs_once_it_is_thawed(no_quota):
    """The watch freezes the sandbox to walk its layer at rest; a command started then (a terminal step, the
    verifier) is refused by the runtime ("cannot exec in a paused container": it never ran). Sandbox.exec starts it
    again once the walk thawed the sandbox: its output, and nothing lost (the verifier's refusal once scored a solved
    episode verifier_error). A command that prints the refusal itself runs once."""
    with sandbox.Sandbox(daemon.BASE_IMAGE, storage_mb=256) as sb:
        sb.container.reload()
        pid = sb.container.attrs["State"]["Pid"]
        sb.disk._freeze(sb.container, pid, True)  # as _watch_layer does before a walk at rest
        refused = sb.container.exec_run(["echo", "ran"])
        assert refused.exit_code == 126 and b"paused" in refused.output, refused  # what the runtime does
        thaw = threading.Timer(1.0, sb.disk._freeze, (sb.container, pid, False))
        thaw.start()
        t0 = time.monotonic()
        try:
            code, out = sb.exec("echo ran >> /app/log; cat /app/log")
        finally:
            thaw.join()
        assert (code, out) == (0, b"ran\n") and time.monotonic() - t0 >= 0.9, (code, out)
        # the refusal without a freeze of the watch's (a command that prints it and exits 126): run once, as it ended
        code, out = sb.exec("echo ran >> /app/log; echo 'cannot exec in a paused container'; exit 126")
        assert (code, out) == (126, b"cannot exec in a paused container\n")
        assert sb.exec("cat /app/log") == (0, b"ran\nran\n")


@pytest.fixture
def small_daemon(base_image, tmp_path_factory):
    """A daemon of .ci/dockerd.sh's default kind with a store of 2 GB, holding the base image; stopped (its store
    unmounted) and removed after."""
    root = tmp_path_factory.mktemp("dockerd")
    env = dict(os.environ, ACTOBS_DOCKER_ROOT=str(root), ACTOBS_DOCKER_DISK_GB="2", ACTOBS_DOCKER_STORAGE="overlay2")
    host = f"unix://{root}/docker.sock"
    try:
        subprocess.run(["bash", str(SCRIPT), "start"], env=env, check=True, capture_output=True, timeout=120)
        save = subprocess.Popen(["docker", "save", base_image], stdout=subprocess.PIPE, env=daemon.docker_env())
        subprocess.run(["docker", "-H", host, "load", "-q"], stdin=save.stdout, check=True, capture_output=True)
        assert save.wait() == 0
        yield host, root
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=120)
        (root / "ext4.img").unlink(missing_ok=True)


def test_with_the_watch_off_the_daemons_store_keeps_the_host_from_filling(small_daemon, monkeypatch):
    """No watch at all: a sandbox writes 3 GB in files of 1 MB on a daemon whose store is 2 GB. The kernel stops the
    writes when the store is full (No space left on device); the host's disk rises by less than the store's size."""
    host, root = small_daemon
    monkeypatch.setenv("DOCKER_HOST", host)
    for module, name, value in ((daemon, "_client", None), (daemon, "_cpus", None), (disk, "_quota", False),
                                (disk.Budget, "watch", lambda self, container, upper: None),
                                (disk, "WATCH_STALE_S", 1e9)):
        monkeypatch.setattr(module, name, value)
    task = Task("fill", "fill\n", storage_mb=256, tests={"test.sh": CHECK})
    keys = f"cd /app && {ATTACKS['files'].split('&& ', 1)[1]}"
    policy = lambda convs: [reply(keys) if len(c) == 1 else reply("", True) for c in convs]  # noqa: E731
    t0 = time.time()
    with disk.HostRise(0.05, path=root) as rise:
        ep, = envs.run_episodes([task], policy, max_turns=3)
    assert ep.reward == 0.0 and "No space left on device" in "\n".join(m["content"] for m in ep.messages), ep.error
    assert 1024 < rise.mb < 2048, rise.mb  # it wrote, and no further than the store
    print(f"host disk rise {rise.mb:.0f} MB with a store of 2 GB, in {time.time() - t0:.0f} s")
