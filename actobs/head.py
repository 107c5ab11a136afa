"""
The one chunked output head: log softmax(h W^T)[target] of hidden rows h through the head W, and the entropies, one
row-chunk at a time, so the (N, V) logits never exist. GRPO's loss, the probes and the log-probs GRPO compares take
its differentiable log-probs (token_logprobs: any objective on them); SFT's loss, a sum of per-token terms, takes
token_loss, which forms the head's gradients in the forward pass (no recompute in the backward). With a grammar's
masks (allowed) it is the masked, renormalised distribution the rows were sampled from.
"""
import torch

CHUNK_BYTES = 512 * 2**20  # fp32 logits of one chunk: 883 rows at Qwen3's 151,936-token vocabulary


def head_chunk(V, buffers=1):
    """Rows per chunk of the head: `buffers` (c, V) fp32 blocks of logits within CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (4 * V * buffers))


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(h W^T)[target] of rows h through the output head W, one row-chunk at a time.

    Two ways to a gradient. Without `terms`, the log-probs are differentiable for any use downstream: forward keeps
    only the log-sum-exp of each row (N,) and backward recomputes a chunk's logits to form its gradient (its
    coefficient, the incoming gradient of each log-prob, is unknown until then). With `terms` (a loss that is a sum
    of per-token terms, each a function of its own token's log-prob), each chunk's coefficients d loss / d log p are
    known as soon as its log-probs are: forward forms the gradients of h and W in the same pass, from the same
    softmax, and backward only scales them by the gradient of the summed loss. That skips the recompute, a third
    of the head's work. Alive at once: the chunk's (c, V) fp32 logits, within CHUNK_BYTES, worked on in place (with
    the entropy, a second block and chunks of half the rows); under autocast also the (c, V) autocast-dtype matmul
    output or gradient; the fp32 (V, H) gradient of W (in forward with `terms`, else in backward). With `allowed`
    (a grammar's masks, _mask) each chunk's logits are masked before the softmax, its (c, V) bits unpacked then."""

    @staticmethod
    def forward(ctx, h, W, targets, chunk, dtype, entropy, terms, allowed):
        N = h.shape[0]
        logp = torch.empty(N, dtype=torch.float32, device=h.device)  # (N,)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if entropy else logp.new_empty(0)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        Wc = W.to(dtype)
        need_h, need_W = terms is not None and ctx.needs_input_grad[0], terms is not None and ctx.needs_input_grad[1]
        grad_h, grad_W = _head_grads(h, W, need_h, need_W)
        ctx.chunk, ctx.dtype = chunk or head_chunk(W.shape[0]), dtype  # the recompute's backward has one block
        ctx.fused = terms is not None
        chunk = chunk or head_chunk(W.shape[0], 2 if entropy else 1)
        for s in range(0, N, chunk):
            hc, tc = h[s: s + chunk].to(dtype), targets[s: s + chunk]  # (c, H), (c,)
            logits = _mask((hc @ Wc.T).float(), allowed, s)  # (c, V)
            tgt = logits.gather(1, tc[:, None]).squeeze(1)  # (c,)
            mx = logits.max(dim=-1, keepdim=True).values  # (c, 1)
            shifted = logits.sub_(mx)  # in place: logit - max
            z = shifted.exp() if entropy else shifted.exp_()  # (c, V) exp(logit - max): a second block only for H
            total = z.sum(dim=-1)  # (c,)
            lse[s: s + chunk] = mx.squeeze(1) + total.log()
            logp[s: s + chunk] = tgt - lse[s: s + chunk]
            if entropy:  # H = lse - sum_v p_v logit_v = log(total) - sum_v z_v (logit_v - max) / total
                ent[s: s + chunk] = total.log() - z.mul_(shifted).sum(dim=-1) / total
            if terms is not None:
                with torch.enable_grad():  # the chunk's terms and their derivatives in its log-probs, (c,) each
                    lp = logp[s: s + chunk].detach().requires_grad_()
                    t = terms(lp, slice(s, s + len(tc))).sum()
                    gc, = torch.autograd.grad(t, lp, allow_unused=True) if t.requires_grad else (None,)
                gc = torch.zeros_like(lp) if gc is None else gc  # terms that do not depend on the log-probs
                loss += t.detach()
                if need_h or need_W:  # d loss / d logits = gc * (onehot(t) - softmax), formed in the one block
                    z = shifted.exp_() if entropy else z  # the entropy used its block
                    _add_head_grads(z.mul_((-gc / total)[:, None]), gc, hc, tc, Wc, grad_h, grad_W, s)
            del logits, shifted, z  # before the next chunk's logits: one block alive, not two
        if ctx.fused:
            ctx.save_for_backward(grad_h, grad_W if grad_W is None else grad_W.to(W.dtype))
        else:
            ctx.save_for_backward(h, W, targets, lse)
            ctx.allowed = allowed
        ctx.mark_non_differentiable(ent, logp if ctx.fused else loss)  # one call: a second would replace the first
        return logp, ent, loss

    @staticmethod
    def backward(ctx, g, _g_ent, g_loss):
        if ctx.fused:  # the gradients formed in forward, for a loss of 1 (scaled copies otherwise: kept for a rerun)
            grads = ctx.saved_tensors
            if g_loss.item() != 1:
                grads = [x if x is None else x * g_loss.to(x.dtype) for x in grads]
            return *grads, None, None, None, None, None, None
        h, W, targets, lse = ctx.saved_tensors
        grad_h, grad_W = _head_grads(h, W, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        Wc = W.to(ctx.dtype)
        for s in range(0, h.shape[0], ctx.chunk):
            hc, tc = h[s: s + ctx.chunk].to(ctx.dtype), targets[s: s + ctx.chunk]  # (c, H), (c,)
            gc = g[s: s + ctx.chunk]  # (c,)
            d = _mask((hc @ Wc.T).float(), ctx.allowed, s).sub_(lse[s: s + ctx.chunk, None]).exp_().mul_(-gc[:, None])
            _add_head_grads(d, gc, hc, tc, Wc, grad_h, grad_W, s)
            del d  # before the next chunk's logits: one block alive, not two
        return grad_h, grad_W if grad_W is None else grad_W.to(W.dtype), None, None, None, None, None, None


# A masked logit: finite, so that exp(it - max) is exactly 0 and the entropy's 0 * (it - max) stays 0 (-inf: NaN).
MASKED_LOGIT = -1e30


def _mask(logits, allowed, s):
    """logits (c, V) of rows s.. with the tokens `allowed` does not allow set to MASKED_LOGIT, in place. allowed:
    None (every token), or (table (M, B) uint8: packed masks, bit t % 8 of byte t // 8 for token t; rows (N,) long:
    each row's mask in table)."""
    if allowed is None:
        return logits
    table, rows = allowed
    bits = table[rows[s: s + len(logits)]]  # (c, B)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    ok = (bits[:, :, None] >> shifts & 1).view(len(bits), -1)[:, :logits.shape[1]]  # (c, 8 B) bits, cut to (c, V)
    return logits.masked_fill_(ok == 0, MASKED_LOGIT)


def _head_grads(h, W, need_h, need_W):
    """The gradients the head fills, or None: of h (N, H) in its dtype, of W (V, H) accumulated in fp32."""
    return (torch.empty_like(h) if need_h else None,
            torch.zeros(W.shape, dtype=torch.float32, device=W.device) if need_W else None)


def _add_head_grads(d, gc, hc, tc, Wc, grad_h, grad_W, s):
    """A chunk's part of the head's gradients: d (c, V) holds -gc * softmax; adding gc at the targets makes it
    d loss / d logits, whose products with the head W and the rows hc are the gradients of rows s.. and of W."""
    d[torch.arange(len(tc), device=d.device), tc] += gc
    d = d.to(Wc.dtype)
    if grad_h is not None:
        grad_h[s: s + len(tc)] = d @ Wc
    if grad_W is not None:  # accumulate in fp32 without a (V, H) fp32 temporary
        grad_W.addmm_(d.T, hc) if d.dtype == grad_W.dtype else grad_W.add_(d.T @ hc)


def _apply_head(h, W, targets, entropy, chunk, terms, allowed):
    """_TokenLogprobs in the autocast dtype when autocast is on (the softmax in fp32), detached under no_grad."""
    dev = h.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    if not torch.is_grad_enabled():
        h, W = h.detach(), W.detach()
    with torch.autocast(dev, enabled=False):
        logp, ent, loss = _TokenLogprobs.apply(h, W, targets, chunk, dtype, entropy, terms, allowed)
    return logp, ent if entropy else None, loss


def token_logprobs(h, W, targets, entropy=False, chunk=None, allowed=None):
    """-> (log softmax(h W^T)[targets] (N,), differentiable in h and W; the entropy of each row's softmax (N,),
    detached, or None) for hidden rows h (N, H), head W (V, H), targets (N,), `chunk` rows at a time (default:
    CHUNK_BYTES of fp32 logits): the (N, V) logits never exist. Matmuls run in the autocast dtype when autocast
    is on; the softmax in fp32. The one head every loss and probe goes through; a loss that sums per-token terms
    of the log-probs takes token_loss, which saves the backward's recompute. allowed: (table, rows), the tokens
    each row may take (_mask; a grammar's): the softmax is over those alone, its log-probs, entropies and
    gradients those of the masked, renormalised distribution the rows were sampled from."""
    return _apply_head(h, W, targets, entropy, chunk, None, allowed)[:2]


def token_loss(h, W, targets, terms, entropy=False, chunk=None, allowed=None):
    """-> (sum of terms(logp, rows) over all rows, differentiable in h and W; the log-probs (N,) and entropies (N,)
    or None, both detached) through token_logprobs' head. terms(lp, rows) gets the log-probs lp (c,) of the rows
    `rows` (a slice of range(N)) and returns their terms (c,), row i's a differentiable function of lp[i] alone (and
    of constants): the gradients of the head are then formed chunk by chunk in the forward pass. allowed: as
    token_logprobs'."""
    logp, ent, loss = _apply_head(h, W, targets, entropy, chunk, terms, allowed)
    return loss, logp, ent
