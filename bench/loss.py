"""
Benchmark: the chunked head (head.token_logprobs) in the two losses that use it, sft.actobs_loss and
grpo.pg_loss, against naive full-logits versions on the same batch, at Qwen3's vocabulary (151,936) with a tiny
hidden size, where the output head dominates; and the head alone against the peak memory its docstring states.
Everything runs in this process, interleaved; prints time and peak-memory ratios.
Targets: peak memory of a loss <= 1/4 of naive, time <= 1.15x; the head's peak within its stated budget.

    python -m bench.loss                       # 4k and 16k tokens (16k naive needs ~30 GB on CPU)
    python -m bench.loss --tokens 4096 8192    # what fits a 24 GB laptop

On CPU, peak memory is the process's resident-set high-water mark above its level before the pass, sampled
every 0.2 ms by a thread; on CUDA it is torch.cuda.max_memory_allocated above the same baseline.
"""
import argparse
import statistics
import threading
import time

import torch

import grpo
import sft
from actobs import batches, head, labels, tiny


def get_parser():
    p = argparse.ArgumentParser(description="the chunked head in the SFT and GRPO losses vs naive full-logits losses: "
                                            "time and peak memory")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="sequence lengths to measure")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3's by default)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny model")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per method (median reported)")
    p.add_argument("--chunk", type=int, default=None,
                   help="rows per chunk of the chunked loss (default: head.CHUNK_BYTES of logits)")
    return p


class PeakRSS:
    """Resident-set high-water mark of this process while the block runs, in bytes above its start."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self.stop = False
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _rss(self):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _watch(self):
        while not self.stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, self._rss()) - self.base


class PeakCUDA:
    def __enter__(self):
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated() - self.base


def naive_sft(model, batch):
    targets = batch["input_ids"].masked_fill(batch["roles"] == labels.PROMPT, -100)
    return model(input_ids=batch["input_ids"], labels=targets).loss


def naive_pg(model, batch, args, n_tok):
    """grpo.pg_loss's PPO term (no KL, no ECHO, token norm) on full logits: log-softmax of the (T, V) logits / T."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float() / args.temperature  # (B, T-1, V)
    logp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)  # (B, T-1)
    act = batch["roles"][:, 1:] == labels.ACTION
    ratio, adv = (logp - batch["behav"][:, 1:]).exp(), batch["adv"][:, 1:]
    obj = grpo.objective(args)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - obj.clip_low, 1 + obj.clip_high) * adv)[act].sum() / n_tok


def measure(fn, model, batch, device):
    """One forward + backward of fn: (seconds, peak bytes, loss)."""
    model.zero_grad(set_to_none=True)
    with (PeakCUDA() if device.type == "cuda" else PeakRSS()) as mem:
        t0 = time.perf_counter()
        loss = fn(model, batch)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    return dt, mem.peak, loss.item()


def main(argv=None):
    args = get_parser().parse_args(argv)
    from transformers import Qwen3ForCausalLM
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = tiny.tiny_config(args.vocab, args.hidden, 2, 4, 2, max_position_embeddings=max(args.tokens))
    model = Qwen3ForCausalLM(cfg).to(device)
    pg_args = grpo.get_parser().parse_args(["--init", "-", "--tasks", "-", "--out", "-", "--temperature", "0.7"])
    print(f"device {device} | vocab {args.vocab} | hidden {args.hidden} | "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params"
          f" | head.CHUNK_BYTES {head.CHUNK_BYTES / 2**30:.2f} GB")
    print(f"{'loss':>5} | {'tokens':>6} | {'naive s':>8} | {'ours s':>8} | {'time ratio':>10} | {'naive GB':>8} | "
          f"{'ours GB':>8} | {'mem ratio':>9} | loss diff")
    for T in args.tokens:
        ids = torch.randint(0, args.vocab, (1, T), device=device)
        roles = torch.full((1, T), labels.ACTION, device=device)
        roles[0, 0] = labels.PROMPT
        batch = {"input_ids": ids, "roles": roles, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():  # behaviour log-probs 0.3 nats off the policy's, advantages of both signs
            behav = (torch.log_softmax(model(input_ids=ids).logits.float() / 0.7, -1)[:, :-1]
                     .gather(-1, ids[:, 1:, None]))
        example = batches.Example(ids=ids[0].tolist(), roles=roles[0].tolist(), wrapper=[False] * T,
                                  adv=torch.randn(T).tolist(), behav=[0.0] + (behav.flatten() + 0.3).tolist())
        rl = batches.micro_batch([example], [0], 0, device)
        need = 3 * T * args.vocab * 4  # fp32 logits, their log-softmax and its gradient
        free = (torch.cuda.mem_get_info()[0] if device.type == "cuda"
                else int(open("/proc/meminfo").read().split("MemAvailable:")[1].split()[0]) * 1024)
        run_naive = need < 0.8 * free
        pairs = {"sft": (lambda m, b: sft.actobs_loss(m, b, lam=1.0, chunk=args.chunk)[0], naive_sft, batch),
                 "grpo": (lambda m, b: grpo.pg_loss(m, b, grpo.objective(pg_args), grpo.Normalisers(T - 1, 1, 0))[0],
                          lambda m, b: naive_pg(m, b, pg_args, T - 1), rl)}
        for name, (ours, naive, b) in pairs.items():
            measure(ours, model, b, device)  # warm-up
            t_n, t_o, m_n, m_o = [], [], [], []
            for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
                dt, mem, l_o = measure(ours, model, b, device)
                t_o.append(dt), m_o.append(mem)
                if run_naive:
                    dt, mem, l_n = measure(naive, model, b, device)
                    t_n.append(dt), m_n.append(mem)
            to, mo = statistics.median(t_o), max(m_o)
            if run_naive:
                tn, mn = statistics.median(t_n), max(m_n)
                print(f"{name:>5} | {T:>6} | {tn:>8.3f} | {to:>8.3f} | {to / tn:>9.2f}x | {mn / 2**30:>8.2f} | "
                      f"{mo / 2**30:>8.2f} | {mo / mn:>8.3f}x | {abs(l_o - l_n):.1e}")
            else:
                print(f"{name:>5} | {T:>6} | {'-':>8} | {to:>8.3f} | {'-':>10} | {'-':>8} | {mo / 2**30:>8.2f} | "
                      f"{'-':>9} | naive skipped: needs ~{need / 2**30:.0f} GB, {free / 2**30:.0f} GB free")
        # the head alone, forward + backward, against what head.token_logprobs' docstring states
        h = torch.randn(T, args.hidden, device=device, requires_grad=True)
        W = model.get_output_embeddings().weight
        for entropy in (False, True):
            with (PeakCUDA() if device.type == "cuda" else PeakRSS()) as mem:
                lp, _ = head.token_logprobs(h, W, ids[0], entropy=entropy, chunk=args.chunk)
                lp.sum().backward()
            model.zero_grad(set_to_none=True)
            budget = head.CHUNK_BYTES + W.numel() * 4 + h.numel() * 4  # one block, the fp32 grads of W and h
            print(f"head  | {T:>6} | entropy {entropy!s:>5} | peak {mem.peak / 2**30:.3f} GB | stated budget "
                  f"{budget / 2**30:.3f} GB | {mem.peak / budget:.2f}x")


if __name__ == "__main__":
    main()
