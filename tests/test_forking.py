"""The README's "Forking an idea", each change made here as the fork would make it, and checked against an exact value:
a new SFT token weight (a line of sft.actobs_loss), a per-turn advantage (grpo.token_advantages), a sequence-level
importance ratio (GSPO's, a line of grpo.pg_loss), a new GRPO loss term (grpo.objective's weights and a line of
grpo.pg_loss), a graded reward (a verifier that pays the share of its checks that pass: taskgen's permissions_graded,
in a sandbox, through GRPO's advantages, its log row and pass@k). A line changed in a function is the edit a fork
makes to the file (patched); a test fails when the line it edits is no longer there, so the recipes follow the code."""
import bisect
import contextlib
import copy
import dataclasses
import inspect
import math
import random

import pytest
import torch

import envs
import grpo
import sft
from actobs import batches, common, labels, passk, steplog, taskgen
from actobs.episode import Episode
from actobs.labels import ACTION, OBS, PROMPT
from actobs.tasks import task_from_spec
from test_grpo import (args_for, behaviour, examples_of, loss_examples, loss_tokens, naive_logprobs, reference_steps,
                       train)


def patched(fn, *edits):
    """fn compiled again from its source with each edit (old, new) made, old exactly once in it, in fn's module:
    the edit a fork makes to the file, made in the test."""
    src = inspect.getsource(fn)
    for old, new in edits:
        assert src.count(old) == 1, f"{fn.__qualname__} no longer holds {old!r}: update the README's recipe"
        src = src.replace(old, new)
    scope = {}
    exec(compile(src, inspect.getsourcefile(fn), "exec"), fn.__globals__, scope)
    return scope[fn.__name__]


# ---------------------------------------------------------------------------------------------- SFT: a token weight

# The observation after the agent's k-th reply weighs lam / k: the replies so far at each supervised token
LATER_OBSERVATIONS_WEIGH_LESS = (
    "    w = torch.where(is_act, w_act, lam)  # (N,) each supervised token's weight\n",
    "    turn = ((roles[:, 1:] == ACTION) & (roles[:, :-1] != ACTION)).cumsum(1)[sel]  # (N,) replies so far\n"
    "    w = torch.where(is_act, w_act, lam / turn.clamp(min=1))\n")


def replies_so_far(roles):
    """Per token, how many of the agent's replies have started by it (a reply: a run of ACTION tokens)."""
    out, k = [], 0
    for i, r in enumerate(roles):
        k += r == ACTION and (i == 0 or roles[i - 1] != ACTION)
        out.append(k)
    return out


def test_a_new_sft_token_weight_is_a_line_of_actobs_loss(model, tokenizer, synthetic, monkeypatch):
    """The observation tokens after reply k weigh lam / k: sft's step (run_micro_batches) then computes each
    trajectory's -sum_i w_i log p_i / sum_i w_i, averaged over the trajectories, as the reference here does token by
    token on full logits; the unchanged loss is another number."""
    lam, examples = 0.8, [labels.render(tokenizer, conv, max_len=300) for conv in synthetic[:3]]
    want = 0.0
    for ids, roles in examples:
        lp = naive_logprobs(model, ids, 1.0)[1].detach()  # (T-1,) log p of each next token
        w = [{ACTION: 1.0, OBS: lam / max(k, 1), PROMPT: 0.0}[r] for k, r in zip(replies_so_far(roles), roles)]
        want += -sum(wi * x for wi, x in zip(w[1:], lp.tolist())) / sum(w[1:]) / len(examples)
    # an observation after a second reply: a weight of lam / 2
    assert any(k >= 2 and r == OBS for _, roles in examples for k, r in zip(replies_so_far(roles), roles))

    def step_loss():  # what sft.main's step computes, over the examples in micro-batches of one
        with torch.no_grad():
            return sft.run_micro_batches(common.LossModule(model), examples, tokenizer.pad_token_id, lam, 1.0, 3,
                                         torch.device("cpu"), contextlib.nullcontext(), train=False, micro_tokens=1,
                                         fsdp=False)["loss"]
    before = step_loss()
    monkeypatch.setattr(sft, "actobs_loss", patched(sft.actobs_loss, LATER_OBSERVATIONS_WEIGH_LESS))
    assert step_loss() == pytest.approx(want, rel=1e-5) and abs(before - want) > 1e-3


# ---------------------------------------------------------------------------------------------- GRPO: an advantage

def test_a_per_turn_advantage_is_a_change_to_one_function(model, tokenizer, synthetic, monkeypatch):
    """Replace grpo.token_advantages by a per-turn advantage (turn k's tokens get (k + 1) A, from the turn
    boundaries it is given) and nothing else: episodes -> examples -> train_batch give the reference's update with
    those per-token advantages (turns counted here from the roles), which differs from the outcome advantage's."""
    args = args_for("--temperature", "0.7", "--grad-clip", "0", "--group-size", "3")
    eps = []
    for conv, reward in zip(synthetic[:3], [1.0, 0.0, 0.0]):
        ids, roles = labels.render(tokenizer, conv, max_len=200)
        ex = batches.Example(ids=ids, roles=roles, wrapper=None, adv=None, behav=None)
        eps.append(Episode("t", [], reward=reward, token_ids=ids, roles=roles, obs_wrapper=[False] * len(ids),
                           logprobs=behaviour(model, ex, args.temperature, 0.1)))

    def update(examples):
        m = copy.deepcopy(model)
        train(m, model, torch.optim.SGD(m.parameters(), lr=0.1), examples, args, tokenizer.pad_token_id)
        return m

    def per_turn(episode, adv, replies):  # from reply k's start on, (k + 1) A
        starts = [start for start, _ in replies]
        return [adv * max(bisect.bisect_right(starts, i), 1) for i in range(len(episode.token_ids))]

    outcome = update(examples_of(eps, args)[0][0])
    monkeypatch.setattr(grpo, "token_advantages", per_turn)
    examples = examples_of(eps, args)[0][0]
    per_turn = update(examples)
    group_adv = [2 / 3, -1 / 3, -1 / 3]
    want = [dataclasses.replace(ex, adv=[a * max(k, 1) for k in replies_so_far(ep.roles)])
            for ex, ep, a in zip(examples, eps, group_adv)]
    assert max(max(ex.adv) for ex in want) >= 2 * 2 / 3  # more than one turn
    theirs = copy.deepcopy(model)
    reference_steps(theirs, model, want, args, torch.optim.SGD(theirs.parameters(), lr=0.1), 1)
    for a, b, c in zip(per_turn.parameters(), theirs.parameters(), outcome.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any(not torch.allclose(a, c, rtol=1e-3, atol=1e-6)
               for a, c in zip(per_turn.parameters(), outcome.parameters()))


# ---------------------------------------------------------------------------------------------- GRPO: the objective

# GSPO's importance ratio: the sequence's, exp of the mean over its action tokens of log pi - log pi_behaviour, at
# each of its tokens; the clip then acts per sequence, and --loss-norm sequence makes the loss GSPO's mean over them
SEQUENCE_RATIO = (
    "        rho, w = (logp - behav).exp(), torch.ones_like(logp)\n",
    "        mean = logp.new_zeros(B).index_add(0, seq, logp - behav) / torch.bincount(seq, minlength=B).clamp(min=1)\n"
    "        rho, w = mean.exp()[seq], torch.ones_like(logp)  # (n,) the sequence's ratio at each of its tokens\n")


def test_a_sequence_level_ratio_is_a_line_of_pg_loss(model, tokenizer, synthetic, monkeypatch):
    """GSPO's objective, -1/|G| sum_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i), s_i = exp(mean_t (log pi -
    log pi_behaviour)) over sequence i's action tokens: with behaviour log-probs set off the policy's by a shift per
    sequence and +-0.3 alternating by token, s_i is known exactly, and so is the loss (-(1.2 * 1 + 0.8 * -0.5 +
    s_3 * 0.75) / 3: the first two sequences are clipped); the gradient is a full-logits GSPO's written here, only the
    third sequence's. Token-level ratios (the loss unchanged) clip token by token: another value."""
    args = args_for("--loss-norm", "sequence", "--temperature", "0.7", "--clip", "0.2")
    shifts, advs = [-0.5, 0.5, 0.1], [1.0, -0.5, 0.75]
    examples = loss_examples(model, tokenizer, synthetic, args, [0.0] * 3, None, advs=advs)
    logs = []  # per sequence: log s_i, exactly as the behaviour log-probs were set
    for ex, shift in zip(examples, shifts):
        act = [i for i, r in enumerate(ex.roles) if i and r == ACTION]
        offsets = [shift + (0.3 if j % 2 else -0.3) for j in range(len(act))]
        for i, o in zip(act, offsets):
            ex.behav[i] += o
        logs.append(-sum(offsets) / len(offsets))
    s = [math.exp(x) for x in logs]
    assert s[0] > 1.2 and s[1] < 0.8 and 0.8 < s[2] < 1.2
    want = -(1.2 * 1.0 + 0.8 * -0.5 + s[2] * 0.75) / 3
    norm, batch = grpo.Normalisers(act_tokens=loss_tokens(examples), seqs=3, echo_seqs=0), batches.collate(examples, 0)
    token_level, _ = grpo.pg_loss(model, batch, grpo.objective(args), norm)

    gspo = patched(grpo.pg_loss, SEQUENCE_RATIO)
    mine = copy.deepcopy(model)
    loss, _ = gspo(mine, batch, grpo.objective(args), norm)
    loss.backward()
    assert loss.item() == pytest.approx(want, rel=1e-5) and abs(token_level.item() - want) > 1e-3
    theirs, total = copy.deepcopy(model), 0.0
    for ex, a in zip(examples, advs):  # GSPO on full logits, one sequence at a time
        act = torch.tensor(ex.roles[1:]) == ACTION
        lp = naive_logprobs(theirs, ex.ids, args.temperature)[0][act]
        si = (lp - torch.tensor(ex.behav[1:])[act]).mean().exp()
        total = total - torch.minimum(si * a, si.clamp(0.8, 1.2) * a) / 3
    total.backward()
    assert total.item() == pytest.approx(want, rel=1e-5)
    for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-7, msg=name)
    assert any(q.grad.abs().max() > 0 for q in theirs.parameters())


# A term: the action tokens' NLL at T, n_i-normalised like the policy gradient, its coefficient a weight of the
# Objective (a fork's flag; 0.5 here)
NLL_WEIGHT = ('"echo": args.echo_coef}', '"echo": args.echo_coef, "nll": 0.5}')
NLL_TERM = ('obj.weights["echo"] * echo\n', 'obj.weights["echo"] * echo + obj.weights["nll"] * -(n * logp).sum()\n')


def test_a_new_loss_term_reaches_groups_without_signal(model, tokenizer, synthetic, monkeypatch):
    """A term added to the loss (its coefficient in grpo.objective's weights, its value in grpo.pg_loss) is computed
    on every example, those of groups without signal included: may_skip reads the same weights. With every
    advantage 0 the update is that term's gradient alone, the reference's (SGD on 0.5 * the action tokens' NLL over
    the step's action tokens); a rule that skipped zero-advantage examples would make no update at all."""
    args = args_for("--temperature", "0.7", "--grad-clip", "0")
    examples = loss_examples(model, tokenizer, synthetic, args, [0, 0, 0], None, advs=(0.0, 0.0, 0.0))
    monkeypatch.setattr(grpo, "objective", patched(grpo.objective, NLL_WEIGHT))
    monkeypatch.setattr(grpo, "pg_loss", patched(grpo.pg_loss, NLL_TERM))
    mine, theirs = copy.deepcopy(model), copy.deepcopy(model)
    tot, gnorm = train(mine, model, torch.optim.SGD(mine.parameters(), lr=1.0), examples, args, tokenizer.pad_token_id)
    assert tot["episodes_trained"] == 3 and gnorm > 0

    nll = sum(-naive_logprobs(theirs, ex.ids, 0.7)[0][torch.tensor(ex.roles[1:]) == ACTION].sum() for ex in examples)
    (0.5 * nll / loss_tokens(examples)).backward()
    torch.optim.SGD(theirs.parameters(), lr=1.0).step()
    assert max((a - b).abs().max() for a, b in zip(theirs.parameters(), model.parameters())) > 1e-4
    for a, b in zip(mine.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------- a graded reward

def test_a_graded_reward_flows_through_advantages_log_and_pass_at_k(base_image, no_leftovers):
    """permissions_graded's verifier writes a score per file whose mode it checks (reward.json, no "reward" key):
    the reward is their mean. Two scripts, a key and a README that must keep its mode: its own solution pays 1, one
    that fixes the scripts alone 3/4, nothing done 1/4 (the README). A group of those four episodes: the advantages
    are the rewards less their mean, the log row's mean reward is that mean, its solve rate and pass@k count full
    marks alone (one of four)."""
    spec = taskgen.generate("permissions_graded", random.Random(0))
    p = spec.params
    assert (len(p["scripts"]), len(p["keys"]), len(p["keep"])) == (2, 1, 1) and "reward.json" in spec.test
    task = task_from_spec(spec)
    scripts_only = dataclasses.replace(task, solution={"solve.sh": f"chmod 755 {' '.join(p['scripts'])}\n".encode()})
    eps = envs.run_oracle([task, scripts_only]) + envs.run_oracle([task, task], noop=True)
    assert [(e.reward, e.failure) for e in eps] == [(1.0, None), (0.75, None), (0.25, None), (0.25, None)]

    for e in eps:  # a token sequence for the log row's counts
        e.token_ids, e.roles, e.turns = [1, 2], [PROMPT, ACTION], 1
    rewards, valid, _ = grpo.group_rewards(eps, 4, "keep", 0.0)
    adv, signal = grpo.group_advantages(rewards, valid)
    assert adv.tolist() == [[0.4375, 0.1875, -0.3125, -0.3125]] and signal.tolist() == [True]
    s = steplog.Step(0, 0, episodes=eps, advantages=[adv], valid=[valid], has_signal=[signal],
                     trained={"episodes_trained": 4}, times=dict.fromkeys(["rollout", "train", "sync", "sync_gather",
                                                                           "step"], 1.0))
    row, _ = steplog.step_record(s, lr=0.0, ppo_epochs=1, device=torch.device("cpu"))
    assert (row["rollout/reward_mean"], row["rollout/solve_rate"]) == (0.5625, 0.25)
    entry = {"attempts": [{"reward": e.reward, "failure": e.failure} for e in eps]}
    assert passk.task_counts(entry)[:2] == (4, 1)
    assert [passk.summarize({"t": entry}, [1, 2, 4])["pass@k"][k] for k in (1, 2, 4)] == [0.25, 0.5, 1.0]
