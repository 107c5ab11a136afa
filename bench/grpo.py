"""
Benchmark of the GRPO rollout stage, ratios measured in one process:

1. generation: the in-process vLLM engine vs Hugging Face `generate` on the same prompts (the toy world's
   first turns), same sampling (T=1, no top-k/top-p), same number of new tokens -> tokens/s ratio;
2. the trainer's speed (forward + backward) before and after the engine starts in the process: on CPU vLLM
   binds threads and replaces torch.set_num_threads;
3. the episode loop: generator idle time with the overlapped loop (an episode's next turn is queued when its
   observation is back) vs lock-step rounds (generate only once every live sandbox has answered), on toy
   tasks in real sandboxes -> idle fractions and wall-time ratio.

    python -m bench.grpo                       # a random 3.5M-param Qwen3 built here (tokenizer trained on toy text)
    python -m bench.grpo --model runs/actobs/final --episodes 16 --concurrency 8
"""
import argparse
import os
import random
import time
from pathlib import Path

import torch

import envs
from actobs import common, engine, taskgen, terminus, tiny
from actobs.labels import ACTION, load_tokenizer
from actobs.tasks import task_from_spec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF checkpoint (default: a random Qwen3, --hidden wide, built in --workdir)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--workdir", default="/tmp/actobs-bench-grpo")
    p.add_argument("--prompts", type=int, default=16, help="prompts for the generation comparison")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--episodes", type=int, default=8, help="toy episodes for the loop comparison (0 = skip it)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=3)
    args = p.parse_args(argv)
    os.environ.update(engine.IN_PROCESS_ENV)  # the engine in this process, as grpo.py's

    rng = random.Random(0)
    specs = [taskgen.generate(kind, rng) for kind in sorted(taskgen.GENERATORS) for _ in range(4)]
    model_dir = args.model
    if model_dir is None:
        model_dir = Path(args.workdir) / f"qwen3-h{args.hidden}-l{args.layers}"
        if not (model_dir / "config.json").exists():
            texts = [terminus.DEFAULT_PROMPT] + [s.instruction + s.solve + s.test for s in specs]
            tiny.build_tiny(model_dir, texts, vocab_size=4096, hidden=args.hidden, layers=args.layers,
                           heads=args.hidden // 64, kv_heads=max(1, args.hidden // 128))
    tok = load_tokenizer(model_dir, "native" if args.model else "prefix")
    model = common.load_model(model_dir, "cpu").eval()
    batch = torch.randint(0, model.config.vocab_size, (4, 512))

    def train_pass_s(n=5):  # median seconds of one forward + backward of a (4, 512) batch
        times = []
        for _ in range(n):
            t = time.time()
            model(input_ids=batch, labels=batch).loss.backward()
            times.append(time.time() - t)
        model.zero_grad(set_to_none=True)
        return sorted(times)[n // 2]

    before, threads = train_pass_s(), torch.get_num_threads()
    llm = engine.make_engine(model_dir, max_model_len=4096, max_seqs=max(args.prompts, args.concurrency))
    after = train_pass_s()
    print(f"model {model_dir} | {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params")
    print(f"trainer fwd+bwd (4 x 512): {before * 1000:.0f} ms before the engine ({threads} threads), "
          f"{after * 1000:.0f} ms after ({torch.get_num_threads()} threads) | ratio {after / before:.2f}")

    # 1. generation: vLLM vs HF generate, same prompts and sampling
    from vllm import SamplingParams
    prompts = [engine.prompt_tokens(tok, [{"role": "user", "content": terminus.fill_prompt(
                   terminus.DEFAULT_PROMPT, s.instruction, "root@box:/app# ")}])[0] for s in specs[: args.prompts]]
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.new_tokens, min_tokens=args.new_tokens,
                            logprobs=0, seed=0)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    t = time.time()
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
    t_vllm = time.time() - t
    n_vllm = sum(len(o.outputs[0].token_ids) for o in outs)
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(q)) + q for q in prompts])  # left padding for generate
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(q) for q in prompts])[:, None]).long()
    t = time.time()
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             pad_token_id=tok.pad_token_id)
    t_hf = time.time() - t
    n_hf = (gen.shape[1] - width) * len(prompts)
    print(f"generation, {len(prompts)} prompts x {args.new_tokens} tokens: vLLM {n_vllm / t_vllm:.0f} tok/s | "
          f"HF generate {n_hf / t_hf:.0f} tok/s | ratio {n_vllm / t_vllm / (n_hf / t_hf):.2f}x")

    # 3. the episode loop: overlapped vs lock-step, same tasks, same engine
    if args.episodes:
        tasks = [task_from_spec(s) for s in specs[: args.episodes]]
        res = {}
        for lockstep in (True, False, True, False):  # interleaved: load on the machine drifts
            st = {}
            policy = engine.VLLMPolicy(llm, tok, temperature=1.0, max_new_tokens=args.new_tokens, max_len=4096,
                                       lockstep=lockstep)
            with engine.engine_threads():
                eps = envs.run_episodes(tasks, policy, max_turns=args.max_turns, concurrency=args.concurrency, stats=st)
            gen_tokens = sum(e.roles.count(ACTION) for e in eps)
            r = res.setdefault(lockstep, [0.0, 0.0, 0.0, 0])
            r[0] += st["wall_s"]
            r[1] += st["idle_s"]
            r[2] += st["policy_s"]
            r[3] += gen_tokens
        for lockstep, (wall, idle, busy, n) in res.items():
            print(f"loop {'lock-step ' if lockstep else 'overlapped'}: wall {wall / 2:.1f}s | "
                  f"generator idle {idle / wall:.0%} | generating {busy / 2:.1f}s | "
                  f"{n / wall:.0f} generated tok/s end to end")
        print(f"overlapped / lock-step: wall {res[False][0] / res[True][0]:.2f}x | idle fraction "
              f"{res[False][1] / res[False][0]:.2f} vs {res[True][1] / res[True][0]:.2f}")


if __name__ == "__main__":
    main()
