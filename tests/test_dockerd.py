""".ci/dockerd.sh's start and stop around a daemon that is still going away, and the daemon's store in a file system
of fixed size, with stand-in `dockerd` / `docker` programs on PATH (the real daemon's part is covered by every Docker
test; tests/test_envs_sandbox.py fills a real daemon's store)."""
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / ".ci" / "dockerd.sh"

# As the real dockerd: refuses to start while its pidfile exists, else writes it and serves until killed; `docker
# version` answers while a stand-in daemon serves. Each start's driver is appended to drivers.log.
FAKE_DOCKERD = """#!/bin/bash
while [ $# -gt 0 ]; do case $1 in --pidfile) pidfile=$2; shift ;; --data-root) data=$2; shift ;;
    --storage-driver=*) driver=${1#*=} ;; esac; shift; done
[ -e "$pidfile" ] && { echo "failed to start daemon: pid file found"; exit 1; }
d=$(dirname "$pidfile")
echo $$ > "$pidfile"; echo "$driver $data" >> "$d/drivers.log"; echo $$ >> "$d/pids.log"; touch "$d/serving"
trap 'rm -f "$pidfile" "$d/serving"; exit 0' TERM
while :; do sleep 0.1; done
"""
FAKE_DOCKER = """#!/bin/bash
[ -e "$ROOT/serving" ]
"""


def reaped(cmd):
    # a process waited for as it ends: an exited child left unreaped still answers `kill -0`, as a daemon never does
    proc = subprocess.Popen(cmd)
    threading.Thread(target=proc.wait, daemon=True).start()
    return proc


def shell(root, bin_dir, cmd):
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ACTOBS_DOCKER_ROOT": str(root), "ROOT": str(root),
           "ACTOBS_DOCKER_STORAGE": "overlay2 vfs", "ACTOBS_DOCKER_DISK_GB": "1"}
    return subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=60)


def stand_ins(tmp_path):
    root, bin_dir = tmp_path / "root", tmp_path / "bin"
    root.mkdir(), bin_dir.mkdir()
    for name, text in (("dockerd", FAKE_DOCKERD), ("docker", FAKE_DOCKER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return root, bin_dir


def unmount(root):
    for mnt in root.glob("*"):
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_start_waits_for_a_daemon_still_going_away_and_stop_keeps_a_newer_pidfile(tmp_path):
    root, bin_dir = stand_ins(tmp_path)
    try:
        # the old daemon: gone in 2 s, its pidfile still there meanwhile (a stop under way)
        old = reaped(["sleep", "2"])
        (root / "dockerd.pid").write_text(f"{old.pid}\n")
        out = shell(root, bin_dir, f". {SCRIPT} start")
        assert out.returncode == 0, out.stderr
        # the first driver, not the fallback a refused start would have led to, on its store: ext4 of 1 GB
        assert (root / "drivers.log").read_text().split() == ["overlay2", str(root / "ext4")]
        fs = subprocess.run(["findmnt", "-n", "-b", "-o", "FSTYPE,SIZE", str(root / "ext4")], capture_output=True,
                            text=True).stdout.split()
        assert fs[0] == "ext4" and 0.9 * 2**30 < int(fs[1]) <= 2**30, fs
        new = int((root / "dockerd.pid").read_text())
        assert new != old.pid

        # a stop of an older daemon that ends after the new one has written the pidfile leaves that pidfile alone
        older = reaped(["bash", "-c", "trap '' TERM; sleep 1.5"])  # takes its time to go
        (root / "dockerd.pid").write_text(f"{older.pid}\n")
        stop = subprocess.Popen(["bash", str(SCRIPT), "stop"], env={**os.environ, "ACTOBS_DOCKER_ROOT": str(root)})
        time.sleep(0.3)
        (root / "dockerd.pid").write_text(f"{new}\n")
        stop.wait(timeout=60)
        assert (root / "dockerd.pid").read_text().strip() == str(new)
        assert shell(root, bin_dir, f"bash {SCRIPT} stop").returncode == 0
        assert not (root / "dockerd.pid").exists() and not (root / "serving").exists()
        assert subprocess.run(["mountpoint", "-q", str(root / "ext4")]).returncode != 0  # unmounted with its daemon
    finally:  # no stand-in daemon or mount outlives a failed assertion
        for pid in (root / "pids.log").read_text().split() if (root / "pids.log").exists() else []:
            subprocess.run(["kill", pid], capture_output=True)
        unmount(root)


def test_a_store_the_host_cannot_hold_is_refused(tmp_path):
    """A store's sparse file that could grow past the host's free space is no bound: the start says so and stops,
    no daemon started."""
    root, bin_dir = stand_ins(tmp_path)
    free_gb = shutil.disk_usage(tmp_path).free // 2**30
    img = root / "ext4.img"
    subprocess.run(["truncate", "-s", f"{free_gb + 8}G", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-m", "0", str(img)], check=True, capture_output=True)
    try:
        out = shell(root, bin_dir, f". {SCRIPT} start")
        assert out.returncode != 0 and "can still grow by" in out.stderr and "free: free space" in out.stderr, out
        assert not (root / "drivers.log").exists()
    finally:
        unmount(root)
