"""
Sandbox benchmark: start latency, the terminal step next to a raw `docker exec` round trip, and throughput with
1, 8 and 32 concurrent sandboxes; then the egress network's cost (root: actobs/sandbox/network.py): a sandbox's start
and its removal with it and without a network, alternately, and the largest concurrency's start with it. All numbers
come from the same run, on the same daemon.

With --daemons, the same run instead compares Docker daemons (e.g. one with a kernel-enforced disk quota against
plain overlay2; each must hold the base image): rounds of `--episodes` concurrent one-command episodes
(run_episodes: start, one terminal step, verification, removal), alternating between the daemons, and the wall
ratio of each against the first; then on each, `--writers` sandboxes of 256 MB at once, half of them trying one
`fallocate -l 4G`, half a `dd` loop of 1 GB, with the peak rise of the disk under the daemon's data root.

With --limits, the same rounds on one daemon treated as one without a disk quota (disk.py), alternately with its
per-file limits (ulimit fsize and core, the seccomp profile) and the watch's count of deleted files still held, and
without them (the watch of the layer's folders alone), in paired rounds whose order alternates:
each round's wall ratio, and their median.

    python envs.py base-image && python -m bench.envs
    python -m bench.envs --reps 50 --steps 20 --concurrency 1 8 32
    python -m bench.envs --daemons unix:///var/lib/actobs-docker/docker.sock \
        unix:///var/lib/actobs-docker-xfs/docker.sock
    python -m bench.envs --limits --rounds 4
"""
import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import envs
from actobs.sandbox import daemon, disk, network, sandbox, verify
from actobs.tasks import Task


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", default=daemon.BASE_IMAGE)
    p.add_argument("--reps", type=int, default=30, help="repetitions for the latency measurements")
    p.add_argument("--steps", type=int, default=10, help="terminal steps per sandbox in the throughput runs")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--daemons", nargs="+", metavar="DOCKER_HOST", help="compare these daemons instead (the first "
                   "is the baseline)")
    p.add_argument("--limits", action="store_true", help="compare the limits of a daemon without a disk quota "
                   "with the watch alone instead")
    p.add_argument("--episodes", type=int, default=32, help="concurrent episodes per round (--daemons, --limits)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per daemon or arm, interleaved (--daemons, "
                   "--limits)")
    p.add_argument("--writers", type=int, default=4, help="sandboxes writing past their budget at once (--daemons)")
    return p.parse_args(argv)


def ms(xs):
    return f"p50 {1000 * statistics.median(xs):6.1f} ms | mean {1000 * statistics.mean(xs):6.1f} ms"


def timed(fn, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def throughput(image, n, steps, net=None):
    """n sandboxes started together (on network `net`), each runs `steps` quick commands; returns (start wall s,
    steps/s, step times)."""
    boxes, step_times = [sandbox.Sandbox(image, memory_mb=256, network=net) for _ in range(n)], []

    def start(sb):
        sb.start()
        sb.screen()

    def work(sb):
        for _ in range(steps):
            t0 = time.perf_counter()
            sb.send("echo hi\n", 1.0)
            step_times.append(time.perf_counter() - t0)

    try:
        with ThreadPoolExecutor(n) as pool:
            t0 = time.perf_counter()
            list(pool.map(start, boxes))
            t_start = time.perf_counter() - t0
            t0 = time.perf_counter()
            list(pool.map(work, boxes))
            return t_start, n * steps / (time.perf_counter() - t0), step_times
    finally:
        for sb in boxes:
            sb.close()


# One command, then the confirmation: the shortest episode that runs a terminal step and a verification (the
# step returns once the shell is idle: 10 s is only its bound, for a daemon slow under load).
ONE_COMMAND = json.dumps({"analysis": "", "plan": "", "commands": [{"keystrokes": "echo hi > /app/out\n",
                                                                     "duration": 10}], "task_complete": True})


def start_stop(image, net):
    """Seconds to start a sandbox on network `net` (container, network, terminal, first screen), and to remove it."""
    t0 = time.perf_counter()
    sb = sandbox.Sandbox(image, memory_mb=256, network=net)
    try:
        sb.start()
        sb.screen()
    finally:
        t1 = time.perf_counter()
        sb.close()
    return t1 - t0, time.perf_counter() - t1


def compare_networks(args):
    """Start and removal with no network and with egress, alternating (so load drifts touch both), and the largest
    concurrency's start on each."""
    network.ensure()  # made outside the timed part
    times = {None: [], network.EGRESS: []}
    for r in range(args.reps):
        for net in (None, network.EGRESS) if r % 2 == 0 else (network.EGRESS, None):
            times[net].append(start_stop(args.image, net))
    for i, what in enumerate(("start", "removal")):
        base, egress = ([t[i] for t in times[net]] for net in (None, network.EGRESS))
        print(f"sandbox {what:7s} no network: {ms(base)} | egress: {ms(egress)} | "
              f"ratio {statistics.median(egress) / statistics.median(base):.2f}x")
    n = max(args.concurrency)
    walls = {net: throughput(args.image, n, 1, net)[0] for net in (None, network.EGRESS)}
    print(f"concurrency {n:3d}: start all, no network {walls[None]:5.1f} s | egress {walls[network.EGRESS]:5.1f} s | "
          f"ratio {walls[network.EGRESS] / walls[None]:.2f}x")


def use_daemon(host):
    """Point sandbox.py at another daemon: its client and what it and verify.py cached of the last one are
    dropped."""
    os.environ["DOCKER_HOST"] = host
    daemon._client, daemon._cpus, disk._quota = None, None, None
    verify.image_archive.cache_clear()
    verify._image_commands.cache_clear()


def disk_rise(image, writers):
    """writers sandboxes of 256 MB at once, half of them trying one fallocate of 4 GB, half a dd loop of 1 GB;
    returns (the peak rise in MB of the disk under the daemon's data root, sampled every 20 ms, their outcomes)."""
    pay = {"test.sh": b"echo 1 > /logs/verifier/reward.txt\n"}  # pays for anything: only the budget stops it
    big = Task("fallocate", "x", image=image, storage_mb=256, tests=pay,
                    solution={"solve.sh": b"fallocate -l 4G /app/big\n"})
    fill = Task("dd", "x", image=image, storage_mb=256, tests=pay, solution={
        "solve.sh": b"for i in $(seq 64); do dd if=/dev/zero of=/app/f$i bs=1M count=16 status=none || break; done\n"})
    with disk.HostRise(0.02) as rise:
        eps = envs.run_oracle([big, fill] * (writers // 2), concurrency=writers)
    return rise.mb, sorted(f"{e.task}: {e.reward:.0f} {e.failure or 'ok'}" for e in eps)


def episodes_wall(args, what):
    """Wall seconds of one round: args.episodes concurrent one-command episodes (printed with `what`)."""
    task = Task("one-command", "Write hi to /app/out.", image=args.image, storage_mb=256, memory_mb=256,
                     tests={"test.sh": b"grep -q hi /app/out && echo 1 > /logs/verifier/reward.txt\n"})
    t0 = time.perf_counter()
    eps = envs.run_episodes([task] * args.episodes, lambda convs: [ONE_COMMAND] * len(convs),
                            max_turns=3, concurrency=args.episodes)
    wall = time.perf_counter() - t0
    bad = [f"{e.failure}: {e.error[:200]}" for e in eps if e.reward != 1.0]
    print(f"{what}: {wall:.1f} s" + (f" | {len(bad)} episodes not scored 1, e.g. {bad[0]}" if bad else ""))
    return wall


def compare_limits(args):
    """--limits: paired rounds with and without the per-file limits and the count of deleted files still held, on
    a daemon treated as one without a quota."""
    disk.quota()  # found (and said on stderr) outside the timed part
    disk._quota = False  # where the daemon has a quota, its sandboxes are created without it
    with_limits, unlinked = disk.Budget.create_options, disk.unlinked_bytes
    ratios = []
    for r in range(args.rounds):
        walls = {}
        for arm in ("with", "without") if r % 2 == 0 else ("without", "with"):
            disk.Budget.create_options = with_limits if arm == "with" else lambda self: {}
            disk.unlinked_bytes = unlinked if arm == "with" else lambda root: 0
            walls[arm] = episodes_wall(args, f"round {r + 1} {arm} the limits")
        ratios.append(walls["with"] / walls["without"])
    disk.Budget.create_options, disk.unlinked_bytes = with_limits, unlinked
    print(f"{args.episodes} concurrent one-command episodes, with / without the limits, paired: "
          f"{', '.join(f'{x:.2f}' for x in ratios)} | median {statistics.median(ratios):.2f}x")


def compare_daemons(args):
    walls = {host: [] for host in args.daemons}
    for r in range(args.rounds):
        for host in args.daemons:
            use_daemon(host)
            disk.quota()  # says (stderr) which budget this daemon has, outside the timed part
            walls[host].append(episodes_wall(args, f"round {r + 1} {host}"))
    base = statistics.median(walls[args.daemons[0]])
    for host, w in walls.items():
        print(f"{args.episodes} concurrent one-command episodes on {host}: median {statistics.median(w):.1f} s "
              f"({', '.join(f'{x:.1f}' for x in w)}) | {statistics.median(w) / base:.2f}x the first")
    for host in args.daemons:
        use_daemon(host)
        quota = disk.quota()
        peak, outcomes = disk_rise(args.image, args.writers)
        print(f"{host} ({quota.kind if quota else 'watched only'}): {args.writers} sandboxes of 256 MB writing past "
              f"it at once: disk rise peak {peak:.0f} MB | {', '.join(outcomes)}")


def main(argv=None):
    args = parse_args(argv)
    if args.daemons:
        return compare_daemons(args)
    if args.limits:
        return compare_limits(args)
    daemon.sweep()
    starts = []
    for _ in range(max(3, args.reps // 6)):
        t0 = time.perf_counter()
        with sandbox.Sandbox(args.image) as sb:
            sb.screen()
            starts.append(time.perf_counter() - t0)
    print(f"sandbox start (container + tmux + first screen): {ms(starts)}")

    with sandbox.Sandbox(args.image) as sb:
        sb.screen()
        for _ in range(3):  # warm up both paths
            sb.send("echo hi\n")
            sb.container.exec_run(["echo", "hi"])
        raw = timed(lambda: sb.container.exec_run(["echo", "hi"]), args.reps)
        step = timed(lambda: sb.send("echo hi\n", 1.0), args.reps)
        assert sb.last_idle, "the step should end on the idle prompt, not after the full duration"
    ratio = statistics.median(step) / statistics.median(raw)
    print(f"raw exec_run('echo hi'):                   {ms(raw)}")
    print(f"terminal step 'echo hi\\n' (duration 1.0): {ms(step)} | ratio {ratio:.2f}x raw exec (target <= 1.5x)")

    for n in args.concurrency:
        t_start, rate, step_times = throughput(args.image, n, args.steps)
        print(f"concurrency {n:3d}: start all {t_start:5.1f} s | {rate:6.1f} steps/s | step {ms(step_times)}")
    compare_networks(args)
    assert daemon.my_containers() == []


if __name__ == "__main__":
    main()
