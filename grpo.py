"""
ActObs GRPO: multi-turn RL of a terminal agent with rollouts from a vLLM engine in the same process, in real
Docker sandboxes (envs.py), token-in/token-out, with an optional observation-prediction term (ECHO).

CPU toy run (tasks from `python envs.py corpus --out data/corpus`, an SFT checkpoint from sft.py):
    python grpo.py --init runs/actobs/final --tasks data/corpus/rl --out runs/grpo-actobs \
        --steps 20 --tasks-per-step 4 --group-size 4 --lr 1e-5 --max-len 4096 --max-new-tokens 512
1 GPU, the paper's settings (the flag defaults: lr 1e-6, 135 steps, 32 tasks x 16 episodes, binary reward):
    python grpo.py --init runs/q4b-actobs/final --tasks tasks/rl --out runs/q4b-actobs-grpo
8 GPUs (each rank: its own engine, 4 of the 32 groups; DDP all-reduces the gradients):
    torchrun --standalone --nproc_per_node 8 grpo.py --init runs/q4b-actobs/final --tasks tasks/rl --out ...
Resume an interrupted run: the same command plus --resume.

One step: sample --tasks-per-step tasks, run --group-size episodes of each (all concurrently, up to
--concurrency sandboxes), score them with the task's verifier, and take --ppo-epochs optimizer steps on

    A_i = r_i - mean(r_group)                          (/ (std(r_group) + 1e-6) with --scale-std; population std)
    L   = -sum_{i in ACTION} n_i * w_i * min(rho_i A, clip(rho_i, 1-eps, 1+eps) A)
          + echo * mean_seq[ sum_{i in OBS(seq)} NLL_i / |OBS(seq)| ]  + kl * sum_{i in ACTION} n_i * k3_i

with rho_i = pi(a_i) / pi_behaviour(a_i) (the vLLM log-prob the token was sampled with), all log-probs at the
sampling temperature (logits / T, top-p 1, top-k off); n_i = 1 / (action tokens in the step) for
`--loss-norm token` (default) or 1 / (|ACTION(seq)| * sequences in the step) for `--loss-norm sequence`.
With --tis-cap C, rho_i is taken against the trainer's own log-prob before the step's first update and
w_i = min(pi_old(a_i) / pi_behaviour(a_i), C) corrects the trainer/vLLM mismatch (truncated importance
sampling); without it w_i = 1. Episodes that failed for infrastructure reasons (sandbox or verifier error)
are left out of their group's mean and of the loss. After every optimizer step the weights go into the
engine in place. Memory plan for Qwen3-4B / 8B on 80 GB GPUs: see README ("GRPO").
"""
import argparse
import json
import math
import os
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import envs
import sft
from labels import ACTION, OBS, PROMPT, encode, load_tokenizer, message_spans


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # model and tasks
    p.add_argument("--init", required=True, help="HF checkpoint to start from (an sft.py final/ dir carries its chat template)")
    p.add_argument("--chat-template", default="native", help="'native' (the checkpoint's own), 'prefix', or a .jinja path")
    p.add_argument("--tasks", required=True, help="folder of Harbor task folders (e.g. the toy world's rl/ split)")
    p.add_argument("--prompt-template", help="file with {instruction} and {terminal_state} (default: taskgen's Terminus-2 prompt)")
    # rollouts
    p.add_argument("--tasks-per-step", type=int, default=32, help="groups per step (global, across ranks)")
    p.add_argument("--group-size", type=int, default=16, help="episodes per task per step")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; training log-probs use logits / T")
    p.add_argument("--max-turns", type=int, default=30)
    p.add_argument("--max-new-tokens", type=int, default=4096, help="tokens per reply")
    p.add_argument("--max-len", type=int, default=16384, help="tokens per episode (prompt + replies + observations); longer ones are cut and flagged")
    p.add_argument("--concurrency", type=int, default=64, help="sandboxes live at once per rank")
    # objective
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip epsilon on the importance ratio")
    p.add_argument("--ppo-epochs", type=int, default=1, help="optimizer steps per batch of rollouts (1 = on-policy)")
    p.add_argument("--loss-norm", default="token", choices=["token", "sequence"], help="token: mean over the step's action tokens; sequence: mean over sequences of their token mean")
    p.add_argument("--scale-std", action="store_true", help="divide advantages by the group's std (+1e-6)")
    p.add_argument("--tis-cap", type=float, default=0.0, help="truncated importance weight cap for the trainer/vLLM mismatch (0 = off)")
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL penalty to the initial policy on sampled tokens (0 = off; the KL is logged either way)")
    p.add_argument("--echo-coef", type=float, default=0.0, help="ECHO: weight of the observation NLL of the policy's own rollouts (0.05 in its reference setting)")
    p.add_argument("--echo-payload-only", action="store_true", help="ECHO on the environment's own text only, not the protocol's fixed wrapper text and end-of-turn tokens")
    # optimisation
    p.add_argument("--steps", type=int, default=135)
    p.add_argument("--lr", type=float, default=1e-6, help="constant learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    p.add_argument("--micro-tokens", type=int, default=32768, help="token budget of one micro-batch (padded rows x length)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="autocast and engine dtype; auto = bf16 on CUDA, fp32 on CPU")
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    # engine
    p.add_argument("--gpu-memory", type=float, default=0.35, help="fraction of GPU memory for the vLLM engine (weights + KV cache)")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="vLLM KV cache on CPU (GiB)")
    # run
    p.add_argument("--out", required=True, help="run dir: config.json, log.jsonl, curves.png, step-N/ checkpoints, final/")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--keep", type=int, default=2, help="step checkpoints kept on disk")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    return p


# ----------------------------------------------------------------------------------------------------------
# The engine and token-in/token-out rollouts

def make_engine(model_dir, *, max_model_len, seed=0, dtype="auto", gpu_memory=0.35, kv_cache_gb=2.0):
    """An in-process vLLM engine. logprobs_mode='processed_logprobs': the log-probs it returns are those of the
    distribution actually sampled from (after temperature), which the importance ratio needs. Sleep mode (free
    the engine's GPU memory while training) exists on CUDA only."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # same process: weights can be passed as tensors
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
    from vllm import LLM
    dtype = {"auto": "bfloat16" if cuda else "float32", "bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype)
    kw = dict(enable_sleep_mode=True, gpu_memory_utilization=gpu_memory) if cuda else {}
    return LLM(model=str(model_dir), dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=not cuda,
               logprobs_mode="processed_logprobs", **kw)


def sync_weights(engine, model):
    """Load the trainer's weights into the engine in place, all at once, then drop cached prefixes (their KV was
    computed by the old weights). With tied embeddings lm_head.weight is passed explicitly: the engine keeps a
    separate head and would otherwise silently keep the old one."""
    sd = dict(model.state_dict())
    sd["lm_head.weight"] = model.get_output_embeddings().weight
    dtype = engine.llm_engine.model_config.dtype
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": [(k, v.detach().to(dtype)) for k, v in sd.items()]})
    engine.reset_prefix_cache()


_SKELETON = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def prompt_tokens(tok, messages):
    """(ids, roles) of the first turn as the chat template renders it, ending with the assistant header."""
    ids, _, text, _ = encode(tok, messages)
    ids = list(ids) + _generation_header(tok, messages, text)
    return ids, [PROMPT] * len(ids)


def _generation_header(tok, messages, text):
    full = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not full.startswith(text):
        raise ValueError("the chat template renders a conversation differently once a generation prompt is added")
    return tok(full[len(text):], add_special_tokens=False)["input_ids"]


def observation_tokens(tok, message, closed, wrapper_re=None):
    """(ids, roles, wrapper) the chat template adds after an assistant reply: the reply's end-of-turn token
    unless it was sampled (closed=False: the reply was cut by max_tokens; that token is PROMPT, nothing sampled
    it), the template's text between turns, the observation `message` (its content and end-of-turn token OBS)
    and the next assistant header. The template renders the turn after a one-exchange skeleton: for a
    prefix-preserving template that is exactly the text the whole conversation would add here, and it starts
    right after a special token, so tokenising it alone gives the same tokens as tokenising everything.
    wrapper: per token, True for OBS tokens whose characters all match `wrapper_re` (the protocol's fixed text)
    or are the end-of-turn token."""
    msgs = _SKELETON + [message]
    ids, roles, text, off = encode(tok, msgs)
    spans = message_spans(tok, msgs, text)
    reply = spans[1]
    cut = reply[-1][1] if closed else reply[0][1]  # after the reply's end-of-turn token, or after its content
    k = int(np.searchsorted(off[:, 0], cut))
    if k < len(off) and k > 0 and off[k - 1, 1] > cut:
        raise ValueError("a token straddles the end of the assistant turn: the chat template cannot be used token-in/token-out")
    roles = roles.copy()
    roles[roles == ACTION] = PROMPT  # the unsampled end-of-turn token of a cut reply
    wrap = np.zeros(len(text) + 1, dtype=np.int64)
    (s, e), eot = spans[2][0], spans[2][1:]
    if wrapper_re is not None:
        for m in wrapper_re.finditer(text[s:e]):
            wrap[s + m.start(): s + m.end()] = 1
    for a, b in eot:
        wrap[a:b] = 1
    csum = np.concatenate([[0], np.cumsum(wrap)])
    wrapper = (csum[off[:, 1]] - csum[off[:, 0]] == off[:, 1] - off[:, 0]) & (roles == OBS)
    head = _generation_header(tok, msgs, text)
    return (list(ids[k:]) + head, roles[k:].tolist() + [PROMPT] * len(head),
            wrapper[k:].tolist() + [False] * len(head))


class VLLMPolicy:
    """run_episodes' policy protocol on an in-process vLLM engine: each episode keeps one append-only token
    sequence (prompt, sampled ids exactly as returned, observation turns as the template renders them) in its
    Episode (token_ids, roles, logprobs, obs_wrapper, truncated). A turn is queued with add_request the moment
    its observation is back; poll() runs one engine step (one decoding iteration of every running request).
    lockstep=True waits for all live sandboxes before generating (the benchmark's baseline)."""

    def __init__(self, engine, tok, *, temperature, max_new_tokens, max_len, seed=0, lockstep=False, wrapper_re=None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        self.engine, self.tok, self.max_new_tokens, self.max_len, self.seed = engine, tok, max_new_tokens, max_len, seed
        self.lockstep, self.wrapper_re = lockstep, wrapper_re
        # top_p 1 and top_k 0 (off): the ratio's denominator is the full softmax at T; a model's generation
        # config (Qwen3: top_k 20) must not apply. logprobs=0: the sampled token's own log-prob.
        self.params = dict(temperature=temperature, top_p=1.0, top_k=0, logprobs=0, detokenize=False,
                           output_kind=RequestOutputKind.FINAL_ONLY)
        self.SamplingParams = SamplingParams
        self.requests, self.eps, self.closed, self.ready = {}, {}, {}, []

    def submit(self, key, ep):
        if not ep.token_ids:
            ids, roles = prompt_tokens(self.tok, ep.messages[:1])
            wrapper = [False] * len(ids)
        else:
            ids, roles, wrapper = observation_tokens(self.tok, ep.messages[-1], self.closed[key], self.wrapper_re)
        ep.token_ids += ids
        ep.roles += roles
        ep.obs_wrapper += wrapper
        ep.logprobs += [0.0] * len(ids)
        room = self.max_len - len(ep.token_ids)
        if room < 1:  # no room for a reply: cut at max_len and end the episode
            for field in ("token_ids", "roles", "obs_wrapper", "logprobs"):
                del getattr(ep, field)[self.max_len:]
            ep.truncated = True
            self.ready.append((key, None))
            return
        turn = sum(m["role"] == "assistant" for m in ep.messages)
        params = self.SamplingParams(max_tokens=min(self.max_new_tokens, room), **self.params,
                                     seed=(self.seed * 1_000_003 + key * 1009 + turn) % 2**31)  # reproducible per turn
        rid = f"{key}-{turn}"
        self.requests[rid], self.eps[key] = key, ep
        self.engine.llm_engine.add_request(rid, {"prompt_token_ids": list(ep.token_ids)}, params)

    def pending(self):
        return len(self.requests) + len(self.ready)

    def poll(self):
        out, self.ready = self.ready, []
        if not self.requests:
            return out
        for o in self.engine.llm_engine.step():
            if not o.finished:
                continue
            key = self.requests.pop(o.request_id)
            ep, c = self.eps[key], o.outputs[0]
            ids = list(c.token_ids)
            ep.token_ids += ids
            ep.roles += [ACTION] * len(ids)
            ep.obs_wrapper += [False] * len(ids)
            ep.logprobs += [d[t].logprob for d, t in zip(c.logprobs, ids)]
            self.closed[key] = c.finish_reason == "stop"  # ended with its end-of-turn (a stop token), included in ids
            reply = self.tok.decode(ids[:-1] if self.closed[key] else ids)
            if c.finish_reason == "length" and len(ep.token_ids) >= self.max_len:
                ep.truncated = True  # the episode's context is full
                out.append((key, None))
            else:
                out.append((key, reply))
        return out

    def abort(self):
        if self.requests:
            self.engine.llm_engine.abort_request(list(self.requests))
        self.requests, self.ready = {}, []


def rollout(engine, tokenizer, tasks, *, temperature, max_turns, max_new_tokens, max_len, concurrency, template=None,
            seed=0, on_episode=None, stats=None, lockstep=False, wrapper_re=None):
    """One episode per entry of `tasks` (repeat a task for several attempts) with the engine's current weights.
    Episodes come back in the order of `tasks`, with reward, turns, failure, timings, and the token sequence
    (token_ids, roles, logprobs, obs_wrapper, truncated). on_episode(i, episode) is called as each ends.
    stats (a dict) receives the generator's wall / busy / idle seconds."""
    policy = VLLMPolicy(engine, tokenizer, temperature=temperature, max_new_tokens=max_new_tokens, max_len=max_len,
                        seed=seed, lockstep=lockstep, wrapper_re=wrapper_re)
    return envs.run_episodes(tasks, policy, max_turns=max_turns, concurrency=concurrency, template=template,
                             on_episode=on_episode, stats=stats)
