"""
Benchmark: sft.actobs_loss (chunked, log-probs from hidden states) against the naive
`model(input_ids, labels=...)` on the same batch, at Qwen3's vocabulary (151,936) with a tiny hidden size,
where the output head dominates. Both run in this process, interleaved; prints time and peak-memory ratios.
Targets: peak memory of the loss <= 1/4 of naive, time <= 1.15x.

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

import labels
import sft


def get_parser():
    p = argparse.ArgumentParser(description="chunked actobs_loss vs naive full-logits loss: time and peak memory")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="sequence lengths to measure")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3's by default)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny model")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per method (median reported)")
    p.add_argument("--chunk", type=int, default=None, help="rows per chunk of the chunked loss (default: sft.CHUNK_BYTES of logits)")
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


def naive(model, batch):
    targets = batch["input_ids"].masked_fill(batch["roles"] == labels.PROMPT, -100)
    return model(input_ids=batch["input_ids"], labels=targets).loss


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
    from transformers import Qwen3Config, Qwen3ForCausalLM
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                      tie_word_embeddings=True, max_position_embeddings=max(args.tokens))
    model = Qwen3ForCausalLM(cfg).to(device)
    ours = lambda m, b: sft.actobs_loss(m, b, lam=1.0, chunk=args.chunk)[0]  # noqa: E731
    print(f"device {device} | vocab {args.vocab} | hidden {args.hidden} | {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params")
    print(f"{'tokens':>7} | {'naive s':>8} | {'ours s':>8} | {'time ratio':>10} | {'naive GB':>8} | {'ours GB':>8} | {'mem ratio':>9} | loss diff")
    for T in args.tokens:
        ids = torch.randint(0, args.vocab, (1, T), device=device)
        roles = torch.full((1, T), labels.ACTION, device=device)
        roles[0, 0] = labels.PROMPT
        batch = {"input_ids": ids, "roles": roles, "attention_mask": torch.ones_like(ids)}
        need = 3 * T * args.vocab * 4  # fp32 logits, their log-softmax and its gradient
        free = (torch.cuda.mem_get_info()[0] if device.type == "cuda"
                else int(open("/proc/meminfo").read().split("MemAvailable:")[1].split()[0]) * 1024)
        run_naive = need < 0.8 * free
        measure(ours, model, batch, device)  # warm-up
        t_n, t_o, m_n, m_o = [], [], [], []
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
            dt, mem, l_o = measure(ours, model, batch, device)
            t_o.append(dt), m_o.append(mem)
            if run_naive:
                dt, mem, l_n = measure(naive, model, batch, device)
                t_n.append(dt), m_n.append(mem)
        to, mo = statistics.median(t_o), max(m_o)
        if run_naive:
            tn, mn = statistics.median(t_n), max(m_n)
            print(f"{T:>7} | {tn:>8.3f} | {to:>8.3f} | {to / tn:>9.2f}x | {mn / 2**30:>8.2f} | {mo / 2**30:>8.2f} | "
                  f"{mo / mn:>8.3f}x | {abs(l_o - l_n):.1e}")
        else:
            print(f"{T:>7} | {'-':>8} | {to:>8.3f} | {'-':>10} | {'-':>8} | {mo / 2**30:>8.2f} | {'-':>9} | "
                  f"naive skipped: needs ~{need / 2**30:.0f} GB, {free / 2**30:.0f} GB free")


if __name__ == "__main__":
    main()
