"""
pass@k of a checkpoint on terminal tasks: every task attempted n times in real sandboxes with the same vLLM
rollout grpo.py trains with (envs.run_episodes with engine.VLLMPolicy), then pass@k, distinct tasks solved and
failures, by task kind.

    # toy world (CPU): the held-out split written by `python envs.py corpus --out data/corpus ...`
    python evaluate.py --model runs/actobs/final --tasks data/corpus/eval --attempts 4 --max-turns 12 \\
        --max-parse-errors 3 --max-new-tokens 512 --max-len 8192 --concurrency 8 --out runs/actobs/eval.json
    python evaluate.py compare runs/actionsft/eval.json runs/actobs/eval.json --png runs/pass_at_k.png
    # Terminal-Bench 2.0 on a GPU: a clone of the benchmark (a folder of its 89 task folders), n = 16
    python evaluate.py --model runs/q4b-actobs-grpo/final --tasks terminal-bench-2 --attempts 16 \\
        --max-new-tokens 8192 --max-len 32768 --concurrency 32 --out runs/q4b-actobs-grpo/tb2.json

--tasks takes Harbor task folders or folders of them; the chat template is the checkpoint's, the system prompt
--prompt-template's, so evaluation sees what training saw. The results JSON is rewritten after every attempt and the
same command resumes; infrastructure failures are reported apart, out of pass@k. What it measures and how to read a
comparison: docs/report.md; validating a task set first: `python envs.py oracle [--noop] DIR/*`. Several evaluations
in one process: `python evaluate.py ARGS ::: ARGS ...`.
"""
import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import envs
from actobs import compare, episode, grammar, labels, runlog, taskgen, terminus
from actobs.passk import NEWER_KEYS, RESUME_KEYS, constrained, groups, ks_up_to, pct, summarize
from actobs.sandbox import network
from actobs.tasks import KIND_FIELDS, load_task


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face checkpoint dir (sft.py / grpo.py output) or hub id")
    p.add_argument("--tasks", nargs="+", required=True, type=Path, help="Harbor task folders, or folders of them")
    p.add_argument("--out", type=Path, default=Path("results.json"), help="results JSON (resumed when it exists)")
    p.add_argument("--attempts", type=int, default=16, help="n: attempts per task")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens with this "
                   "much probability (1: all)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    for flag, kw in envs.EPISODE_FLAGS.items():  # --max-turns, --max-parse-errors, --summarize
        p.add_argument(flag, **kw)
    p.add_argument("--max-new-tokens", type=int, default=2048, help="tokens per reply")
    p.add_argument("--max-len", type=int, default=16384, help="tokens per context (prompt + the turns in it)")
    p.add_argument("--prompt-template", type=Path, help="system prompt with {instruction} and {terminal_state} "
                   "(default: terminus.DEFAULT_PROMPT, what envs.py corpus writes); pass the SFT corpus's own")
    p.add_argument("--concurrency", type=int, default=8, help="sandboxes live at once")
    p.add_argument("--transcripts", type=Path, help="also append every episode to this JSONL: its record, the "
                   "verifier's output, the conversation (the SFT corpus's form) and its hand-offs at --max-len "
                   "(where each was in the conversation, its calls, the context after it), to read what the policy "
                   "did")
    p.add_argument("--network", choices=(network.EGRESS, network.HOST), help="give the tasks that allow the internet "
                   "(task.toml allow_internet, Harbor's default: true) a network: egress (the internet through NAT, "
                   "nothing of the host's nor of another sandbox: docs/sandboxes.md; where this host cannot have it "
                   "the run stops) or host (the host's network namespace: not isolated). Default: no network for any "
                   "task (an attempt that failed for want of it is counted apart as 'needs network')")
    p.add_argument("--keep-agent-processes", action="store_true", help="leave the agent's processes running while "
                   "the verifier runs (tests that probe a service the agent started, as Harbor does). Trade-off: "
                   "anything the agent left behind can then write the reward file or change the tests, so a reward "
                   "can be forged; RL (grpo.py) always stops them")
    p.add_argument("--second-try", action="store_true", help="aider's harness: after a completion the verifier "
                   "scores below 1, the agent sees the test output once and continues; pass@k is reported for the "
                   "first try and for the second apart")
    p.add_argument("--kind-by", choices=KIND_FIELDS, help="the task.toml [metadata] field the per-kind rows "
                   "group by (language for aider-polyglot); default: the first of kind, category, language, "
                   "difficulty a task has")
    p.add_argument("--retry-infra", action="store_true", help="on resume, run again the attempts that ended in an "
                   "infrastructure failure (otherwise they stay recorded, and excluded)")
    p.add_argument("--grammar", **grammar.GRAMMAR_FLAG)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="vLLM dtype: auto (bf16 on GPU and on a CPU where it is faster "
                   "than fp32: common.resolve_dtype), bf16, fp32")
    p.add_argument("--gpu-memory", type=float, default=0.9, help="share of GPU memory for vLLM (no trainer here)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
# The estimator


# ----------------------------------------------------------------------------------------------------------
# Results: {"settings", "configs": [runlog.run_config of each session, with "time": its time_breakdown once it
# ran attempts], "tasks": {name: {"path", "kind", "heldout", "attempts": [record]}}, "summary"}


def table(results):
    ks = ks_up_to(results["settings"]["attempts"])
    lines = [f"{'':20} {'tasks':>5} " + " ".join(f"{f'pass@{k}':>7}" for k in ks)
             + f" {'solved':>7} {'excl':>5}  failures"]
    second = results["settings"].get("second_try")
    for label, tasks in groups(results):  # with the second try: a row for the first try, one for the second
        tries = [(f"{label[:12]} 1st try", True), (f"{label[:12]} 2nd try", False)] if second else [(label, False)]
        for name, first in tries:
            s = summarize(tasks, ks, first)
            fails = ", ".join(f"{k} {v}" for k, v in sorted(s["failures"].items())) or "-"
            lines.append(f"{name[:20]:20} {s['tasks']:>5} " + " ".join(f"{pct(s['pass@k'][k]):>7}" for k in ks)
                         + f" {s['solved']:>7} {s['excluded']:>5}  {fails}")
    s = summarize(results["tasks"], ks)
    infra = ", ".join(f"{k} {v}" for k, v in sorted(s["infra"].items()))
    lines.append(f"pass@k in %, over {s['attempts']} attempts; {s['excluded']} excluded as infrastructure failures"
                 + (f" ({infra})" if infra else "") + "; replies " + constrained(results["settings"]))
    if s["failures"].get("needs network"):
        lines.append(f"needs network: {s['failures']['needs network']} attempts scored below 1 in a sandbox without "
                     "the network after a command failed for want of it (their tasks allow it: --network)")
    if s["failures"].get("tampered"):
        lines.append(f"tampered: {s['failures']['tampered']} attempts changed what the verifier loads or runs "
                     "(verify.py; their reward stands, as under Harbor)")
    short = [k for k in ks if s["tasks@k"][k] < s["tasks"]]
    if short:
        lines.append(f"pass@{','.join(map(str, short))}: only tasks with at least k valid attempts "
                     f"({', '.join(str(s['tasks@k'][k]) for k in short)} of {s['tasks']})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Where an evaluation's time goes

# An attempt's seconds by phase (episode.Episode.timings; its record keeps them), and what the breakdown calls them.
PHASES = {"start_s": "sandbox start", "env_s": "terminal steps", "policy_s": "policy wait", "verify_s": "verification"}


def time_breakdown(records, stats, setup_s):
    """Where a session's time went. records: the attempt records it produced; stats: envs.run_episodes' wall_s
    and policy_s (the engine inside its steps), and, from a model, its config, dtype, threads and matmul_flop_s;
    setup_s: the time before the first attempt started (images, engine). Phase seconds are summed over attempts,
    which overlap: a sum over the wall is how many attempts were in that phase at once, on average. The FLOP
    bound counts every token of an episode once (its prompt and observations prefilled through the prefix
    cache, its replies decoded) at the matmul rate: the time that work takes at best, and the generated tokens/s
    that allows."""
    from actobs import tiny  # torch: only where the bound is computed
    n, wall = max(len(records), 1), stats["wall_s"]
    phases = {**{k: sum(a[k] for a in records) for k in PHASES}, "attempt_s": sum(a["wall_s"] for a in records)}
    generated = sum(a["generated"] for a in records)
    out = {"setup_s": setup_s, "wall_s": wall, "attempts": len(records),
           "phases": {k: {"sum_s": v, "mean_s": v / n, "at_once": v / wall} for k, v in phases.items()},
           "turns_mean": sum(a["turns"] for a in records) / n, "generated": generated,
           "gen_tok_s": generated / wall, "engine_busy_frac": stats["policy_s"] / wall,
           "engine_tok_s": generated / max(stats["policy_s"], 1e-9)}
    if "config" in stats:
        # an episode of T tokens: sum over positions p < T of forward_flops(p), linear in p: T * forward_flops((T-1)/2)
        flops = sum(a["tokens"] * tiny.forward_flops(stats["config"], (a["tokens"] - 1) / 2) for a in records)
        compute_s = flops / stats["matmul_flop_s"]
        out["bound"] = {k: stats[k] for k in ("dtype", "threads", "matmul_flop_s")} | {
            "tokens": sum(a["tokens"] for a in records), "flops": flops, "compute_s": compute_s,
            "gen_tok_s": generated / max(compute_s, 1e-9), "of_wall": compute_s / wall,
            "of_busy": compute_s / max(stats["policy_s"], 1e-9)}
    return out


def breakdown_text(b):
    lines = [f"time: {b['attempts']} attempts in {b['wall_s']:.0f}s (after {b['setup_s']:.0f}s of setup: images, "
             f"engine); the engine was busy {100 * b['engine_busy_frac']:.0f}% of the wall",
             f"  {'seconds per phase':20} {'sum':>8} {'mean':>7} {'at once':>8}"]
    for k, label in (*PHASES.items(), ("attempt_s", "attempt (all)")):
        p = b["phases"][k]
        lines.append(f"  {label:20} {p['sum_s']:8.1f} {p['mean_s']:7.2f} {p['at_once']:8.1f}")
    lines.append(f"  {b['turns_mean']:.1f} turns per attempt | {b['generated']:,} tokens generated: "
                 f"{b['gen_tok_s']:.0f} tok/s over the wall, {b['engine_tok_s']:.0f} over the engine's busy time")
    if "bound" in b:
        x = b["bound"]
        lines.append(f"  FLOP bound: {x['flops'] / 1e9:,.1f} GFLOP for the {x['tokens']:,} tokens at the matmul's "
                     f"{x['matmul_flop_s'] / 1e9:.1f} GFLOP/s ({x['dtype']}, threads {x['threads']}): "
                     f"{x['compute_s']:.1f}s of compute,")
        lines.append(f"  {x['gen_tok_s']:.0f} generated tok/s at best; the run reached {100 * x['of_wall']:.0f}% of "
                     f"it over the wall, {100 * x['of_busy']:.0f}% while the engine was busy")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Running an evaluation

def task_dirs(paths):
    """Harbor task folders: each path is one (it has task.toml) or a folder of them."""
    out = []
    for p in paths:
        if (p / "task.toml").is_file():
            out.append(p)
        elif p.is_dir() and (sub := sorted(d for d in p.iterdir() if (d / "task.toml").is_file())):
            out.extend(sub)
        else:
            raise ValueError(f"{p}: neither a task folder (no task.toml) nor a folder of task folders")
    return out


def save_results(path, results):
    """Written to a temp file and renamed: a killed run leaves the previous complete file, never half of one."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)


def attempt_record(attempt, ep):
    """tokens: the episode's token sequence (prompt, replies, observations); generated: the sampled ones; wall_s
    and the PHASES: its seconds (an image that did not build: none)."""
    rec = {"attempt": attempt, "reward": ep.reward, "turns": ep.turns, "tokens": len(ep.token_ids),
           "generated": sum(r == labels.ACTION for r in ep.roles), "wall_s": round(ep.timings.get("total_s", 0.0), 3),
           **{k: round(ep.timings.get(k, 0.0), 3) for k in PHASES}, "failure": ep.failure, "error": ep.error[-1000:]}
    if ep.needs_network:
        rec["needs_network"] = ep.needs_network
    if ep.tampered:
        rec["tampered"] = ep.tampered[:20]
    if ep.first_reward is not None:
        rec["first_reward"] = ep.first_reward
    if ep.handoffs:  # at --max-len (--summarize): how each new context was made, None where none fit
        rec["handoffs"] = [h.fallback for h in ep.handoffs]
    return rec


def settings_of(args):
    prompt = terminus.load_template(args.prompt_template)
    return {"model": str(args.model), "tasks": [str(p.resolve()) for p in args.tasks], "attempts": args.attempts,
            "protocol": terminus.PROTOCOL, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "max_turns": args.max_turns, "max_parse_errors": args.max_parse_errors,
            "max_new_tokens": args.max_new_tokens, "max_len": args.max_len, "prompt": prompt, "seed": args.seed,
            "dtype": args.dtype, "network": args.network, "keep_agent_processes": args.keep_agent_processes,
            "second_try": args.second_try, "grammar": args.grammar, "summarize": args.summarize,
            "concurrency": args.concurrency}


def open_results(path, settings):
    """The results so far (a resumed run) or a fresh dict; refuses to resume with other settings."""
    if not path.exists():
        return {"settings": settings, "configs": [], "tasks": {}}
    results = json.loads(path.read_text())
    changed = [k for k in RESUME_KEYS if results["settings"].get(k, NEWER_KEYS.get(k)) != settings[k]]
    if changed:
        raise SystemExit(f"{path} holds a run with other settings ({', '.join(changed)} differ): "
                         "use another --out, or the settings it was run with")
    results["settings"]["concurrency"] = settings["concurrency"]
    return results


def vllm_rollout(args, session):
    """The engine and rollout grpo.py trains with (imported here: the tables and compare need neither torch nor
    vLLM)."""
    from actobs import common
    from actobs import engine
    import torch
    llm = engine.make_engine(args.model, max_model_len=args.max_len, max_seqs=args.concurrency, seed=args.seed,
                             dtype=args.dtype, gpu_memory=args.gpu_memory)
    tokenizer = labels.load_tokenizer(args.model, "native")  # the template the checkpoint was trained with
    template = terminus.load_template(args.prompt_template)

    def rollout(tasks, on_episode, stats):
        # Each episode samples with a seed from (seed, its index in `tasks`): a resumed session gets another seed,
        # so its first attempts do not replay the random streams of the first session's.
        policy = engine.VLLMPolicy(llm, tokenizer, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                   max_new_tokens=args.max_new_tokens,
                                   max_len=args.max_len, seed=args.seed + session, grammar=args.grammar,
                                   summarize=args.summarize, logprobs=False)  # nothing trains on them
        with engine.engine_threads():
            episodes = envs.run_episodes(tasks, policy, max_turns=args.max_turns,
                                         max_parse_errors=args.max_parse_errors, concurrency=args.concurrency,
                                         template=template, on_episode=on_episode, stats=stats, network=args.network,
                                         keep_agent=args.keep_agent_processes, second_try=args.second_try,
                                         strict=False)  # Harbor's semantics: tampering is counted, not scored
        mc = llm.llm_engine.model_config  # what time_breakdown's FLOP bound needs, at the engine's threads
        with engine.engine_threads():
            stats.update(config=mc.hf_text_config.to_dict(), dtype=str(mc.dtype).removeprefix("torch."),
                         threads=torch.get_num_threads(), matmul_flop_s=common.matmul_flop_s(mc.dtype))
        return episodes
    return rollout


def evaluate(args, rollout=None):
    """Run the attempts the results file does not have yet. rollout(tasks, on_episode, stats) -> episodes, calling
    on_episode(i, episode) as each finishes and filling stats as envs.run_episodes does (time_breakdown reads
    them); default: vllm_rollout's, on args.model. The session's time breakdown goes in its configs entry."""
    t_begin = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = open_results(args.out, settings_of(args))
    paths = task_dirs(args.tasks)
    jobs, missing, names = [], {}, {}
    for p in paths:
        task = load_task(p, build=False)  # a malformed folder is an error before anything runs
        prev = results["tasks"].get(task.name)
        if prev is not None and prev["path"] != str(p.resolve()):
            raise ValueError(f"{p}: task name {task.name!r} also names {prev['path']}")
        entry = results["tasks"].setdefault(task.name, {"path": str(p.resolve()), "attempts": []})
        entry["kind"] = task.meta.get(args.kind_by) if args.kind_by else task.kind
        entry["heldout"] = entry["kind"] in taskgen.HELDOUT_KINDS
        if args.retry_infra:
            entry["attempts"] = [a for a in entry["attempts"] if a["failure"] not in episode.INFRA_FAILURES]
        done = {a["attempt"] for a in entry["attempts"]}
        if len(done) < args.attempts:
            missing[p], names[p] = [i for i in range(args.attempts) if i not in done], task.name

    # Images build in parallel; one that does not build leaves task.build_error, and the rollout records its
    # attempts as image_build_error (infrastructure) while the other tasks run.
    with ThreadPoolExecutor(max(1, min(8, args.concurrency))) as pool:
        for p, task in zip(missing, pool.map(load_task, missing)):
            if task.build_error:
                print(f"{p}: the image does not build; its attempts are recorded as image_build_error")
            jobs += [(names[p], i, task) for i in missing[p]]
    jobs.sort(key=lambda job: job[1])  # attempt 0 of every task first: a stopped run has some of each task
    results["configs"].append(runlog.run_config(vars(args)))  # one per session: a resumed run may run other code
    save_results(args.out, results)
    print(f"{len(paths)} tasks x {args.attempts} attempts: {len(jobs)} to run -> {args.out}")
    if jobs:
        from tqdm import tqdm
        rollout = rollout or vllm_rollout(args, len(results["configs"]) - 1)
        lock, t0, bar, outcomes = threading.Lock(), time.time(), tqdm(total=len(jobs), desc="attempts"), Counter()
        ran, stats = [], {}  # this session's attempt records, the rollout's stats
        transcripts = open(args.transcripts, "a") if args.transcripts else None

        def on_episode(i, ep):
            name, attempt, _ = jobs[i]
            rec = attempt_record(attempt, ep)
            with lock:
                if transcripts:  # before the results: an attempt the results hold has its transcript
                    # the conversation in order, across hand-offs; each hand-off (episode.Handoff): where it was in
                    # it (at), its calls and the context the replies after it answer
                    transcripts.write(json.dumps({"task": name, **rec, "verifier_output": ep.verifier_output,
                                                  "conversations": ep.messages,
                                                  "handoffs": [dataclasses.asdict(h) for h in ep.handoffs]}) + "\n")
                    transcripts.flush()
                results["tasks"][name]["attempts"].append(rec)
                ran.append(rec)
                results["tasks"][name]["attempts"].sort(key=lambda a: a["attempt"])
                save_results(args.out, results)
                outcomes[ep.failure or ("solved" if episode.solved(ep.reward) else "failed")] += 1
                bar.set_postfix(outcomes)
                bar.update()
        try:
            rollout([task for _, _, task in jobs], on_episode, stats)
        finally:
            bar.close()
            if transcripts:
                transcripts.close()
        results["configs"][-1]["time"] = time_breakdown(ran, stats, t0 - t_begin)
        print(breakdown_text(results["configs"][-1]["time"]))
    results["summary"] = summarize(results["tasks"], ks_up_to(args.attempts))
    if args.second_try:  # the summary's pass@k is the final one; the first try's apart
        results["summary"]["first_try"] = summarize(results["tasks"], ks_up_to(args.attempts), first=True)["pass@k"]
    save_results(args.out, results)
    print(table(results))
    return results


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:
        return compare.main(argv[1:])
    args = parse_args(argv)
    from actobs import engine  # torch: only when a run starts
    os.environ.update(engine.IN_PROCESS_ENV)  # vLLM's engine in this process, as grpo.py's
    return evaluate(args)


if __name__ == "__main__":
    from actobs import common  # torch: the CLI only (the tables and compare need none)
    common.run_cli(main)
