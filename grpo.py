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
Resume an interrupted run: the same command plus --resume. Several runs in one process, the imports paid once
(common.run_cli): `python grpo.py ARGS ::: ARGS ...`.

One step: sample --tasks-per-step tasks, run --group-size episodes of each (all concurrently, up to
--concurrency sandboxes), score them with the task's verifier, and take --ppo-epochs optimizer steps on

    A_i = r_i - mean(r_group)                          (/ (std(r_group) + 1e-6) with --scale-std; population std)
    L   = -sum_{i in ACTION} n_i * w_i * min(rho_i A, clip(rho_i, 1-eps_low, 1+eps_high) A)
          + echo * mean_seq[ sum_{i in OBS(seq)} NLL_i / |OBS(seq)| ]  + kl * sum_{i in ACTION} n_i * k3_i

with rho_i = pi(a_i) / pi_behaviour(a_i) (the vLLM log-prob the token was sampled with), all log-probs at the
sampling temperature (logits / T, top-p 1, top-k off); eps_low = eps_high = --clip unless --clip-low /
--clip-high say otherwise (DAPO's clip-higher); n_i = 1 / (action tokens in the step) for `--loss-norm token`
(default), 1 / (|ACTION(seq)| * sequences in the step) for `sequence`, or Dr. GRPO's constant
1 / (--max-len * sequences in the step) for `constant`. k3_i = e^(ref_i - logp_i) - (ref_i - logp_i) - 1 with
ref the initial policy's log-prob. With --tis-cap C, rho_i is taken against the trainer's own log-prob before
the step's first update and w_i = min(pi_old(a_i) / pi_behaviour(a_i), C) corrects the trainer/vLLM mismatch
(truncated importance sampling); without it w_i = 1. Episodes that failed for infrastructure reasons
(envs.INFRA_FAILURES) are left out of their group's mean and of the loss; the normalisers count every other
episode, those of groups without signal included (with no KL and no ECHO term those are not forwarded: their
loss is 0; a step where nothing is left makes no optimizer step). --dynamic-sampling drops groups without
signal and draws more (DAPO). An episode cut at --max-len (rollout/truncated) keeps the reward the verifier
gives the sandbox as it stands, is masked out of the loss, or is penalised (--overlong). After every optimizer
step the weights go into the engine in place. Each episode's token sequence is exactly what the policy saw and sampled (token-in/token-out):
observation turns are tokenised as the chat template renders them, never the history re-tokenised.

GPU memory plan (80 GB GPUs, bf16 autocast over fp32 master weights; per GPU): Qwen3-4B with --fsdp on 8 GPUs:
weights + grads + AdamW = 16 B/param, sharded: 8 GB; the initial policy for the KL, a bf16 copy: 8 GB; the
engine, --gpu-memory 0.35: 28 GB (8 GB weights, the rest KV cache), asleep while training (weights to host
memory, KV cache freed); activations with --grad-ckpt and --micro-tokens 16384: ~10 GB. Qwen3-8B, same
layout: 16 + 16 GB, engine 0.4 (16 GB weights + 16 GB KV cache), --micro-tokens 8192. Weight sync gathers
one tensor at a time. DDP (no --fsdp) keeps the full 16 B/param per GPU: models up to ~1.5B.
"""
import argparse
import gc
import json
import os
import shutil
import signal
import sys
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import common
import envs
import terminus
from labels import (ACTION, OBS, PROMPT, defuse_specials, encode, encode_spans, generation_prompt, load_tokenizer,
                    wrapper_mask)


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # model and tasks
    p.add_argument("--init", required=True, help="HF checkpoint to start from (an sft.py final/ dir carries its chat template)")
    p.add_argument("--chat-template", default="native", help="'native' (the checkpoint's own), 'prefix', or a .jinja path")
    p.add_argument("--tasks", required=True, help="folder of Harbor task folders (e.g. the toy world's rl/ split)")
    p.add_argument("--kinds", type=lambda v: v.split(","), metavar="KIND,...", help="train only on the tasks of "
                   "these kinds (task.toml's [metadata] kind), e.g. the ones the policy solves sometimes")
    p.add_argument("--prompt-template", help="file with {instruction} and {terminal_state} (default: terminus.DEFAULT_PROMPT)")
    # rollouts
    p.add_argument("--tasks-per-step", type=int, default=32, help="groups per step (global, across ranks)")
    p.add_argument("--group-size", type=int, default=16, help="episodes per task per step")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; training log-probs use logits / T")
    p.add_argument("--max-turns", type=int, default=30)
    p.add_argument("--max-new-tokens", type=int, default=4096, help="tokens per reply")
    p.add_argument("--max-len", type=int, default=16384, help="tokens per episode (prompt + replies + observations); longer ones are cut and flagged")
    p.add_argument("--concurrency", type=int, default=64, help="sandboxes live at once per rank")
    p.add_argument("--network", metavar="MODE", help="Docker network for tasks that allow the internet (task.toml allow_internet): bridge, host or a network's name (see evaluate.py --network); default: none for any task")
    # objective
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip epsilon on the importance ratio (both sides)")
    p.add_argument("--clip-low", type=float, help="lower clip epsilon: the ratio is clipped to [1 - clip-low, 1 + clip-high] (default --clip)")
    p.add_argument("--clip-high", type=float, help="upper clip epsilon (default --clip); DAPO's clip-higher: --clip-low 0.2 --clip-high 0.28")
    p.add_argument("--ppo-epochs", type=int, default=1, help="optimizer steps per batch of rollouts (1 = on-policy)")
    p.add_argument("--loss-norm", default="token", choices=["token", "sequence", "constant"], help="token: mean over the step's action tokens; sequence: mean over sequences of their token mean; constant: Dr. GRPO's sum over each sequence's action tokens / --max-len, mean over sequences")
    p.add_argument("--scale-std", action="store_true", help="divide advantages by the group's std (+1e-6)")
    p.add_argument("--dynamic-sampling", type=int, default=0, metavar="MAX_GROUPS", help="drop groups without signal and draw more, --tasks-per-step groups at a time, until --tasks-per-step groups have signal or MAX_GROUPS groups were drawn (a multiple of --tasks-per-step; 0 = off: every drawn group trains)")
    p.add_argument("--overlong", default="keep", choices=["keep", "mask", "penalty"], help="episodes cut at --max-len: keep (the verifier's reward), mask (in their group's statistics, out of the loss), penalty (reward - --overlong-penalty)")
    p.add_argument("--overlong-penalty", type=float, default=1.0, help="what --overlong penalty subtracts from a cut episode's reward")
    p.add_argument("--tis-cap", type=float, default=0.0, help="truncated importance weight cap for the trainer/vLLM mismatch (0 = off)")
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL penalty to the initial policy on sampled tokens (0 = off; the KL is logged either way)")
    p.add_argument("--echo-coef", type=float, default=0.0, help="ECHO: weight of the observation NLL of the policy's own rollouts (0.05 in its reference setting)")
    p.add_argument("--echo-payload-only", action="store_true", help="ECHO on the environment's own text only, not the protocol's fixed wrapper text and end-of-turn tokens")
    # optimisation
    p.add_argument("--steps", type=int, default=135)
    p.add_argument("--lr", type=float, default=1e-6, help="constant learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0)
    # PyTorch's AdamW defaults, now explicit: what every GRPO run so far trained with
    p.add_argument("--adam-betas", type=float, nargs=2, default=[0.9, 0.999], metavar=("B1", "B2"), help="AdamW betas")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    p.add_argument("--micro-tokens", type=int, default=32768, help="token budget of one micro-batch (padded rows x length)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="autocast and engine dtype; auto = bf16 on CUDA, fp32 on CPU")
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="shard weights, grads and Adam state with FSDP2 instead of DDP under torchrun")
    p.add_argument("--seed", type=int, default=0)
    # engine
    p.add_argument("--gpu-memory", type=float, default=0.35, help="fraction of GPU memory for the vLLM engine (weights + KV cache)")
    p.add_argument("--kv-cache-gb", type=float, help="vLLM KV cache on CPU (GiB); default: room for --concurrency sequences of --max-len tokens")
    # run
    p.add_argument("--out", required=True, help="run dir: config.json, log.jsonl, curves.png, step-N/ checkpoints, final/")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--keep", type=int, default=2, help="step checkpoints kept on disk")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    p.add_argument("--wandb", metavar="PROJECT", help="also log every log.jsonl row to this Weights & Biases project (pip install wandb; offline under OUT/wandb/ when W&B is unreachable)")
    return p


# ----------------------------------------------------------------------------------------------------------
# The engine and token-in/token-out rollouts

def kv_cache_bytes(config, *, max_model_len, max_seqs, dtype_bytes):
    """CPU KV cache (bytes) that holds max_seqs sequences of max_model_len tokens: K and V of every layer's
    key/value heads, per token, plus a 256-token margin per sequence for its last partly filled block. Sized to
    the need, not a fixed GiB: the engine allocates and touches all of it at start, which took 10-16 s for 2 GiB
    on a loaded 2-core machine against the ~2 MB a toy evaluation uses."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes
    return max_seqs * (max_model_len + 256) * per_token


def make_engine(model_dir, *, max_model_len, max_seqs, seed=0, dtype="auto", gpu_memory=0.35, kv_cache_gb=None):
    """An in-process vLLM engine for up to max_seqs sequences at once. logprobs_mode='processed_logprobs': the
    log-probs it returns are those of the distribution actually sampled from (after temperature), which the
    importance ratio needs. Sleep mode (free the engine's GPU memory while training) exists on CUDA only. On CPU
    the KV cache is kv_cache_gb, or by default what max_seqs sequences of max_model_len tokens need."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # same process: weights can be passed as tensors
    cuda = torch.cuda.is_available()
    from vllm import LLM
    dtype = {"auto": "bfloat16" if cuda else "float32", "bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype)
    # On CPU a prefill is scheduled whole: one split across steps makes the engine rewind the request's seeded
    # generator, which a CPU generator cannot do (RuntimeError: CPU Generator does not use offset), and
    # VLLMPolicy seeds every turn. A step then takes whole prompts up to the budget (4096, vLLM's CPU default, or
    # a whole context when that is longer).
    if cuda:
        kw = dict(enable_sleep_mode=True, gpu_memory_utilization=gpu_memory)
    else:
        from transformers import AutoConfig
        kv = (int(kv_cache_gb * 2 ** 30) if kv_cache_gb else
              kv_cache_bytes(AutoConfig.from_pretrained(model_dir).get_text_config(), max_model_len=max_model_len,
                             max_seqs=max_seqs, dtype_bytes=getattr(torch, dtype).itemsize))
        kw = dict(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096),
                  kv_cache_memory_bytes=kv)
    return LLM(model=str(model_dir), dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=not cuda,
               logprobs_mode="processed_logprobs", **kw)


def sync_weights(engine, model):
    """Load the trainer's weights into the engine in place, all at once, then drop cached prefixes (their KV was
    computed by the old weights). With tied embeddings lm_head.weight must be among them: the engine keeps a
    separate head and would otherwise silently keep the old one. Under FSDP2 each rank gathers the full
    tensors for its own engine one at a time, so the transient memory is one tensor, not the model."""
    dtype = engine.llm_engine.model_config.dtype
    sd = model.state_dict()
    if model.config.tie_word_embeddings and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]

    def weights():  # consumed in order by the engine; FSDP2's gathers happen in the same order on every rank
        for k, v in sd.items():
            yield k, (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().to(dtype)

    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
    engine.reset_prefix_cache()


_SKELETON = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def prompt_tokens(tok, messages):
    """(ids, roles) of the first turn as the chat template renders it, ending with the assistant header."""
    ids = encode(tok, messages)[0]
    ids = list(ids) + tok(generation_prompt(tok, messages), add_special_tokens=False)["input_ids"]
    return ids, [PROMPT] * len(ids)


def observation_tokens(tok, message, closed):
    """(ids, roles, wrapper) the chat template adds after an assistant reply: the reply's end-of-turn token
    unless it was sampled (closed=False: the reply was cut by max_tokens; that token is PROMPT, nothing sampled
    it), the template's text between turns, the observation `message` (its content and end-of-turn token OBS)
    and the next assistant header. The template renders the turn after a one-exchange skeleton: for a
    prefix-preserving template that is exactly the text the whole conversation would add here, and it starts
    right after a special token, so tokenising it alone gives the same tokens as tokenising everything.
    wrapper: per token, True for OBS tokens that are all the protocol's fixed text (terminus.wrapper_spans)
    or the end-of-turn token."""
    msgs = _SKELETON + [message]
    ids, roles, text, off, spans = encode_spans(tok, msgs)
    k = int(np.searchsorted(off[:, 0], spans[1][-1][1]))  # the first token after the reply's end-of-turn token
    if k == 0 or (k < len(off) and off[k - 1, 1] > spans[1][-1][1]):
        raise ValueError("a token straddles the end of the assistant turn: the chat template cannot be used token-in/token-out")
    if not closed:
        k -= 1  # the end-of-turn token, which the cut reply lacks
    roles = roles.copy()
    roles[roles == ACTION] = PROMPT  # the unsampled end-of-turn token of a cut reply
    wrapper = wrapper_mask(msgs, roles, text, off, spans)
    head = tok(generation_prompt(tok, msgs), add_special_tokens=False)["input_ids"]
    return (list(ids[k:]) + head, roles[k:].tolist() + [PROMPT] * len(head),
            wrapper[k:].tolist() + [False] * len(head))


class VLLMPolicy:
    """run_episodes' policy protocol on an in-process vLLM engine: each episode keeps one append-only token
    sequence (prompt, sampled ids exactly as returned, observation turns as the template renders them) in its
    Episode (token_ids, roles, logprobs, obs_wrapper, truncated). A turn is queued with add_request the moment
    its observation is back; poll() runs one engine step (one decoding iteration of every running request).
    lockstep=True is the benchmark's baseline: rounds of generating every live episode's turn to the end, then
    stepping all their sandboxes."""

    def __init__(self, engine, tok, *, temperature, max_new_tokens, max_len, seed=0, lockstep=False):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        self.engine, self.tok, self.max_new_tokens, self.max_len, self.seed = engine, tok, max_new_tokens, max_len, seed
        self.lockstep = lockstep
        # top_p 1 and top_k 0 (off): the ratio's denominator is the full softmax at T; a model's generation
        # config (Qwen3: top_k 20) must not apply. logprobs=0: the sampled token's own log-prob.
        self.params = dict(temperature=temperature, top_p=1.0, top_k=0, logprobs=0, detokenize=False,
                           output_kind=RequestOutputKind.FINAL_ONLY)
        self.SamplingParams = SamplingParams
        self.requests, self.eps, self.closed, self.ready = {}, {}, {}, []

    def submit(self, key, ep):
        # the environment's text may hold a special token's string (`echo '<|im_end|>'`): defused in the
        # episode's messages before they are rendered, so messages and tokens agree
        ep.messages[-1]["content"] = defuse_specials(self.tok, ep.messages[-1]["content"])
        if not ep.token_ids:
            ids, roles = prompt_tokens(self.tok, ep.messages[:1])
            wrapper = [False] * len(ids)
        else:
            ids, roles, wrapper = observation_tokens(self.tok, ep.messages[-1], self.closed[key])
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
        outputs = self.engine.llm_engine.step()
        while self.lockstep and len(outputs) < len(self.requests):  # a round: every queued turn, then the sandboxes
            outputs += self.engine.llm_engine.step()
        for o in outputs:
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
            seed=0, on_episode=None, stats=None, lockstep=False, network=None, keep_agent=False, second_try=False,
            strict=True):
    """One episode per entry of `tasks` (repeat a task for several attempts) with the engine's current weights.
    Episodes come back in the order of `tasks`, with reward, turns, failure, timings, and the token sequence
    (token_ids, roles, logprobs, obs_wrapper, truncated). on_episode(i, episode) is called as each ends.
    stats (a dict) receives the generator's wall / busy / idle seconds. network, keep_agent, second_try, strict:
    as envs.run_episodes (evaluate.py's options; training uses only network, and strict verification)."""
    policy = VLLMPolicy(engine, tokenizer, temperature=temperature, max_new_tokens=max_new_tokens, max_len=max_len,
                        seed=seed, lockstep=lockstep)
    with engine_threads():
        return envs.run_episodes(tasks, policy, max_turns=max_turns, concurrency=concurrency, template=template,
                                 on_episode=on_episode, stats=stats, network=network, keep_agent=keep_agent,
                                 second_try=second_try, strict=strict)


@contextmanager
def engine_threads():
    """The CPU engine serves with one intra-op thread, as vLLM means to (vllm.utils.torch_utils: a multi-threaded
    op leaves its threads spin-waiting, taking the cores the sandboxes and the step's serial code need; measured
    0.33-0.47x the wall of an evaluation at two threads). vLLM's own call is lost in process, where its CPU worker
    has already made torch.set_num_threads a no-op: torch._C's is the same function, untouched. The caller's
    threads (the trainer's) come back after. On CUDA nothing changes."""
    threads = torch.get_num_threads()
    if not torch.cuda.is_available():
        torch._C.set_num_threads(1)
    try:
        yield
    finally:
        torch._C.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------------
# The objective

def group_advantages(rewards, valid=None, scale_std=False, eps=1e-6):
    """rewards (G, S) -> (advantages (G, S), signal (G,) bool). A = r - mean of the group's valid episodes; with
    scale_std, / (std + eps), std being the population std (ddof 0) of those valid rewards. Invalid episodes
    (infrastructure failures) get 0 and stay out of the statistics; a group whose valid rewards are all equal,
    or with fewer than two valid episodes, has no signal: all its advantages are 0."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    n = valid.sum(1, keepdim=True).clamp(min=1)  # (G, 1)
    mean = (rewards * valid).sum(1, keepdim=True) / n
    dev = (rewards - mean) * valid  # (G, S)
    std = (dev.pow(2).sum(1, keepdim=True) / n).sqrt()
    has_signal = (std.squeeze(1) > 0) & (valid.sum(1) >= 2)  # (G,)
    adv = dev / (std + eps) if scale_std else dev
    return adv * has_signal[:, None], has_signal


def collate(examples, pad_id):
    """Episodes (dicts of per-token lists: ids, roles, adv, behav, wrapper, [old, ref]) -> right-padded (B, T)
    tensors (PROMPT on padding, so padding never carries loss)."""
    out = common.collate([(e["ids"], e["roles"]) for e in examples], pad_id)  # input_ids, roles, attention_mask
    B, T = out["input_ids"].shape
    out["wrapper"] = torch.zeros((B, T), dtype=torch.bool)
    for key in ("adv", "behav", "old", "ref"):
        if key in examples[0]:
            out[key] = torch.zeros((B, T), dtype=torch.float32)
    for b, e in enumerate(examples):
        n = len(e["ids"])
        out["wrapper"][b, :n] = torch.as_tensor(e["wrapper"], dtype=torch.bool)
        for key in ("adv", "behav", "old", "ref"):
            if key in e:
                out[key][b, :n] = torch.as_tensor(e[key], dtype=torch.float32)
    return out


def echo_mask(roles, wrapper, payload_only):
    """roles, wrapper (..., T) -> (..., T-1) bool: the positions whose next token carries the ECHO loss, OBS
    tokens (only the environment's own text when payload_only)."""
    m = roles[..., 1:] == OBS
    return m & ~wrapper[..., 1:] if payload_only else m


def selected_rows(model, batch, temperature, echo):
    """Hidden states of the positions that carry loss: those predicting ACTION tokens (scaled by 1/T, so the head
    gives logits / T) and, when echo, OBS tokens (at T = 1: the model's own prediction of the environment).
    -> (rows (N, H), targets (N,), is_act (N,), row (N,) sequence index, sel (B, T-1))."""
    ids, roles = batch["input_ids"], batch["roles"]  # (B, T)
    hidden = model.base_model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).last_hidden_state  # (B, T, H)
    is_act = roles[:, 1:] == ACTION  # (B, T-1): the role of the token each position predicts
    sel = is_act | (roles[:, 1:] == OBS) & echo
    h, act = hidden[:, :-1][sel], is_act[sel]  # (N, H), (N,)
    scale = torch.where(act, 1.0 / temperature, 1.0).to(h.dtype)
    row = torch.arange(len(ids), device=ids.device)[:, None].expand_as(sel)[sel]
    return h * scale[:, None], ids[:, 1:][sel], act, row, sel


def clip_range(args):
    """-> (1 - eps_low, 1 + eps_high): the interval the importance ratio is clipped to."""
    low = args.clip if args.clip_low is None else args.clip_low
    high = args.clip if args.clip_high is None else args.clip_high
    return 1 - low, 1 + high


def pg_loss(model, batch, args, n_tok, n_seq, n_echo):
    """-> (this micro-batch's part of the step's loss, stats of sums): the objective of the module docstring,
    written on the per-token log-probs of common.token_logprobs (the chunked head, differentiable: the (N, V)
    logits never exist) and left to autograd. n_tok, n_seq, n_echo: the step's action tokens, sequences with
    action tokens and sequences with ECHO tokens, over all micro-batches and ranks (the normalisers)."""
    echo = echo_mask(batch["roles"], batch["wrapper"], args.echo_payload_only) & (args.echo_coef > 0)  # (B, T-1)
    h, targets, act, row, sel = selected_rows(model, batch, args.temperature, echo)
    logp_all, ent = common.token_logprobs(h, model.get_output_embeddings().weight, targets, entropy=True)  # (N,), (N,)
    logp, obs_logp = logp_all[act], logp_all[~act]  # (n_act,) at T, (n_obs,) at T = 1
    a_row, o_row = row[act], row[~act]

    def at_act(key):  # a (B, T) per-token field at the action positions, (n_act,)
        return batch[key][:, 1:][sel][act]
    adv, behav = at_act("adv"), at_act("behav")
    lp = logp.detach()
    old = at_act("old") if "old" in batch else lp  # the trainer before this step's first update
    if args.loss_norm == "token":
        norm = torch.full_like(lp, 1.0 / n_tok)
    elif args.loss_norm == "sequence":
        norm = 1.0 / (torch.bincount(a_row, minlength=len(sel)).float()[a_row] * n_seq)
    else:  # constant (Dr. GRPO): every action token weighs the same, however long its sequence
        norm = torch.full_like(lp, 1.0 / (args.max_len * n_seq))
    if args.tis_cap > 0:
        ratio, w_is = (logp - old).exp(), (old - behav).exp().clamp(max=args.tis_cap)
    else:
        ratio, w_is = (logp - behav).exp(), torch.ones_like(lp)
    unclipped, clipped = ratio * adv, ratio.clamp(*clip_range(args)) * adv
    pg = -(norm * w_is * torch.minimum(unclipped, clipped)).sum()
    d_ref = at_act("ref") - logp if "ref" in batch else torch.zeros_like(logp)  # log pi_init - log pi
    k3 = d_ref.exp() - d_ref - 1
    kl_pen = args.kl_coef * (norm * k3).sum()
    n_obs_row = torch.bincount(o_row, minlength=len(sel)).float()  # (B,)
    echo_term = (args.echo_coef / (n_obs_row[o_row] * max(n_echo, 1)) * -obs_logp).sum()
    loss = pg + kl_pen + echo_term
    flows = (unclipped <= clipped).detach()  # the min takes the unclipped branch: the gradient flows through the ratio
    stats = {"loss": loss.item(), "pg_loss": pg.item(), "echo_loss": echo_term.item(), "act_tokens": len(lp),
             "entropy_sum": float(ent[act].sum()), "kl_init_sum": float(-d_ref.detach().sum()),
             "kl_init_k3_sum": float(k3.detach().sum()), "mismatch_sum": float((behav - old).sum()),
             "mismatch_abs_sum": float((behav - old).abs().sum()), "clipped_sum": float((~flows & (adv != 0)).sum()),
             "tis_w_sum": float(w_is.sum()), "obs_tokens": len(obs_logp), "obs_nll_sum": float(-obs_logp.detach().sum())}
    return loss, stats


class PGModule(torch.nn.Module):
    """pg_loss as a module forward, so DDP / FSDP2 hooks see the whole computation."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, batch, args, n_tok, n_seq, n_echo):
        return pg_loss(self.lm, batch, args, n_tok, n_seq, n_echo)


@torch.no_grad()
def score(model, examples, args, pad_id, device, ctx):
    """Per-token log-probs (at T) of each example's tokens under `model` (a list per example, 0 where a token
    is not an action), e.g. the initial policy for the KL, or the trainer before a multi-epoch step."""
    out = []
    for g in common.micro_batches([len(e["ids"]) for e in examples], args.micro_tokens):
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in g], pad_id).items()}
        with ctx:
            h, targets, act, row, sel = selected_rows(model, batch, args.temperature, torch.zeros_like(batch["wrapper"][:, 1:]))
            logp, _ = common.token_logprobs(h, model.get_output_embeddings().weight, targets)
        full = torch.zeros(sel.shape, dtype=torch.float32, device=device)
        full[sel] = logp
        for j, i in enumerate(g):
            out.append((i, [0.0] + full[j, : len(examples[i]["ids"]) - 1].tolist()))
    return [lp for _, lp in sorted(out)]


# ----------------------------------------------------------------------------------------------------------
# The run

# flags that fix the task set, the objective and the schedule: a resumed run must keep them
RESUME_KEYS = ("init", "chat_template", "tasks", "kinds", "prompt_template", "tasks_per_step", "group_size", "temperature",
               "max_turns", "max_new_tokens", "max_len", "clip", "clip_low", "clip_high", "ppo_epochs", "loss_norm",
               "scale_std", "dynamic_sampling", "overlong", "overlong_penalty", "tis_cap", "kl_coef", "echo_coef",
               "echo_payload_only", "steps", "lr", "weight_decay", "adam_betas", "adam_eps", "grad_clip", "seed", "network")


def load_tasks(path, kinds=None):
    """Every Harbor task folder (with a task.toml) under `path`, images built (cached), sorted by folder name;
    with kinds, only the tasks whose [metadata] kind is one of them."""
    dirs = sorted(p.parent for p in Path(path).glob("*/task.toml"))
    if not dirs:
        raise ValueError(f"{path}: no task folders (*/task.toml); write the toy world's with `python envs.py corpus --out DIR` (DIR/rl)")
    if kinds:
        found = {d: envs.load_task(d, build=False).kind for d in dirs}
        dirs = [d for d in dirs if found[d] in kinds]
        if not dirs:
            raise ValueError(f"{path}: no task of the kinds {', '.join(kinds)} (--kinds); its kinds are "
                             f"{', '.join(sorted({str(k) for k in found.values()}))}")
    return [envs.load_task(d) for d in dirs]


def step_groups(n_tasks, tasks_per_step, step, seed, draw=0):
    """Task indices of one draw of a step: without replacement within a draw, seeded by (seed, step) for the
    first draw and (seed, step, draw) for dynamic sampling's further ones, so a resumed run draws the same."""
    rng = np.random.default_rng([seed, step] + ([draw] if draw else []))
    return rng.choice(n_tasks, tasks_per_step, replace=tasks_per_step > n_tasks).tolist()


def step_seed(seed, step, rank, draw=0):
    """The sampling seed of one rank's rollouts in one draw of a step (each turn's seed derives from it): a
    function of (seed, step, rank, draw) alone, so a resumed run samples as the uninterrupted one would, and no
    RNG state needs saving. The first draw's is that of a run without dynamic sampling."""
    return (seed * 100_003 + step) * 64 + rank + (draw << 40)


def token_advantages(episode, adv):
    """The advantage of each of an episode's tokens (a list, one per token; the loss reads it at the action
    tokens) from its group-relative advantage `adv`: GRPO's outcome reward gives every token the same. A
    per-turn or per-token advantage (turn rewards, a value model) is a change to this function alone."""
    return [adv] * len(episode.token_ids)


def group_examples(episodes, group_size, args):
    """Episodes of consecutive groups (group_size each) -> (training examples per group, has_signal (G,) bool,
    valid (G, S) bool). An example holds an episode's per-token lists (ids, roles, behav: the vLLM log-probs,
    wrapper, adv: token_advantages). Infrastructure failures are not valid: out of their group's statistics
    and of the loss. An episode cut at --max-len keeps the verifier's reward (--overlong keep), stays in its group's
    statistics without a loss (mask), or has --overlong-penalty taken off its reward (penalty)."""
    cut = torch.tensor([e.truncated for e in episodes]).view(-1, group_size)  # (G, S)
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32).view(-1, group_size)
    if args.overlong == "penalty":
        rewards = rewards - args.overlong_penalty * cut
    valid = torch.tensor([not infra_failure(e) for e in episodes]).view(-1, group_size)
    adv, has_signal = group_advantages(rewards, valid, args.scale_std)
    trains = valid & ~cut if args.overlong == "mask" else valid
    groups = [[] for _ in range(len(rewards))]
    for i, e in enumerate(episodes):
        g, j = divmod(i, group_size)
        if trains[g, j] and ACTION in e.roles:
            groups[g].append({"ids": e.token_ids, "roles": e.roles, "behav": e.logprobs, "wrapper": e.obs_wrapper,
                              "adv": token_advantages(e, float(adv[g, j]))})
    return groups, has_signal, valid


def keep_signal_groups(has_signal, room, rank, device):
    """Dynamic sampling's choice in one draw: -> (indices of this rank's groups kept, groups kept over all
    ranks). Groups with signal are kept in rank order until `room` are, so the step gets exactly as many as it
    lacks, whichever ranks hold them."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = int(has_signal.sum())
    counts = common.all_reduce([mine if r == rank else 0 for r in range(world)], device)  # (world,)
    take = max(0, min(mine, room - int(sum(counts[:rank]))))
    return has_signal.nonzero().flatten().tolist()[:take], min(int(sum(counts)), room)


def sample_step(draw_episodes, n_tasks, args, step, rank, device):
    """One step's episodes and training examples. draw_episodes(draw, task indices) -> the episodes of those
    tasks' groups (group_size each, in order) on this rank. One draw of --tasks-per-step groups, split over the
    ranks; with --dynamic-sampling, groups without signal are dropped and further draws (new tasks, seeded by the
    draw) fill the step until --tasks-per-step groups have signal or the cap is drawn. -> (episodes of every
    draw, valid (G, S), has_signal (G,) over every drawn group, this rank's examples)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_rank = args.tasks_per_step // world
    episodes, valid, has_signal, examples, kept = [], [], [], [], 0
    for draw in range(max(args.dynamic_sampling // args.tasks_per_step, 1)):
        groups = step_groups(n_tasks, args.tasks_per_step, step, args.seed, draw)[rank * per_rank: (rank + 1) * per_rank]
        eps = draw_episodes(draw, groups)
        ex_groups, sig, ok = group_examples(eps, args.group_size, args)
        episodes, valid, has_signal = episodes + eps, valid + [ok], has_signal + [sig]
        if not args.dynamic_sampling:
            examples = [ex for g in ex_groups for ex in g]
            break
        keep, n_kept = keep_signal_groups(sig, args.tasks_per_step - kept, rank, device)
        examples += [ex for g in keep for ex in ex_groups[g]]
        kept += n_kept
        if kept >= args.tasks_per_step:
            break
    return episodes, torch.cat(valid), torch.cat(has_signal), examples


def train_batch(model, raw, ref, opt, examples, args, pad_id, device, ctx, step, log):
    """--ppo-epochs optimizer steps of `model` (PGModule around `raw`) on this rank's examples; ref: the initial
    policy. -> (stats summed over the first epoch's micro-batches, grad norm of the last update or None).

    The normalisers count every example of every rank. Without a KL or ECHO term an example whose advantage is
    0 at every token (a group without signal) adds nothing to the loss: it is not forwarded. When no rank has an example left
    there is nothing to learn from and nothing runs: no optimizer step either, as Adam's moments would move the
    weights on the memory of earlier gradients (and weight decay would shrink them) with a gradient of 0."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    n_echo = sum(bool(echo_mask(torch.tensor(ex["roles"]), torch.tensor(ex["wrapper"]), args.echo_payload_only).any())
                 for ex in examples) if args.echo_coef > 0 else 0
    n_tok, n_seq, n_echo = common.all_reduce([sum(ex["roles"][1:].count(ACTION) for ex in examples), len(examples),
                                           n_echo], device)
    if args.kl_coef == 0 and args.echo_coef == 0:
        examples = [ex for ex in examples if any(ex["adv"])]
    if common.all_reduce([len(examples)], device)[0] == 0:
        return {"episodes_trained": 0}, None
    for ex, lp in zip(examples, score(ref, examples, args, pad_id, device, ctx) if examples else []):
        ex["ref"] = lp
    if args.ppo_epochs > 1 and args.tis_cap > 0:  # the trainer before the step's first update
        for ex, lp in zip(examples, score(raw, examples, args, pad_id, device, ctx) if examples else []):
            ex["old"] = lp
    tot = {"episodes_trained": len(examples)}
    for epoch in range(args.ppo_epochs):
        mbs = common.rank_micro_batches([len(ex["ids"]) for ex in examples], args.micro_tokens, device)
        for k, g in enumerate(mbs):
            # an empty group (no example left on this rank) still runs a 1-token pass to keep DDP in step
            batch = collate([examples[i] for i in g] or [{"ids": [pad_id], "roles": [PROMPT], "behav": [0.0],
                                                         "wrapper": [False], "adv": [0.0]}], pad_id)
            batch = {key: v.to(device) for key, v in batch.items()}
            with common.grad_sync(model, k == len(mbs) - 1, world, args.fsdp), ctx:
                loss, st = model(batch, args, max(n_tok, 1), max(n_seq, 1), n_echo)
                (loss * world).backward()  # DDP averages over ranks; the normalisers are already global
            if epoch == 0:
                for key, v in st.items():
                    tot[key] = tot.get(key, 0.0) + v
        gnorm = common.optimizer_step(model, opt, args.grad_clip, step, log)
    return tot, gnorm


def infra_failure(ep):
    """Failures of the machinery, not of the agent: left out of the group statistics and of the loss."""
    return ep.failure in envs.INFRA_FAILURES


def plot_curves(log_path, png):
    plt = common.pyplot()
    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines()]
    keys = [("rollout/reward_mean", "mean reward"), ("train/entropy", "action-token entropy"), ("train/kl_init", "KL from init")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for ax, (k, title) in zip(axes, keys):
        pts = [(r["step"], r[k]) for r in rows if k in r]
        if pts:
            ax.plot(*zip(*pts), marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv=None):
    args = get_parser().parse_args(argv)
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    # a terminated run unwinds like an exception: run_episodes removes its sandboxes on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    distributed, rank, world, device = common.init_distributed()
    print0 = print if rank == 0 else (lambda *a, **k: None)
    if args.fsdp and not distributed:
        raise ValueError("--fsdp shards across ranks: launch with torchrun")
    if args.tasks_per_step % world:
        raise ValueError(f"--tasks-per-step {args.tasks_per_step} must be a multiple of the {world} ranks")
    if args.keep < 1 or args.ppo_epochs < 1 or args.temperature <= 0:
        raise ValueError("--keep and --ppo-epochs must be >= 1, --temperature > 0")
    if args.dynamic_sampling % args.tasks_per_step:
        raise ValueError(f"--dynamic-sampling {args.dynamic_sampling} must be a multiple of --tasks-per-step {args.tasks_per_step} (0 = off)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    ckpt, state, finished = common.resume_point(out, args, RESUME_KEYS, world)
    if finished:
        print0(f"{out} is finished (final/ exists); nothing to resume")
        return

    tok = load_tokenizer(ckpt or args.init, "native" if ckpt else args.chat_template)
    template = terminus.load_template(args.prompt_template)
    tasks = load_tasks(args.tasks, args.kinds)
    use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    raw = common.load_model(ckpt or args.init, device)
    # the initial policy, for the KL from init: a full copy per rank, in the autocast dtype
    ref = common.load_model(args.init, device).to(torch.bfloat16 if use_bf16 else torch.float32).requires_grad_(False).eval()
    model = common.wrap_model(PGModule(raw), raw, args, device)
    opt = common.adamw(model, args)
    start = 0
    if state is not None:
        common.load_optimizer_state(model, opt, state, args.fsdp)
        start = state["step"]
    engine = make_engine(ckpt or args.init, max_model_len=args.max_len, seed=args.seed,
                         max_seqs=args.concurrency, dtype=args.dtype, gpu_memory=args.gpu_memory,
                         kv_cache_gb=args.kv_cache_gb)
    if rank == 0 and args.resume:  # drop log rows past the checkpoint: those steps run again
        rows = (out / "log.jsonl").read_text().splitlines() if (out / "log.jsonl").exists() else []
        (out / "log.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r)["step"] <= start))
    config = common.run_config(vars(args)) if rank == 0 else None
    if rank == 0:
        (out / "config.json").write_text(json.dumps(config, indent=2))
    log = common.RunLog(out, config, args.wandb, rank)
    print0(f"{len(tasks)} tasks | {sum(p.numel() for p in raw.parameters()) / 1e6:.1f}M params | {args.steps} steps x "
           f"{args.tasks_per_step} tasks x {args.group_size} episodes | world {world} | "
           + (f"resumed at step {start}" if start else "fresh start"))
    parse_error_head = terminus.PARSE_ERRORS.split("{")[0]

    raw.train()
    for step in range(start, args.steps):
        t0, gen = time.time(), Counter()  # gen: the generator's wall / busy / idle seconds over the step's draws

        def draw_episodes(draw, groups):  # rollouts of one draw's groups on this rank, scored by their verifiers
            bar = tqdm(total=len(groups) * args.group_size, desc=f"step {step + 1} rollouts" + (f" (draw {draw + 1})" if draw else ""),
                       leave=False, disable=rank != 0, dynamic_ncols=True)
            stats = {}
            eps = rollout(engine, tok, [tasks[g] for g in groups for _ in range(args.group_size)], temperature=args.temperature,
                          max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, max_len=args.max_len,
                          concurrency=args.concurrency, template=template, seed=step_seed(args.seed, step, rank, draw),
                          on_episode=lambda i, e: bar.update(), stats=stats, network=args.network)
            bar.close()
            gen.update(stats)
            return eps
        episodes, valid, has_signal, examples = sample_step(draw_episodes, len(tasks), args, step, rank, device)
        if device.type == "cuda":  # the engine's weights go to host memory and its KV cache is freed while training
            engine.sleep(level=1)
        t_roll = time.time()

        # training: --ppo-epochs optimizer steps on this batch, micro-batches by token budget; then the new
        # weights into the engine (a step without an update leaves them as they are)
        tot, gnorm = train_batch(model, raw, ref, opt, examples, args, tok.pad_token_id, device, ctx, step, print0)
        t_train = time.time()
        if device.type == "cuda":
            engine.wake_up()
        if gnorm is not None:
            sync_weights(engine, raw)
        t_sync = time.time()

        # one log row: episode statistics summed over ranks, over every draw of the step
        ok = valid.flatten().tolist()
        ep_sums = {"episodes": len(episodes), "valid": sum(ok), "reward_sum": sum(e.reward for e, v in zip(episodes, ok) if v),
                   "solved": sum(e.reward >= 1.0 for e, v in zip(episodes, ok) if v),
                   "signal": int(has_signal.sum()), "groups": len(has_signal), "turns": sum(e.turns for e in episodes),
                   "tokens": sum(len(e.token_ids) for e in episodes), "truncated": sum(e.truncated for e in episodes),
                   "gen_tokens": sum(e.roles.count(ACTION) for e in episodes),
                   "parse_errors": sum(m["role"] == "user" and m["content"].startswith(parse_error_head)
                                       for e in episodes for m in e.messages),
                   "gen_busy_s": gen["policy_s"], "gen_idle_s": gen["idle_s"], "rollout_s": gen["wall_s"]}
        failures = Counter(e.failure for e in episodes if e.failure)  # by kind, whichever kinds envs reports
        if distributed:
            parts = [None] * world
            dist.all_gather_object(parts, failures)
            failures = sum(parts, Counter())
        keys = sorted(set(ep_sums) | set(tot))
        sums = dict(zip(keys, common.all_reduce([ep_sums.get(k, tot.get(k, 0.0)) for k in keys], device)))
        na, nv = sums.get("act_tokens", 0), max(sums["valid"], 1)
        rec = {"step": step + 1,
               "rollout/reward_mean": sums["reward_sum"] / nv, "rollout/solve_rate": sums["solved"] / nv,
               "rollout/groups_drawn": sums["groups"], "rollout/groups_with_signal": sums["signal"],
               "rollout/groups_zero_variance": sums["groups"] - sums["signal"],
               "rollout/infra_excluded": sums["episodes"] - sums["valid"], "rollout/turns_mean": sums["turns"] / sums["episodes"],
               "rollout/episode_tokens_mean": sums["tokens"] / sums["episodes"],
               "rollout/response_tokens_mean": sums["gen_tokens"] / max(sums["turns"], 1),
               "rollout/truncated": sums["truncated"], "rollout/parse_error_rate": sums["parse_errors"] / max(sums["turns"], 1),
               **{f"rollout/failures/{k}": n for k, n in sorted(failures.items())},
               "rollout/gen_tok_per_s": sums["gen_tokens"] / max(sums["gen_busy_s"], 1e-9),
               "rollout/generator_idle_frac": sums["gen_idle_s"] / max(sums["rollout_s"], 1e-9),
               "train/episodes_trained": int(sums["episodes_trained"]), "train/action_tokens": int(na),
               "train/optimizer_steps": 0 if gnorm is None else args.ppo_epochs, "train/lr": args.lr,
               "time/rollout_s": t_roll - t0, "time/generate_s": gen["policy_s"], "time/env_wait_s": gen["idle_s"],
               "time/train_s": t_train - t_roll, "time/sync_s": t_sync - t_train, "time/step_s": time.time() - t0}
        if gnorm is not None:  # what the trained episodes show (a step without an update scored none)
            rec.update({"train/loss": sums["loss"], "train/pg_loss": sums["pg_loss"], "train/echo_loss": sums["echo_loss"],
                        "train/grad_norm": gnorm, "train/obs_nll": sums["obs_nll_sum"] / max(sums["obs_tokens"], 1)})
        if na:
            rec.update({"train/entropy": sums["entropy_sum"] / na, "train/kl_init": sums["kl_init_sum"] / na,
                        "train/kl_init_k3": sums["kl_init_k3_sum"] / na, "train/mismatch": sums["mismatch_sum"] / na,
                        "train/mismatch_abs": sums["mismatch_abs_sum"] / na, "train/clip_frac": sums["clipped_sum"] / na,
                        "train/tis_weight": sums["tis_w_sum"] / na})
        log.write(rec)
        trained = (f"ent {rec['train/entropy']:.3f} | kl {rec['train/kl_init']:.2e} | mism {rec['train/mismatch_abs']:.1e} | "
                   f"gnorm {gnorm:.3f}" if gnorm is not None and na else "nothing to learn from: no update")
        print0(f"step {step + 1}/{args.steps} | reward {rec['rollout/reward_mean']:.3f} | solved {rec['rollout/solve_rate']:.2f} | "
               f"signal {sums['signal']:.0f}/{sums['groups']:.0f} | {trained} | gen {rec['time/generate_s']:.0f}s "
               f"idle {rec['rollout/generator_idle_frac']:.0%} | train {rec['time/train_s']:.0f}s | {rec['time/step_s']:.0f}s")
        done = step + 1
        if done % args.save_every == 0 or done == args.steps:
            common.save_checkpoint(out / f"step-{done:06d}", model, raw, tok, opt, done, args, rank, rng=False)
            for old in common.checkpoint_dirs(out)[: -args.keep] if rank == 0 else []:
                shutil.rmtree(old)
            if rank == 0:
                plot_curves(out / "log.jsonl", out / "curves.png")
    common.save_checkpoint(out / "final", model, raw, tok, None, args.steps, args, rank)  # weights + tokenizer only
    print0(f"final model: {out / 'final'}")
    log.close()
    del engine  # its shutdown also tears down the process group it joined (torchrun): before ours, not after
    gc.collect()
    common.close_distributed()


if __name__ == "__main__":
    common.run_cli(main)
