"""What an agent must not be able to do to its own score, and failures that explain themselves (real Docker):
no process outlives the agent's turn to forge the reward, `exit` is the agent's ending, the disk budget holds,
task.toml's limits are read as Harbor reads them, and a broken task image is recorded, not raised."""
import json
import time
from pathlib import Path

import pytest

import envs
from actobs import episode
from actobs.sandbox import disk, sandbox, verify
from actobs.tasks import Task, build_task_image, load_task, size_mb

HARBOR = Path(__file__).parent / "fixtures" / "harbor"

pytestmark = pytest.mark.usefixtures("no_leftovers")

# Writes the right answer only if /app/answer holds "right"; the agent's forgers below write 1 all the time.
CHECK = b'grep -qx right /app/answer && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n'
FORGERS = [  # three ways to outlive the terminal: a new session, nohup, a disowned supervisor that respawns
    "setsid bash -c 'while :; do echo 1 > /tmp/r; mv -f /tmp/r /logs/verifier/reward.txt; done' >/dev/null 2>&1 &\n",
    "nohup bash -c 'while :; do echo 1 > /logs/verifier/reward.txt 2>/dev/null; done' >/dev/null 2>&1 &\n",
    "(while :; do (echo 1 > /logs/verifier/reward.txt; sleep 0.01) & sleep 0.005; done) >/dev/null 2>&1 & disown\n",
]


def reply(keys, done=False, duration=0.5):
    return json.dumps({"analysis": "", "plan": "", "commands": [{"keystrokes": k, "duration": duration} for k in keys],
                       "task_complete": done})


def by_instruction(replies):
    """A policy whose task's instruction names its list of replies (one per turn, then claims completion)."""
    def policy(states):
        out = []
        for msgs in states:
            turns = replies[msgs[0]["content"].split("Task:\n")[1].split("\n")[0]]
            i = sum(m["role"] == "assistant" for m in msgs)
            out.append(turns[i] if i < len(turns) else reply([], done=True))
        return out
    return policy


def tree(tmp_path, name, toml="", dockerfile="FROM ubuntu:24.04\nWORKDIR /app\n"):
    d = tmp_path / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "task.toml").write_text(toml)
    (d / "instruction.md").write_text("Write right to /app/answer.\n")
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    (d / "tests" / "test.sh").write_bytes(CHECK)
    return d


# ---------------------------------------------------------------------------------------------- the reward

def test_processes_left_running_cannot_forge_the_reward(base_image):
    task = Task("forge", "x", tests={"test.sh": CHECK})
    with sandbox.Sandbox(base_image) as sb:
        sb.screen()
        sb.send("echo wrong > /app/answer\n")
        for keys in FORGERS:
            sb.send(keys, 0.2)
        time.sleep(0.3)
        assert any(sb.exec("cat /logs/verifier/reward.txt")[1] == b"1\n" for _ in range(50))  # the forgers are at work
        reward, error, output = verify.verify(sb, task)
        assert (reward, error) == (0.0, None)
        # Nothing of the agent's is left: only init (bash), init's sleep and this exec.
        code, out = sb.exec("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done", user="root")
        left = [c for c in out.decode().split("\n") if c.strip()]
        assert all(c.startswith(("bash -c trap", "sleep 86400", "bash -c for f in", "tr ")) for c in left), left
        sb.exec("echo right > /app/answer")
        assert verify.verify(sb, task)[:2] == (1.0, None)  # the same verifier pays for the right answer


def test_verifier_timeout_scores_0_even_after_writing_1(base_image):
    late = Task("late", "x", verifier_timeout=1, tests={"test.sh": b"echo 1 > /logs/verifier/reward.txt; sleep 30\n"})
    ep, = envs.run_oracle([late], noop=True)
    assert (ep.reward, ep.failure) == (0.0, "verifier_error") and "timed out" in ep.error


def test_verifier_that_never_started_pytest_is_not_a_wrong_answer(base_image):
    never = b"source $HOME/.local/bin/env\nuvx -p 3.99 -w pytest==8.4.1 pytest /tests/t.py\n" + \
            b"[ $? -eq 0 ] && echo 1 > /logs/verifier/reward.txt " \
            b"|| echo 0 > /logs/verifier/reward.txt\n"
    wrong = b"source $HOME/.local/bin/env\nuvx -w pytest==8.4.1 pytest /tests/t.py\n" \
            b"[ $? -eq 0 ] && echo 1 > /logs/verifier/reward.txt " \
            b"|| echo 0 > /logs/verifier/reward.txt\n"
    t = b"def test_x():\n    assert open('/app/answer').read() == 'right\\n'\n"
    eps = envs.run_oracle([Task("never", "x", image="ubuntu:24.04", tests={"test.sh": never, "t.py": t}),
                           Task("wrong", "x", image="ubuntu:24.04", tests={"test.sh": wrong, "t.py": t})], noop=True)
    assert [(e.reward, e.failure) for e in eps] == [(0.0, "verifier_error"), (0.0, None)]
    assert "test runner never started" in eps[0].error and "3.99" in eps[0].verifier_output
    assert "1 failed" in eps[1].verifier_output  # the verifier's output is kept on every episode


# ---------------------------------------------------------------------------------------------- the agent's endings

def test_exit_or_killing_the_terminal_is_the_agents_ending(base_image):
    endings = {"exit": "exit\n", "kill-shell": "kill -9 $$\n", "kill-tmux": "tmux kill-server\n",
               "kill-all": "kill -9 -1\n"}
    tasks = [Task(name, f"{name}\n", tests={"test.sh": CHECK}) for name in endings]
    policy = by_instruction({name: [reply(["echo right > /app/answer\n", keys])] for name, keys in endings.items()})
    eps = envs.run_episodes(tasks, policy, max_turns=5, concurrency=4)
    # The episode ends there, as the agent's outcome; the verifier scores what was done.
    assert [(e.task, e.failure, e.reward, e.turns) for e in eps] == [(n, "shell_exited", 1.0, 1) for n in endings]
    assert all(e.failure not in episode.INFRA_FAILURES and e.messages[-1]["role"] == "assistant" for e in eps)
    assert episode.INFRA_FAILURES == {"sandbox_error", "image_build_error"}


def test_wiping_tmp_does_not_cut_the_terminal(base_image):
    with sandbox.Sandbox(base_image) as sb:
        sb.screen()
        sb.send("rm -rf /tmp/* /tmp/.[!.]*\n")
        assert sb.send("echo still here\n", 2).endswith("still here\nroot@sandbox:/app#") and sb.last_idle


# ---------------------------------------------------------------------------------------------- disk budget

def test_disk_budget_ends_the_episode_and_scores_0(base_image):
    pay = {"test.sh": b"echo 1 > /logs/verifier/reward.txt\n"}  # pays for anything: the disk limit must win
    fill = "i=0; while :; do dd if=/dev/zero of=/app/f$i bs=1M count=8 status=none; i=$((i+1)); done\n"
    tasks = [Task("fill", "fill\n", storage_mb=64, tests=pay),
             Task("bg", "bg\n", storage_mb=64, tests=pay),  # written in the background, between steps
             Task("small", "small\n", storage_mb=64, tests=pay)]
    policy = by_instruction({"fill": [reply([fill], duration=30)],
                             # in 8 MB pieces: one 200 MB fallocate is refused whole where the kernel enforces a quota
                             "bg": [reply(["(for i in $(seq 25); do fallocate -l 8M /app/b$i; done &)\n"]),
                                    reply(["sleep 2\n"], duration=3)],
                             "small": [reply(["fallocate -l 16M /app/ok\n"])]})
    eps = envs.run_episodes(tasks, policy, max_turns=4, concurrency=3)
    assert [(e.failure, e.reward) for e in eps] == [("disk_limit", 0.0), ("disk_limit", 0.0), (None, 1.0)]
    assert eps[0].timings["env_s"] < 30  # the 30 s step was cut as soon as the budget was passed
    used = int(eps[0].error.split("wrote ")[1].split(" MB")[0])
    assert 64 <= used < 1024, eps[0].error  # stopped within a poll of the budget (unbounded: ~20 GB in 30 s)
    solved = envs.run_oracle([Task("oracle", "x", storage_mb=64, tests=pay, solution={"solve.sh": fill.encode()})])
    assert [(e.failure, e.reward) for e in solved] == [("disk_limit", 0.0)]


# Writes past a 256 MB budget as an agent types them, none with the answer: refused inside the sandbox, or ended
# disk_limit by the watch; "honest" writes 200 MB and the answer.
MMAP = ("python3 -c \"import mmap, os\nfor i in range(16):\n"
        " f = os.open(f'/app/m{i}', os.O_CREAT | os.O_RDWR); os.ftruncate(f, 200 << 20); m = mmap.mmap(f, 0)\n"
        " for o in range(0, 200 << 20, 1 << 20): m[o:o + (1 << 20)] = b'x' * (1 << 20)\"\n")
UNLINKED_MAPPED = ("python3 -c \"import mmap, os, time\nmaps = []\nfor i in range(6):\n"
                   " f = os.open(f'/app/m{i}', os.O_CREAT | os.O_RDWR); os.ftruncate(f, 200 << 20)\n"
                   " maps.append(mmap.mmap(f, 0)); os.close(f); os.unlink(f'/app/m{i}')\n"
                   " for o in range(0, 200 << 20, 1 << 20): maps[-1][o:o + (1 << 20)] = b'x' * (1 << 20)\n"
                   "time.sleep(1000)\"\n")
DISK_ATTACKS = {  # name: (keystrokes, ending)
    "fallocate": ("fallocate -l 4G /app/big\n", None),
    "posix_fallocate": ("python3 -c \"import os; os.posix_fallocate(os.open('/app/big', os.O_CREAT | os.O_WRONLY), 0, "
                        "4 << 30)\"\n", None),
    "truncate-tail": ("truncate -s 4G /app/big; dd if=/dev/zero of=/app/big bs=1M seek=4095 count=1 conv=notrunc\n",
                      None),
    "keep-size": ("touch /app/big; fallocate --keep-size -l 4G /app/big\n", None),
    "stream": ("head -c 3G /dev/zero > /app/big\n", "disk_limit"),  # stopped at the budget: the layer is past it
    "files": ("for i in $(seq 2000); do head -c 1M /dev/zero > /app/f$i; done\n", "disk_limit"),
    "mmap": (MMAP, "disk_limit"),
    # files deleted while held open, or mapped: out of the layer's folders, on the disk until let go
    "unlinked": ("for i in $(seq 6); do (exec 3>/app/x$i; rm /app/x$i; head -c 200M /dev/zero >&3; sleep 1000) & "
                 "done; wait\n", "disk_limit"),
    "unlinked-mapped": (UNLINKED_MAPPED, "disk_limit"),
    "honest": ("head -c 200M /dev/zero > /app/data && echo right > /app/answer\n", None),
}


def test_without_a_quota_no_write_takes_the_host_past_the_budget(no_quota):
    """On a daemon without a disk quota, one at a time in a sandbox of 256 MB: each of DISK_ATTACKS is refused
    inside (no file may outgrow the budget, fallocate cannot preallocate) or ended `disk_limit`, reward 0, and the
    disk under the daemon never rises past the budget + 512 MB; the honest writer's 200 MB are scored 1."""
    whole = b'[ "$(stat -c %s /app/data)" = 209715200 ] && ' + CHECK  # the honest writer's file, whole
    peaks = {}
    for name, (keys, ending) in DISK_ATTACKS.items():
        task = Task(name, name + "\n", storage_mb=256, tests={"test.sh": whole if name == "honest" else CHECK})
        with disk.HostRise() as rise:
            ep, = envs.run_episodes([task], by_instruction({name: [reply([keys], duration=60)]}), max_turns=3)
        peaks[name] = f"{rise.mb:.0f} MB {ep.failure or 'no failure'} {ep.timings.get('env_s', 0):.1f} s"
        assert (ep.failure, ep.reward) == (ending, float(name == "honest")), (name, ep.failure, ep.error)
        assert rise.mb < 256 + 512, (name, rise.mb)
    print("host disk rise peaks:", peaks)


def test_without_a_quota_fallocate_cannot_preallocate_and_the_limits_hold(base_image, no_quota):
    """The seccomp rules: fallocate's keep-size mode, the RESVSP ioctls (their 32-bit form too) and io_uring are
    refused, plain fallocate, hole punching and other ioctls work; the agent cannot raise its file size limit, and
    a writer killed by it dumps no core."""
    probe = r"""import ctypes, errno, fcntl, os, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open("/app/f", os.O_CREAT | os.O_RDWR)
def call(*args):
    return 0 if libc.syscall(*args) == 0 else errno.errorcode[ctypes.get_errno()]
def ioctl(cmd):
    try:
        return fcntl.ioctl(fd, cmd, struct.pack("hhqqiI4i", 0, 0, 0, 1 << 30, *[0] * 6)) and 0
    except OSError as e:
        return errno.errorcode[e.errno]
falloc = [call(285, fd, mode, ctypes.c_long(0), ctypes.c_long(n))  # fallocate(2)
          for mode, n in ((1, 1 << 30), (0, 1 << 20), (3, 1 << 19))]
print(*falloc, os.fstat(fd).st_blocks * 512 >> 10, *map(ioctl, (0x40305828, 0x4030582a, 0x402c5828, 0x4030582b)),
      call(425, 8, ctypes.create_string_buffer(120)))
"""
    with sandbox.Sandbox(base_image, storage_mb=64) as sb:
        code, out = sb.exec(["python3", "-c", probe])
        # fallocate keep-size (ENOTSUP is EOPNOTSUPP), plain, punch-hole; the file's KB: the plain 1 MB less the
        # 512 KB punched; ioctls RESVSP, RESVSP64, RESVSP's 32-bit form, UNRESVSP64 (hole punching); io_uring_setup
        assert (code, out.split()) == (0, b"ENOTSUP 0 0 512 EPERM EPERM EPERM 0 EPERM".split()), out
        code, out = sb.exec("exec 2>/dev/null; ulimit -f unlimited; ulimit -f; ulimit -c; "
                            "head -c 65M /dev/zero > /app/g; echo $?; ls /app")
        assert out.split() == b"65536 0 153 f g".split(), out  # the 64 MB limit; core 0; SIGXFSZ; no core file


def test_an_image_without_bash_is_explained(tmp_path, base_image):
    (tmp_path / "Dockerfile").write_text("FROM scratch\nCOPY Dockerfile /Dockerfile\n")
    image = build_task_image("no-bash", tmp_path)
    ep, = envs.run_episodes([Task("no-bash", "x", image=image)], by_instruction({}), max_turns=1)
    assert (ep.failure, ep.reward) == ("sandbox_error", 0.0) and "the image needs bash" in ep.error


# ---------------------------------------------------------------------------------------------- task.toml

def test_task_toml_limits_as_harbor_reads_them(tmp_path, base_image, capsys):
    sizes = tree(tmp_path, "sizes", '[environment]\nmemory = "4G"\nstorage = "512M"\ncpus = 64\n')
    mb = tree(tmp_path, "mb", '[environment]\nmemory = "4G"\nmemory_mb = 3000\nstorage_mb = 2048\n')
    t = load_task(sizes)
    assert (t.memory_mb, t.storage_mb, t.cpus) == (4096, 512, 64.0)
    assert (load_task(mb, build=False).memory_mb, load_task(mb, build=False).storage_mb) == (3000, 2048)
    assert size_mb("1.5Gi") == 1536 and size_mb(256) == 256
    with pytest.raises(ValueError, match=r"task.toml: bad value of \[environment\] memory: not a size: 'lots'"):
        load_task(tree(tmp_path, "bad", '[environment]\nmemory = "lots"\n'), build=False)
    # More CPUs than the host has: capped with a warning, not a sandbox error.
    t.solution = {"solve.sh": b"echo right > /app/answer\n"}
    ep, = envs.run_oracle([t])
    assert (ep.reward, ep.failure) == (1.0, None), ep.error
    assert "asks for 64 CPUs" in capsys.readouterr().err
    # docker_image present here: used as is, the Dockerfile is not built.
    pre = load_task(tree(tmp_path, "pre", f'[environment]\ndocker_image = "{base_image}"\n',
                              dockerfile="FROM actobs-missing/image:1\n"))
    assert (pre.image, pre.build_error) == (base_image, "")


def test_build_timeout_and_failures_are_recorded_and_the_others_run(tmp_path, base_image, capsys):
    # Abandoned after 2 s (the daemon may go on with it: this one then fails, so no image is ever cached)
    slow = tree(tmp_path, "slow", "[environment]\nbuild_timeout_sec = 2\n",
                dockerfile="FROM ubuntu:24.04\nRUN sleep 20 && false\n")
    broken = tree(tmp_path, "broken", dockerfile="FROM ubuntu:24.04\nRUN echo about to fail && exit 3\n")
    missing = tree(tmp_path, "missing", dockerfile="FROM actobs-missing/image:1\n")
    t0 = time.time()
    eps = envs.main(["oracle", str(slow), str(broken), str(missing), str(HARBOR / "non-root")])
    assert time.time() - t0 < 60
    assert [(e.failure, e.reward) for e in eps] == [("image_build_error", 0.0)] * 3 + [(None, 1.0)]
    assert "timed out after 2s" in eps[0].error
    assert "about to fail" in eps[1].error and "returned a non-zero code: 3" in eps[1].error
    assert "cannot be pulled" not in eps[1].error and "cannot be pulled" in eps[2].error  # only when FROM is why
    assert "about to fail" in capsys.readouterr().out  # the oracle CLI tells why
    # The episode runner records them the same way: an Episode, not an exception.
    ep, = envs.run_episodes([load_task(broken)], by_instruction({}), max_turns=2)
    assert (ep.failure, ep.reward, ep.messages) == ("image_build_error", 0.0, [])


# ------------------------------------------------------------------------------------------- Terminal-Bench 2.0 offline

def test_tb2_tasks_score_their_true_result_offline(base_image):
    """Terminal-Bench 2.0-format tasks (FROM ubuntu:24.04 / python:3.13-slim-bookworm, apt and pip in the build,
    verifiers running `uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest`) on the offline stand-in."""
    tasks = [load_task(p) for p in sorted((Path(__file__).parent / "fixtures" / "tb2-tasks").iterdir())]
    assert [t.build_error for t in tasks] == [""] * 3
    assert tasks[0].image.startswith("actobs-task/")  # docker_image is not here: built from the Dockerfile
    solved = envs.run_oracle(tasks, concurrency=3)
    idle = envs.run_oracle(tasks, noop=True, concurrency=3)
    assert [(e.reward, e.failure) for e in solved] == [(1.0, None)] * 3, [e.verifier_output for e in solved]
    assert [(e.reward, e.failure) for e in idle] == [(0.0, None)] * 3, [e.verifier_output for e in idle]
    assert all(" passed" in e.verifier_output for e in solved) and all(" failed" in e.verifier_output for e in idle)
