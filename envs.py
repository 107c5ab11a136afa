"""
Episodes for ActObs on the Docker sandboxes of sandbox.py: Harbor / Terminal-Bench 2.0 task folders (tasks.py
reads them and builds their images, verify.py runs their verifiers), an embedded procedural task world (taskgen.py),
and the one concurrent episode runner (the Terminus-2 protocol) used by SFT data generation, GRPO rollouts and
evaluation.

Needs a Docker daemon (DOCKER_HOST); `. .ci/dockerd.sh start` starts a private one.

    python envs.py base-image                              # debootstrap bookworm -> actobs-base:bookworm (reused)
    python envs.py base-image --standin                    # trixie + uv/pytest, tagged ubuntu:24.04,
                                                           # python:3.13-slim-bookworm (Terminal-Bench 2.0's FROMs)
                                                           # and ubuntu:22.04 (Endless Terminals')
    python envs.py oracle tests/fixtures/harbor/*          # run solution/solve.sh, print rewards (expect 1.0)
    python envs.py oracle --noop tests/fixtures/harbor/*   # do nothing, print rewards (expect 0.0)
    python envs.py oracle --network egress tests/fixtures/harbor/pip-install # a task that downloads at solve time
    python envs.py corpus --out data/corpus --n-sft 200 --n-rl 64 --n-eval 64 --seed 0
    python envs.py sweep                                   # remove sandboxes left by dead processes
"""
import argparse
import dataclasses
import functools
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from actobs import labels, taskgen
from actobs.episode import Episode, solved
from actobs.sandbox.container_files import LayerLimit, put_files
from actobs.sandbox.daemon import BASE_IMAGE, sweep
from actobs.sandbox.images import STANDIN_SUITE, STANDIN_TAGS, build_base_image
from actobs.sandbox.network import EGRESS, HOST, ensure
from actobs.sandbox.sandbox import DiskLimit, ProcessLimit, Sandbox, ShellExited
from actobs.sandbox.verify import Tampered, VERIFIER_DIR, verify
from actobs.tasks import load_task, task_from_spec
from actobs.terminus import (DEFAULT_PROMPT, CutReply, answer, cut_message, decode, fill_prompt, load_template,
                             network_evidence, parse_reply, second_try_message)

# ----------------------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("base-image", help="build the Debian base image (debootstrap -> docker import), reuse it")
    b.add_argument("--tag", action="append", help="extra tag(s) for the base image, e.g. ubuntu:24.04")
    b.add_argument("--rebuild", action="store_true", help="build even if the image exists")
    b.add_argument("--with-uv", action="store_true", help="add uv and offline pytest wheels (Harbor verifiers)")
    b.add_argument("--suite", default="bookworm", help="Debian release to debootstrap (image actobs-base:SUITE)")
    b.add_argument("--standin", action="store_true",
                   help=f"the offline Terminal-Bench 2.0 stand-in: --suite {STANDIN_SUITE} --with-uv, "
                   f"tagged {STANDIN_TAGS}")

    o = sub.add_parser("oracle", help="run Harbor tasks with solution/solve.sh and print rewards")
    o.add_argument("tasks", nargs="+", type=Path, help="Harbor task folders")
    o.add_argument("--noop", action="store_true", help="do nothing instead of solving (the reward must be 0)")
    o.add_argument("--concurrency", type=int, default=4)
    o.add_argument("--network", choices=(EGRESS, HOST), help="give tasks that allow the internet a network: egress "
                   "(the internet, nothing of the host's: docs/sandboxes.md) or host (not isolated); default: none")
    o.add_argument("--keep-agent-processes", action="store_true", help="leave what solve.sh started running for "
                   "the verifier (tests of a service); see evaluate.py --keep-agent-processes")

    c = sub.add_parser("corpus", help="generate tasks, run the scripted expert, write Nemotron-format JSONL")
    c.add_argument("--out", type=Path, required=True, help="output folder: sft.jsonl, rl/, eval/")
    c.add_argument("--n-sft", type=int, default=200, help="SFT tasks (expert episodes)")
    c.add_argument("--n-rl", type=int, default=64, help="RL tasks written as Harbor folders")
    c.add_argument("--n-eval", type=int, default=64, help="evaluation tasks written as Harbor folders")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--concurrency", type=int, default=8)
    c.add_argument("--max-turns", type=int, default=12)
    c.add_argument("--keep-failed", action="store_true", help="also write the episodes not solved")
    c.add_argument("--prompt-template", type=Path, help="file with {instruction} and {terminal_state}")

    sub.add_parser("sweep", help="remove sandboxes whose owning process is gone")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
# Episodes

def open_sandbox(task, network=None):
    """network: "egress" or "host" (Sandbox) for a task that allows the internet; None, or a task with
    allow_internet = false: no network."""
    return Sandbox(task.image, workdir=task.workdir, user=task.user, cpus=task.cpus, memory_mb=task.memory_mb,
                   storage_mb=task.storage_mb, inodes=task.inodes, network=network if task.allow_internet else None,
                   files=task.files, tmpfs=(VERIFIER_DIR,))


class _Run:
    """One episode's state between policy calls; every method runs in a worker thread."""

    def __init__(self, task, template, network, keep_agent=False, second_try=False, strict=True):
        self.task, self.template, self.network, self.keep_agent = task, template, network, keep_agent
        self.second_try, self.strict = second_try, strict
        self.ep = Episode(task.name, [], instruction=task.instruction.strip(),
                          timings=dict(start_s=0.0, env_s=0.0, policy_s=0.0, verify_s=0.0))
        self.sb, self.done, self.confirming, self.parse_errors = None, False, False, 0
        self.turn0, self.clock0 = 0, 0.0  # where the turn budget and the agent's clock start (a second try: anew)

    def begin(self):
        self.t0 = time.time()
        if self.task.build_error:
            return self.finish("image_build_error", self.task.build_error, verify_=False)
        try:
            self.sb = open_sandbox(self.task, self.network)
            self.sb.start()
            self.ep.timings["start_s"] = self.sb.start_s
            self.ep.messages.append({"role": "user", "content": fill_prompt(
                self.template, self.task.instruction, self.sb.screen())})
            self.clock0 = time.time()
        except Exception as e:
            self.finish(*self._failed(e), verify_=False)

    def act(self, reply, max_turns, max_parse_errors):
        t = time.time()
        self.ep.turns += 1
        self.ep.messages.append({"role": "assistant", "content": str(reply)})
        try:
            failure, error = self._act(reply, max_turns, max_parse_errors)
        except DiskLimit as e:
            return self.finish("disk_limit", str(e), verify_=False)
        except ProcessLimit as e:
            return self.finish("pids_limit", str(e), verify_=False)
        except ShellExited as e:
            return self.finish("shell_exited", str(e))
        except Exception as e:
            return self.finish(*self._failed(e), verify_=False)
        finally:
            self.ep.timings["env_s"] += time.time() - t
        if failure is not None or self.done:
            self.finish(failure, error)

    def _failed(self, e):
        """(failure, error) of a sandbox that failed: disk_limit where the disk watch stopped it (its kill can break
        a terminal step or the terminal's start first; a watch that failed closed is never the infrastructure's),
        else sandbox_error."""
        if self.sb is not None and self.sb.disk_exceeded:
            return "disk_limit", self.sb.disk_exceeded
        return "sandbox_error", f"{type(e).__name__}: {e}"

    def _left(self):
        """Seconds left on the agent's clock. Harbor's agent timeout bounds the wall-clock time of the agent's run
        (asyncio.wait_for around Terminus-2's run): every model call, queueing behind other trials included, and
        every terminal step, from the first screen on; the sandbox's start is not in it. Here the same: the clock
        starts once the sandbox shows its first screen, and the time an episode's reply waits in the engine behind
        the other episodes' counts. It is read when a reply arrives and before each command, whose wait it
        shortens: Harbor cancels the run at the deadline, mid-command or mid-call; here a reply that arrives late
        ends the episode as `timeout` without running."""
        return self.task.agent_timeout - (time.time() - self.clock0)

    def _act(self, reply, max_turns, max_parse_errors):
        """Carry out one reply as Terminus-2 does (terminus.answer); returns (failure, error) when the episode ends
        without a confirmed completion. The messages end with the last reply: they are exactly what the policy saw,
        plus what it answered. max_turns, max_parse_errors: 0 for none (Harbor's: its turn cap is off and parse
        errors never end an episode). max_turns counts every reply, a cut one too (Harbor's cap, when set, counts
        its loop's turns, and the re-ask of a cut reply happens within one)."""
        timeout = "timeout", f"agent timeout of {self.task.agent_timeout:.0f}s reached"
        if self._left() <= 0:
            return timeout
        last_turn = 0 < max_turns <= self.ep.turns - self.turn0
        max_turns = "max_turns", f"no confirmed completion after {self.ep.turns} turns"
        if isinstance(reply, CutReply):  # Terminus-2 asks again; nothing runs
            if last_turn:
                return max_turns
            self.ep.messages.append({"role": "user", "content": cut_message(reply.limit, parse_reply(reply)[2])})
            return None, None
        parsed, error, warnings = parse_reply(reply)
        if parsed is None:
            self.parse_errors += 1
            if 0 < max_parse_errors <= self.parse_errors:
                why = error or "; ".join(warnings)  # a reply rejected for its warnings has no error of its own
                return "parse_errors", f"{self.parse_errors} replies in a row could not be parsed: {why}"
            if last_turn:
                return max_turns
            self.ep.messages.append({"role": "user", "content": answer(parsed, error, warnings)})
            return None, None
        self.parse_errors = 0
        commands = parsed.commands or [("", 0.0)]  # no command: read the terminal
        for i, (keys, duration) in enumerate(commands):
            left = self._left()
            if left <= 0:
                return timeout
            obs = self.sb.send(keys, min(duration, left), read=i == len(commands) - 1)
        told = answer(parsed, None, warnings, obs, self.confirming)
        if told is None:  # a completion confirmed
            self.done = True
            return None, None
        if last_turn:
            return max_turns
        self.confirming = parsed.task_complete
        self.ep.messages.append({"role": "user", "content": told})
        return None, None

    def finish(self, failure, error="", verify_=True):
        self.done = True
        self.ep.failure, self.ep.error = failure, error or ""
        again = False  # aider's second try: the sandbox stays for it
        try:
            if verify_:
                t = time.time()
                seen = "\n".join(m["content"] for m in self.ep.messages[1:] if m["role"] == "user")
                _score(self.ep, self.sb, self.task, seen, self.keep_agent, self.strict)
                self.ep.timings["verify_s"] += time.time() - t
                again = (self.second_try and self.ep.first_reward is None and self.ep.failure is None
                         and not solved(self.ep.reward))
        finally:
            if not again:
                self.close()
                self.ep.timings["total_s"] = time.time() - self.t0
        if again:
            self.retry()

    def retry(self):
        """aider's second try: the agent sees the verifier's output once, in a new terminal (verification
        stopped its processes), and goes on with a fresh turn budget and clock; /tests is taken away again."""
        ep = self.ep
        ep.first_reward, self.done, self.confirming = ep.reward, False, False
        try:
            self.sb.exec("rm -rf /tests /logs/verifier/*", user="root")
            screen = self.sb.restart_terminal()
        except Exception as e:
            self.finish("sandbox_error", f"second try: {type(e).__name__}: {e}", verify_=False)
            return
        self.turn0, self.clock0 = ep.turns, time.time()
        ep.messages.append({"role": "user", "content": second_try_message(ep.verifier_output, screen)})

    def close(self):
        if self.sb is not None:
            self.sb.close()


def _score(ep, sb, task, seen="", keep_agent=False, strict=False):
    """Verify into the episode. The disk budget is checked last: a sandbox over it scores 0 as disk_limit; then
    tampering, under strict verification (verify). seen: what the solution's or the agent's commands printed,
    searched for network errors on a reward below 1."""
    tampered = ""
    try:
        ep.reward, verr, ep.verifier_output = verify(sb, task, keep_agent, ep.tampered, strict)
    except Tampered as e:
        ep.reward, verr, tampered = 0.0, None, str(e)
    except LayerLimit as e:  # the layer could not be read within its bounds: over the budget, as the watch says it
        ep.reward, verr = 0.0, None
        sb.disk.exceeded = sb.disk.exceeded or f"{e}: stopped as over the disk budget"
    except Exception as e:
        ep.reward, verr = 0.0, f"{type(e).__name__}: {e}"
    if sb.disk_exceeded:
        ep.reward, ep.failure, ep.error = 0.0, "disk_limit", sb.disk_exceeded
    elif tampered:
        ep.failure, ep.error = "tampered", tampered
    elif verr and ep.failure is None:
        ep.failure, ep.error = "verifier_error", verr
    if not solved(ep.reward) and task.allow_internet and not sb.network:
        ep.needs_network = network_evidence(seen) or (network_evidence(ep.verifier_output) if verr else "")


class BatchPolicy:
    """A plain batch function `fn(list of message lists) -> list of reply strings` (the scripted expert, HF
    sampling) under the submit/poll protocol of run_episodes. It is lock-step: called once every live episode
    waits on it, with all their conversations in one batch."""
    lockstep = True

    def __init__(self, fn):
        self.fn, self.waiting = fn, []

    def submit(self, key, episode):
        self.waiting.append((key, episode.messages))

    def pending(self):
        return len(self.waiting)

    def poll(self):
        batch, self.waiting = self.waiting, []
        replies = self.fn([m for _, m in batch])
        if len(replies) != len(batch) or not all(isinstance(r, str) for r in replies):
            raise ValueError(f"policy must return {len(batch)} reply strings, got {str(replies)[:200]}")
        return [(key, r) for (key, _), r in zip(batch, replies)]

    def abort(self):
        self.waiting = []


# How long an episode may go on: flags of grpo.py and evaluate.py, by default as Harbor's Terminus-2 runs one (no turn
# cap and no parse-error limit: the task's agent timeout bounds it; at the context limit a hand-off, not an end)
EPISODE_FLAGS = {
    "--max-turns": dict(type=int, default=0, help="replies per episode before it ends as max_turns; 0: no cap, as "
                        "Harbor's Terminus-2 (the task's agent timeout bounds an episode)"),
    "--max-parse-errors": dict(type=int, default=0, help="replies in a row the protocol rejects before the episode "
                               "ends as parse_errors; 0: never, as Harbor's"),
    "--summarize": dict(action=argparse.BooleanOptionalAction, default=True, help="where an episode's next reply has "
                        "no room in --max-len, hand it off to a new context as Harbor's Terminus-2 summarises "
                        "(actobs/handoff.py; what grpo.py trains of it: its docstring); --no-summarize: it ends there "
                        "as max_len"),
}


def run_episodes(tasks, policy, *, max_turns=0, concurrency=8, template=None, network=None, max_parse_errors=0,
                 on_episode=None, stats=None, keep_agent=False, second_try=False, strict=True):
    """Run one episode per entry of `tasks` (repeat a task for several rollouts), up to `concurrency` sandboxes
    live at once; a finished episode's slot starts the next sandbox at once. Sandbox starts and terminal steps
    run in a thread pool; this thread drives the policy. An episode runs as Harbor's Terminus-2 runs one (_Run):
    until a confirmed completion or the task's agent timeout; max_turns (replies) and max_parse_errors (replies
    in a row the protocol rejects) end it sooner when not 0 (the toy world's tight limits; Harbor has neither).

    `policy` is a plain batch function (wrapped in BatchPolicy: lock-step rounds) or an object with
    submit(key, episode) (the episode's messages end with an observation: queue its next reply),
    poll() -> [(key, reply str, or None to end the episode as `max_len`)] (do some work, return what is
    finished; a reply the policy's token limit cut is a terminus.CutReply, which the episode answers with
    Terminus-2's re-ask instead of running it), pending() (replies still owed) and abort() (drop them). The
    policy may hand an episode off to a new context on the way to a reply (engine.VLLMPolicy: Terminus-2's
    summarisation, in the episode's record), its calls' time on the agent's clock as Harbor's. A policy
    with `lockstep = False`
    (engine.VLLMPolicy) generates while sandboxes step: an episode's next turn is queued the moment its
    observation is back. on_episode(i, episode) is called as each one ends. `stats`, a dict, receives wall_s,
    policy_s (time inside poll: the generator working) and idle_s (the generator waiting for sandboxes).
    Sandboxes are removed even if the policy raises. network: "egress" or "host" for the tasks that allow the
    internet (open_sandbox), None for none; where this host cannot have the egress network nothing runs
    (network.ensure raises). keep_agent: verify(..., keep_agent). second_try: after a confirmed completion that the
    verifier scores below 1, the agent sees its output and goes on once (_Run.retry).
    strict: an agent that changed what the verifier loads or runs scores 0 as `tampered` (verify): what RL needs;
    evaluate.py passes False (Harbor's semantics; the evidence is counted)."""
    template = template or DEFAULT_PROMPT
    policy = policy if hasattr(policy, "submit") else BatchPolicy(policy)
    if network == EGRESS and any(t.allow_internet for t in tasks):
        ensure()  # a host without the egress network stops the run here, saying why (not a sandbox_error each)
    sweep()
    runs = [_Run(t, template, network, keep_agent, second_try, strict) for t in tasks]
    todo, env, live, asked = list(range(len(runs)))[::-1], {}, 0, {}  # env: future of a pool job -> episode
    pool = ThreadPoolExecutor(max(1, concurrency))
    t_start, busy = time.time(), 0.0
    try:
        while todo or env or policy.pending():
            while todo and live < concurrency:
                i = todo.pop()
                env[pool.submit(runs[i].begin)] = i
                live += 1
            done = [f for f in env if f.done()]
            for f in done:
                i = env.pop(f)
                f.result()  # _Run records sandbox failures itself; anything raised here is a bug
                if runs[i].done:
                    live -= 1
                    if on_episode is not None:
                        on_episode(i, runs[i].ep)
                else:
                    asked[i] = time.time()
                    policy.submit(i, runs[i].ep)
            if done:
                continue
            if policy.pending() and not (policy.lockstep and env):
                t = time.time()
                replies = policy.poll()
                busy += time.time() - t
                for i, reply in replies:
                    runs[i].ep.timings["policy_s"] += time.time() - asked.pop(i)
                    if reply is None:  # the policy's context is full: end here and verify what was done
                        h = runs[i].ep.handoffs
                        why = "the episode reached the context length" + (
                            "; no context of the hand-off fit in it" if h and h[-1].fallback is None else "")
                        job = functools.partial(runs[i].finish, "max_len", why)
                    else:
                        job = functools.partial(runs[i].act, reply, max_turns, max_parse_errors)
                    env[pool.submit(job)] = i
            elif env:
                wait(env, return_when=FIRST_COMPLETED)
    finally:
        policy.abort()
        pool.shutdown(wait=True, cancel_futures=True)  # no thread is still starting a container after this
        for r in runs:
            r.close()
    if stats is not None:
        wall = time.time() - t_start
        stats.update(wall_s=wall, policy_s=busy, idle_s=wall - busy)
    return [r.ep for r in runs]


def run_oracle(tasks, *, noop=False, concurrency=4, network=None, keep_agent=False, strict=False):
    """Run each task's solution/solve.sh (or nothing, with noop) and the verifier; returns Episodes. network,
    keep_agent, strict: as in run_episodes (keep_agent: what solve.sh left running stays up for the verifier;
    strict is off: a task's own solution may change the verifier's programs, as under Harbor)."""
    def one(task):
        ep, t0 = Episode(task.name, []), time.time()
        if task.build_error:
            ep.failure, ep.error, ep.timings["total_s"] = "image_build_error", task.build_error, 0.0
            return ep
        try:
            with open_sandbox(task, network) as sb:
                out = b""
                if not noop:
                    put_files(sb.container, [("/solution/" + rel, data, 0o755) for rel, data in task.solution.items()])
                    code, out = sb.exec(["bash", "/solution/solve.sh"], timeout=task.agent_timeout)
                    if code in (124, 137) and not sb.disk_exceeded:
                        ep.failure, ep.error = "timeout", decode(out)[-500:]
                _score(ep, sb, task, decode(out), keep_agent, strict)
        except Exception as e:
            ep.failure, ep.error = "sandbox_error", f"{type(e).__name__}: {e}"
        ep.timings["total_s"] = time.time() - t0
        return ep
    if network == EGRESS and any(t.allow_internet for t in tasks):
        ensure()  # as in run_episodes
    sweep()
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, tasks))


# ----------------------------------------------------------------------------------------------------------

def corpus(args):
    template = load_template(args.prompt_template)
    splits = taskgen.make_splits(args.n_sft, args.n_rl, args.n_eval, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("rl", "eval"):
        for spec in splits[split]:
            taskgen.write_harbor(spec, args.out / split / spec.name, BASE_IMAGE)
        labels.write_jsonl(args.out / f"{split}.jsonl", [dataclasses.asdict(s) for s in splits[split]])
    tasks = [task_from_spec(s) for s in splits["sft"]]
    t0 = time.time()
    from tqdm import tqdm
    with tqdm(total=len(tasks), desc="expert episodes", dynamic_ncols=True) as bar:
        episodes = run_episodes(tasks, taskgen.expert_policy, max_turns=args.max_turns, concurrency=args.concurrency,
                                template=template, on_episode=lambda i, ep: bar.update())
    rows = [{"conversations": e.messages, "task": e.task, "reward": e.reward} for e in episodes
            if args.keep_failed or (solved(e.reward) and e.failure is None)]
    labels.write_jsonl(args.out / "sft.jsonl", rows)
    n_solved = sum(solved(e.reward) for e in episodes)
    turns = sum(e.turns for e in episodes) / max(1, len(episodes))
    print(f"sft: {n_solved}/{len(episodes)} solved | {turns:.1f} turns/episode | {len(rows)} rows -> "
          f"{args.out / 'sft.jsonl'} | {time.time() - t0:.0f}s")
    for e in episodes:
        if e.failure:
            print(f"  {e.task}: {e.failure} {e.error[:200]}")
    print(f"rl: {len(splits['rl'])} tasks -> {args.out / 'rl'} | "
          f"eval: {len(splits['eval'])} tasks -> {args.out / 'eval'}")


def main(argv=None):
    args = parse_args(argv)
    if args.cmd == "base-image":
        if args.standin:
            build_base_image(STANDIN_SUITE, STANDIN_TAGS + (args.tag or []), args.rebuild, with_uv=True)
        else:
            build_base_image(args.suite, args.tag, args.rebuild, args.with_uv)
    elif args.cmd == "sweep":
        print(f"removed {sweep()} leftover sandboxes")
    elif args.cmd == "oracle":
        tasks = [load_task(p) for p in args.tasks]
        episodes = run_oracle(tasks, noop=args.noop, concurrency=args.concurrency, network=args.network,
                              keep_agent=args.keep_agent_processes)
        for e in episodes:
            print(f"{e.task}\treward {e.reward:.2f}\t{e.failure or 'ok'}\t{e.timings['total_s']:.1f}s"
                  + (f"\tneeds the network: {e.needs_network}" if e.needs_network else ""))
            if e.failure:  # the end of the story: a build log's hint, the verifier's last words
                print("    " + (e.error[-600:] + "\n" + e.verifier_output[-600:]).strip().replace("\n", "\n    "))
        return episodes
    elif args.cmd == "corpus":
        corpus(args)


if __name__ == "__main__":
    main()
