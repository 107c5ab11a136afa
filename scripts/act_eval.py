"""
Do the checkpoints act? Sample replies from HF checkpoints on evaluation tasks, through the same episode runner
as data generation and RL (envs.run_episodes, real sandboxes), and report pass@k per model.

    python scripts/act_eval.py --models runs/base/model runs/act/final runs/actobs/final \
        --tasks runs/corpus/eval.jsonl --attempts 16 --temperature 1.0 --out runs/act_eval.json

--tasks: a task-spec JSONL (`envs.py corpus` writes eval.jsonl) or Harbor task folders. Per model and per
group of task kinds (all, the kinds seen in training, each held-out kind): pass@1 and pass@k with the
unbiased estimator 1 - C(n-c, k) / C(n, k) averaged over tasks, mean turns, the share of replies that did not
parse, and how episodes ended (solved, wrong: completed but the verifier says 0, or the runner's failure).
HF sampling on a CPU; evaluate.py does the same with vLLM.
"""
import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, when run as a script

import numpy as np  # noqa: E402
import torch  # noqa: E402

import envs  # noqa: E402
import taskgen  # noqa: E402
from labels import load_tokenizer  # noqa: E402


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", required=True, help="HF checkpoint dirs (with their chat template)")
    p.add_argument("--tasks", nargs="+", required=True, type=Path, help="a task-spec JSONL or Harbor task folders")
    p.add_argument("--attempts", type=int, default=16, help="episodes per task (n of pass@k)")
    p.add_argument("--k", type=int, nargs="+", default=[1, 16], help="pass@k values reported")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (no top-k / top-p)")
    p.add_argument("--max-turns", type=int, default=12)
    p.add_argument("--prompt-template", type=Path, help="the SFT corpus's prompt file ({instruction}, {terminal_state})")
    p.add_argument("--max-new-tokens", type=int, default=512, help="longest reply")
    p.add_argument("--concurrency", type=int, default=48, help="live sandboxes = replies sampled per batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="JSON: per model, the table and per-task successes")
    return p


def pass_at_k(n, c, k):
    """Unbiased pass@k of one task with c successes in n attempts: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def kind_of(task_name):
    return task_name.rsplit("/", 1)[-1].rsplit("-", 1)[0]  # names are (prefix/)kind-digest


def load_tasks(paths):
    if len(paths) == 1 and paths[0].suffix == ".jsonl":
        rows = [json.loads(line) for line in paths[0].read_text().splitlines() if line.strip()]
        return [envs.task_from_spec(taskgen.Spec(**r)) for r in rows]
    return [envs.load_task(p) for p in paths]


def hf_policy(model, tok, temperature, max_new_tokens):
    """policy(list of message lists) -> replies: one left-padded generate call over the batch, pure sampling."""
    im_end = tok.eos_token

    @torch.no_grad()
    def policy(states):
        prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in states]
        enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        ids = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)  # (B, T_prompt + T_new)
        texts = tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
        return [t.split(im_end, 1)[0].replace(tok.pad_token, "") for t in texts]
    return policy


def summarise(episodes, ks, n):
    """The table row of a group of episodes (n attempts per task)."""
    by_task = collections.defaultdict(list)
    for e in episodes:
        by_task[e.task].append(e.reward >= 1.0)
    replies = sum(e.turns for e in episodes)
    parse_errors = sum(m["content"].startswith("Previous response had parsing errors") for e in episodes
                       for m in e.messages if m["role"] == "user")
    ends = collections.Counter("solved" if e.reward >= 1.0 else (e.failure or "wrong") for e in episodes)
    parse_errors += sum(e.failure == "parse_errors" for e in episodes)  # the last bad reply gets no message
    return {"tasks": len(by_task), "episodes": len(episodes),
            **{f"pass@{k}": float(np.mean([pass_at_k(n, sum(s), k) for s in by_task.values()])) for k in ks if k <= n},
            "mean_turns": replies / max(len(episodes), 1), "parse_error_rate": parse_errors / max(replies, 1),
            "ends": dict(ends.most_common())}


def evaluate(model_path, tasks, args):
    from transformers import AutoModelForCausalLM
    tok = load_tokenizer(model_path, "native")  # the checkpoint's own (training) chat template
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    t0 = time.time()
    eps = envs.run_episodes([t for t in tasks for _ in range(args.attempts)],
                            hf_policy(model, tok, args.temperature, args.max_new_tokens),
                            max_turns=args.max_turns, concurrency=args.concurrency,
                            template=envs.load_template(args.prompt_template))
    kinds = sorted({kind_of(e.task) for e in eps})
    groups = {"all": eps, "seen kinds": [e for e in eps if kind_of(e.task) not in taskgen.HELDOUT_KINDS]}
    groups |= {k: [e for e in eps if kind_of(e.task) == k] for k in kinds}
    table = {g: summarise(v, args.k, args.attempts) for g, v in groups.items() if v}
    solved = collections.defaultdict(int)
    for e in eps:
        solved[e.task] += e.reward >= 1.0
    return {"table": table, "solved_per_task": dict(solved), "wall_s": time.time() - t0,
            "example": eps[0].messages if eps else []}


def main(argv=None):
    args = get_parser().parse_args(argv)
    tasks = load_tasks(args.tasks)
    res = {"args": {k: str(v) for k, v in vars(args).items()}}
    for m in args.models:
        r = res[m] = evaluate(m, tasks, args)
        print(f"{m} ({r['wall_s']:.0f}s, T={args.temperature}, n={args.attempts})")
        for g, row in r["table"].items():
            print(f"  {g:14s} | " + " | ".join(f"pass@{k} {row[f'pass@{k}']:.3f}" for k in args.k if k <= args.attempts) +
                  f" | turns {row['mean_turns']:.1f} | parse errors {row['parse_error_rate']:.3f} | {row['ends']}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
