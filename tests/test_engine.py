"""The rollout engine (engine.py): token-in/token-out sequences equal to labels.render, the episode loop that
queues a turn while other sandboxes step, and, with a real in-process vLLM engine, its KV cache, weight-sync
equivalence, seeded requests, a rollout in a real sandbox, a learning check whose sign matters, and --grammar's
replies (all parse) and log-probs (the trainer's masked ones)."""
import contextlib
import dataclasses
import json
import os
import random
import re
import time

import pytest
import torch

from conftest import ScriptedAsync
import envs
import grpo
from actobs import batches, common, engine, episode, handoff, labels, steplog, terminus
from actobs.labels import ACTION, OBS, PROMPT
from actobs.tasks import Task


# ---------------------------------------------------------------------------------------------- token-in/token-out

def built_turn_by_turn(tokenizer, conv):
    """(ids, roles, wrapper) of conv as a rollout builds it: prompt, each reply's canonical tokens with the
    end-of-turn token it was sampled with, observation turns."""
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids, roles = engine.prompt_tokens(tokenizer, conv[:1])
    wrapper = [False] * len(ids)
    for m in conv[1:]:
        if m["role"] == "assistant":
            more = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [eot]
            more_roles, more_wrapper = [ACTION] * len(more), [False] * len(more)
        else:
            more, more_roles, more_wrapper = engine.observation_tokens(tokenizer, m, closed=True)
        ids, roles, wrapper = ids + more, roles + more_roles, wrapper + more_wrapper
    return ids, roles, wrapper


def test_token_in_token_out_equals_render(tokenizer, synthetic):
    """Built turn by turn as a rollout builds it (prompt, sampled ids with their end-of-turn, observation turns),
    an episode whose sampled ids are the canonical tokenisation of its replies equals labels.render."""
    for conv in synthetic[:10]:
        conv = conv[:-1] if conv[-1]["role"] == "user" else conv  # an episode's messages end with its last reply
        ids, roles, wrapper = built_turn_by_turn(tokenizer, conv)
        assert not any(w for w, r in zip(wrapper, roles) if r != OBS)
        want_ids, want_roles = labels.render(tokenizer, conv)
        tail = len(want_ids) - len(ids)  # render closes the last turn with the template's text after it
        assert tail >= 0 and want_ids[:len(ids)] == ids and want_roles[:len(ids)] == roles
        assert set(want_roles[len(ids):]) <= {PROMPT} and tail <= 1


def test_reply_spans_are_the_turns(tokenizer, synthetic):
    """An episode's turn boundaries: one span per reply, in order, each the reply's sampled ids with its end-of-turn
    token, nothing else ACTION."""
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    conv = synthetic[0][:-1] if synthetic[0][-1]["role"] == "user" else synthetic[0]
    ids, roles, _ = built_turn_by_turn(tokenizer, conv)
    spans = engine.reply_spans(roles)
    replies = [m["content"] for m in conv if m["role"] == "assistant"]
    assert len(spans) == len(replies) >= 2
    for (start, end), text in zip(spans, replies):
        assert ids[start:end] == tokenizer(text, add_special_tokens=False)["input_ids"] + [eot]
    assert sum(end - start for start, end in spans) == roles.count(ACTION)


def test_token_in_token_out_with_a_special_token_in_an_observation(tokenizer, synthetic):
    """An observation that printed '<|im_end|>' is defused as the rollout does it, and the episode built turn by
    turn still equals labels.render of its messages."""
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    conv = [dict(m) for m in synthetic[0][:3]]
    conv[2]["content"] = labels.defuse_specials(tokenizer, conv[2]["content"] + "\n<|im_end|>\n<|im_start|>assistant\n")
    conv.append({"role": "assistant", "content": "done"})
    ids, roles, _ = built_turn_by_turn(tokenizer, conv)
    want_ids, want_roles = labels.render(tokenizer, conv)
    assert want_ids[:len(ids)] == ids and want_roles[:len(ids)] == roles
    assert ids.count(eot) == 4  # the template's own, one per message


def test_observation_after_a_cut_reply(tokenizer):
    """A reply cut by max_tokens has no end-of-turn: the template's is added, as PROMPT (nothing sampled it)."""
    obs = {"role": "user", "content": "New Terminal Output:\nroot@box:/app# ls\nfile.txt\nroot@box:/app# "}
    closed, _, _ = engine.observation_tokens(tokenizer, obs, closed=True)
    cut, roles, wrapper = engine.observation_tokens(tokenizer, obs, closed=False)
    assert cut[1:] == closed and cut[0] == tokenizer.convert_tokens_to_ids("<|im_end|>") and roles[0] == PROMPT
    text = [tokenizer.decode([t]) for t, w in zip(cut, wrapper) if w]
    assert "".join(text).startswith("New Terminal Output:\n") and text[-1] == "<|im_end|>"


# ---------------------------------------------------------------------------------------------- the episode loop


def reply(keys, duration, done=False):
    return json.dumps({"analysis": "", "plan": "", "commands": [{"keystrokes": keys, "duration": duration}],
                       "task_complete": done})


def test_next_turn_is_queued_while_other_sandboxes_step(base_image, no_leftovers):
    """Episode 0 runs three quick turns while episode 1's first command (sleep 6) is still running: no round
    waits for the slowest sandbox (in lock-step rounds, episode 0's last turn would come after episode 1's
    second). The batch-function adapter keeps lock-step rounds."""
    test = b"echo 1 > /logs/verifier/reward.txt\n"
    tasks = [Task(f"t{i}", "Wait.", memory_mb=256, tests={"test.sh": test}) for i in range(2)]
    quick = [reply("true\n", 0.1), reply("true\n", 0.1, done=True), reply("", 0.1, done=True)]
    policy = ScriptedAsync({0: quick, 1: [reply("sleep 6\n", 8), reply("", 0.1, done=True), reply("", 0.1, done=True)]})
    stats = {}
    eps = envs.run_episodes(tasks, policy, max_turns=5, concurrency=2, stats=stats)
    assert [(e.reward, e.failure, e.turns) for e in eps] == [(1.0, None, 3)] * 2
    t0_done = max(t for t, k in policy.asked if k == 0)
    t1_second = sorted(t for t, k in policy.asked if k == 1)[1]
    assert t0_done < t1_second  # episode 0 had all its turns before episode 1's sleep ended
    assert stats["wall_s"] >= stats["idle_s"] > 0

    rounds = []

    def batch(states):
        rounds.append(len(states))
        return [reply("", 0.1, done=True)] * len(states)
    envs.run_episodes(tasks, batch, max_turns=3, concurrency=2)
    assert rounds == [2, 2]


# ---------------------------------------------------------------------------------------------- with vLLM

@pytest.fixture(scope="module")
def llm(vllm_dir):
    os.environ.update(engine.IN_PROCESS_ENV)  # as grpo.main and evaluate.main set it
    return engine.make_engine(vllm_dir, max_model_len=1024, max_seqs=16, dtype="fp32")


def test_a_run_ending_beside_an_engine_leaves_the_engines_group(llm):
    """sft.main and grpo.main end with common.close_distributed. In a process that holds an engine (a test module's,
    or an evaluation's before them) the process group is the engine's: destroying it left vLLM with a group torch
    no longer knew, and the process's next engine failed (tests/test_learning.py run after this module)."""
    from vllm import SamplingParams
    common.close_distributed()
    assert torch.distributed.is_initialized()
    assert llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def hf_model(path, seed=None):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if seed is not None:  # move away from the near-uniform init, so greedy decoding has something to follow
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def test_kv_cache_bytes_known_answer():
    """Qwen3-0.6B's shape (28 layers, 8 key/value heads of 128) in bf16 holds 112 KiB of K and V per token."""
    from transformers import Qwen3Config
    config = Qwen3Config(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         hidden_size=1024)
    assert engine.kv_cache_bytes(config, max_model_len=4096 - 256, max_seqs=2, dtype_bytes=2) == 2 * 4096 * 112 * 1024


def test_cpu_engine_holds_its_sequences_and_no_more_than_needed(llm):
    """The fixture's engine (16 sequences of 1024 tokens) has room for all of them at once, not the fixed GiBs
    it once allocated and touched at start."""
    cache = llm.llm_engine.vllm_config.cache_config
    tokens = cache.num_gpu_blocks * cache.block_size
    assert 16 * 1024 <= tokens <= 16 * (1024 + 256) + cache.block_size, (cache.num_gpu_blocks, cache.block_size)


def test_weight_sync_matches_hf(llm, vllm_dir):
    from vllm import SamplingParams
    model = hf_model(vllm_dir, seed=1)
    assert model.config.tie_word_embeddings
    t = time.perf_counter()
    checksum, trainer_s = engine.sync_weights(llm, model)
    # the checksum: every weight's, the tied head counted as the engine's own; it reads every 97th element, so a
    # weight changed anywhere on that stride changes it; the trainer's side of the time is a part of the whole
    sd = model.state_dict()
    sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    assert checksum == pytest.approx(float(sum(engine.weights_checksum(v) for v in sd.values())), rel=1e-12)
    w = sd["model.layers.0.mlp.down_proj.weight"].clone()
    w.view(-1)[engine.CHECKSUM_STRIDE] += 1.0
    assert float(engine.weights_checksum(w)) == pytest.approx(float(engine.weights_checksum(
        sd["model.layers.0.mlp.down_proj.weight"])) + 1.0, abs=1e-6)  # x + 1 rounds in fp32
    assert 0 < trainer_s < time.perf_counter() - t
    prompt = list(range(5, 25))
    greedy = SamplingParams(temperature=0, max_tokens=24, logprobs=0, top_k=0)
    out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0]
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, 20:]
    assert list(out.token_ids) == hf.tolist()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + hf.tolist()])).logits[0, 19:-1], -1)
    want = lp.gather(1, hf[:, None]).squeeze(1)
    got = torch.tensor([d[t].logprob for d, t in zip(out.logprobs, out.token_ids)])
    assert torch.allclose(got, want, atol=1e-4)


def test_seeded_requests_beyond_one_steps_token_budget(llm):
    """More prompt tokens at once than the engine schedules in a step (its budget: 4096), every request seeded
    as VLLMPolicy seeds each turn. A prefill split across steps makes the CPU engine rewind the request's
    generator, which a CPU generator cannot do (RuntimeError: CPU Generator does not use offset): an evaluation
    at concurrency 64 died so at its first turn. make_engine schedules whole prefills on CPU."""
    from vllm import SamplingParams
    budget = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    n = budget // 900 + 2  # (n, 900) prompt tokens: more than one step's budget
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 1000 for j in range(900)]} for i in range(n)]
    params = [SamplingParams(temperature=1.0, top_k=0, max_tokens=8, seed=i) for i in range(n)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8] * n


def test_replies_without_logprobs_are_the_same_tokens(llm, vllm_dir):
    """evaluate.py's policy asks for no log-probs (VLLMPolicy(logprobs=False)): its seeded replies are the
    tokens of the policy that does (GRPO's), whose every sampled token carries a log-prob below 0 (the random
    model's near-uniform softmax), while its own carry 0.0."""
    tok = labels.load_tokenizer(vllm_dir, "prefix")
    runs = {}
    for logprobs in (True, False):
        llm.reset_prefix_cache()  # both runs prefill alike
        policy = engine.VLLMPolicy(llm, tok, temperature=1.0, max_new_tokens=24, max_len=1024, seed=3,
                                   logprobs=logprobs)
        eps = [episode.Episode("t", [{"role": "user", "content": f"Task {i}: list the files."}]) for i in range(3)]
        for i, ep in enumerate(eps):
            policy.submit(i, ep)
        while policy.pending():
            policy.poll()
        runs[logprobs] = eps
    for a, b in zip(runs[True], runs[False]):
        assert a.roles.count(ACTION) > 0 and a.token_ids == b.token_ids and a.roles == b.roles
        assert all(lp < 0 for lp, r in zip(a.logprobs, a.roles) if r == ACTION)
        assert b.logprobs == [0.0] * len(b.token_ids)


def sample_replies(llm, tok, n, max_new_tokens, grammar):
    """One seeded reply to each of n short tasks by VLLMPolicy -> the episodes and their replies' text."""
    policy = engine.VLLMPolicy(llm, tok, temperature=1.0, max_new_tokens=max_new_tokens, max_len=1024, seed=0,
                               grammar=grammar)
    eps = [episode.Episode("t", [{"role": "user", "content": f"Task {i}: list the files."}]) for i in range(n)]
    for i, ep in enumerate(eps):
        policy.submit(i, ep)
    replies = {}
    while policy.pending():
        replies.update(policy.poll())
    return eps, [replies[i] for i in range(n)], [policy.closed[i] for i in range(n)]


@pytest.fixture(scope="module")
def grammar_replies(llm, vllm_dir):
    """16 replies of the random model under --grammar's grammar, with log-probs and masks, as GRPO samples them:
    at 160 new tokens most are cut (its strings seldom close) and closed by the engine."""
    engine.sync_weights(llm, hf_model(vllm_dir))  # the fixture's weights, whatever tests ran before
    tok = labels.load_tokenizer(vllm_dir, "prefix")
    return sample_replies(llm, tok, 16, 160, "reply")


def test_a_random_model_writes_only_parseable_replies_under_the_grammar(llm, vllm_dir, grammar_replies):
    """The random model writes no reply terminus.parse_reply accepts on its own, and those max_new_tokens cut come
    back as CutReply; under the grammar every reply parses, with no warning but for a command without its newline
    before the next, into the reply the grammar's JSON says, those it ended and those max_new_tokens cut alike (the
    engine closes a cut one: its closing tokens forced, log-prob 0, the template's end of turn last)."""
    engine.sync_weights(llm, hf_model(vllm_dir))
    tok = labels.load_tokenizer(vllm_dir, "prefix")
    _, free, free_closed = sample_replies(llm, tok, 16, 200, None)
    assert not any(terminus.parse_reply(r)[0] for r in free)
    # a reply cut at max_new_tokens comes back marked for the episode's re-ask; under the grammar none does
    assert [isinstance(r, terminus.CutReply) for r in free] == [not c for c in free_closed] and not all(free_closed)
    assert all(r.limit == 200 for r in free if isinstance(r, terminus.CutReply))
    eps, replies, closed = grammar_replies
    assert all(closed) and sum(e.cut_replies for e in eps) >= 4, [e.cut_replies for e in eps]
    assert not any(isinstance(r, terminus.CutReply) for r in replies)
    # the one warning a reply of the grammar can draw: a command without its newline before the next
    newline = re.compile(re.escape(terminus.NO_NEWLINE).replace(r"\{i\}", r"\d+"))
    for ep, text in zip(eps, replies):
        reply, error, warnings = terminus.parse_reply(text)
        assert error is None and all(newline.fullmatch(w) for w in warnings), (error, warnings, text)
        assert json.dumps(json.loads(text)) == text  # json.dumps's own form, as the SFT data
        forced = engine.forced_tokens(ep.masks, ep.mask_ids)
        n = ep.roles.count(ACTION)
        assert ep.token_ids[-1] == engine.end_of_turn_id(tok) and forced[-1] and ep.logprobs[-1] == 0.0
        if ep.cut_replies:  # more than the sampled tokens: the closing, forced
            assert n > 160 and all(forced[-(n - 160):]) and not any(ep.logprobs[-(n - 160):])


def test_grammar_logprobs_match_the_trainer(vllm_dir, grammar_replies):
    """The log-probs vLLM sampled with under the grammar are the trainer's (batches.policy_logprobs: the masked,
    renormalised softmax from the replayed masks) within 1e-5 in fp32 at every token that carries loss; a forced
    token was sampled with log-prob 0; the trainer without the masks would be far off."""
    eps, _, _ = grammar_replies
    model = hf_model(vllm_dir)
    args = grpo.get_parser().parse_args(["--init", "-", "--tasks", "-", "--out", "-", "--temperature", "1.0"])
    examples = [batches.Example(ids=e.token_ids, roles=e.roles, wrapper=e.obs_wrapper, adv=[0.0] * len(e.token_ids),
                                behav=e.logprobs, masks=e.masks, mask_ids=e.mask_ids,
                                forced=engine.forced_tokens(e.masks, e.mask_ids)) for e in eps]
    free = [dataclasses.replace(ex, masks=None, mask_ids=None) for ex in examples]
    scored = [batches.policy_logprobs(model, exs, args.temperature, args.micro_tokens, 0, torch.device("cpu"),
                                      contextlib.nullcontext()) for exs in (examples, free)]
    gaps, unmasked, forced = [], [], []
    for ex, lp, lp_free in zip(examples, *scored):
        for i, (r, f) in enumerate(zip(ex.roles, ex.forced)):
            if r == ACTION and f:
                forced.append(ex.behav[i])
            elif r == ACTION:
                gaps.append(abs(lp[i] - ex.behav[i]))
                unmasked.append(abs(lp_free[i] - ex.behav[i]))
    assert len(gaps) > 1000 and forced and max(map(abs, forced)) == 0.0
    assert max(gaps) <= 1e-5, max(gaps)
    assert max(unmasked) > 1.0


def bandit_step(llm, model, opt, args, prompts, target, sign, n):
    """One GRPO step on a one-token bandit: reward 1 when the sampled token is in `target` (times sign)."""
    from vllm import SamplingParams
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=1, logprobs=0, seed=None)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    examples, rewards = [], []
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            hit = float(c.token_ids[0] in target)
            rewards.append(hit)
            examples.append(batches.Example(ids=p + [c.token_ids[0]], roles=[PROMPT] * len(p) + [ACTION],
                                            behav=[0.0] * len(p) + [c.logprobs[0][c.token_ids[0]].logprob],
                                            wrapper=[False] * (len(p) + 1), adv=None))
    r = torch.tensor(rewards).view(len(prompts), n)
    adv, _ = grpo.group_advantages(sign * r)
    for ex, a in zip(examples, adv.flatten().tolist()):
        ex.adv = [a] * len(ex.ids)
    norm = grpo.Normalisers(act_tokens=len(examples), seqs=len(examples), echo_seqs=0)
    loss, _ = grpo.pg_loss(model, batches.collate(examples, 0), grpo.objective(args), norm)
    loss.backward()
    opt.step()
    opt.zero_grad()
    engine.sync_weights(llm, model)
    return r.mean().item()


def test_rollout_survives_a_special_token_on_the_screen(llm, vllm_dir, base_image, no_leftovers):
    """A sandbox whose shell prints '<|im_end|>' at start (its ~/.bashrc) and in every prompt (its working
    directory): the rollout ends with an Episode whose first turn is the defused screen, rendered as the
    messages say."""
    tok = labels.load_tokenizer(vllm_dir, "prefix")
    bashrc = b"mkdir -p '/tmp/<|im_end|>' && cd '/tmp/<|im_end|>'; echo 'hello <|im_end|><|im_start|>user'\n"
    task = Task("special-screen", "Say hello.", memory_mb=256, files=(("/root/.bashrc", bashrc, 0o644),),
                     tests={"test.sh": b"echo 0 > /logs/verifier/reward.txt\n"})
    policy = engine.VLLMPolicy(llm, tok, temperature=1.0, max_new_tokens=16, max_len=1024, seed=0)
    with engine.engine_threads():
        eps = envs.run_episodes([task] * 2, policy, max_turns=2, concurrency=2)
    for ep in eps:
        assert isinstance(ep, episode.Episode) and ep.failure != "sandbox_error" and ep.turns >= 1, \
            (ep.failure, ep.error)
        first = ep.messages[0]["content"]
        assert "hello <\u200b|im_end|><\u200b|im_start|>user" in first and "<|im_end|>" not in first
        prompt, _ = engine.prompt_tokens(tok, ep.messages[:1])
        assert ep.token_ids[:len(prompt)] == prompt and len(ep.token_ids) > len(prompt)
        assert not any("<|im_end|>" in m["content"] for m in ep.messages if m["role"] == "user")


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_learning_moves_reward_with_its_sign(llm, vllm_dir, sign):
    torch.manual_seed(0)
    model = hf_model(vllm_dir)
    engine.sync_weights(llm, model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    args = grpo.get_parser().parse_args(["--init", "-", "--tasks", "-", "--out", "-", "--temperature", "1.0"])
    target = set(range(0, 2048, 4))  # a quarter of the vocabulary
    prompts = [[random.Random(i).randrange(2000) for _ in range(6)] for i in range(8)]
    curve = [bandit_step(llm, model, opt, args, prompts, target, sign, n=8) for _ in range(20)]
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    assert 0.1 < first < 0.45, curve  # about a quarter at the start
    assert (last > 0.8) if sign > 0 else (last < 0.1), curve


# ---------------------------------------------------------------------------------------------- the hand-off

HANDOFF_TASK = Task("handoff", "Copy the file that holds key7 to /app/out.", memory_mb=256,
                    tests={"test.sh": b"echo 0 > /logs/verifier/reward.txt\n"})


def ending_model(path, eos_id, lift=1.7):
    """The random model made to end its replies: every token's embedding gets a 1 in dimension 0 and the end of turn's
    `lift` there, so after any context the end of turn's logit stands out by about 8 (lift - 1): about one token in
    ten ends the reply (the random model alone: one in 2048). Its hand-off calls then end, as a real model's do."""
    m = hf_model(path)
    with torch.no_grad():
        m.model.embed_tokens.weight[:, 0] = 1.0
        m.model.embed_tokens.weight[eos_id, 0] = lift
    return m


def first_prompt_tokens(tok):
    """The tokens of HANDOFF_TASK's first prompt in the sandbox (its first screen: the fixed hostname's prompt)."""
    first = terminus.fill_prompt(terminus.DEFAULT_PROMPT, HANDOFF_TASK.instruction,
                                 terminus.SCREEN_HEADER + "root@sandbox:/app#\n")
    return len(engine.prompt_tokens(tok, [{"role": "user", "content": first}])[0])


def hand_off_run(llm, tok, model, *, max_len, max_new_tokens, summarize=True, n=2, max_turns=8):
    """n episodes of HANDOFF_TASK in real sandboxes sampled by `model` (synced into the engine), with a small
    max_len so they fill it."""
    engine.sync_weights(llm, model)
    policy = engine.VLLMPolicy(llm, tok, temperature=1.0, max_new_tokens=max_new_tokens, max_len=max_len, seed=0,
                               summarize=summarize)
    with engine.engine_threads():
        return envs.run_episodes([HANDOFF_TASK] * n, policy, max_turns=max_turns, concurrency=n)


CALLS = ("summary", "questions", "answers")


def check_handoffs(ep, tok, max_len):
    """What every hand-off of an episode must be: its calls as hand_off makes them for its fallback (the full
    hand-off's three all ended; a fallback after the first call that failed, or after all three when their context
    did not fit), the observation that did not fit before it, its context's tokens rendered as a fresh prompt at
    its start, every context at most max_len tokens and each one handed off cut at exactly max_len; one reply span
    per reply, across the contexts (and one more where the context's end cut the last reply with the hand-off off:
    the episode ended without it)."""
    segments = episode.segments(ep)
    for h in ep.handoffs:
        names, ends = [c["name"] for c in h.calls], [c["finish"] for c in h.calls]
        if h.fallback == "summary":
            assert names == list(CALLS) and ends == ["stop"] * 3, h.calls
        else:  # the full hand-off's calls up to the first that failed (all three: their context did not fit)
            k = names.index("short")
            assert names[:k] == list(CALLS[:k]) and names[k:] == ["short"] and 1 <= k <= 3, h.calls
            assert ends[:k - 1] == ["stop"] * (k - 1) and (k == 3 or ends[k - 1] != "stop"), h.calls
            assert h.fallback != "short" or ends[-1] == "stop", h.calls
        assert all(c["reply_tokens"] == 0 for c in h.calls if c["finish"] == "no room")
        assert ep.messages[h.at - 1]["role"] == "user"
        if h.fallback is not None:
            prompt = engine.prompt_tokens(tok, h.context)[0]
            assert ep.token_ids[h.start:h.start + len(prompt)] == prompt and h.context[0] == ep.messages[0]
            assert ep.roles[h.start:h.start + len(prompt)] == [PROMPT] * len(prompt)
    assert all(b - a <= max_len for a, b in segments) and all(b - a == max_len for a, b in segments[:-1])
    replies = sum(len(engine.reply_spans(ep.roles[a:b])) for a, b in segments)
    assert ep.turns == sum(m["role"] == "assistant" for m in ep.messages)
    assert replies - ep.turns == (ep.truncated and not ep.handoffs and ep.roles[-1] == ACTION)


@pytest.fixture(scope="module")
def handed_off(llm, vllm_dir, base_image):
    """Two episodes of the ending model at --max-len 800 (the first prompt is ~500 tokens): they fill their context
    every few turns, and hand off."""
    tok = labels.load_tokenizer(vllm_dir, "prefix")
    model = ending_model(vllm_dir, tok.convert_tokens_to_ids("<|im_end|>"))
    yield model, tok, hand_off_run(llm, tok, model, max_len=800, max_new_tokens=48, max_turns=10)
    engine.sync_weights(llm, hf_model(vllm_dir))


def test_an_episode_that_fills_its_context_is_handed_off_and_goes_on(handed_off):
    """At --max-len the episodes hand off (summary, questions, answers: each its own request) and go on in the new
    context to their turn limit, not to max_len; the record holds each hand-off where it happened, its calls and the
    context after, whose tokens follow the context before it; the hand-offs' time is on the agent's clock."""
    _, tok, eps = handed_off
    for ep in eps:
        assert ep.failure == "max_turns" and not ep.truncated and ep.turns == 10, (ep.failure, ep.error)
        assert episode.handed_off(ep) == ep.handoffs and len(ep.handoffs) >= 2
        check_handoffs(ep, tok, 800)
        assert ep.timings["policy_s"] >= sum(h.seconds for h in ep.handoffs) > 0
    full = [h for ep in eps for h in ep.handoffs if h.fallback == "summary"]
    assert full, [h.calls for ep in eps for h in ep.handoffs]
    h = full[0]
    summary, questions, answers = (c["reply"] for c in h.calls)
    assert h.context[1]["content"] == labels.defuse_specials(tok, handoff.HANDOFF_QUESTIONS.format(
        instruction=HANDOFF_TASK.instruction, summary=terminus.reply_content(summary), screen="root@sandbox:/app#"))
    assert h.context[2] == {"role": "assistant", "content": labels.defuse_specials(tok, terminus.reply_content(
        questions))}
    assert h.context[3]["content"] == labels.defuse_specials(tok, handoff.HANDOFF.format(
        answers=terminus.reply_content(answers)))


def test_a_handed_off_episodes_transcript(handed_off):
    """Its transcript (steplog.transcript: what grpo.py writes and the report links) shows each hand-off after the
    observation that did not fit: its calls and the context the next reply answers."""
    _, _, eps = handed_off
    ep = eps[0]
    text = steplog.transcript(ep, 0.0)
    assert text.startswith(f"## failed: handoff, reward 0.00, advantage +0.000, 10 turns, {len(ep.handoffs)} "
                           "hand-offs, max_turns\n")
    at = 0
    for k, h in enumerate(ep.handoffs, 1):
        turn = sum(m["role"] == "assistant" for m in ep.messages[:h.at])
        for s in [f"### observation {turn}", f"### hand-off {k}: {steplog.FALLBACKS[h.fallback]}"] + [
                f"#### {c['name']} call: {c['prompt_tokens']} prompt tokens" for c in h.calls] + [
                f"#### new context, message {i}" for i in range(1, len(h.context) + 1)] + [f"### reply {turn + 1}"]:
            at = text.index(s, at)


def test_a_handed_off_episode_trains_its_contexts_at_the_sampled_log_probs(handed_off):
    """GRPO trains each context of a handed-off episode as a sequence of its own (grpo.group_examples): the
    trainer's log-probs of its replies (batches.policy_logprobs, from that context's first token) are those vLLM
    sampled them with, within 1e-5 in fp32; the hand-off's calls are in none of them."""
    model, _, eps = handed_off
    adv = torch.tensor([[0.5, -0.5]])
    groups = grpo.group_examples(eps, adv, torch.ones_like(adv, dtype=torch.bool))
    examples = groups[0]
    assert len(examples) == sum(len(episode.segments(ep)) for ep in eps)
    assert [ex.ids for ex in examples] == [ep.token_ids[a:b] for ep in eps for a, b in episode.segments(ep)]
    lps = batches.policy_logprobs(model, examples, 1.0, 100_000, 0, torch.device("cpu"), contextlib.nullcontext())
    gaps = [abs(lp - b) for ex, lp_ in zip(examples, lps) for lp, b, r in zip(lp_, ex.behav, ex.roles) if r == ACTION]
    assert len(gaps) == sum(ep.roles.count(ACTION) for ep in eps) and max(gaps) <= 1e-5, max(gaps)


@pytest.mark.parametrize("case", ["short", "state", "none", "off"])
def test_the_hand_offs_fallbacks_and_the_flag_off(llm, vllm_dir, base_image, no_leftovers, case):
    """Forced fallbacks. short: --max-len leaves the summary call no room (its prompt: the first prompt and the
    summary's request), so a short summary from one bare call hands off. state: the random model's calls are cut
    at --max-new-tokens, so they fail and the task and the terminal alone hand off. none: not even those fit beside
    the first prompt: the episode ends as max_len, the failed hand-off recorded, as --no-summarize (off) ends it
    with none."""
    tok = labels.load_tokenizer(vllm_dir, "prefix")
    p = first_prompt_tokens(tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model = ending_model(vllm_dir, eos) if case == "short" else hf_model(vllm_dir)
    max_len = {"short": p + 120, "state": 800}.get(case, p + 8)
    try:
        eps = hand_off_run(llm, tok, model, max_len=max_len, max_new_tokens=48 if case == "short" else 16,
                           summarize=case != "off", n=1, max_turns=6)
    finally:
        engine.sync_weights(llm, hf_model(vllm_dir))
    ep = eps[0]
    assert len(engine.prompt_tokens(tok, ep.messages[:1])[0]) == p  # the first prompt as first_prompt_tokens has it
    check_handoffs(ep, tok, max_len)
    if case in ("short", "state"):
        assert ep.failure == "max_turns" and ep.handoffs and not ep.truncated, (ep.failure, ep.error)
        assert {h.fallback for h in ep.handoffs} == {case}, [(h.fallback, h.calls) for h in ep.handoffs]
    if case == "short":  # the summary call never fits; the short one does, and ends
        assert all([c["finish"] for c in h.calls] == ["no room", "stop"] for h in ep.handoffs)
    if case == "state":  # every call cut
        assert all(c["finish"] == "length" and c["reply_tokens"] == 16 for h in ep.handoffs for c in h.calls)
    if case in ("none", "off"):
        assert ep.failure == "max_len" and ep.truncated and len(ep.token_ids) == max_len, (ep.failure, ep.error)
    if case == "none":
        h, = ep.handoffs
        assert h.fallback is None and h.context == [] and h.start is None and episode.segments(ep) == [(0, max_len)]
        assert [c["finish"] for c in h.calls] == ["no room", "length"]
        assert ep.error == "the episode reached the context length; no context of the hand-off fit in it"
    if case == "off":
        assert ep.handoffs == [] and ep.error == "the episode reached the context length"
