"""GRPO: advantage math, the loss (grpo.pg_loss and a reference written here, on full logits one sequence at a time,
agree in every mode), episodes to training examples, dynamic sampling, and end-to-end runs on toy tasks in real
sandboxes with real vLLM: one killed and resumed, and runs on two torchrun ranks (DDP, FSDP2). The rollout engine's
own tests: tests/test_engine.py; the fork recipes': tests/test_forking.py."""
import contextlib
import copy
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import grpo
from actobs import batches, common, engine, labels, taskgen
from actobs.episode import Episode, Handoff
from actobs.labels import ACTION, OBS, PROMPT
from actobs.sandbox import daemon

ROOT = Path(__file__).resolve().parents[1]


def args_for(*flags):
    return grpo.get_parser().parse_args(["--init", "-", "--tasks", "-", "--out", "-", *flags])


# ---------------------------------------------------------------------------------------------- advantages

def test_group_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    adv, signal = grpo.group_advantages(r)
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [-0.25, 0.75, -0.25, -0.25]]))
    assert signal.tolist() == [True, False, True]
    adv, _ = grpo.group_advantages(r, scale_std=True)
    std = torch.tensor([0.5, 0.0, 0.75 ** 0.5 * 0.5])  # population std: sqrt(p (1 - p))
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.allclose(adv[2], (r[2] - 0.25) / (std[2] + 1e-6))
    # an infrastructure failure leaves its group's mean; a group with one valid episode has no signal
    valid = torch.tensor([[True, True, False, True], [True] * 4, [False, True, False, False]])
    adv, signal = grpo.group_advantages(r, valid)
    assert torch.allclose(adv[0], torch.tensor([1 / 3, -2 / 3, 0.0, 1 / 3])) and signal.tolist() == [True, False, False]


# ---------------------------------------------------------------------------------------------- the loss

def naive_logprobs(model, ids, T, allowed=None):
    """Full-logits log-probs of ids[1:] at temperature T and at 1: ((T-1,), (T-1,)), with autograd. allowed:
    (T-1, V) bool, the tokens a grammar allowed: the log-probs at T are then the masked log-softmax's."""
    ids = torch.tensor(ids)
    logits = model(input_ids=ids[None]).logits[0, :-1].float()  # (T-1, V)
    masked = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    lp_t = torch.log_softmax(masked / T, -1).gather(1, ids[1:, None]).squeeze(1)
    lp_1 = torch.log_softmax(logits, -1).gather(1, ids[1:, None]).squeeze(1)
    return lp_t, lp_1


def reference_loss(model, examples, args, n_tok, n_seq, n_echo):
    """The objective of grpo's docstring written out here, apart from grpo.pg_loss (from the examples' lists, not
    collate's batch, and the flags, not grpo.objective), with full logits, one sequence at a time: PPO's clipped
    surrogate at [1 - eps_low, 1 + eps_high], TIS against the old log-probs (the current ones, detached, when
    the example has none), k3 KL to ex.ref, ECHO (payload only or not) and the three normalisers."""
    low = args.clip if args.clip_low is None else args.clip_low
    high = args.clip if args.clip_high is None else args.clip_high
    total = 0.0
    for ex in examples:
        lp_t, lp_1 = naive_logprobs(model, ex.ids, args.temperature, unpacked(ex))
        roles = torch.tensor(ex.roles[1:])
        act, obs = roles == ACTION, roles == OBS
        if ex.forced is not None:  # a token the grammar allowed alone carries no loss
            act = act & ~torch.tensor(ex.forced[1:])
        if args.echo_payload_only:
            obs = obs & ~torch.tensor(ex.wrapper[1:])
        a = torch.tensor(ex.adv[1:])
        behav = torch.tensor(ex.behav[1:])
        if args.tis_cap > 0:
            old = torch.tensor(ex.old[1:]) if ex.old is not None else lp_t.detach()
            ratio, w = (lp_t - old).exp(), (old - behav).exp().clamp(max=args.tis_cap)
        else:
            ratio, w = (lp_t - behav).exp(), torch.ones_like(lp_t)
        s = torch.minimum(ratio * a, ratio.clamp(1 - low, 1 + high) * a)
        norm = {"token": 1 / n_tok, "sequence": 1 / (act.sum() * n_seq),
                "constant": 1 / (args.max_len * n_seq)}[args.loss_norm]
        total = total - (norm * w * s)[act].sum()
        if args.kl_coef:
            d = torch.tensor(ex.ref[1:]) - lp_t
            total = total + args.kl_coef * (norm * (d.exp() - d - 1))[act].sum()
        if args.echo_coef and obs.any():
            total = total + args.echo_coef * (-lp_1[obs]).sum() / obs.sum() / n_echo
    return total


def unpacked(ex):
    """An example's grammar masks as (T-1, V) bool, the mask of the token each position predicts (every token
    where it has none), or None without masks."""
    if ex.masks is None:
        return None
    table = np.unpackbits(np.stack(ex.masks), axis=1, bitorder="little").astype(bool)  # (M, >= V)
    ids = torch.tensor(ex.mask_ids[1:])
    return torch.from_numpy(table[ids.clamp(min=0).numpy()]) | (ids < 0)[:, None]


def behaviour(model, ex, T, shift):
    """The exact log-probs at T of ex's tokens (shifted by `shift` on action tokens: ratio e^-shift)."""
    with torch.no_grad():
        lp = naive_logprobs(model, ex.ids, T, unpacked(ex))[0]
    return [0.0] + [x + shift if r == ACTION else 0.0 for x, r in zip(lp.tolist(), ex.roles[1:])]


def perturbed(model, seed, scale=0.05):
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in m.parameters():
            q.add_(torch.randn(q.shape, generator=g) * scale)
    return m


# Each case: flags, the behaviour log-probs' shift per sequence (ratio e^-shift on its action tokens), and
# whether the examples carry old log-probs of another policy (a later --ppo-epochs epoch) or the initial
# policy's (KL). "clipped": the first two sequences sit outside the clip range on the side where the gradient
# stops (A > 0 and ratio 1.65; A < 0 and ratio 0.61); the third where it flows (A > 0, ratio 0.61).
# "clip-higher": [0.9, 1.5]: ratio 1.35 with A > 0 flows (it would stop at 1.2), 0.74 with A < 0 stops (it would
# flow at 0.8), 1.82 with A > 0 stops.
LOSS_CASES = {
    "ratio1": ([], [0, 0, 0], None),
    "clipped": ([], [-0.5, 0.5, 0.5], None),
    "clip-higher": (["--clip-low", "0.1", "--clip-high", "0.5"], [-0.3, 0.3, -0.6], None),
    "echo": (["--echo-coef", "0.5"], [0, 0, 0], None),
    "echo-payload": (["--echo-coef", "0.5", "--echo-payload-only"], [0.1, -0.1, 0], None),
    "kl": (["--kl-coef", "0.3"], [0.05, -0.05, 0], "ref"),
    "tis": (["--tis-cap", "1.2"], [-0.5, 0.5, 0.1], None),  # w = e^-shift: capped, 0.61, 0.90
    "tis-old": (["--tis-cap", "1.2", "--ppo-epochs", "2"], [-0.3, 0.3, 0.1], "old"),
}


def grammar_masks(ex, vocab_size, seed):
    """Give example ex masks as a grammar would (engine.VLLMPolicy's masks, mask_ids) and forced: at each action
    token one of three random masks (a third of the vocabulary) plus the token itself, or, every fourth, a mask
    allowing that token alone (forced)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(3, vocab_size, generator=g) < 0.3  # (3, V)
    index, ex.masks, ex.mask_ids, ex.forced = {}, [], [], []
    for i, (t, r) in enumerate(zip(ex.ids, ex.roles)):
        kind = i % 4 if r == ACTION else -1
        if kind < 0:
            ex.mask_ids.append(-1)
        else:
            ok = torch.zeros(vocab_size, dtype=torch.bool) if kind == 3 else base[kind].clone()
            ok[t] = True
            bits = np.packbits(np.pad(ok.numpy(), (0, -vocab_size % 32)), bitorder="little")
            if bits.tobytes() not in index:
                index[bits.tobytes()] = len(ex.masks)
                ex.masks.append(bits)
            ex.mask_ids.append(index[bits.tobytes()])
        ex.forced.append(kind == 3)


def loss_examples(model, tokenizer, synthetic, args, shifts, extra, advs=(1.0, -0.5, 0.75), grammar=False):
    examples = []
    for conv, adv, sh in zip(synthetic[:3], advs, shifts):
        ids, roles = labels.render(tokenizer, conv, max_len=200)
        wrapper = [r == OBS and i % 3 == 0 for i, r in enumerate(roles)]  # some observation tokens are wrapper text
        ex = batches.Example(ids=ids, roles=roles, wrapper=wrapper, adv=[adv] * len(ids), behav=None)
        if grammar:
            grammar_masks(ex, model.config.vocab_size, seed=len(examples))
        ex.behav = behaviour(model, ex, args.temperature, sh)
        examples.append(ex)
    if extra:  # another policy's log-probs: the initial one's (KL) or the trainer's before the first update (TIS)
        other = perturbed(model, seed=7)
        for ex in examples:
            setattr(ex, extra, behaviour(other, ex, args.temperature, 0.0))
    return examples


def loss_tokens(examples):
    """The action tokens of the examples that carry loss: all but the forced ones."""
    return sum(r == ACTION and not f for ex in examples
               for r, f in zip(ex.roles[1:], (ex.forced or [False] * len(ex.ids))[1:]))


def assert_loss_matches_reference(model, tokenizer, synthetic, norm, case, grammar):
    """grpo.pg_loss (in two padded micro-batches) and reference_loss (full logits, one sequence at a time): the same
    loss and the same gradients."""
    flags, shifts, extra = LOSS_CASES[case]
    args = args_for("--loss-norm", norm, "--temperature", "0.7", "--max-len", "300", *flags)
    examples = loss_examples(model, tokenizer, synthetic, args, shifts, extra, grammar=grammar)
    n_tok = loss_tokens(examples)
    n_seq, n_echo = len(examples), len(examples)
    obj, step_norm = grpo.objective(args), grpo.Normalisers(act_tokens=n_tok, seqs=n_seq, echo_seqs=n_echo)

    ref_model = copy.deepcopy(model)
    ref = reference_loss(ref_model, examples, args, n_tok, n_seq, n_echo)
    ref.backward()
    model.zero_grad()
    total = 0.0
    for part in ([examples[0]], examples[1:]):  # two micro-batches, padded: the normalisers are the step's
        batch = batches.collate(part, tokenizer.pad_token_id)
        loss, st = grpo.pg_loss(model, batch, obj, step_norm)
        loss.backward()
        total += st["loss"]
    assert total == pytest.approx(ref.item(), rel=1e-4, abs=1e-6)
    assert any(q.grad.abs().max() > 0 for q in ref_model.parameters())
    for (name, p), r in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.allclose(p.grad, r.grad, rtol=1e-3, atol=1e-7), name
    if case in ("clipped", "clip-higher"):  # only one sequence moves the weights
        flows = {"clipped": 2, "clip-higher": 0}[case]
        model.zero_grad()
        stopped = [ex for i, ex in enumerate(examples) if i != flows]
        batch = batches.collate(stopped, tokenizer.pad_token_id)
        loss, st = grpo.pg_loss(model, batch, obj, step_norm)
        loss.backward()
        assert all(p.grad is None or p.grad.abs().max() == 0 for p in model.parameters())
        assert st["clipped_sum"] == st["act_tokens"]
    model.zero_grad()


@pytest.mark.parametrize("norm", ["token", "sequence", "constant"])
@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_matches_reference(model, tokenizer, synthetic, norm, case):
    assert_loss_matches_reference(model, tokenizer, synthetic, norm, case, grammar=False)


@pytest.mark.parametrize("norm", ["token", "sequence"])
@pytest.mark.parametrize("case", ["ratio1", "clipped", "echo", "kl", "tis-old"])
def test_loss_under_a_grammar_matches_reference(model, tokenizer, synthetic, norm, case):
    """--grammar: the reference's log-probs are the log-softmax over the tokens each position's mask allowed (the
    ratio, the KL's, ECHO's unmasked), the forced tokens out of the loss and of the normalisers."""
    assert_loss_matches_reference(model, tokenizer, synthetic, norm, case, grammar=True)


@pytest.mark.parametrize("flags", [[], ["--kl-coef", "0.3"]], ids=["no KL", "KL"])
def test_every_rank_sums_the_same_stats(model, tokenizer, synthetic, flags):
    """A rank left without examples (dynamic sampling handed every group with signal to the others) forwards an empty
    one; its loss stats must name what another rank's do, the step's log sums them over the ranks by position: with
    a KL term, the KL's sums too (its empty example holds no initial policy's log-probs)."""
    args = args_for("--temperature", "0.7", *flags)
    examples = loss_examples(model, tokenizer, synthetic, args, [0.05, -0.05, 0], "ref" if flags else None)
    obj, norm = grpo.objective(args), grpo.Normalisers(act_tokens=10, seqs=3, echo_seqs=0)
    keys = [sorted(grpo.pg_loss(model, batches.micro_batch(examples, g, 0, torch.device("cpu")), obj, norm)[1])
            for g in ([0, 1], [])]
    assert keys[0] == keys[1] and ("kl_init_sum" in keys[0]) == bool(flags)


def test_forced_tokens_carry_no_loss(model, tokenizer, synthetic):
    """Under a grammar, a token its mask allowed alone (log-prob 0 whatever the weights) carries no loss, no KL and
    no count: with every action token forced, pg_loss gives no gradient and counts no action token, though the
    same examples with those tokens free (masked but not forced) move the weights."""
    args = args_for("--temperature", "0.7", "--kl-coef", "0.3")
    examples = loss_examples(model, tokenizer, synthetic, args, [0.1, -0.1, 0.0], "ref", grammar=True)
    for ex in examples:
        ex.forced = [r == ACTION for r in ex.roles]
    for free in (False, True):
        model.zero_grad()
        batch = batches.collate([dataclasses.replace(ex, forced=[f and not free for f in ex.forced])
                                 for ex in examples], tokenizer.pad_token_id)
        loss, st = grpo.pg_loss(model, batch, grpo.objective(args), grpo.Normalisers(100, 3, 0))
        loss.backward()
        moved = max(p.grad.abs().max() for p in model.parameters() if p.grad is not None)
        assert (moved > 0 and st["act_tokens"] > 0) if free else (moved == 0 and st["act_tokens"] == 0)
    model.zero_grad()


# what each case's flags or extra log-probs are set against: the same examples without the mode
WITHOUT = {"clipped": (["--clip", "10"], None), "clip-higher": ([], None), "echo": ([], None),
           "echo-payload": (["--echo-coef", "0.5"], None), "kl": ([], None), "tis": ([], None),
           "tis-old": (["--tis-cap", "1.2"], None)}


def test_reference_tells_the_modes_apart(model, tokenizer, synthetic):
    """Each case's mode changes the reference's gradient (by more than the tolerance of the comparison above), so
    pg_loss cannot match it with that mode's term missing, its sign flipped or its bounds swapped."""
    def grad(flags, shifts, extra):
        args = args_for("--temperature", "0.7", "--max-len", "300", *flags)
        examples = loss_examples(model, tokenizer, synthetic, args, shifts, extra)
        m = copy.deepcopy(model)
        reference_loss(m, examples, args, loss_tokens(examples), 3, 3).backward()
        return torch.cat([q.grad.flatten() for q in m.parameters()])
    for case, (flags, extra) in WITHOUT.items():
        with_mode, shifts, with_extra = LOSS_CASES[case]
        g = grad(with_mode, shifts, with_extra)
        assert not torch.allclose(g, grad(flags, shifts, extra), rtol=1e-2, atol=1e-6), case
        if case == "kl":  # and the KL's sign: a penalty of the opposite sign gives another gradient
            assert not torch.allclose(g, grad(["--kl-coef", "-0.3"], shifts, with_extra), rtol=1e-2, atol=1e-6)
        if case == "clip-higher":  # and the bounds swapped
            swapped = grad(["--clip-low", "0.5", "--clip-high", "0.1"], shifts, None)
            assert not torch.allclose(g, swapped, rtol=1e-2, atol=1e-6)


def forward_rows(module):
    """A list that grows by the batch size of every forward of module (a base model)."""
    rows = []
    module.register_forward_pre_hook(lambda m, a, kw: rows.append(len(kw["input_ids"])), with_kwargs=True)
    return rows


def train(model, init, opt, examples, args, pad_id):
    """grpo.train_batch in one CPU process: `model` trains, `init` is the initial policy."""
    return grpo.train_batch(common.LossModule(model), init, opt, examples, grpo.objective(args), pad_id,
                            torch.device("cpu"), contextlib.nullcontext(), 0, print, ppo_epochs=args.ppo_epochs,
                            micro_tokens=args.micro_tokens, grad_clip=args.grad_clip, fsdp=False)


def reference_steps(model, init, examples, args, opt, epochs):
    """--ppo-epochs updates by reference_loss on all examples at once: old log-probs (with --tis-cap) before the
    first, the initial policy's for the KL, the normalisers over every example."""
    examples = [dataclasses.replace(ex, ref=behaviour(init, ex, args.temperature, 0.0)) for ex in examples]
    if args.tis_cap > 0 and epochs > 1:
        examples = [dataclasses.replace(ex, old=behaviour(model, ex, args.temperature, 0.0)) for ex in examples]
    losses = []
    for _ in range(epochs):
        opt.zero_grad()
        loss = reference_loss(model, examples, args, loss_tokens(examples), len(examples), len(examples))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_ppo_epochs_with_tis_and_kl_match_reference(model, tokenizer, synthetic):
    """grpo.train_batch over two --ppo-epochs, in micro-batches: the old log-probs are the trainer's before the
    first update, the KL's are the initial policy's (scored by batches.policy_logprobs); the weights after both
    updates are the reference's."""
    args = args_for("--ppo-epochs", "2", "--tis-cap", "1.5", "--kl-coef", "0.2", "--temperature", "0.7",
                    "--grad-clip", "0", "--micro-tokens", "400")
    init = perturbed(model, seed=3)
    examples = loss_examples(model, tokenizer, synthetic, args, [-0.2, 0.3, 0.0], None)
    mine, theirs = copy.deepcopy(model), copy.deepcopy(model)
    opt = torch.optim.SGD(mine.parameters(), lr=0.1)
    tot, gnorm = train(mine, init, opt, examples, args, tokenizer.pad_token_id)
    losses = reference_steps(theirs, init, examples, args, torch.optim.SGD(theirs.parameters(), lr=0.1), 2)
    assert tot["loss"] == pytest.approx(losses[0], rel=1e-4) and gnorm > 0 and tot["episodes_trained"] == 3
    assert abs(losses[1] - losses[0]) > 1e-3  # the second epoch saw another policy than the first
    moved = max((a - b).abs().max() for a, b in zip(theirs.parameters(), model.parameters()))
    assert moved > 1e-3
    for (name, a), b in zip(mine.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_groups_without_signal_are_not_forwarded(model, tokenizer, synthetic):
    """Without KL or ECHO an example whose advantage is 0 is never forwarded (neither the policy nor the initial
    policy sees it), and the update is still the reference's over all examples (the normaliser counts it)."""
    args = args_for("--temperature", "0.7", "--grad-clip", "0")
    examples = loss_examples(model, tokenizer, synthetic, args, [0.1, 0.0, -0.1], None, advs=(1.0, 0.0, -0.5))
    mine, theirs, init = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    rows, init_rows = forward_rows(mine.base_model), forward_rows(init.base_model)
    opt = torch.optim.SGD(mine.parameters(), lr=1.0)
    tot, _ = train(mine, init, opt, examples, args, tokenizer.pad_token_id)
    assert sum(rows) == 2 and sum(init_rows) == 2 and tot["episodes_trained"] == 2
    reference_steps(theirs, init, examples, args, torch.optim.SGD(theirs.parameters(), lr=1.0), 1)
    for a, b in zip(mine.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_step_without_signal_makes_no_update(model, tokenizer, synthetic):
    """After a step with signal, Adam's moments would move the weights on a step whose gradient is 0; a step
    with nothing to learn from runs no forward and no optimizer step: the weights and Adam's state stay."""
    args = args_for("--temperature", "0.7", "--lr", "1e-2")
    examples = loss_examples(model, tokenizer, synthetic, args, [0, 0, 0], None)
    mine = copy.deepcopy(model)
    opt = torch.optim.AdamW(mine.parameters(), lr=args.lr)
    run = lambda exs: train(mine, model, opt, exs, args, tokenizer.pad_token_id)  # noqa: E731
    assert run(examples)[1] > 0
    before = [q.detach().clone() for q in mine.parameters()]
    state = copy.deepcopy(opt.state_dict())
    rows = forward_rows(mine.base_model)
    tot, gnorm = run([dataclasses.replace(ex, adv=[0.0] * len(ex.ids)) for ex in examples])
    assert gnorm is None and rows == [] and tot == {"episodes_trained": 0}
    assert all(torch.equal(a, b) for a, b in zip(before, mine.parameters()))
    assert all(v["step"] == state["state"][k]["step"] for k, v in opt.state_dict()["state"].items())
    for q in mine.parameters():  # what an update with a gradient of 0 would have done
        q.grad = torch.zeros_like(q)
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, mine.parameters()))


def test_help_puts_the_recipe_first():
    """grpo.py --help: the recipe's group first, holding exactly the flags ablation.sh gives grpo.py (its GRPO=(...)
    recipes and what they add, the ECHO arm's, what its grpo() adds) but those of how a run computes and where it
    writes (the groups execution and run: FREE_ON_RESUME, tests/test_runs.py); then the rest by purpose; every flag
    has its help."""
    text = (ROOT / "ablation.sh").read_text()
    given = (re.findall(r"\b(?:GRPO|ECHO|PTF|NET)\+?=\((.*?)\)", text, re.S)
             + re.findall(r"^grpo\(\) \{(.*?)\); \}$", text, re.M | re.S))
    flags = {f[2:].removeprefix("no-").replace("-", "_")  # --no-summarize: summarize's
             for f in re.findall(r"(?<![\w-])--[a-z][a-z-]*", " ".join(given))}
    parser = grpo.get_parser()
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups[2:]}
    assert list(groups) == ["recipe", "tasks and rollouts", "objective", "optimizer", "execution", "run"]
    assert groups["recipe"] == flags - set(grpo.FREE_ON_RESUME) and {"lr", "kl_coef", "echo_coef"} <= flags
    assert all(a.help for a in parser._actions), "a flag without help"


# ---------------------------------------------------------------------------------------------- episodes to examples

def episode(reward, truncated=False, failure=None):
    return Episode("t", [], reward=reward, failure=failure, token_ids=[5, 6, 7], roles=[PROMPT, ACTION, ACTION],
                        logprobs=[0.0, -1.0, -1.0], obs_wrapper=[False] * 3, truncated=truncated)


def examples_of(episodes, args):
    """What grpo.main makes of one draw's episodes: rewards -> advantages -> training examples per group.
    -> (examples per group, has_signal (G,), valid (G, S))."""
    rewards, valid, trains = grpo.group_rewards(episodes, args.group_size, args.overlong, args.overlong_penalty)
    adv, signal = grpo.group_advantages(rewards, valid, args.scale_std)
    return grpo.group_examples(episodes, adv, trains), signal, valid


def test_overlong_episodes_kept_masked_or_penalised():
    # group 0: rewards 1 0 1, the last cut by the context; group 1: 0 0 0, the last cut; group 2: an infra failure
    eps = [episode(1.0), episode(0.0), episode(1.0, truncated=True), episode(0.0), episode(0.0),
           episode(0.0, truncated=True), episode(1.0), episode(0.0), episode(0.0, failure="sandbox_error")]
    adv = lambda groups: [[round(ex.adv[0], 6) for ex in g] for g in groups]  # noqa: E731
    r = lambda rows: [[round(x, 6) for x in g] for g in rows]  # noqa: E731
    groups, signal, valid = examples_of(eps, args_for("--group-size", "3"))
    assert adv(groups) == r([[1 / 3, -2 / 3, 1 / 3], [0, 0, 0], [0.5, -0.5]])
    assert signal.tolist() == [True, False, True] and valid.tolist() == [[True] * 3, [True] * 3, [True, True, False]]
    groups, signal, _ = examples_of(eps, args_for("--group-size", "3", "--overlong", "mask"))
    assert adv(groups) == r([[1 / 3, -2 / 3], [0, 0], [0.5, -0.5]]) and signal.tolist() == [True, False, True]
    groups, signal, _ = examples_of(eps, args_for("--group-size", "3", "--overlong", "penalty", "--overlong-penalty",
                                                  "0.5"))
    # rewards 1 0 0.5 and 0 0 -0.5: the cut episodes lose 0.5, and group 1 gains a signal
    assert adv(groups) == r([[0.5, -0.5, 0.0], [1 / 6, 1 / 6, -1 / 3], [0.5, -0.5]])
    assert signal.tolist() == [True, True, True]


def fake_run(out, init, monkeypatch, *flags, signal_tasks):
    """grpo.main on a tiny model with its rollouts faked (no Docker, no vLLM): 10 tasks, groups of 2; in a group of
    a task in signal_tasks the first episode is solved, the second not. -> (the draws (step, draw, task indices),
    the examples each step trained on, the log rows)."""
    draws, trained = [], []

    def draw_episodes(llm, tok, tasks, template, args, step, rank, gen, draw, groups):
        draws.append((step, draw, groups))
        return [episode(float(g in signal_tasks and i == 0)) for g in groups for i in range(args.group_size)]

    def train_batch(model, ref, opt, examples, *rest, **kw):
        trained.append(list(examples))
        return real_train_batch(model, ref, opt, examples, *rest, **kw)
    real_train_batch = grpo.train_batch
    monkeypatch.setattr(grpo, "load_tasks", lambda path, kinds=None: list(range(10)))
    monkeypatch.setattr(engine, "make_engine", lambda *a, **k: None)
    monkeypatch.setattr(engine, "sync_weights", lambda llm, model: (0.0, 0.0))
    monkeypatch.setattr(grpo, "draw_episodes", draw_episodes)
    monkeypatch.setattr(grpo, "train_batch", train_batch)
    grpo.main(["--init", str(init), "--chat-template", "prefix", "--tasks", "-", "--out", str(out), "--dtype", "fp32",
               "--tasks-per-step", "3", "--group-size", "2", "--steps", "1", "--save-every", "0", "--lr", "1e-3",
               *flags])
    return draws, trained, [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]


def test_dynamic_sampling_fills_the_step_with_signal_groups(tmp_path, tiny_dir, monkeypatch):
    """Groups without signal are dropped and further draws (new tasks, seeded by the draw) fill the step to
    --tasks-per-step groups with signal, trimmed to exactly that many, or stop at the cap; the same step draws
    the same tasks again (a resumed run). Off, one draw trains every group. The log counts every drawn group."""
    def run(name, *flags, signal_tasks=frozenset(range(5))):
        draws, trained, rows = fake_run(tmp_path / name, tiny_dir, monkeypatch, "--seed", "0", *flags,
                                        signal_tasks=signal_tasks)
        assert [g for _, _, g in draws] == [grpo.step_groups(10, 3, 0, 0, d) for _, d, _ in draws]
        drawn = [g for _, _, gs in draws for g in gs]
        assert rows[0]["rollout/groups_drawn"] == len(drawn)
        assert rows[0]["rollout/groups_with_signal"] == sum(g in signal_tasks for g in drawn)
        return draws, [g in signal_tasks for g in drawn], trained[0]

    draws, signal, examples = run("off")
    assert len(draws) == 1 and len(examples) == 6
    draws, signal, examples = run("on", "--dynamic-sampling", "30")
    assert sum(signal[:-3]) < 3 < sum(signal)  # the last draw had more than the step lacked: trimmed
    assert len(examples) == 6 and sorted(ex.adv[0] for ex in examples) == [-0.5] * 3 + [0.5] * 3
    assert run("again", "--dynamic-sampling", "30")[0] == draws  # the same tasks again
    draws, signal, examples = run("cap", "--dynamic-sampling", "6", signal_tasks={9})
    assert len(draws) == 2 and len(signal) == 6 and len(examples) == 2 * sum(signal)
    first = np.random.default_rng([0, 0]).choice(10, 3, replace=False)
    assert grpo.step_groups(10, 3, 0, 0) == first.tolist()  # the first draw is the draw of a run without it
    text = (tmp_path / "on" / "transcripts" / "step_0001.md").read_text()  # a solved and a failed episode, one group
    assert text.count("\n## solved: t, reward 1.00, advantage +0.500") == text.count("\n## failed: t, reward 0.00") == 1


def test_no_initial_policy_without_a_kl_term(tmp_path, tiny_dir, monkeypatch):
    """--kl-coef 0 (the default, the paper's setting): the initial policy is not loaded (one model: the policy) and
    no KL is computed or logged; with a KL term it is loaded, and its KL logged."""
    loads, real = [], common.load_model
    monkeypatch.setattr(common, "load_model", lambda path, device: loads.append(path) or real(path, device))
    _, _, rows = fake_run(tmp_path / "no-kl", tiny_dir, monkeypatch, signal_tasks=frozenset(range(10)))
    assert len(loads) == 1 and "train/entropy" in rows[0]
    assert not any(k.startswith("train/kl_init") for k in rows[0])
    loads.clear()
    _, _, rows = fake_run(tmp_path / "kl", tiny_dir, monkeypatch, "--kl-coef", "0.1", signal_tasks=frozenset(range(10)))
    assert len(loads) == 2 and rows[0]["train/kl_init_k3"] >= 0


def test_redraw_gives_the_last_steps_the_first_steps_tasks(tmp_path, tiny_dir, monkeypatch):
    """--redraw K: the last K steps draw the tasks the first K drew, in order, and log whose draw they used; the
    steps between keep their own draws; more than half the steps is refused before anything loads."""
    draws, _, rows = fake_run(tmp_path / "run", tiny_dir, monkeypatch, "--seed", "4", "--steps", "8", "--redraw", "2",
                              signal_tasks=set(range(10)))
    drawn = {step: groups for step, _, groups in draws}
    assert [grpo.task_step(s, 8, 2) for s in range(8)] == [0, 1, 2, 3, 4, 5, 0, 1]
    assert [r["rollout/task_draw"] for r in rows] == [1, 2, 3, 4, 5, 6, 1, 2]
    assert drawn[6] == drawn[0] and drawn[7] == drawn[1]
    assert [drawn[s] for s in range(6)] == [grpo.step_groups(10, 3, s, 4) for s in range(6)]
    assert [grpo.task_step(s, 8, 0) for s in range(8)] == list(range(8))  # off: every step its own draw
    with pytest.raises(ValueError, match="--redraw 5: .* at most half of --steps 8"):
        grpo.main(["--init", "-", "--tasks", "-", "--out", "-", "--steps", "8", "--redraw", "5"])


def test_examples_under_a_grammar_carry_its_masks_and_forced_tokens():
    """An episode decoded under the grammar (its masks and mask_ids, as engine.VLLMPolicy stores them) becomes an
    example with them and its forced tokens (those whose mask allows one token): out of the action tokens that
    carry loss; without a grammar an example has none. --grammar is a setting a resumed run keeps."""
    one, two = (np.packbits(np.isin(np.arange(32), ok), bitorder="little") for ok in ([6], [6, 7]))
    eps = [dataclasses.replace(episode(r), masks=[one, two], mask_ids=[-1, 0, 1]) for r in (1.0, 0.0)]
    groups, _, _ = examples_of(eps, args_for("--group-size", "2"))
    ex = groups[0][0]
    assert ex.forced == [False, True, False] and ex.mask_ids == [-1, 0, 1] and len(ex.masks) == 2
    assert grpo.loss_tokens(ex) == 1
    plain = examples_of([episode(1.0), episode(0.0)], args_for("--group-size", "2"))[0][0][0]
    assert plain.masks is None and plain.forced is None and grpo.loss_tokens(plain) == 2
    assert "grammar" not in grpo.FREE_ON_RESUME and args_for("--grammar").grammar == "reply"


def handed_off(reward, seed=0):
    """An episode handed off once (episode.Handoff at token 6): its first context holds 3 action tokens (two
    replies), the one after it 2; random ids of the tiny vocabulary, no log-probs yet."""
    g = torch.Generator().manual_seed(seed)
    roles = [PROMPT] * 2 + [ACTION] * 2 + [OBS] + [ACTION] + [PROMPT] * 3 + [ACTION] * 2
    return Episode("t", [], reward=reward, token_ids=torch.randint(10, 2000, (len(roles),), generator=g).tolist(),
                   roles=roles, logprobs=[0.0] * len(roles), obs_wrapper=[False] * len(roles),
                   handoffs=[Handoff(at=4, fallback="summary", start=6)])


def test_a_handed_off_episode_trains_each_context_it_sampled_in():
    """Each context of a handed-off episode is an example of its own (episode.segments), every token with the
    episode's advantage, its tokens and log-probs those of that context alone; under a grammar its slice of the mask
    indices and forced tokens, with the episode's masks. A context with no reply in it (a hand-off after which the
    episode ended) is no example."""
    eps = [handed_off(1.0), handed_off(0.0, seed=1)]
    eps[0].logprobs = [float(-i) for i in range(len(eps[0].roles))]
    groups, _, _ = examples_of(eps, args_for("--group-size", "2"))
    assert [len(g) for g in groups] == [4]
    first, second = groups[0][:2]
    assert first.ids == eps[0].token_ids[:6] and second.ids == eps[0].token_ids[6:]
    assert first.roles == eps[0].roles[:6] and second.behav == eps[0].logprobs[6:]
    assert first.adv == [0.5] * 6 and second.adv == [0.5] * 5 and groups[0][2].adv == [-0.5] * 6
    assert [grpo.loss_tokens(ex) for ex in groups[0]] == [3, 2, 3, 2]
    one, two = (np.packbits(np.isin(np.arange(32), ok), bitorder="little") for ok in ([6], [6, 7]))
    masked = dataclasses.replace(handed_off(1.0), masks=[one, two], mask_ids=[-1, -1, 0, 1, -1, 1, -1, -1, -1, 0, 1])
    ex = examples_of([masked, handed_off(0.0)], args_for("--group-size", "2"))[0][0][1]
    assert ex.mask_ids == [-1, -1, -1, 0, 1] and ex.masks == [one, two]
    assert ex.forced == [False, False, False, True, False]
    ended = dataclasses.replace(handed_off(1.0), token_ids=[5] * 8, roles=[PROMPT] * 2 + [ACTION] * 4 + [PROMPT] * 2,
                                logprobs=[0.0] * 8, obs_wrapper=[False] * 8)
    group = examples_of([ended, handed_off(0.0, seed=1)], args_for("--group-size", "2"))[0][0]
    assert [ex.ids for ex in group] == [[5] * 6] + [ex.ids for ex in groups[0][2:]]


@pytest.mark.parametrize("norm", ["token", "sequence", "constant"])
def test_how_the_normalisers_weigh_a_handed_off_episode(model, norm):
    """A group of two: X handed off once (contexts of 3 and 2 action tokens, advantage +0.5), Y not (one context of
    4, advantage -0.5). At ratio 1 the policy-gradient loss is -sum_i n_i A: token weighs every action token alike,
    as if X's contexts were one sequence; sequence makes each context a sequence, its mean over its own tokens (X
    counts twice); constant weighs every token 1 / (--max-len x the step's sequences), contexts counted."""
    x = handed_off(1.0)
    roles = [PROMPT] * 2 + [ACTION] * 2 + [OBS] + [ACTION] * 2
    y = Episode("t", [], reward=0.0, token_ids=list(range(20, 20 + len(roles))), roles=roles,
                logprobs=[0.0] * len(roles), obs_wrapper=[False] * len(roles))
    args = args_for("--group-size", "2", "--loss-norm", norm, "--max-len", "64")
    examples = examples_of([x, y], args)[0][0]
    behav = batches.policy_logprobs(model, examples, args.temperature, 10_000, 0, torch.device("cpu"),
                                    contextlib.nullcontext())
    examples = [dataclasses.replace(ex, behav=lp) for ex, lp in zip(examples, behav)]  # the trainer's: ratio 1
    norm_ = grpo.Normalisers(act_tokens=sum(map(grpo.loss_tokens, examples)), seqs=len(examples), echo_seqs=0)
    with torch.no_grad():
        loss, st = grpo.pg_loss(model, batches.collate(examples, 0), grpo.objective(args), norm_)
    want = {"token": -(0.5 * 5 - 0.5 * 4) / 9, "sequence": -(0.5 + 0.5 - 0.5) / 3,
            "constant": -(0.5 * 5 - 0.5 * 4) / (64 * 3)}[norm]
    assert len(examples) == 3 and st["act_tokens"] == 9
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-7)


# ---------------------------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def toy_tasks(tmp_path_factory, base_image):
    d = tmp_path_factory.mktemp("rl")
    for kind in ("find_copy", "rename"):
        spec = taskgen.generate(kind, random.Random(3))
        taskgen.write_harbor(spec, d / spec.name, daemon.BASE_IMAGE)
    return d


def run_cli(out, tasks, model, *extra, wait=True, ranks=1):
    """grpo.py on toy settings in a process group of its own; ranks > 1: under torchrun (gloo), one thread a rank."""
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                                 if ranks > 1 else [])
    cmd = [*launch, str(ROOT / "grpo.py"), "--init", str(model), "--chat-template", "prefix", "--tasks", str(tasks),
           "--out", str(out), "--steps", "2", "--tasks-per-step", "2", "--group-size", "2", "--max-turns", "2",
           "--max-new-tokens", "24", "--max-len", "1024", "--lr", "1e-3", "--echo-coef", "0.05", "--save-every", "1",
           "--concurrency", "4", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if ranks > 1 else None
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    if wait:
        text, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, text[-3000:]
        return text
    return proc


def weights(path):
    from safetensors.torch import load_file
    return load_file(str(Path(path) / "model.safetensors"))


# fp32 whatever the CPU, and a KL term: the KL from the initial policy is 0 at the first step (in bf16 the policy's
# fp32 norms and embeddings against the initial policy's bf16 copy part by ~1e-4)
E2E = ("--dtype", "fp32", "--kl-coef", "0.01")


@pytest.mark.slow
def test_end_to_end_killed_and_resumed(tmp_path, toy_tasks, vllm_dir, no_leftovers):
    """Two steps on toy tasks with real sandboxes and real vLLM. The run is killed (SIGTERM) during its second
    step's rollouts: no sandbox is left, and --resume continues from the step-1 checkpoint (its log row kept)
    to the end: the log, the checkpoints, the curves. (Sandbox rollouts are not bit-reproducible, the container
    hostname is in the first screen, so the resumed step is checked for its state, not for equal weights.)"""
    out = tmp_path / "run"
    proc = run_cli(out, toy_tasks, vllm_dir, *E2E, wait=False)
    deadline = time.time() + 600
    while not ((out / "step-000001").exists() and daemon.my_containers(proc.pid)):
        if proc.poll() is not None or time.time() > deadline:
            pytest.fail(proc.stdout.read()[-3000:])
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    assert daemon.my_containers(proc.pid) == [] and not (out / "step-000002").exists()
    first = (out / "log.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in first] == [1]
    before = weights(out / "step-000001")

    text = run_cli(out, toy_tasks, vllm_dir, *E2E, "--resume")
    assert "resumed at step 1" in text
    rows = (out / "log.jsonl").read_text().splitlines()
    assert rows[0] == first[0] and [json.loads(r)["step"] for r in rows] == [1, 2]
    rows = [json.loads(r) for r in rows]
    for key in ("rollout/reward_mean", "rollout/groups_with_signal", "rollout/groups_drawn", "train/entropy",
                "train/kl_init", "train/mismatch_abs", "rollout/generator_idle_frac", "time/sync_s", "train/echo_loss",
                "train/optimizer_steps", "rollout/failures/max_turns"):
        assert key in rows[1]
    assert rows[0]["train/mismatch_abs"] < 1e-3 and rows[0]["train/kl_init"] == pytest.approx(0, abs=1e-6)
    assert rows[1]["train/kl_init"] != 0 and rows[1]["train/action_tokens"] > 0  # step 2 rolled out the step-1 policy
    assert weights(out / "step-000001").keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in weights(out / "step-000001").items())
    assert (out / "curves.png").exists() and (out / "final" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------- two ranks

# torchrun on two gloo ranks, each with its own engine; fp32 whatever the CPU (the mismatch bound below is fp32's)
TWO_RANKS = ("--dtype", "fp32")


def rank_pids(pid):
    """{rank: pid} of the worker processes torchrun process `pid` has started so far."""
    out = {}
    try:
        kids = [int(k) for t in Path(f"/proc/{pid}/task").iterdir() for k in (t / "children").read_text().split()]
        for k in kids:
            env = dict(v.split("=", 1) for v in Path(f"/proc/{k}/environ").read_text().split("\0") if "=" in v)
            if "RANK" in env:
                out[int(env["RANK"])] = k
    except OSError:  # a process went away while read: the next poll reads again
        pass
    return out


def wait_for(proc, ready, timeout=600):
    """Poll until ready() or fail with the run's output (it exited or the time ran out)."""
    deadline = time.time() + timeout
    while not ready():
        if proc.poll() is not None or time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(proc.stdout.read()[-3000:])
        time.sleep(0.2)


def checksum(path):
    """engine.sync_weights' checksum of a checkpoint: weights_checksum over its state dict (the tied head included)."""
    from transformers import AutoModelForCausalLM
    sd = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    return float(sum(engine.weights_checksum(v) for v in sd.values()))


def log_rows(out):
    return [json.loads(r) for r in (Path(out) / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def coin_tasks(tmp_path_factory, toy_tasks):
    """The toy tasks with a verifier that pays 1 or 0 at random: a group of three has signal three times in four, so
    a draw's two groups (one per rank) may both, one or neither have it."""
    d = tmp_path_factory.mktemp("coin")
    for t in toy_tasks.iterdir():
        shutil.copytree(t, d / t.name)
        (d / t.name / "tests" / "test.sh").write_text("#!/bin/bash\necho $((RANDOM % 2)) > /logs/verifier/reward.txt\n")
    return d


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def two_rank_run(request, tmp_path_factory, coin_tasks, vllm_dir):
    """A two-step run on two ranks (DDP or FSDP2), groups of three, dynamic sampling up to four draws a step (a step
    without signal, which makes no update, then comes once in 65,536), a KL term (its initial policy a full copy a
    rank under DDP, sharded like the policy under FSDP2); shared by the tests below. -> (its run dir, its log rows)."""
    out = tmp_path_factory.mktemp(request.param) / "run"
    run_cli(out, coin_tasks, vllm_dir, *TWO_RANKS, "--group-size", "3", "--dynamic-sampling", "8", "--kl-coef", "0.01",
            *(["--fsdp"] if request.param == "fsdp" else []), ranks=2)  # the initial policy sharded under FSDP2
    return out, log_rows(out)


@pytest.mark.slow
def test_two_ranks_hold_the_weights_their_engines_sample(two_rank_run):
    """After each step both ranks' engines got the same weights (their checksums agree: under DDP each rank's own
    update, under FSDP2 the gathered shards), those of the step's checkpoint; and each rank's engine samples under
    them: at step 2, after an update that moved the policy, the worst rank's rollout/trainer mismatch is fp32's."""
    out, rows = two_rank_run
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/optimizer_steps"] == 1 for r in rows)
    for r in rows:
        assert r["train/weights_checksum_spread"] == 0
        assert r["train/weights_checksum"] == pytest.approx(checksum(out / f"step-{r['step']:06d}"), rel=1e-12)
    assert rows[0]["train/weights_checksum"] != rows[1]["train/weights_checksum"]
    assert rows[1]["train/kl_init_k3"] > 1e-4  # a stale engine would sample the initial policy: a mismatch that large
    assert rows[1]["train/mismatch_abs_rank_max"] <= 1e-5


@pytest.mark.slow
def test_two_ranks_log_both_ranks_draws(two_rank_run):
    """A row counts both ranks' episodes, and dynamic sampling chooses across the ranks: draws of two groups (one a
    rank) go on until two groups with signal are kept or four draws were made, and exactly min(signal, 2) groups
    train, whichever ranks hold them (each rank keeping what it has would train more)."""
    _, rows = two_rank_run
    for r in rows:
        drawn, signal = r["rollout/groups_drawn"], r["rollout/groups_with_signal"]
        assert drawn in (2, 4, 6, 8) and r["rollout/episodes_valid"] + r["rollout/infra_excluded"] == 3 * drawn
        assert signal >= 2 or drawn == 8
        assert drawn == 2 or signal <= 3  # a further draw only when the ones before left the step short of two
        if r["rollout/infra_excluded"] == 0:
            assert r["train/episodes_trained"] == 3 * min(signal, 2)


@pytest.mark.slow
def test_a_rank_killed_ends_the_run_and_resume_continues_it(tmp_path, toy_tasks, vllm_dir):
    """Rank 1 killed outright (SIGKILL, as the kernel's OOM killer does) during the second step's rollouts ends rank 0
    too, no hang: torchrun exits non-zero naming the rank and its signal, rank 0 unwound (its sandboxes removed).
    --resume on two ranks then continues the run as the uncut one goes on: step 1's row and checkpoint kept, both
    ranks restart from that checkpoint (trainer, Adam's state, engine): after step 2 they hold the same weights,
    their engines sample them, and the row counts both ranks' four episodes; the dead rank's sandboxes are swept."""
    out = tmp_path / "run"
    proc = run_cli(out, toy_tasks, vllm_dir, *TWO_RANKS, "--kl-coef", "0.01", wait=False, ranks=2)  # KL: logged
    ranks = {}

    def rolling_out_step_2():  # step 1's sandboxes are gone before its checkpoint: any now are step 2's
        ranks.update(rank_pids(proc.pid))
        return len(ranks) == 2 and (out / "step-000001").exists() and daemon.my_containers(ranks[1])
    wait_for(proc, rolling_out_step_2)
    os.kill(ranks[1], signal.SIGKILL)
    t = time.time()
    try:
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # a hang: the test fails, and leaves nothing running
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and "Signal 9 (SIGKILL)" in text, text[-3000:]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: -9", text), text[-3000:]
    assert daemon.my_containers(ranks[0]) == [] and not Path(f"/proc/{ranks[0]}").exists(), f"{time.time() - t:.0f}s"
    assert not (out / "step-000002").exists() and [r["step"] for r in log_rows(out)] == [1]
    first, before = log_rows(out)[0], checksum(out / "step-000001")

    text = run_cli(out, toy_tasks, vllm_dir, *TWO_RANKS, "--kl-coef", "0.01", "--resume", ranks=2)
    assert "resumed at step 1" in text and "world 2" in text and daemon.my_containers(ranks[1]) == []
    rows = log_rows(out)
    assert rows[0] == first and [r["step"] for r in rows] == [1, 2] and checksum(out / "step-000001") == before
    r = rows[1]
    assert r["rollout/groups_drawn"] == 2 and r["rollout/episodes_valid"] + r["rollout/infra_excluded"] == 4
    assert r["train/weights_checksum_spread"] == 0 and r["train/mismatch_abs_rank_max"] <= 1e-5
    assert r["train/weights_checksum"] == pytest.approx(checksum(out / "step-000002"), rel=1e-12)
    assert r["train/kl_init_k3"] > 1e-4  # the engines were started from the step-1 checkpoint, not the init
    state = torch.load(out / "step-000002" / "trainer_state.pt", weights_only=False)
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {2}  # Adam's state went on


@pytest.mark.slow
def test_a_task_only_one_rank_draws_that_cannot_build(tmp_path, toy_tasks, vllm_dir):
    """A task whose image cannot build, drawn by rank 1 alone: its episodes are lost to the infrastructure (the run
    goes on, as on one rank), the row counts them, and rank 0 names the build failure it never saw. Under FSDP2 with
    --ppo-epochs 2 and --tis-cap, rank 1, left without examples, still runs the forwards rank 0 runs."""
    tasks = tmp_path / "tasks"
    shutil.copytree(toy_tasks, tasks)
    broken = tasks / "zz-broken"  # sorted last: task index 2
    shutil.copytree(min(toy_tasks.iterdir()), broken)
    (broken / "environment" / "Dockerfile").write_text(f"FROM {daemon.BASE_IMAGE}\nRUN exit 3\n")
    seed = next(s for s in range(100) if grpo.step_groups(3, 2, 0, s)[1] == 2)  # rank 1's group at step 1
    text = run_cli(tmp_path / "run", tasks, vllm_dir, *TWO_RANKS, "--steps", "1", "--seed", str(seed), "--fsdp",
                   "--ppo-epochs", "2", "--tis-cap", "2", ranks=2)
    r = log_rows(tmp_path / "run")[0]
    assert r["rollout/infra_excluded"] == 2 and r["rollout/failures/image_build_error"] == 2
    assert r["rollout/episodes_valid"] == 2 and r["train/episodes_trained"] == 2 and r["train/optimizer_steps"] == 2
    assert "2 of the step's episodes lost to the infrastructure, e.g. " in text
    assert re.search(r"lost to the infrastructure, e\.g\. \S+: image_build_error: \S*zz-broken/environment/Dockerfile: "
                     r"build failed", text)
