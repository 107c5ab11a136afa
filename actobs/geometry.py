"""
The geometry of SFT's gradients: the action-only and observation-only losses' gradients of the same batch, their
norms, ratio and cosine (sft.py --probe-every, `probes.py geometry`), and its plot. docs/probes.md.
"""
import json
from pathlib import Path

import torch

from actobs import common, labels
from actobs.head import token_logprobs

def role_nll(model, batch, role, n_traj):
    """Sum over the batch's trajectories with `role` tokens of their mean NLL on those tokens, / n_traj: sft.py's
    action-only loss (role ACTION, --lam 0) or observation-only loss (OBS) over a step of n_traj trajectories."""
    ids, roles = batch["input_ids"], batch["roles"]  # (B, T)
    hidden = model.base_model(input_ids=ids, attention_mask=batch["attention_mask"],
                              use_cache=False).last_hidden_state  # (B, T, H)
    sel = roles[:, 1:] == role  # (B, T-1): the positions predicting a `role` token
    traj = torch.arange(len(ids), device=ids.device)[:, None].expand_as(sel)[sel]  # (N,)
    per_traj = torch.bincount(traj, minlength=len(ids)).float()  # (B,)
    logp, _ = token_logprobs(hidden[:, :-1][sel], model.get_output_embeddings().weight, ids[:, 1:][sel])
    return -(logp / per_traj[traj]).sum() / n_traj


def grad_geometry(model, batches):
    """-> {cos, norm_act, norm_obs, r} of the gradients of the action-only loss and the observation-only loss
    (role_nll), each the mean over all trajectories in `batches` (common.collate outputs, on the model's device)
    that have such tokens.

    Memory: the action gradient is accumulated in .grad and set aside; the observation gradient then accumulates
    in .grad, and during the last batch's backward each parameter's dot product and norms are taken as soon as
    its gradient is final, freeing both of its buffers. With one batch, at most one full gradient is alive at a
    time, as in training; with several, two. Gradients already in .grad are kept aside (alive) and restored, so
    call it with .grad cleared. Train/eval mode is left as is (training mode keeps gradient checkpointing on;
    Qwen3 has no dropout that would make the two passes differ)."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    n_act, n_obs = (sum(int((b["roles"][:, 1:] == r).any(1).sum()) for b in batches)
                    for r in (labels.ACTION, labels.OBS))
    if not n_act or not n_obs:
        raise ValueError(f"grad_geometry needs action and observation tokens: {n_act} / {n_obs} trajectories "
                         "have them")
    acc = torch.zeros(3, dtype=torch.float64, device=params[0].device)  # g_act.g_obs, |g_act|^2, |g_obs|^2
    try:
        for p in params:
            p.grad = None
        for b in batches:
            role_nll(model, b, labels.ACTION, n_act).backward()
        g_act = {p: p.grad for p in params}
        for p in params:
            p.grad = None

        def reduce(p):  # p's observation gradient is final: fold it into the sums, free both buffers
            a, o = ((torch.zeros_like(p) if t is None else t).float().flatten() for t in (g_act.pop(p), p.grad))
            acc.add_(torch.stack([torch.dot(a, o), torch.dot(a, a), torch.dot(o, o)]).double())
            p.grad = None

        for i, b in enumerate(batches):
            hooks = [p.register_post_accumulate_grad_hook(reduce) for p in params] if i == len(batches) - 1 else []
            role_nll(model, b, labels.OBS, n_obs).backward()
            for h in hooks:
                h.remove()
        for p in list(g_act):  # parameters the observation loss does not reach
            reduce(p)
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    dot, aa, oo = acc.tolist()
    na, no = aa ** 0.5, oo ** 0.5
    return {"cos": dot / max(na * no, 1e-30), "norm_act": na, "norm_obs": no, "r": no / max(na, 1e-30)}


def plot_geometry(log_path, png_path):
    """cos(g_act, g_obs) and r against step from the probe/* rows of a JSONL: sft.py's log.jsonl or
    `geometry`'s."""
    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if "probe/cos" in r and r.get("step") is not None), key=lambda r: r["step"])
    if not rows:
        raise ValueError(f"{log_path}: no rows with 'probe/cos' and 'step'")
    plt = common.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    steps = [r["step"] for r in rows]
    a.plot(steps, [r["probe/cos"] for r in rows], marker="o")
    a.axhline(0, color="grey", lw=0.5)
    a.set(xlabel="step", ylabel="cos(g_act, g_obs)")
    rs = [r["probe/r"] for r in rows]
    b.plot(steps, rs, marker="o")
    b.set(xlabel="step", ylabel="r = |g_obs| / |g_act|")
    if max(rs) > 10 * min(rs):  # e.g. 0.5 -> 41: a log axis, labelled 0.5, 1, 2, 5, 10, ...
        b.set_yscale("log")
        b.yaxis.set_major_locator(plt.matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
        b.yaxis.set_major_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        b.yaxis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
