"""
ActObs probes: the measurements behind the paper's explanation, for any checkpoint sft.py writes.

    geometry     cos(g_act, g_obs) and r = |g_obs| / |g_act| over checkpoints     -> JSONL + PNG curve
    obs-nll      held-out observation NLL, fixed wrapper vs payload tokens         -> JSON + PNG bars
    cmd-entropy  next-token entropy by token position within each command          -> JSON + PNG curve
    entropy      self-entropy on own samples at T; --match-entropy bisects for T*  -> JSON (+ PNG of the search)
    kl           mean per-token KL(checkpoint || init) on the checkpoint's samples  -> JSON (+ PNG over checkpoints)

--data holds held-out trajectories (sft.py's format); --n takes the first n (the paper: 256).
    python probes.py geometry --checkpoints runs/act/step-* --data heldout.jsonl --out runs/act/geometry.jsonl
    python probes.py obs-nll --models Qwen/Qwen3-4B runs/act/final runs/actobs/final --data heldout.jsonl --out obs.json
    python probes.py cmd-entropy --models runs/act/final runs/actobs/final --data heldout.jsonl --out cmd.json
    python probes.py entropy --model runs/actobs/final --temperature 1.0 --data heldout.jsonl --out h_actobs.json
    python probes.py entropy --model runs/act/final --match-entropy h_actobs.json --data heldout.jsonl --out tstar.json
    python probes.py kl --models runs/act/final runs/actobs/final --init Qwen/Qwen3-4B --data heldout.jsonl \
        --out kl.json
Each writes --out, the PNG next to it (same stem), and prints one line per model. Several probes in one
process (common.run_cli): `python probes.py obs-nll ARGS ::: kl ARGS`. On CUDA, forward and backward
run under bf16 autocast (as sft.py's --dtype auto); entropies, KLs and NLLs are always computed in fp32.
"""
import argparse
import json
import re
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from actobs import common, labels, terminus
from actobs.geometry import grad_geometry, plot_geometry
from actobs.head import head_chunk, token_logprobs

KEYSTROKES = re.compile(r'"keystrokes"\s*:\s*"((?:[^"\\]|\\.)*)"')  # group 1: a command's JSON string value
BUCKETS = {"1": (1, 1), "2": (2, 2), "3": (3, 3), "4-7": (4, 7), "8+": (8, 1 << 30)}  # 1-based positions


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--data", required=True, help="held-out trajectories, JSONL or JSON array (sft.py's format)")
    shared.add_argument("--n", type=int, default=256, help="use the first n trajectories")
    shared.add_argument("--max-len", type=int, default=16384, help="truncate trajectories (and prompts, from the left)")
    shared.add_argument("--out", required=True, help="output JSON (JSONL for geometry); the PNG goes next to it")
    sub = p.add_subparsers(dest="probe", required=True)
    g = sub.add_parser("geometry", parents=[shared], help="action vs observation gradients, per checkpoint")
    g.add_argument("--checkpoints", nargs="+", required=True, help="HF checkpoint dirs, e.g. RUN/init RUN/step-*")
    g.add_argument("--micro-tokens", type=int, default=32768, help="token budget of one forward/backward pass")
    o = sub.add_parser("obs-nll", parents=[shared], help="observation NLL, wrapper vs payload tokens")
    o.add_argument("--models", nargs="+", required=True, help="base model and checkpoints, scored on the same tokens")
    o.add_argument("--tokenizer", help="tokenizer + chat template to render with (default: the last of --models)")
    c = sub.add_parser("cmd-entropy", parents=[shared], help="entropy by token position within commands")
    c.add_argument("--models", nargs="+", required=True, help="each rendered with its own saved chat template")
    for name, hlp in (("entropy", "self-entropy on own samples"), ("kl", "KL from the initialisation")):
        s = sub.add_parser(name, parents=[shared], help=hlp)
        s.add_argument("--max-new-tokens", type=int, default=512,
                       help="sample length; prompts are the first user turns")
        s.add_argument("--sample-batch", type=int, default=16, help="prompts per generate call")
        s.add_argument("--seed", type=int, default=0, help="sampling seed, the same for every model and temperature")
    sub.choices["entropy"].add_argument("--model", required=True, help="HF checkpoint dir whose samples are scored")
    sub.choices["entropy"].add_argument("--temperature", type=float, default=1.0, help="ignored with --match-entropy")
    sub.choices["entropy"].add_argument("--match-entropy",
                                        help="a target entropy (nats) or an `entropy` JSON: bisect on T")
    sub.choices["kl"].add_argument("--models", nargs="+", required=True, help="checkpoints, each sampled at T = 1")
    sub.choices["kl"].add_argument("--init", required=True, help="the model the checkpoints were trained from")
    return p


# ----------------------------------------------------------------------------------------------------------
# Full-vocabulary quantities, a chunk of rows at a time: the (N, V) logits never exist

def token_entropy(h, W, temperature=1.0, chunk=None):
    """Entropy (nats) of softmax(h W^T / T) per row; h (N, H), W (V, H). -> (N,), by the training loss's head."""
    with torch.no_grad():
        return token_logprobs(h / temperature, W, torch.zeros(len(h), dtype=torch.long, device=h.device),
                              entropy=True, chunk=chunk)[1]


def token_kl(h_p, W_p, h_q, W_q, chunk=None):
    """KL(p || q) per row with p = softmax(h_p W_p^T), q = softmax(h_q W_q^T), rows aligned. -> (N,). Two heads
    at once, which the training head does not do: its own chunks, four (c, V) fp32 blocks within the same
    CHUNK_BYTES of head.py (both log-softmaxes, p and the product)."""
    chunk = chunk or head_chunk(len(W_p), 4)
    out = []
    with torch.no_grad(), torch.autocast(h_p.device.type, enabled=False):
        for s in range(0, len(h_p), chunk):
            lp = torch.log_softmax(h_p[s: s + chunk].float() @ W_p.float().T, -1)  # (c, V)
            lq = torch.log_softmax(h_q[s: s + chunk].float() @ W_q.float().T, -1)
            out.append((lp.exp() * (lp - lq)).sum(-1))
    return torch.cat(out) if out else torch.zeros(0, device=h_p.device)


def token_nll(h, W, targets, chunk=None):
    """-log softmax(h W^T)[target] per row, by the training loss's head. -> (N,)"""
    with torch.no_grad():
        return -token_logprobs(h, W, targets, chunk=chunk)[0]


def hidden(model, ids):
    """Final hidden states (T, H) of one token sequence; logits are these times head(model)^T."""
    x = torch.as_tensor(ids, device=model.device)[None]  # (1, T)
    return model.base_model(input_ids=x, use_cache=False).last_hidden_state[0]


def head(model):
    return model.get_output_embeddings().weight  # (V, H)


# ----------------------------------------------------------------------------------------------------------
# Observation prediction: fixed wrapper vs payload

def obs_split(tok, messages, max_len=None):
    """-> (ids, roles, wrapper (T,) bool): wrapper tokens are observation tokens of harness text (headers, the
    truncation notice, the parse-error / warnings / completion-check text, the end-of-turn token; see
    terminus.wrapper_mask), the rest of the observation tokens are the payload the terminal printed."""
    ids, roles, text, off, spans = labels.encode_spans(tok, messages, max_len)
    return ids, roles, terminus.wrapper_mask(messages, roles, text, off, spans)


@torch.no_grad()
def obs_nll(model, splits):
    """Per-token observation NLL over obs_split outputs: all, wrapper, payload (nats), and token counts."""
    sums = np.zeros((2, 2))  # [wrapper, payload] x [nll sum, tokens]
    for ids, roles, wrap in splits:
        t = np.nonzero(roles[1:] == labels.OBS)[0] + 1  # observation positions; position t - 1 predicts token t
        h = hidden(model, ids)[torch.as_tensor(t - 1, device=model.device)]  # (N, H)
        nll = token_nll(h, head(model), torch.as_tensor(np.asarray(ids)[t], device=model.device)).cpu().numpy()
        for k, sel in enumerate((wrap[t], ~wrap[t])):
            sums[k] += nll[sel].sum(), sel.sum()
    (w_sum, w_n), (p_sum, p_n) = sums
    return {"obs_nll": float((w_sum + p_sum) / max(w_n + p_n, 1)), "wrapper_nll": float(w_sum / max(w_n, 1)),
            "payload_nll": float(p_sum / max(p_n, 1)), "wrapper_tokens": int(w_n), "payload_tokens": int(p_n)}


# ----------------------------------------------------------------------------------------------------------
# Command-token entropy

def command_tokens(tok, messages, max_len=None):
    """-> (ids, commands): for each "keystrokes" JSON value in an assistant turn, the positions of the tokens
    overlapping its characters, in order (a token straddling a quote counts). Matches outside assistant turns
    (e.g. examples in the system prompt) are skipped."""
    ids, roles, text, off = labels.encode(tok, messages, max_len)
    commands = []
    for m in KEYSTROKES.finditer(text):
        idx = np.nonzero((off[:, 0] < m.end(1)) & (off[:, 1] > m.start(1)))[0]
        if len(idx) and (roles[idx] == labels.ACTION).all():
            commands.append(idx.tolist())
    return ids, commands


@torch.no_grad()
def command_entropy(model, encoded):
    """Mean next-token entropy (nats, T = 1) by BUCKETS of position within a command, over command_tokens
    outputs. -> {"entropy": {bucket: mean or None}, "tokens": {bucket: count}}"""
    ents = {k: [] for k in BUCKETS}
    for ids, commands in encoded:
        if commands:
            h = hidden(model, ids)  # (T, H)
            for cmd in commands:
                pos = torch.as_tensor(cmd, device=model.device) - 1  # position t - 1 predicts token t
                e = token_entropy(h[pos], head(model))
                for j, v in enumerate(e.tolist(), 1):
                    ents[next(k for k, (a, b) in BUCKETS.items() if a <= j <= b)].append(v)
    return {"entropy": {k: float(np.mean(v)) if v else None for k, v in ents.items()},
            "tokens": {k: len(v) for k, v in ents.items()}}


# ----------------------------------------------------------------------------------------------------------
# Sampling: self-entropy, temperature matching, KL from the initialisation

def first_turn_prompts(tok, convs, max_len):
    """Token ids of each conversation up to its first assistant turn, plus the generation prompt."""
    out = []
    for c in convs:
        k = next((i for i, m in enumerate(c) if m["role"] == "assistant"), len(c))
        text = tok.apply_chat_template(c[:k], add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"][-max_len:])
    return out


def hf_sampler(model, tok, batch=16):
    """-> sample(prompts, temperature, max_new_tokens, seed) -> completions (id lists, cut after the first eos).
    Pure sampling, no top-k / top-p; left-padded batches. A vLLM sampler with this signature drops in."""
    def sample(prompts, temperature, max_new_tokens, seed):
        torch.manual_seed(seed)
        out = []
        for s in range(0, len(prompts), batch):
            ps = prompts[s: s + batch]
            width = max(map(len, ps))
            x = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in ps], device=model.device)  # (b, width)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=model.device)
            y = model.generate(x, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                               max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id)
            for row in y[:, width:].tolist():  # after an eos, generate pads
                out.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
        return out
    return sample


@torch.no_grad()
def self_entropy(model, prompts, completions, temperature):
    """Mean per-token entropy of softmax(logits / T) along the completions (the model's own samples at T)."""
    tot, n = 0.0, 0
    for p, c in zip(prompts, completions):
        if c:
            h = hidden(model, p + c)[len(p) - 1: -1]  # (len(c), H): the positions that predicted the completion
            tot, n = tot + token_entropy(h, head(model), temperature).sum().item(), n + len(c)
    return tot / max(n, 1)


def match_temperature(entropy_at, target, lo=0.05, hi=3.0, tol=0.01):
    """Bisection for T* with entropy_at(T*) = target; entropy_at must increase with T. -> (T*, [(T, H), ...])"""
    trace = [(lo, entropy_at(lo)), (hi, entropy_at(hi))]
    if not trace[0][1] <= target <= trace[1][1]:
        raise ValueError(f"target entropy {target:.4f} is outside [{trace[0][1]:.4f}, {trace[1][1]:.4f}], "
                         f"the self-entropies at T = {lo} and T = {hi}")
    while hi - lo > tol:
        mid = (lo + hi) / 2
        trace.append((mid, entropy_at(mid)))
        lo, hi = (mid, hi) if trace[-1][1] < target else (lo, mid)
    return (lo + hi) / 2, trace


@torch.no_grad()
def kl_from_init(model, init, prompts, completions):
    """Mean per-token KL(model || init) along completions sampled from model. -> (mean, tokens)"""
    tot, n = 0.0, 0
    for p, c in zip(prompts, completions):
        if c:
            ids, t = p + c, slice(len(p) - 1, -1)
            tot += token_kl(hidden(model, ids)[t], head(model), hidden(init, ids)[t], head(init)).sum().item()
            n += len(c)
    return tot / max(n, 1), n


# ----------------------------------------------------------------------------------------------------------
# Gradient geometry: `geometry` on saved checkpoints, sft.py --probe-every during training


# ----------------------------------------------------------------------------------------------------------
# Plots (matplotlib through common.pyplot; plot_geometry: above)

def plot_series(png_path, xs, series, xlabel, ylabel, bars=False, hline=None):
    """One line (or bar group) per name in series {name: ys} over xs: numbers, or categories if strings."""
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    numeric = not bars and all(isinstance(x, (int, float)) for x in xs)
    pos, width = (np.asarray(xs, dtype=float) if numeric else np.arange(len(xs))), 0.8 / max(len(series), 1)
    for i, (name, ys) in enumerate(series.items()):
        if bars:
            ax.bar(pos + (i - (len(series) - 1) / 2) * width, ys, width, label=name)
        else:
            ax.plot(pos, ys, marker="o", label=name)
    if hline is not None:
        ax.axhline(hline, color="grey", ls="--", lw=1)
    if not numeric:
        ax.set_xticks(pos, [str(x) for x in xs])
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def _target_entropy(arg):
    """--match-entropy: a number, or the JSON an `entropy` run wrote."""
    if Path(arg).is_file():
        res = json.loads(Path(arg).read_text())
        if not isinstance(res, dict) or not isinstance(res.get("entropy"), (int, float)):
            raise ValueError(f"{arg}: no number in field 'entropy' (write this file with `probes.py entropy`)")
        return float(res["entropy"])
    try:
        return float(arg)
    except ValueError:
        raise ValueError(f"--match-entropy {arg!r}: neither a number nor an existing JSON file") from None


def _step(path):
    """Training step of a checkpoint dir: init/ is 0, step-N/ is N, anything else (final/) is None."""
    name = Path(path).name
    return 0 if name == "init" else int(name[5:]) if re.fullmatch(r"step-\d+", name) else None


# ----------------------------------------------------------------------------------------------------------

def main(argv=None):
    args = get_parser().parse_args(argv)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def load(path):  # fp32 weights; bf16 only inside autocast
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()

    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    convs = labels.read_trajectories(args.data)[0][: args.n]
    out, png = Path(args.out), Path(args.out).with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {}

    if args.probe == "geometry":
        rows = []
        for ck in args.checkpoints:
            tok, model = labels.load_tokenizer(ck, "native"), load(ck)
            ex = [labels.render(tok, c, args.max_len) for c in convs]
            groups = common.micro_batches([len(ids) for ids, _ in ex], args.micro_tokens)
            batches = [{k: v.to(device) for k, v in common.collate([ex[i] for i in g], tok.pad_token_id).items()}
                       for g in groups]
            with ctx:
                geo = grad_geometry(model, batches)
            rows.append({"checkpoint": str(ck), "step": _step(ck), **{f"probe/{k}": v for k, v in geo.items()}})
            print(f"{ck} | cos {geo['cos']:.4f} | r {geo['r']:.3f} | |g_act| {geo['norm_act']:.4g} | "
                  f"|g_obs| {geo['norm_obs']:.4g}")
        labels.write_jsonl(out, rows)
        if any(r["step"] is not None for r in rows):
            plot_geometry(out, png)
        return rows

    if args.probe == "obs-nll":
        tok = labels.load_tokenizer(args.tokenizer or args.models[-1], "native")
        splits = [obs_split(tok, c, args.max_len) for c in convs]
        for path in args.models:
            with ctx:
                r = res[str(path)] = obs_nll(load(path), splits)
            print(f"{path} | obs {r['obs_nll']:.4f} | wrapper {r['wrapper_nll']:.4f} ({r['wrapper_tokens']} tok) | "
                  f"payload {r['payload_nll']:.4f} ({r['payload_tokens']} tok)")
        plot_series(png, ["all observation", "wrapper", "payload"],
                    {m: [v["obs_nll"], v["wrapper_nll"], v["payload_nll"]] for m, v in res.items()},
                    "observation tokens", "NLL (nats / token)", bars=True)

    elif args.probe == "cmd-entropy":
        for path in args.models:
            tok = labels.load_tokenizer(path, "native")
            with ctx:
                r = res[str(path)] = command_entropy(load(path), [command_tokens(tok, c, args.max_len) for c in convs])
            print(f"{path} | " + " | ".join(f"pos {k}: {v:.3f}" for k, v in r["entropy"].items() if v is not None))
        curves = {m: [np.nan if x is None else x for x in v["entropy"].values()] for m, v in res.items()}
        plot_series(png, list(BUCKETS), curves, "token position within the command", "entropy (nats)")

    elif args.probe == "entropy":
        target = None if args.match_entropy is None else _target_entropy(args.match_entropy)  # bad input fails first
        tok, model = labels.load_tokenizer(args.model, "native"), load(args.model)
        prompts, sample = first_turn_prompts(tok, convs, args.max_len), hf_sampler(model, tok, args.sample_batch)

        def entropy_at(t):
            with ctx:
                return self_entropy(model, prompts, sample(prompts, t, args.max_new_tokens, args.seed), t)

        if target is None:
            res = {"model": args.model, "temperature": args.temperature, "entropy": entropy_at(args.temperature)}
            print(f"{args.model} | T {args.temperature} | self-entropy {res['entropy']:.4f} nats/token")
        else:
            t_star, trace = match_temperature(entropy_at, target)
            res = {"model": args.model, "target": target, "t_star": t_star, "trace": trace}
            print(f"{args.model} | target self-entropy {target:.4f} | T* {t_star:.3f}")
            trace = sorted(trace)
            plot_series(png, [t for t, _ in trace], {args.model: [h for _, h in trace]}, "temperature",
                        "self-entropy (nats / token)", hline=target)

    else:  # kl
        tok, init = labels.load_tokenizer(args.models[0], "native"), load(args.init)
        prompts = first_turn_prompts(tok, convs, args.max_len)
        for path in args.models:
            model = load(path)
            if head(model).shape != head(init).shape:
                raise ValueError(f"{path}: output head {tuple(head(model).shape)} differs from --init's "
                                 f"{tuple(head(init).shape)}")
            with ctx:
                completions = hf_sampler(model, tok, args.sample_batch)(prompts, 1.0, args.max_new_tokens, args.seed)
                kl, n = kl_from_init(model, init, prompts, completions)
            res[str(path)] = {"kl": kl, "tokens": n}
            print(f"{path} | KL(ckpt || init) {kl:.4f} nats/token over {n} sampled tokens")
        if len(res) > 1:  # label checkpoints as RUN/step-N, RUN/final
            plot_series(png, ["/".join(Path(m).parts[-2:]) for m in res],
                        {"KL(ckpt || init)": [v["kl"] for v in res.values()]}, "checkpoint", "nats / token")
    out.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    common.run_cli(main)
