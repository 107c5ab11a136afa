"""
Sandbox benchmark: start latency, the terminal step next to a raw `docker exec` round trip, and throughput with
1, 8 and 32 concurrent sandboxes. All numbers come from the same run, on the same daemon.

    python envs.py base-image && python -m bench.envs
    python -m bench.envs --reps 50 --steps 20 --concurrency 1 8 32
"""
import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import sandbox


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", default=sandbox.BASE_IMAGE)
    p.add_argument("--reps", type=int, default=30, help="repetitions for the latency measurements")
    p.add_argument("--steps", type=int, default=10, help="terminal steps per sandbox in the throughput runs")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
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


def throughput(image, n, steps):
    """n sandboxes started together, each runs `steps` quick commands; returns (start wall s, steps/s, step times)."""
    boxes, step_times = [sandbox.Sandbox(image, memory_mb=256) for _ in range(n)], []

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


def main(argv=None):
    args = parse_args(argv)
    sandbox.sweep()
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
    assert sandbox.my_containers() == []


if __name__ == "__main__":
    main()
