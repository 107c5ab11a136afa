"""The lambda-weighted loss: exact against a naive full-logits reference, gradient accumulation, stats."""
import random

import numpy as np
import pytest
import torch

import sft
from actobs import common, head, labels
from conftest import synthetic_trajectory

P, A, O = labels.PROMPT, labels.ACTION, labels.OBS



@pytest.fixture(scope="module")
def examples(tokenizer):
    rng = random.Random(3)
    return [labels.render(tokenizer, synthetic_trajectory(rng), max_len=300) for _ in range(6)]


def reference_loss(model, batch, lam, w_act=1.0):
    """The paper's formula written plainly: full logits, log-softmax, per-trajectory normalisation."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)  # (B, T-1)
    r = batch["roles"][:, 1:]
    losses = []
    for b in range(len(r)):
        a, o = r[b] == A, r[b] == O
        den = w_act * a.sum() + lam * o.sum()
        if den > 0:
            losses.append(-(w_act * logp[b][a].sum() + lam * logp[b][o].sum()) / den)
    return torch.stack(losses).mean()


@pytest.mark.parametrize("lam,w_act", [(1.0, 1.0), (0.0, 1.0), (0.3, 1.0), (1.0, 0.0)])
def test_loss_and_grads_match_reference(model, examples, tokenizer, lam, w_act):
    batch = common.collate(examples, tokenizer.pad_token_id)
    model.zero_grad()
    loss, stats = sft.actobs_loss(model, batch, lam, w_act, chunk=37)  # a chunk that does not divide N
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = reference_loss(model, batch, lam, w_act)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("entropy", [False, True])
def test_the_chunked_head_matches_full_logits(entropy):
    """head.token_logprobs, the head every loss and probe uses: log-probs, entropies and both gradients equal the
    full-logits log-softmax's, in chunks that do not divide the rows; under no_grad nothing asks for a gradient."""
    torch.manual_seed(0)
    h, W = torch.randn(50, 16, requires_grad=True), torch.randn(300, 16, requires_grad=True)
    t, g = torch.randint(0, 300, (50,)), torch.randn(50)
    logp, ent = head.token_logprobs(h, W, t, entropy=entropy, chunk=7)
    (g * logp).sum().backward()
    got = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    full = torch.log_softmax(h @ W.T, -1)  # (N, V)
    ref = full.gather(1, t[:, None]).squeeze(1)
    (g * ref).sum().backward()
    torch.testing.assert_close(logp, ref)
    torch.testing.assert_close(got[0], h.grad)
    torch.testing.assert_close(got[1], W.grad)
    if entropy:
        torch.testing.assert_close(ent, -(full.exp() * full).sum(-1))
    else:
        assert ent is None
    with torch.no_grad():
        assert not head.token_logprobs(h, W, t, chunk=7)[0].requires_grad


@pytest.mark.parametrize("entropy", [False, True])
def test_the_head_with_per_token_terms_matches_full_logits(entropy):
    """head.token_loss forms the head's gradients in the forward pass: for a loss whose per-token terms are
    non-linear in their own log-probs (a clipped ratio, a square), the loss, log-probs, entropies and both gradients
    equal autograd's through the full-logits log-softmax, in chunks that do not divide the rows, with the loss scaled
    downstream, and the backward reads neither h nor W (both zeroed before it); under no_grad no gradient."""
    torch.manual_seed(0)
    h, W = torch.randn(50, 16, requires_grad=True), torch.randn(300, 16, requires_grad=True)
    t, a, b = torch.randint(0, 300, (50,)), torch.randn(50), torch.randn(50) - 5

    def f(lp, a, b):  # (n,) terms
        return a * torch.minimum((lp - b).exp(), (lp - b).exp().clamp(0.8, 1.2)) + 0.1 * lp ** 2
    full = torch.log_softmax(h @ W.T, -1)  # (N, V)
    ref_lp = full.gather(1, t[:, None]).squeeze(1)
    ref = f(ref_lp, a, b).sum()
    (3 * ref).backward()
    want = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    loss, logp, ent = head.token_loss(h, W, t, lambda lp, rows: f(lp, a[rows], b[rows]), entropy=entropy, chunk=7)
    assert not logp.requires_grad
    with torch.no_grad():
        h.zero_(), W.zero_()
    (3 * loss).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(logp, ref_lp)
    assert want[0].abs().max() > 0 and want[1].abs().max() > 0
    torch.testing.assert_close(h.grad, want[0])
    torch.testing.assert_close(W.grad, want[1])
    if entropy:
        torch.testing.assert_close(ent, -(full.exp() * full).sum(-1))
    else:
        assert ent is None
    with torch.no_grad():
        assert not head.token_loss(h, W, t, lambda lp, rows: -lp, chunk=7)[0].requires_grad


def packed(ok):
    """Masks (M, V) bool -> (M, ceil(V / 32) * 4) uint8 as xgrammar packs them: bit t % 8 of byte t // 8."""
    ok = torch.nn.functional.pad(ok, (0, -ok.shape[1] % 32))
    return torch.from_numpy(np.packbits(ok.numpy(), axis=1, bitorder="little"))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
def test_the_head_under_a_grammar_mask_matches_masked_full_logits(entropy, fused):
    """With `allowed` (a grammar's masks: a table of packed masks, one row of it per token) the chunked head's
    log-probs, entropies and both gradients are those of the full logits' log-softmax over the allowed tokens alone
    (the others at -inf), whichever way the gradient is formed, in chunks that do not divide the rows, with a
    vocabulary that is not a multiple of the packing; a token no row allows gets no gradient in W."""
    torch.manual_seed(0)
    V = 300
    h, W = torch.randn(50, 16, requires_grad=True), torch.randn(V, 16, requires_grad=True)
    t, g = torch.randint(0, 250, (50,)), torch.randn(50)
    ok = torch.rand(4, V) < 0.3  # (M, V): four masks over tokens 0..249; 250.. never allowed
    ok[:, 250:] = False
    rows = torch.randint(0, 4, (50,))
    t[rows == 0] = 7
    ok[rows, t] = True  # each row's target is allowed
    ok[0] = False
    ok[0, 7] = True  # mask 0 allows one token alone: a forced choice, log-prob 0
    full = torch.log_softmax((h @ W.T).masked_fill(~ok[rows], float("-inf")), -1)  # (N, V)
    ref = full.gather(1, t[:, None]).squeeze(1)
    (g * ref).sum().backward()
    want = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    allowed = (packed(ok), rows)
    if fused:
        loss, logp, ent = head.token_loss(h, W, t, lambda lp, r: g[r] * lp, entropy=entropy, chunk=7, allowed=allowed)
    else:
        logp, ent = head.token_logprobs(h, W, t, entropy=entropy, chunk=7, allowed=allowed)
        loss = (g * logp).sum()
    loss.backward()
    torch.testing.assert_close(logp, ref)
    assert (rows == 0).any() and logp[rows == 0].abs().max() < 1e-6
    torch.testing.assert_close(h.grad, want[0])
    torch.testing.assert_close(W.grad, want[1])
    assert W.grad[250:].abs().max() == 0 and W.grad[:250].abs().max() > 0
    if entropy:
        torch.testing.assert_close(ent, -(full.exp() * full.nan_to_num(neginf=0)).sum(-1))


def test_stats_report_both_nlls_whatever_lambda(model, examples, tokenizer):
    batch = common.collate(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        _, s0 = sft.actobs_loss(model, batch, 0.0)
        _, s1 = sft.actobs_loss(model, batch, 1.0)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)  # (B, T-1)
    r = batch["roles"][:, 1:]
    assert s0["obs_tokens"] > 0 and s0["act_tokens"] > 0
    assert s0["act_tokens"] == int((r == A).sum()) and s0["obs_tokens"] == int((r == O).sum())
    for s in (s0, s1):  # the full-logits NLL sums of each role, whichever role the loss weighs
        assert s["act_nll_sum"] == pytest.approx(nll[r == A].sum().item(), rel=1e-5)
        assert s["obs_nll_sum"] == pytest.approx(nll[r == O].sum().item(), rel=1e-5)
        assert s["act_nll"] == pytest.approx(s["act_nll_sum"] / s["act_tokens"])


def test_gradient_accumulation_equals_one_big_batch(model, examples, tokenizer):
    lam = 0.5
    whole = common.collate(examples, tokenizer.pad_token_id)
    model.zero_grad()
    sft.actobs_loss(model, whole, lam)[0].backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    n = sum(sft.loss_denominator(r, lam) > 0 for _, r in examples)
    for group in common.micro_batches([len(i) for i, _ in examples], token_budget=700):
        batch = common.collate([examples[i] for i in group], tokenizer.pad_token_id)
        sft.actobs_loss(model, batch, lam, n_traj=n)[0].backward()
    assert len(common.micro_batches([len(i) for i, _ in examples], token_budget=700)) > 2
    for g, p in zip(ref, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-7)


def test_trajectory_without_supervised_tokens_gives_no_nan(model, tokenizer):
    # lam = 0 and a trajectory with observations only: its denominator is 0, it must not count or NaN
    only_obs = ([1, 2, 3, 4], [P, O, O, O])
    normal = ([5, 6, 7, 8], [P, P, A, A])
    batch = common.collate([only_obs, normal], tokenizer.pad_token_id)
    loss, stats = sft.actobs_loss(model, batch, 0.0)
    ref = sft.actobs_loss(model, common.collate([normal], tokenizer.pad_token_id), 0.0)[0]
    assert torch.isfinite(loss) and stats["n_traj"] == 1
    torch.testing.assert_close(loss, ref)
    empty = sft.actobs_loss(model, common.collate([([1, 2], [P, P])], tokenizer.pad_token_id), 1.0)[0]
    assert empty.item() == 0.0


def test_bf16_autocast_close_to_fp32(model, examples, tokenizer):
    batch = common.collate(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        ref = sft.actobs_loss(model, batch, 1.0)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = sft.actobs_loss(model, batch, 1.0)[0]
    assert abs(low.item() - ref.item()) < 0.05 * ref.item()


def test_micro_batches_respect_budget_and_cover_everything():
    lengths = [500, 20, 300, 301, 40, 999, 1200, 7]
    groups = common.micro_batches(lengths, token_budget=1000)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 1000
    more = common.micro_batches(lengths, 1000, n_micro=len(groups) + 3)
    assert len(more) == len(groups) + 3 and sorted(i for g in more for i in g) == list(range(len(lengths)))
    assert common.micro_batches([5], 1000, n_micro=3) == [[0], [], []]


def test_lr_schedule():
    lrs = [sft.lr_at(s, 100, 10, 1.0, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_dir, examples, tokenizer):
    from transformers import AutoModelForCausalLM
    batch = common.collate(examples, tokenizer.pad_token_id)
    grads = []
    for ckpt in (False, True):
        m = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        assert m.is_gradient_checkpointing == ckpt
        sft.actobs_loss(m, batch, 1.0)[0].backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
