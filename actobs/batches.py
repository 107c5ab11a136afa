"""
GRPO's training examples as the trainer reads them: an episode's per-token lists collated into padded tensors
(collate, micro_batch), the positions of a micro-batch that carry loss (selected_rows: what grpo.pg_loss sends
through the chunked head), and a model's log-probs of the action tokens (policy_logprobs: the initial policy's for the
KL, the trainer's before a multi-epoch step). grpo.py states the loss on them; docs/training.md#the-grpo-objective.
"""
import dataclasses

import torch

from actobs import common, engine, head
from actobs.labels import ACTION, OBS, PROMPT

def collate(examples, pad_id):
    """Examples (dicts of per-token lists: ids, roles, wrapper, adv, behav, [old, ref]; under a grammar forced, masks,
    mask_ids) -> right-padded (B, T) tensors, PROMPT on padding; under a grammar mask_table, mask_row (engine's)."""
    out = common.collate([(e["ids"], e["roles"]) for e in examples], pad_id)  # input_ids, roles, attention_mask
    out.update(engine.mask_batch(examples, out["input_ids"].shape))
    for key, dtype in (("wrapper", torch.bool), ("forced", torch.bool), ("adv", torch.float32),
                       ("behav", torch.float32), ("old", torch.float32), ("ref", torch.float32)):
        if key in examples[0]:
            out[key] = torch.zeros(out["input_ids"].shape, dtype=dtype)
            for b, e in enumerate(examples):
                out[key][b, :len(e[key])] = torch.as_tensor(e[key], dtype=dtype)
    return out


@dataclasses.dataclass
class Rows:
    """The positions of a micro-batch that carry loss (selected_rows): N of its (B, T-1) predictions."""
    h: torch.Tensor  # (N, H) hidden states, action rows scaled by 1 / T (the head then gives logits / T)
    targets: torch.Tensor  # (N,) the token each row predicts
    act: torch.Tensor  # (N,) bool: an action row (else an ECHO row, at T = 1)
    seq: torch.Tensor  # (N,) its sequence in the batch
    sel: torch.Tensor  # (B, T-1) bool: the positions selected
    adv: torch.Tensor  # (N,) the batch's per-token fields at the rows: the advantage,
    behav: torch.Tensor  # the log-prob vLLM sampled the token with,
    old: torch.Tensor | None  # the trainer's before the step's first update (None: the row's own, detached),
    ref: torch.Tensor | None  # the initial policy's (None: no KL)


def selected_rows(lm, batch, temperature, echo):
    """The positions that carry loss: those predicting ACTION tokens (hidden states scaled by 1/T: the head gives
    logits / T) but the forced ones (a grammar allowed them alone) and, where echo (B, T-1), OBS tokens (at T = 1:
    the model's own prediction of the environment). -> Rows."""
    ids, roles = batch["input_ids"], batch["roles"]  # (B, T)
    hidden = lm.base_model(input_ids=ids, attention_mask=batch["attention_mask"],
                           use_cache=False).last_hidden_state  # (B, T, H)
    is_act = roles[:, 1:] == ACTION  # (B, T-1): the role of the token each position predicts
    if "forced" in batch:
        is_act &= ~batch["forced"][:, 1:]
    sel = is_act | (roles[:, 1:] == OBS) & echo
    h, act = hidden[:, :-1][sel], is_act[sel]  # (N, H), (N,)
    scale = torch.where(act, 1.0 / temperature, 1.0).to(h.dtype)
    seq = torch.arange(len(ids), device=ids.device)[:, None].expand_as(sel)[sel]
    at = {k: batch[k][:, 1:][sel] if k in batch else None for k in ("adv", "behav", "old", "ref")}  # (N,) each
    return Rows(h=h * scale[:, None], targets=ids[:, 1:][sel], act=act, seq=seq, sel=sel, **at)


def action_logprobs(lm, batch, temperature):
    """-> (B, T-1) the log-prob (at T) of each next token that is an action under `lm`, 0 elsewhere."""
    r = selected_rows(lm, batch, temperature, torch.zeros_like(batch["wrapper"][:, 1:]))  # no ECHO rows
    logp, _ = head.token_logprobs(r.h, lm.get_output_embeddings().weight, r.targets,
                                  allowed=engine.allowed_rows(batch, r.sel))
    full = torch.zeros(r.sel.shape, dtype=torch.float32, device=logp.device)
    full[r.sel] = logp
    return full


def micro_batch(examples, group, pad_id, device):
    """The collated micro-batch of examples[i] for i in group, on device. Of an empty group, a 1-token example that
    carries no loss: a rank with no examples left still runs as many forwards as the others (DDP's and FSDP2's
    collectives require it)."""
    empty = {"ids": [pad_id], "roles": [PROMPT], "behav": [0.0], "wrapper": [False], "adv": [0.0]}
    return {k: v.to(device) for k, v in collate([examples[i] for i in group] or [empty], pad_id).items()}


@torch.no_grad()
def policy_logprobs(scorer, examples, args, pad_id, device, ctx, wrapped=False):
    """Per-token log-probs (at T) of each example's tokens (a list per example, 0 where a token is not an action)
    under `scorer`: an HF model (the initial policy, a full copy), or with wrapped=True a LossModule under DDP or
    FSDP2 (the trainer before a multi-epoch step, or the initial policy sharded: its forward gathers FSDP2's shards,
    so every rank runs as many)."""
    lengths = [len(e["ids"]) for e in examples]
    out = []
    for g in (common.rank_micro_batches(lengths, args.micro_tokens, device) if wrapped else
              common.micro_batches(lengths, args.micro_tokens)):
        batch = micro_batch(examples, g, pad_id, device)
        with ctx:
            full = (scorer(batch, args.temperature, fn=action_logprobs) if wrapped else
                    action_logprobs(scorer, batch, args.temperature))
        for j, i in enumerate(g):
            out.append((i, [0.0] + full[j, : len(examples[i]["ids"]) - 1].tolist()))
    return [lp for _, lp in sorted(out)]
