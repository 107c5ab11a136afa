"""ablation.sh's own checks of its input, which run before anything is installed or started."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from actobs.sandbox import daemon

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, env, message", [
    (["--sweep=0.5,2"], {}, "--sweep: 2 is not a λ in [0, 1]"),
    (["--fast"], {}, "usage: bash ablation.sh"),
    ([], {"SEED": "1x"}, "SEED=1x: the seed is a non-negative integer"),
    (["--model"], {}, "--model needs a value"),
    (["--model", "tiny", "--preset", "huge"], {}, "--preset huge: quick, paper or rehearsal"),
    (["--model", "tiny", "--quick"], {}, "--quick is the CPU world's; with --model pick a --preset"),
    (["--tb2", "tasks/tb2"], {}, "--preset, --data, --tb2, --aider, --rl-tasks, --prompt-template, --network and "
                                 "--offline-images go with --model"),
    (["--offline-images"], {}, "--offline-images go with --model"),
    (["--model", "tiny", "--network", "bridge"], {}, "--network: egress, host or none"),
])
def test_bad_input_stops_the_run_before_it_installs_anything(args, env, message):
    # input let through would start the install (minutes): the 30 s timeout fails the test then
    run = subprocess.run(["bash", str(ROOT / "ablation.sh"), *args], capture_output=True, text=True, timeout=30,
                         env={**os.environ, **env})
    assert run.returncode == 2 and message in run.stderr, run.stderr


def checkout_copy(dst):
    """The working tree's files (tracked, and untracked ones git does not ignore) copied to dst, the venv linked:
    the README's command runs there as in a fresh clone, and its runs/ stay out of this checkout."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    (dst / ".venv").symlink_to(ROOT / ".venv")
    return dst


def group_pids(pgid):
    ps = subprocess.run(["ps", "-e", "-o", "pid=,pgid="], capture_output=True, text=True, check=True).stdout
    return {int(p) for p, g in (line.split() for line in ps.splitlines()) if int(g) == pgid}


def containers_of(pids):
    return [c for pid in pids for c in daemon.my_containers(pid)]


def stop(proc, lines):
    """SIGTERM to the run's process group, as a user's `kill` would; -> its rc and its whole output."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # the whole group has exited already
        pass
    proc.wait(timeout=120)
    time.sleep(0.5)  # the reader's last lines
    return proc.returncode, "".join(lines)


def start(repo, args, env, until, timeout=300):
    """`bash ablation.sh ARGS` in repo with env, its output read until `until(output so far, its pid)` holds, or fail.
    -> (the process, the list its output lines keep arriving in)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RUN_DIR", "SEED")} | env
    proc = subprocess.Popen(["bash", "ablation.sh", *args], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.time() + timeout
    try:
        while not until("".join(lines), proc.pid):
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"ablation.sh {args} exited {proc.poll()} before its stages started:\n"
                            + "".join(lines)[-4000:])
            time.sleep(0.2)
    except BaseException:  # a failed wait leaves no run going on behind the test
        stop(proc, lines)
        raise
    return proc, lines


@pytest.mark.slow
def test_the_readme_command_as_typed_runs_into_its_stages_and_stops_cleanly(tmp_path, base_image):
    # `bash ablation.sh`: no flags, no RUN_DIR, no SEED. It once stopped silently after set-up (an assignment's
    # command substitution failed under set -e); now it must write the full run's settings into runs/ablation/ and
    # start its first stage: the base model's session recording, with sandboxes live.
    repo = checkout_copy(tmp_path)
    settings = repo / "runs" / "ablation" / "settings.json"
    proc, lines = start(repo, [], {}, lambda out, pid: "==> stage 1/8: base" in out and settings.exists()
                        and containers_of(group_pids(pid)))
    pids = group_pids(proc.pid)
    rc, out = stop(proc, lines)
    st = json.loads(settings.read_text())
    assert st["stages"]["mode"] == "full" and st["stages"]["seed"] == "0" and "--sessions 256" in st["stages"]["base"]
    # the main job: the paper's two arms, no ECHO or T* (--all adds them)
    assert (st["stages"]["arms"], st["stages"]["echo"], st["stages"]["tstar"]) == ("actionsft actobs", "", "")
    assert st["compute_dtype"]["dtype"] in ("fp32", "bf16") and "compute dtype: " in out
    assert "--dtype" not in st["stages"]["sft"]  # every stage on the machine's own choice
    assert rc == 143 and "ablation.sh: stopped by SIGTERM" in out, out[-3000:]
    assert not group_pids(proc.pid) and containers_of(pids) == []  # no process, no sandbox left behind


@pytest.mark.slow
@pytest.mark.parametrize("args, env, where, mode, seed", [
    (["--quick"], {"SEED": "3"}, "runs/ablation-quick", "quick", "3"),
    ([], {"RUN_DIR": "elsewhere/r1", "SEED": "2"}, "elsewhere/r1", "full", "2"),
    (["--model", "tiny"], {}, "runs/real-rehearsal", "real", "0"),  # the real run's CPU form: the fixtures' inputs
])
def test_run_dir_seed_and_quick_choose_the_run(tmp_path, base_image, args, env, where, mode, seed):
    repo = checkout_copy(tmp_path)
    settings = repo / where / "settings.json"
    first = "fetch" if mode == "real" else "base"
    stop(*start(repo, args, env, lambda out, _: f"==> stage 1/8: {first}" in out and settings.exists()))
    st = json.loads(settings.read_text())["stages"]
    assert (st["mode"], st["seed"]) == (mode, seed)
    assert ("--sessions 8 " in st["base"]) == (mode == "quick")
    if mode == "real":
        assert (st["model"], st["preset"], st["network"]) == ("tiny", "rehearsal", "")
        assert "--data tests/fixtures/nemotron_terminal_sample.json" in st["corpus"] and "--kl-coef" not in st["grpo"]
    assert not (repo / "runs" / "ablation").exists()


def test_a_failing_stage_names_its_line_and_command(tmp_path):
    # a stage that fails prints ablation.sh's line, the stage, its command expanded and its exit status, then ends
    # the run with that status (stage() as ablation.sh defines it, on a command that fails)
    script = (ROOT / "ablation.sh").read_text()
    helpers = script[script.index("# The stages in order"):script.index("# Runs of one script share a process")]
    test = tmp_path / "t.sh"
    test.write_text("set -Eeuo pipefail\nR=" + str(tmp_path) + "\nTSTAR=\n" + helpers +
                    "stage corpus python -c 'import sys; sys.exit(7)' --seed 5\necho not reached\n")
    run = subprocess.run(["bash", str(test)], capture_output=True, text=True, timeout=30)
    line = helpers.count("\n") + 4
    assert run.returncode == 7 and "not reached" not in run.stdout
    assert "==> stage 2/8: corpus" in run.stdout
    assert (f"line {line}: stage corpus failed (exit 7) after 0s: python -c import sys; sys.exit(7) --seed 5"
            in run.stderr), run.stderr


def snippet(start, end):
    """The part of ablation.sh from `start` to the next `end`, to run on its own."""
    script = (ROOT / "ablation.sh").read_text()
    at = script.index(start)
    return script[at:script.index(end, at)]


def test_a_driver_torch_cannot_use_stops_the_run_with_its_versions(tmp_path):
    # nvidia-smi answers (a fake one first on PATH: GPU 0, driver 535) while this CPU build of torch sees no GPU:
    # the run stops there, naming the driver and torch's CUDA build, rather than run the CPU branch on a GPU node
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text('#!/bin/sh\ncase "$*" in *driver_version*) echo 535.104.05 ;;\n'
                                     '*) echo "GPU 0: NVIDIA H100 80GB HBM3" ;; esac\n')
    (bin_ / "nvidia-smi").chmod(0o755)
    test = tmp_path / "t.sh"
    test.write_text("set -Eeuo pipefail\n" + snippet("GPUS=$(python", "# The GPUs this job was given")
                    + "echo went on\n")
    env = {**os.environ, "PATH": f"{bin_}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(test)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1 and "went on" not in run.stdout, (run.stdout, run.stderr)
    assert "nvidia-smi sees GPUs (driver 535.104.05) but torch " in run.stderr and " sees none" in run.stderr
    assert "built for CUDA None" in run.stderr  # this machine's CPU torch
    test.write_text(test.read_text().replace("GPUS=$(python", "PATH=${PATH#*:}; GPUS=$(python"))  # no nvidia-smi
    run = subprocess.run(["bash", str(test)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and run.stdout == "went on\n", (run.stdout, run.stderr)


def test_evaluations_run_on_the_gpus_the_job_was_given(tmp_path):
    # spread() under a scheduler's CUDA_VISIBLE_DEVICES=5,7 on 2 GPUs: 5 evaluations (a `python` that records the
    # GPU it was given, and how many ran at once), each on 5 or 7, never two on one GPU, never more than 2 at once
    test = tmp_path / "t.sh"
    log = tmp_path / "log"
    test.write_text(
        "set -Eeuo pipefail\nGPUS=2\n"
        f'python() {{ echo "start $CUDA_VISIBLE_DEVICES $3" >> {log}; sleep 0.$((RANDOM % 5 + 1)); '
        f'echo "end $CUDA_VISIBLE_DEVICES $3" >> {log}; }}\n'
        + snippet("if [ -n \"${CUDA_VISIBLE_DEVICES:-}\" ]", "if [ $MODE = real ]")
        + snippet("spread() {", "trained() {")
        + "spread evaluate.py " + " ::: ".join(f"--run {i}" for i in range(5)) + "\n")
    run = subprocess.run(["bash", str(test)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "5,7"})
    assert run.returncode == 0, run.stderr
    events = [ln.split() for ln in log.read_text().splitlines()]
    assert sorted(e[2] for e in events if e[0] == "start") == ["0", "1", "2", "3", "4"]
    busy = set()
    for what, gpu, _ in events:
        assert gpu in ("5", "7")
        if what == "start":
            assert gpu not in busy
            busy.add(gpu)
        else:
            busy.remove(gpu)
