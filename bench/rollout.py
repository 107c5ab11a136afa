"""
Benchmark of the rollout engine's generated tokens/s at the ablation's settings: each lever as a ratio against
today's configuration (engine.make_engine and engine.VLLMPolicy's defaults: grpo.py's, and evaluate.py's before it
dropped the log-probs: the no-logprobs lever), in one process, interleaved. Ratios are of tokens per second of the
engine's CPU time: on a shared machine the wall of a step also counts the time other processes hold the core.

1. record (once, cached in --record): episodes in real sandboxes with today's engine: GRPO's first draw
   (--tasks-per-step tasks x --group-size at --concurrency), or with --eval an evaluation's (--attempts of
   --eval-tasks tasks at --concurrency). Each episode's token sequence, roles and time per terminal step.
2. replay: the recorded turns through each lever's engine. A turn is queued with its recorded context (prompt,
   earlier replies, observations) when the episode's previous reply is back and its recorded time per terminal
   step has passed, with the recording's seeds: today's engine reproduces every recorded reply. Printed per lever:
   generated tokens/s over the engine's steps (process CPU time and wall), the ratio of the CPU-time rates to
   today's (mean over rounds), the fraction of the FLOP bound, the replies that differ from today's, and the
   largest and mean log-prob difference on the rest.
3. profile: where a decode step's milliseconds go in today's engine (attention, matmuls, the rest: scheduler,
   sampler, Python) at a few batch sizes and contexts.

    python -m bench.rollout --model runs/ablation/actionsft/final --tasks runs/ablation/corpus/rl \\
        --record /tmp/rollout-grpo.jsonl                                   # GRPO: 4 tasks x 8 at concurrency 32
    python -m bench.rollout --model runs/ablation/actionsft/final --tasks runs/ablation/corpus/eval --eval \\
        --eval-tasks 12 --attempts 8 --concurrency 64 --record /tmp/rollout-eval.jsonl
    # what --grammar costs: GRPO's (log-probs and the masks' replay) and an evaluation's (neither)
    python -m bench.rollout ... --levers grammar,no-logprobs,grammar+no-logprobs --profile ""

Under the grammar the engine samples other replies than the recorded ones (the column of replies differing):
the contexts are the recorded ones, the rate is of the tokens it generated.
"""
import argparse
import heapq
import json
import os
import time
from pathlib import Path

import envs
import grpo
from actobs import common, engine, terminus, tiny
from actobs.labels import ACTION, load_tokenizer, write_jsonl
from actobs.tasks import load_tasks

# lever -> make_engine arguments, whether replies carry their log-probs and the grammar they are decoded under (a
# request's setting, not the engine's); "today" is every ratio's baseline
LEVERS = {
    "today": {},
    "grammar": {"grammar": "reply"},  # --grammar: every reply under grammar.reply_grammar, its masks replayed
    "compiled": {"enforce_eager": False},  # inductor on CPU: the model's forward as generated code
    "no-logprobs": {"logprobs": False},  # what an evaluation needs: no log-prob or rank per sampled token
    "bf16": {"dtype": "bf16"},  # bf16 weights and KV cache (AVX512-BF16): other numerics
    "no-prefix-cache": {"enable_prefix_caching": False},  # what reusing the earlier turns' KV is worth
}


def record(args, tok):
    """Episodes in real sandboxes with today's engine -> rows (token_ids, roles, step_s) in args.record."""
    tasks = load_tasks(args.tasks)
    if args.eval:
        spread = tasks[:: max(1, len(tasks) // args.eval_tasks)][: args.eval_tasks]
        todo = [t for t in spread for _ in range(args.attempts)]
    else:
        todo = [tasks[g] for g in grpo.step_groups(len(tasks), args.tasks_per_step, 0, args.seed)
                for _ in range(args.group_size)]
    llm = engine.make_engine(args.model, max_model_len=args.max_len, max_seqs=args.concurrency, seed=args.seed)
    st = {}
    policy = engine.VLLMPolicy(llm, tok, temperature=1.0, max_new_tokens=args.max_new_tokens, max_len=args.max_len,
                               seed=args.seed)
    with engine.engine_threads():
        eps = envs.run_episodes(todo, policy, max_turns=args.max_turns, concurrency=args.concurrency,
                                template=terminus.load_template(args.template), stats=st)
    n = sum(e.roles.count(ACTION) for e in eps)
    print(f"recorded {len(eps)} episodes in sandboxes: {n} generated tokens, wall {st['wall_s']:.0f}s, engine busy "
          f"{st['policy_s']:.0f}s: {n / st['policy_s']:.0f} tok/s while busy, {n / st['wall_s']:.0f} over the wall")
    write_jsonl(args.record, [{"token_ids": e.token_ids, "roles": e.roles,
                               "step_s": e.timings["env_s"] / max(e.turns, 1)} for e in eps])


def replay(llm, policy, eps, concurrency):
    """Every recorded turn through llm; -> (generated tokens, CPU s and wall s inside engine steps, wall s,
    {(episode, turn): (token ids, log-probs)})."""
    turns = [[e["token_ids"][:a] for a, _ in engine.reply_spans(e["roles"])] for e in eps]  # each reply's context
    todo, live, later, replies = list(range(len(eps)))[::-1], {}, [], {}
    cpu = busy = 0.0
    t0 = time.perf_counter()

    def add(i, k):
        live[policy.add(i, k, turns[i][k], min(policy.max_new_tokens, policy.max_len - len(turns[i][k])))] = (i, k)

    while todo or live or later:
        while todo and len({i for i, _ in live.values()}) + len(later) < concurrency:
            add(todo.pop(), 0)
        while later and later[0][0] <= time.perf_counter():
            add(*heapq.heappop(later)[1:])
        if not live:
            time.sleep(max(0.0, later[0][0] - time.perf_counter()))
            continue
        c, t = time.process_time(), time.perf_counter()
        outputs = llm.llm_engine.step()
        for o in outputs:
            if o.finished:
                i, k = live.pop(o.request_id)
                ids, lp = list(o.outputs[0].token_ids), o.outputs[0].logprobs
                replies[i, k] = ids, [d[t].logprob for d, t in zip(lp, ids)] if lp else []
                if policy.compiled is not None:  # the rollout replays the grammar's masks (VLLMPolicy.poll): its cost
                    engine.allowed_masks(policy.compiled, ids, policy.stop_ids)
                if k + 1 < len(turns[i]):
                    heapq.heappush(later, (time.perf_counter() + eps[i]["step_s"], i, k + 1))
        cpu, busy = cpu + time.process_time() - c, busy + time.perf_counter() - t
    return sum(len(r[0]) for r in replies.values()), cpu, busy, time.perf_counter() - t0, replies


def step_profile(llm, seqs, context, steps=16):
    """Today's decode step at `seqs` sequences of `context` tokens (prefix cached): -> (ms a step: the median of
    `steps`, ms of it in the attention kernel and in matmuls: their own time in torch's profiler over as many more
    steps, which the profiler itself slows)."""
    import random

    from torch.profiler import profile
    from vllm import SamplingParams
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(context)] for _ in range(seqs)]
    eng = llm.llm_engine
    for new in (1, 2 * steps + 2):  # the first pass caches the prompts, the second decodes
        for i, q in enumerate(prompts):
            eng.add_request(f"p{seqs}-{context}-{new}-{i}", {"prompt_token_ids": q},
                            SamplingParams(max_tokens=new, ignore_eos=True, logprobs=0, seed=i, top_k=0,
                                           detokenize=False))
        while eng.has_unfinished_requests() and new == 1:
            eng.step()
    eng.step()  # the prefill of the last partial blocks
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    with profile() as p:
        for _ in range(steps):
            eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    own = {e.key: e.self_cpu_time_total / 1000 / steps for e in p.key_averages()}
    return (sorted(times)[steps // 2] * 1000, sum(v for k, v in own.items() if "attention" in k),
            sum(v for k, v in own.items() if k.endswith("mm")))


def summary(eps, res, llm):
    """The table: per lever, CPU-time tok/s (mean over rounds), its ratio to today's, the fraction of the FLOP
    bound, and, from the first round, the replies that differ from today's and the log-prob difference on the
    others."""
    mc = llm.llm_engine.model_config
    flops = sum(len(e["token_ids"]) * tiny.forward_flops(mc.hf_text_config.to_dict(), (len(e["token_ids"]) - 1) / 2)
                for e in eps)  # every token once: prompts and observations prefilled, replies decoded
    bound = sum(e["roles"].count(ACTION) for e in eps) / (flops / common.matmul_flop_s(mc.dtype))
    recorded = {(i, k): e["token_ids"][a:b] for i, e in enumerate(eps)
                for k, (a, b) in enumerate(engine.reply_spans(e["roles"]))}
    base = res["today"]
    same = sum(base[0][4][key][0] == ids for key, ids in recorded.items())
    print(f"\n{len(eps)} episodes, {len(recorded)} replies, {same} of them reproduced by today's engine | FLOP bound "
          f"{bound:.0f} generated tok/s (every token once, at a 1024² matmul's rate in this process)")
    print(f"{'lever':24} {'tok/s (CPU)':>11} {'ratio':>6} {'of bound':>8} {'replies differing':>18} "
          f"{'log-prob diff max / mean':>25}")
    rate0 = sum(x[0] / x[1] for x in base) / len(base)
    for name, runs in res.items():
        rate = sum(x[0] / x[1] for x in runs) / len(runs)
        a, b = base[0][4], runs[0][4]
        d = [abs(x - y) for k in a if a[k][0] == b[k][0] and b[k][1] for x, y in zip(a[k][1], b[k][1])]
        lp = f"{max(d):.1e} / {sum(d) / len(d):.1e}" if d else "-"
        print(f"{name:24} {rate:11.0f} {rate / rate0:6.2f} {rate / bound:8.0%} "
              f"{sum(a[k][0] != b[k][0] for k in a):>10} of {len(a):<5} {lp:>25}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint (an SFT'd policy: realistic turns)")
    p.add_argument("--tasks", required=True, help="task folders to record in (the corpus's rl/ or eval/)")
    p.add_argument("--record", type=Path, required=True,
                   help="recorded episodes (JSONL): made if missing, then reused")
    p.add_argument("--template", default="scripts/toy_prompt.txt", help="prompt template (ablation.sh's)")
    p.add_argument("--eval", action="store_true", help="record an evaluation's episodes instead of a GRPO draw")
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-tasks", type=int, default=12, help="with --eval: tasks, spread over the folder's order")
    p.add_argument("--attempts", type=int, default=8, help="with --eval: attempts per task")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--levers", default="compiled,no-logprobs,bf16,no-prefix-cache",
                   help=f"of {', '.join(list(LEVERS)[1:])}; a+b: both")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--profile", default="1x200,8x1000,32x200,32x1000", help="SEQSxCONTEXT decode steps to profile")
    args = p.parse_args(argv)
    os.environ.update(engine.IN_PROCESS_ENV)  # the engine in this process, as grpo.py's
    levers = ["today"] + [x for x in args.levers.split(",") if x]
    if unknown := {x for lever in levers for x in lever.split("+")} - set(LEVERS):
        raise ValueError(f"--levers: unknown {', '.join(sorted(unknown))} (known: {', '.join(LEVERS)})")

    tok = load_tokenizer(args.model, "native")
    if not args.record.exists():
        record(args, tok)
    eps = [json.loads(line) for line in open(args.record)]
    with engine.engine_threads():
        engines = {}
        for name in levers:
            kw = {k: v for x in name.split("+") for k, v in LEVERS[x].items()}  # a+b: both levers
            logprobs, grammar = kw.pop("logprobs", True), kw.pop("grammar", None)
            t = time.time()
            llm = engine.make_engine(args.model, max_model_len=args.max_len, max_seqs=args.concurrency,
                                     seed=args.seed, **kw)
            pol = engine.VLLMPolicy(llm, tok, temperature=1.0, max_new_tokens=args.max_new_tokens,
                                    max_len=args.max_len, seed=args.seed, logprobs=logprobs, grammar=grammar)
            replay(llm, pol, eps[:1], 1)  # warm-up: the first steps compile and allocate
            engines[name] = llm, pol
            print(f"engine {name}: started in {time.time() - t:.0f}s", flush=True)
        res = {name: [] for name in levers}
        for r in range(args.rounds):
            for name in levers:  # interleaved: the load on the machine drifts
                llm, pol = engines[name]
                llm.reset_prefix_cache()  # each round from a cold cache, as a rollout after a weight sync
                res[name].append(replay(llm, pol, eps, args.concurrency))
                n, cpu, busy, wall, _ = res[name][-1]
                print(f"round {r + 1} {name:24} {n} tokens | {n / cpu:5.0f} tok/s of engine CPU time | "
                      f"{n / busy:5.0f} over its steps' wall | {n / wall:5.0f} over the replay's wall", flush=True)
        summary(eps, res, engines["today"][0])
        print("\ntoday's decode step, ms: total | attention kernel | matmuls | the rest (scheduler, sampler, Python)")
        for spec in filter(None, args.profile.split(",")):
            seqs, context = map(int, spec.split("x"))
            ms, attn, mm = step_profile(engines["today"][0], seqs, context)
            print(f"  {seqs:3} sequences x {context:5} tokens: {ms:6.1f} | {attn:6.1f} | {mm:6.1f} | "
                  f"{ms - attn - mm:6.1f} | {seqs / ms * 1000:5.0f} tok/s")


if __name__ == "__main__":
    main()
