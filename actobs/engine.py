"""
The rollout engine of grpo.py and evaluate.py: an in-process vLLM engine (make_engine), the policy that samples
episodes from it token-in/token-out (VLLMPolicy: the policy object of envs.run_episodes), under a grammar if asked
(the masks the trainer replays), and the weight sync from the trainer into the engine (sync_weights). What an
episode's tokens are and how a grammar's masks reach the loss: docs/training.md#the-rollout-engine. Nothing heavy
at import: vLLM is imported when an engine or a policy is made.
"""
import os
import time
import zlib
from contextlib import contextmanager

import numpy as np
import torch

from actobs import common, episode, handoff, terminus
from actobs.grammar import close_reply, reply_grammar
from actobs.labels import ACTION, PROMPT, defuse_specials, encode, encode_spans, generation_prompt


def kv_cache_bytes(config, *, max_model_len, max_seqs, dtype_bytes):
    """CPU KV cache (bytes) that holds max_seqs sequences of max_model_len tokens: K and V of every layer's
    key/value heads, per token, plus a 256-token margin per sequence for its last partly filled block. Sized to
    the need, not a fixed GiB: the engine allocates and touches all of it at start, which takes seconds a GiB."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes
    return max_seqs * (max_model_len + 256) * per_token


# vLLM runs its engine core in this process, not a child, only with this in the environment, which vLLM reads when
# an engine is made and while it runs: sync_weights hands the engine tensors, VLLMPolicy steps it. The entry point
# (grpo.main, evaluate.main, a benchmark's main) sets it before make_engine, which refuses to start without it.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def make_engine(model_dir, *, max_model_len, max_seqs, seed=0, dtype="auto", gpu_memory=0.35, kv_cache_gb=None,
                sleep=False, **engine_args):
    """An in-process vLLM engine (IN_PROCESS_ENV) for up to max_seqs sequences at once, made with engine_kwargs on
    this process's current GPU (the entry point chose it: under torchrun common.init_distributed's cuda:LOCAL_RANK;
    make_engine raises if the engine's worker landed elsewhere), or on the CPU. sleep: the engine can sleep (its
    memory freed while a trainer trains; vLLM allows one such engine a process). engine_args: further vLLM engine
    arguments over these (bench/rollout.py's levers)."""
    if any(os.environ.get(k) != v for k, v in IN_PROCESS_ENV.items()):
        raise RuntimeError(f"make_engine: set {IN_PROCESS_ENV} in the environment first (os.environ.update("
                           "engine.IN_PROCESS_ENV) in the entry point): vLLM would run the engine in a child process")
    cuda = torch.cuda.is_available()
    from vllm import LLM
    if dtype == "auto":  # the trainers' rule (common.resolve_dtype): bf16 where it is fast
        dtype = common.resolve_dtype(dtype, torch.device("cuda" if cuda else "cpu"))[0]
    gpu = torch.cuda.current_device() if cuda else None
    llm = LLM(**(engine_kwargs(model_dir, max_model_len=max_model_len, max_seqs=max_seqs, seed=seed, dtype=dtype,
                               gpu=gpu, gpu_memory=gpu_memory, kv_cache_gb=kv_cache_gb, sleep=sleep) | engine_args))
    if cuda and (where := llm.collective_rpc(worker_device)) != [torch.device("cuda", gpu)]:
        raise RuntimeError(f"make_engine: the engine's worker is on {where}, not cuda:{gpu}, this process's GPU")
    return llm


def engine_kwargs(model_dir, *, max_model_len, max_seqs, seed, dtype, gpu, gpu_memory, kv_cache_gb, sleep):
    """vLLM's LLM(...) arguments of make_engine's engine; gpu: the GPU's index as torch numbers it, or None for the CPU.
    logprobs_mode='processed_logprobs': the log-probs it returns are those of the distribution actually sampled from
    (after temperature), which the importance ratio needs. On a GPU: sleep mode if asked (CUDA only), and the GPU
    named (device_ids): vLLM's in-process worker puts itself on device_ids[0] (an index
    into CUDA_VISIBLE_DEVICES when that is set, as torch's is) and makes it the process's current device; without it
    the worker takes GPU 0, so under torchrun every rank's engine would share the first GPU. On CPU the KV cache is
    kv_cache_gb, or by default what max_seqs sequences of max_model_len tokens need."""
    dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype)
    if gpu is not None:
        kw = dict(enable_sleep_mode=sleep, gpu_memory_utilization=gpu_memory, device_ids=[gpu])
    else:
        from transformers import AutoConfig
        kv = (int(kv_cache_gb * 2 ** 30) if kv_cache_gb else
              kv_cache_bytes(AutoConfig.from_pretrained(model_dir).get_text_config(), max_model_len=max_model_len,
                             max_seqs=max_seqs, dtype_bytes=getattr(torch, dtype).itemsize))
        # a prefill scheduled whole: one split across steps makes the engine rewind the request's seeded generator,
        # which a CPU generator cannot do (RuntimeError: CPU Generator does not use offset), and VLLMPolicy seeds
        # every turn. A step then takes whole prompts up to the budget (4096, vLLM's CPU default, or a whole context
        # when that is longer)
        kw = dict(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096),
                  kv_cache_memory_bytes=kv)
    return dict(model=str(model_dir), dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=gpu is None,
                logprobs_mode="processed_logprobs", **kw)


def worker_device(worker):
    """The device an engine's worker runs on (called in the worker by LLM.collective_rpc)."""
    return worker.device


# The weight sync's checksum reads every 97th element of each tensor (a prime stride, so no row length aliases
# it): a tensor left stale or loaded on one rank only shows in it, at ~1 % of the cost of summing all of them in
# float64, which took a third of a sync's time on CPU
CHECKSUM_STRIDE = 97


def weights_checksum(t):
    """The float64 sum of every CHECKSUM_STRIDE-th element of tensor t (a 0-dim tensor on t's device)."""
    return t.detach().flatten()[::CHECKSUM_STRIDE].sum(dtype=torch.float64)


def sync_weights(engine, model):
    """Load the trainer's weights into the engine in place, all at once, then drop cached prefixes (their KV was
    computed by the old weights). With tied embeddings lm_head.weight must be among them: the engine keeps a
    separate head and would otherwise silently keep the old one. Under FSDP2 each rank gathers the full
    tensors for its own engine one at a time, so the transient memory is one tensor, not the model. -> (a checksum
    of the weights loaded: weights_checksum summed over them, as the trainer holds them, equal on ranks whose
    engines got equal weights; the seconds the trainer's side took: the gathers, sums and casts, measured inside
    the iterator the engine consumes, so the rest of the sync's time is the engine's loading; on a GPU, whose
    kernels run asynchronously, the split is approximate)."""
    dtype = engine.llm_engine.model_config.dtype
    sd = model.state_dict()
    if model.config.tie_word_embeddings and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    sums, trainer_s = [], 0.0

    def weights():  # consumed in order by the engine; FSDP2's gathers happen in the same order on every rank
        nonlocal trainer_s
        for k, v in sd.items():
            t = time.perf_counter()
            full = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
            sums.append(weights_checksum(full))  # on the device: one host sync for all, below
            full = full.to(dtype)
            trainer_s += time.perf_counter() - t
            yield k, full

    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
    engine.reset_prefix_cache()
    return float(torch.stack(sums).sum()), trainer_s


_SKELETON = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def end_of_turn_id(tok):
    """The token the chat template ends an assistant turn with: the last one a reply that stops samples."""
    ids, _, _, off, spans = encode_spans(tok, _SKELETON)
    return int(ids[int(np.searchsorted(off[:, 0], spans[1][-1][1])) - 1])


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
        raise ValueError("a token straddles the end of the assistant turn: the chat template cannot be used "
                         "token-in/token-out")
    if not closed:
        k -= 1  # the end-of-turn token, which the cut reply lacks
    roles = roles.copy()
    roles[roles == ACTION] = PROMPT  # the unsampled end-of-turn token of a cut reply
    wrapper = terminus.wrapper_mask(msgs, roles, text, off, spans)
    head = tok(generation_prompt(tok, msgs), add_special_tokens=False)["input_ids"]
    return (list(ids[k:]) + head, roles[k:].tolist() + [PROMPT] * len(head),
            wrapper[k:].tolist() + [False] * len(head))


def reply_spans(roles):
    """[(start, end)] of each reply in an episode's token sequence, in turn order: a reply is one run of ACTION
    tokens (the policy samples nothing else, a turn samples at least one token, and a turn's header lies between
    two replies)."""
    spans = []
    for i, r in enumerate(roles):
        if r == ACTION and i and roles[i - 1] == ACTION:
            spans[-1] = (spans[-1][0], i + 1)
        elif r == ACTION:
            spans.append((i, i + 1))
    return spans


def compile_grammar(tok, grammar, vocab_size):
    """xgrammar's compiled `grammar` (EBNF) for tokenizer tok and the model's vocab_size (its head's rows, which
    may exceed the tokenizer's): as vLLM's xgrammar backend compiles it, so a replay allows what vLLM allowed."""
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    return xgr.GrammarCompiler(info).compile_grammar(grammar)


def allowed_masks(compiled, ids, stop_ids):
    """The grammar's mask before each of a reply's sampled ids, replayed: -> [packed bits (ceil(V / 32) * 4,)
    uint8 per id], bit t % 8 of byte t // 8 set where token t was allowed (xgrammar's int32 words, little-endian).
    stop_ids: the request's stop tokens, the only ones allowed once the grammar is complete (vLLM passes
    SamplingParams.all_stop_token_ids). Raises if an id was not allowed: then the replay is not vLLM's."""
    import xgrammar as xgr
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids))
    bits = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)  # (1, ceil(V / 32)) int32
    out = []
    for i, t in enumerate(ids):
        matcher.fill_next_token_bitmask(bits)
        if not matcher.accept_token(t):
            raise ValueError(f"token {t} at {i} of a reply is not what the grammar allowed")
        out.append(bits[0].numpy().view(np.uint8).copy())
    return out


def forced_tokens(masks, mask_ids):
    """Per token (mask_ids: its mask's index in masks, -1 for none): whether its mask allowed one token alone (the
    grammar's fixed text; the end of turn after a complete reply). Sampled with probability 1, it carries no loss."""
    single = [int(np.unpackbits(m).sum()) == 1 for m in masks]
    return [i >= 0 and single[i] for i in mask_ids]


class VLLMPolicy:
    """run_episodes' policy protocol on an in-process vLLM engine: each episode keeps one append-only token
    sequence (prompt, sampled ids exactly as returned, observation turns as the template renders them) in its
    Episode (token_ids, roles, logprobs, obs_wrapper, truncated). A turn is queued with add_request the moment
    its observation is back; poll() runs one engine step (one decoding iteration of every running request).
    lockstep=True is the benchmark's baseline: rounds of generating every live episode's turn to the end, then
    stepping all their sandboxes. logprobs=False: replies without their log-probs (ep.logprobs 0.0 for them), for
    runs that do not train on them. grammar ('reply' or 'think': grammar.GRAMMAR_FLAG's choices): every reply
    decoded under grammar.reply_grammar, the think form with 'think'; with logprobs, each reply's masks are replayed
    into the episode (ep.masks, one per distinct mask, and ep.mask_ids, per token
    its mask's index or -1 where nothing was masked). A reply cut at max_new_tokens comes back as a
    terminus.CutReply (Terminus-2 asks again); under a grammar the engine instead closes it (grammar.close_reply:
    the closing's tokens forced) and it runs, unless the closing does not fit the context.

    When an episode's next reply has no room in max_len: with summarize=True the episode is handed off as Terminus-2
    does (handoff.hand_off: its calls are requests among the other episodes' turns, free text, no grammar, no
    log-probs) and goes on in a new context, its tokens appended as a new segment (episode.segments) and the hand-off
    recorded (ep.handoffs); a reply cut by the context's end is then a CutReply (Terminus-2's re-ask, which no longer
    fits: the hand-off follows). Without, or where no context fits, the episode ends there (None: envs' max_len)."""

    def __init__(self, engine, tok, *, temperature, max_new_tokens, max_len, seed=0, lockstep=False, logprobs=True,
                 grammar=None, top_p=1.0, top_k=0, summarize=False):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        self.engine, self.tok, self.max_new_tokens, self.max_len, self.seed = engine, tok, max_new_tokens, max_len, seed
        self.lockstep = lockstep
        # top_p and top_k as asked, 1 and 0 (off) by default: a model's generation config (Qwen3: top_k 20) must not
        # apply, and a trainer's ratio needs the full softmax at T as its denominator (grpo.py keeps the defaults).
        # logprobs=0: the sampled token's own log-prob.
        if logprobs and (top_p < 1.0 or top_k > 0):
            raise ValueError("VLLMPolicy: log-probs for training are the full softmax's at T: top_p 1 and top_k 0")
        self.params = dict(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=0 if logprobs else None,
                           detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        self.compiled, self.grammar = None, grammar
        if grammar:
            self.end_of_turn = end_of_turn_id(tok)
            ebnf = reply_grammar(think=grammar == "think")
            self.params["structured_outputs"] = StructuredOutputsParams(grammar=ebnf)
            if logprobs:  # the trainer needs the masks the log-probs were taken under
                config = engine.llm_engine.model_config
                self.compiled = compile_grammar(tok, ebnf, config.get_vocab_size())
                # the stop tokens as the engine completes a request's (on its own copy): the tokenizer's end of
                # turn and the generation config's
                p = SamplingParams(**self.params)
                p.update_from_generation_config(config.try_get_generation_config(), tok.eos_token_id)
                self.stop_ids = p.all_stop_token_ids
        self.SamplingParams = SamplingParams
        self.summarize = summarize
        # a hand-off's calls: free text (no grammar), no log-probs (not trained)
        self.call_params = {k: v for k, v in self.params.items() if k != "structured_outputs"} | {"logprobs": None}
        self.requests, self.eps, self.closed, self.ready = {}, {}, {}, []
        self.handing = {}  # key -> the hand-off in progress: [its generator, its Handoff record, its start time]

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
        ep.mask_ids += [-1] * len(ids)
        self.eps[key] = ep
        start = episode.segments(ep)[-1][0]  # the context's first token
        room = self.max_len - (len(ep.token_ids) - start)
        if room >= 1:
            return self.queue_reply(key, ep, room)
        for field in ("token_ids", "roles", "obs_wrapper", "logprobs", "mask_ids"):  # no room: cut at max_len
            del getattr(ep, field)[start + self.max_len:]
        if not self.summarize:  # the episode ends
            ep.truncated = True
            self.ready.append((key, None))
            return
        gen = handoff.hand_off(episode.contexts(ep)[-1], ep.instruction, handoff.latest_screen(ep.messages),
                               self.tokens, self.max_len)
        self.handing[key] = [gen, episode.Handoff(at=len(ep.messages)), time.time()]
        self.step_handoff(key, None)

    def queue_reply(self, key, ep, room):
        turn = sum(m["role"] == "assistant" for m in ep.messages)
        start = episode.segments(ep)[-1][0]
        self.requests[self.add(key, turn, ep.token_ids[start:], min(self.max_new_tokens, room))] = key

    def add(self, key, turn, token_ids, max_tokens, call=None):
        """Queue the reply of episode `key`'s turn `turn` to the context token_ids, sampled with a seed of (seed,
        key, turn) alone: reproducible per turn, whatever else runs -> its request id. call: a hand-off's call (its
        name, unique in the episode), sampled with call_params and a seed of its own."""
        seed = (self.seed * 1_000_003 + key * 1009 + turn + (zlib.crc32(call.encode()) if call else 0)) % 2**31
        params = self.SamplingParams(max_tokens=max_tokens, **(self.call_params if call else self.params), seed=seed)
        rid = f"{key}-{turn}" + (f"-{call}" if call else "")
        self.engine.llm_engine.add_request(rid, {"prompt_token_ids": list(token_ids)}, params)
        return rid

    def render(self, messages):
        """-> (ids, messages): a fresh context of `messages` as the chat template renders it up to the reply's header,
        and the messages it rendered: special-token strings defused (a reply the policy sampled may hold one)."""
        messages = [dict(m, content=defuse_specials(self.tok, m["content"])) for m in messages]
        return prompt_tokens(self.tok, messages)[0], messages

    def tokens(self, messages):
        return len(self.render(messages)[0])

    def step_handoff(self, key, sent):
        """Advance episode `key`'s hand-off: send its generator `sent` (the last call's content, None where it
        failed), and queue its next call that fits; once it is done, the episode's next reply in the new context, or
        the episode's end (None: max_len) where no context fit."""
        gen, record, t0 = self.handing[key]
        ep = self.eps[key]
        while True:
            try:
                call = gen.send(sent)
            except StopIteration as done:
                return self.end_handoff(key, ep, record, done.value, t0)
            ids, _ = self.render(call.messages)
            record.calls.append({"name": call.name, "prompt_tokens": len(ids), "reply": "", "reply_tokens": 0,
                                 "finish": "no room"})
            if len(ids) < self.max_len:
                turn = sum(m["role"] == "assistant" for m in ep.messages)
                name = f"handoff{len(ep.handoffs) + 1}-{call.name}"
                self.requests[self.add(key, turn, ids, min(self.max_new_tokens, self.max_len - len(ids)), name)] = key
                return
            sent = None  # its prompt does not fit: it fails

    def handoff_reply(self, key, c):
        """A hand-off call's output c: recorded, its content sent on; a reply cut at its token limit fails, as
        Terminus-2's model call raises on a reply cut at its limit."""
        ids, stopped = list(c.token_ids), c.finish_reason == "stop"
        text = self.tok.decode(ids[:-1] if stopped else ids)
        self.handing[key][1].calls[-1].update(reply=text, reply_tokens=len(ids), finish=c.finish_reason)
        self.step_handoff(key, terminus.reply_content(text) if stopped else None)

    def end_handoff(self, key, ep, record, outcome, t0):
        del self.handing[key]
        record.kept, record.fallback, record.seconds = outcome.kept, outcome.fallback, time.time() - t0
        ep.handoffs.append(record)
        if outcome.context is None:  # not even the task and the terminal alone fit: the episode ends
            ep.truncated = True
            self.ready.append((key, None))
            return
        ids, record.context = self.render(outcome.context)
        record.start = len(ep.token_ids)
        ep.token_ids += ids
        ep.roles += [PROMPT] * len(ids)
        ep.obs_wrapper += [False] * len(ids)
        ep.logprobs += [0.0] * len(ids)
        ep.mask_ids += [-1] * len(ids)
        self.queue_reply(key, ep, self.max_len - len(ids))

    def reply_masks(self, ep, ids, forced=0):
        """Per id of a reply: the index in ep.masks of the mask it was sampled under (appended when new), or -1
        without a grammar to replay; the last `forced` ids (the engine's closing of a cut reply) each under a mask
        that allows it alone. Within a free value the mask repeats: the distinct ones are few."""
        if self.compiled is None:
            return [-1] * len(ids)
        index = {m.tobytes(): i for i, m in enumerate(ep.masks)}
        out = []
        masks = allowed_masks(self.compiled, ids, self.stop_ids)  # raises if the closing is not the grammar's
        for i in range(len(ids) - forced, len(ids)):
            masks[i] = np.zeros_like(masks[i])
            masks[i][ids[i] // 8] = 1 << ids[i] % 8
        for m in masks:
            if m.tobytes() not in index:
                index[m.tobytes()] = len(ep.masks)
                ep.masks.append(m)
            out.append(index[m.tobytes()])
        return out

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
            if key in self.handing:
                self.handoff_reply(key, c)
                continue
            ids, closing, start = list(c.token_ids), [], episode.segments(ep)[-1][0]
            ep.cut_replies += c.finish_reason == "length"
            if self.grammar and c.finish_reason == "length":  # closed where the context has room for it
                text = close_reply(self.tok.decode(ids), think=self.grammar == "think")
                closing = self.tok(text, add_special_tokens=False)["input_ids"] + [self.end_of_turn]
                if len(ep.token_ids) - start + len(ids) + len(closing) > self.max_len:
                    closing = []
            logprobs = [d[t].logprob for d, t in zip(c.logprobs, ids)] if c.logprobs else [0.0] * len(ids)
            ids += closing
            ep.token_ids += ids
            ep.roles += [ACTION] * len(ids)
            ep.obs_wrapper += [False] * len(ids)
            ep.logprobs += logprobs + [0.0] * len(closing)  # a forced token's probability is 1
            ep.mask_ids += self.reply_masks(ep, ids, len(closing))
            # ended with its end-of-turn (a stop token, or the closing's), included in ids
            self.closed[key] = c.finish_reason == "stop" or bool(closing)
            reply = self.tok.decode(ids[:-1] if self.closed[key] else ids)
            full = len(ep.token_ids) - start >= self.max_len  # cut by the context's end, not max_new_tokens
            if c.finish_reason == "length" and not closing and full and not self.summarize:
                ep.truncated = True
                out.append((key, None))
            elif c.finish_reason == "length" and not closing:  # the episode asks again (a full context: the re-ask
                out.append((key, terminus.CutReply(reply, self.max_new_tokens)))  # does not fit, it hands off)
            else:
                out.append((key, reply))
        return out

    def abort(self):
        if self.requests:
            self.engine.llm_engine.abort_request(list(self.requests))
        self.requests, self.ready, self.handing = {}, [], {}


@contextmanager
def engine_threads():
    """The context a rollout runs in (envs.run_episodes with a VLLMPolicy): the CPU engine serves with one intra-op
    thread, as vLLM means to (vllm.utils.torch_utils: a multi-threaded op leaves its threads spin-waiting, taking
    the cores the sandboxes and the step's serial code need). vLLM's own call is lost in process, where its CPU
    worker has already made torch.set_num_threads a no-op: torch._C's is the same function, untouched. The caller's
    threads (the trainer's) come back after. On CUDA nothing changes."""
    threads = torch.get_num_threads()
    if not torch.cuda.is_available():
        torch._C.set_num_threads(1)
    try:
        yield
    finally:
        torch._C.set_num_threads(threads)
