"""
GRPO's training examples as the trainer reads them: one episode's per-token lists (Example), collated into padded
tensors (collate, micro_batch) with its grammar's masks (mask_batch), the positions of a micro-batch that carry loss
(selected_rows: what grpo.pg_loss sends through the chunked head, allowed_rows: their masks), and a model's log-probs
of the action tokens (policy_logprobs: the initial policy's for the KL, the trainer's before a multi-epoch step).
grpo.py states the loss on them; docs/training.md#the-grpo-objective.
"""
import dataclasses

import numpy as np
import torch

from actobs import common, head
from actobs.labels import ACTION, OBS, PROMPT


def per_token(dtype, default=dataclasses.MISSING):
    """An Example field with a value per token: collate pads it with 0 (False) into a (B, T) tensor of dtype."""
    return dataclasses.field(default=default, metadata={"dtype": dtype})


@dataclasses.dataclass
class Example:
    """One episode as the trainer reads it (grpo.group_examples): lists of the episode's length, one value per token.
    The optional fields are None where they do not apply; collate gives a batch's field None when every example's is."""
    ids: list  # the token ids, the one append-only sequence the policy saw and sampled
    roles: list  # labels.PROMPT / ACTION / OBS of each token
    wrapper: list = per_token(torch.bool)  # OBS tokens of the protocol's fixed text (and end-of-turn tokens)
    adv: list = per_token(torch.float32)  # each token's advantage (the loss reads it at the action tokens)
    behav: list = per_token(torch.float32)  # the log-prob vLLM sampled each token with (0 where it sampled none)
    ref: list | None = per_token(torch.float32, None)  # the initial policy's log-probs (a KL term: train_batch's)
    old: list | None = per_token(torch.float32, None)  # the trainer's before the step's first update (--tis-cap)
    forced: list | None = per_token(torch.bool, None)  # under a grammar: the tokens it allowed alone (no loss)
    masks: list | None = None  # under a grammar: the distinct masks the replies were sampled under (packed bits)
    mask_ids: list | None = None  # under a grammar: each token's mask in masks, -1 where nothing was masked


def collate(examples, pad_id):
    """Examples -> a batch: right-padded (B, T) tensors input_ids, roles (PROMPT on padding), attention_mask, and one
    per per-token field of Example (None where no example has it); under a grammar mask_table and mask_row
    (mask_batch; None without)."""
    batch = common.collate([(e.ids, e.roles) for e in examples], pad_id)
    shape = batch["input_ids"].shape
    for f in dataclasses.fields(Example):
        if "dtype" not in f.metadata:
            continue
        values = [getattr(e, f.name) for e in examples]
        if all(v is None for v in values):
            batch[f.name] = None
            continue
        if any(v is None for v in values):
            raise ValueError(f"Example.{f.name}: set on some examples of a batch, not on all")
        batch[f.name] = torch.zeros(shape, dtype=f.metadata["dtype"])
        for b, v in enumerate(values):
            batch[f.name][b, :len(v)] = torch.as_tensor(v, dtype=f.metadata["dtype"])
    return batch | mask_batch(examples, shape)


def mask_batch(examples, shape):
    """The grammar masks of a batch's examples, right-padded to shape (B, T) -> {mask_table: (1 + M, ceil(V / 32) * 4)
    uint8, its row 0 allowing every token; mask_row: (B, T) long, each token's mask in mask_table, 0 where nothing was
    masked}, both None when no example has a mask. Read at the rows that carry loss (allowed_rows), they are
    head.token_logprobs' `allowed`."""
    masks = [m for e in examples for m in e.masks or []]
    if not masks:
        return {"mask_table": None, "mask_row": None}
    table = torch.from_numpy(np.stack([np.full_like(masks[0], 255)] + masks))
    rows, base = torch.zeros(shape, dtype=torch.long), 1
    for b, e in enumerate(examples):
        ids = torch.as_tensor(e.mask_ids or [], dtype=torch.long)  # (T_b,)
        rows[b, :len(ids)] = torch.where(ids >= 0, ids + base, 0)
        base += len(e.masks or [])
    return {"mask_table": table, "mask_row": rows}


def allowed_rows(batch, sel):
    """head.token_logprobs' `allowed` at the selected positions sel (B, T-1) of a batch: each row's mask from the
    grammar its target was sampled under, or None without one."""
    return None if batch["mask_table"] is None else (batch["mask_table"], batch["mask_row"][:, 1:][sel])


def micro_batch(examples, group, pad_id, device):
    """The collated micro-batch of examples[i] for i in group, on device. Of an empty group, a 1-token example that
    carries no loss: a rank with no examples left still runs as many forwards as the others (DDP's and FSDP2's
    collectives require it)."""
    empty = Example(ids=[pad_id], roles=[PROMPT], wrapper=[False], adv=[0.0], behav=[0.0])
    batch = collate([examples[i] for i in group] or [empty], pad_id)
    return {k: v if v is None else v.to(device) for k, v in batch.items()}


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
    old: torch.Tensor | None  # the trainer's before the step's first update (None: not given),
    ref: torch.Tensor | None  # the initial policy's (None: not given)


def selected_rows(lm, batch, temperature, echo):
    """The positions that carry loss: those predicting ACTION tokens (hidden states scaled by 1/T: the head gives
    logits / T) but the forced ones (a grammar allowed them alone) and, where echo (B, T-1), OBS tokens (at T = 1:
    the model's own prediction of the environment). -> Rows."""
    ids, roles = batch["input_ids"], batch["roles"]  # (B, T)
    hidden = lm.base_model(input_ids=ids, attention_mask=batch["attention_mask"],
                           use_cache=False).last_hidden_state  # (B, T, H)
    is_act = roles[:, 1:] == ACTION  # (B, T-1): the role of the token each position predicts
    if batch["forced"] is not None:
        is_act &= ~batch["forced"][:, 1:]
    sel = is_act | (roles[:, 1:] == OBS) & echo
    h, act = hidden[:, :-1][sel], is_act[sel]  # (N, H), (N,)
    scale = torch.where(act, 1.0 / temperature, 1.0).to(h.dtype)
    seq = torch.arange(len(ids), device=ids.device)[:, None].expand_as(sel)[sel]
    at = {k: None if batch[k] is None else batch[k][:, 1:][sel] for k in ("adv", "behav", "old", "ref")}  # (N,) each
    return Rows(h=h * scale[:, None], targets=ids[:, 1:][sel], act=act, seq=seq, sel=sel, **at)


def action_logprobs(lm, batch, temperature):
    """-> (B, T-1) the log-prob (at T) of each next token that is an action under `lm`, 0 elsewhere."""
    r = selected_rows(lm, batch, temperature, torch.zeros_like(batch["wrapper"][:, 1:]))  # no ECHO rows
    logp, _ = head.token_logprobs(r.h, lm.get_output_embeddings().weight, r.targets, allowed=allowed_rows(batch, r.sel))
    full = torch.zeros(r.sel.shape, dtype=torch.float32, device=logp.device)
    full[r.sel] = logp
    return full


@torch.no_grad()
def policy_logprobs(scorer, examples, temperature, micro_tokens, pad_id, device, ctx, wrapped=False):
    """Per-token log-probs (at temperature) of each example's tokens (a list per example, 0 where a token is not an
    action) under `scorer`, in micro-batches of micro_tokens: an HF model (the initial policy, a full copy), or with
    wrapped=True a LossModule under DDP or FSDP2 (the trainer before a multi-epoch step, or the initial policy
    sharded: its forward gathers FSDP2's shards, so every rank runs as many)."""
    lengths = [len(e.ids) for e in examples]
    out = []
    for g in (common.rank_micro_batches(lengths, micro_tokens, device) if wrapped else
              common.micro_batches(lengths, micro_tokens)):
        batch = micro_batch(examples, g, pad_id, device)
        with ctx:
            full = (scorer(batch, temperature, fn=action_logprobs) if wrapped else
                    action_logprobs(scorer, batch, temperature))
        for j, i in enumerate(g):
            out.append((i, [0.0] + full[j, : len(examples[i].ids) - 1].tolist()))
    return [lp for _, lp in sorted(out)]
