"""
What a run costs before it starts: the memory each process needs per stage (from the model's parameter count and
shape: the plan that chooses --fsdp and --grad-ckpt), and a time from FLOPs at a stated MFU. Rough on purpose: the
big terms only, each named below; bench/rehearsal.py measures them on CPU at Qwen3-0.6B's shape, RESULTS.md has how
close they came. docs/training.md#gpu-memory-plan-of-a-grpo-run.
"""
import json
from pathlib import Path

from actobs.head import CHUNK_BYTES

GIB = 2 ** 30
# A process before its model (Python, torch, transformers; with vLLM's engine), on CPU: the rehearsal's --tiny peaks
RUNTIME_GIB = {"torch": 0.5, "vllm": 0.8}
# Dense bf16 peak of a GPU, FLOP/s, by a word of its name (the vendors' data sheets); else measured (peak_flop_s)
GPU_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}
MFU = {"train": 0.35, "generate": 0.05}  # the stated utilisations of time_s: training; sampling (memory-bound)


def shape(model_dir):
    """The config.json of a Hugging Face model folder, as a dict (text_config where it nests one)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def n_params(cfg):
    """The parameter count of a causal LM of config `cfg` (a dict), counted on the meta device: nothing allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config
    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    config = AutoConfig.for_model(cfg["model_type"], **rest) if "model_type" in cfg else Qwen3Config(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def kv_bytes(cfg, tokens, dtype_bytes):
    """The KV cache of `tokens` tokens: K and V of every layer's key/value heads (engine.kv_cache_bytes per token)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return tokens * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def positions(cfg):
    """The positions a model of config `cfg` holds: config.json's max_position_embeddings, what vLLM checks an
    engine's max_model_len against (a YaRN rope scaling in the config does not raise it there: raise both)."""
    return cfg["max_position_embeddings"]


# What an engine's share of a GPU holds besides the weights and the KV cache (vLLM's profiling run's activations, the
# sampler's logits, the CUDA context): an assumption, the big terms only
ENGINE_OVERHEAD_GIB = 2.0


def kv_tokens(cfg, P, *, share, gpu_gib, dtype_bytes=2):
    """The tokens an engine's KV cache holds when the engine takes `share` of a GPU of gpu_gib GiB (vLLM's
    gpu_memory_utilization): the share less the weights and ENGINE_OVERHEAD_GIB, over kv_bytes a token."""
    free = share * gpu_gib * GIB - dtype_bytes * P - ENGINE_OVERHEAD_GIB * GIB
    return max(0, int(free // kv_bytes(cfg, 1, dtype_bytes)))


def length_problems(cfg, P, stages, *, gpu_gib=None):
    """What stops a run before it starts, one line each: a stage's context (--max-len) beyond the model's positions,
    a reply (--max-new-tokens) longer than its context, an engine whose KV cache cannot hold one context (vLLM
    refuses to start then). stages: {name: (max_len, max_new_tokens or None, the engine's GPU share or None)};
    gpu_gib: each GPU's memory (None: a CPU, whose engines size their cache to the need)."""
    limit = positions(cfg)
    out = []
    for name, (max_len, new, share) in stages.items():
        if max_len > limit:
            out.append(f"{name}: --max-len {max_len} exceeds the model's {limit} positions (config.json "
                       f"max_position_embeddings): set --max-len <= {limit}, or extend the model's positions (YaRN "
                       "rope scaling in its config.json, max_position_embeddings raised to match)")
        if new is not None and new > max_len:
            out.append(f"{name}: --max-new-tokens {new} exceeds its --max-len {max_len}")
        if share is not None and gpu_gib is not None and (kv := kv_tokens(cfg, P, share=share, gpu_gib=gpu_gib)) \
                < max_len:
            out.append(f"{name}: an engine's KV cache ({share:g} of {gpu_gib:.0f} GiB, less {2 * P / GIB:.1f} GiB of "
                       f"weights and {ENGINE_OVERHEAD_GIB:g} GiB) holds {kv} tokens, fewer than --max-len "
                       f"{max_len}: raise --gpu-memory or lower --max-len")
    return out


def divisible(n, ranks):
    """None where n splits over `ranks`, else the nearest multiples of ranks (below, above) as a sentence."""
    if n % ranks == 0:
        return None
    below, above = n // ranks * ranks, (n // ranks + 1) * ranks
    return " or ".join(str(x) for x in (below, above) if x > 0)


def trainer_bytes(cfg, P, *, ranks, seq_len, fsdp, grad_ckpt, rank0_save):
    """One training rank's peak (sft.py, grpo.py's trainer): fp32 weights, grads and AdamW's two moments (16 B a
    parameter), sharded over the ranks by FSDP2, else whole (DDP adds its gradient buckets: 4 B a parameter); the
    head's one block of logits (head.CHUNK_BYTES) and its fp32 (V, H) gradient; under FSDP2 the tied (V, H) embedding
    unsharded for the forward and its full gradient until the reduce-scatter; activations over seq_len tokens: with
    --grad-ckpt each layer's input and one layer's work, else every layer's work. rank0_save: a checkpoint with the
    optimizer state gathers the full weights and moments on rank 0 (12 B a parameter) after the grads are freed."""
    V, H, L, I = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    attn = cfg["num_attention_heads"] * (cfg.get("head_dim") or H // cfg["num_attention_heads"])
    state = 16 * P / ranks if fsdp else 20 * P
    head = CHUNK_BYTES + 4 * V * H + (2 * 4 * V * H if fsdp else 0)
    work = 4 * I + 8 * attn  # one layer's activations a token, in fp32 words (its MLP's and attention's)
    act = 4 * seq_len * (L * H + work) if grad_ckpt else 4 * seq_len * L * (H + work)
    peak = state + head + act
    return max(peak, 12 * P / ranks + 12 * P) if rank0_save and fsdp else peak


def memory_gib(stage, cfg, P, *, ranks=1, seq_len, dtype_bytes, device="cpu", fsdp=True, grad_ckpt=True, kl=False,
               max_seqs=1, gpu_gib=None, gpu_memory=0.35):
    """Planned peak GiB of each process of a stage (rank 0 first), from the parameter count P. On a GPU the engine
    holds --gpu-memory of it while it samples and sleeps while the trainer trains (weights to host memory, KV cache
    freed), so a GRPO rank's peak is the larger phase; on a CPU the engine's weights, its KV cache (engine.py's size)
    and its (V, H) head twice (oneDNN's packed copy for the logits) stay beside the trainer, plus each process's
    runtime (RUNTIME_GIB). The initial policy (kl: a KL term) is one more copy in the compute dtype, sharded like the
    policy under --fsdp. The engine wakes into the memory the trainer released: grpo.py empties the allocator's cache
    (torch.cuda.empty_cache) between the update and wake_up, so the trainer's activations and cached blocks are not
    held beside the engine, only its weights, gradients and optimizer state (static)."""
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    cpu = device == "cpu"
    rt = {k: v * GIB if cpu else 0 for k, v in RUNTIME_GIB.items()}
    train = [trainer_bytes(cfg, P, ranks=ranks, seq_len=seq_len, fsdp=fsdp, grad_ckpt=grad_ckpt,
                           rank0_save=cpu and r == 0) for r in range(ranks)]
    ref = dtype_bytes * P / (ranks if fsdp else 1) if kl else 0
    if cpu:
        engine = dtype_bytes * P + kv_bytes(cfg, max_seqs * (seq_len + 256), dtype_bytes) + dtype_bytes * V * H
        grpo = [rt["vllm"] + ref + engine + t for t in train]
    else:
        engine = gpu_memory * gpu_gib * GIB
        static = (16 * P / ranks if fsdp else 20 * P) + ref
        grpo = [max(static + engine, t + ref) for t in train]
    procs = {"sft": [rt["torch"] + t for t in train],
             "grpo": grpo,
             "evaluate": [rt["vllm"] + engine],
             "probes": [rt["torch"] + 4 * P + CHUNK_BYTES + 4 * V * H
                        + 4 * seq_len * (cfg["num_hidden_layers"] * H + 4 * cfg["intermediate_size"])]}[stage]
    return [round(x / GIB, 2) for x in procs]


def choose(cfg, P, *, ranks, seq_len, gpu_gib, dtype_bytes=2, kl=False, gpu_memory=0.35, margin=0.9):
    """The cheapest of (DDP), (DDP, --grad-ckpt), (--fsdp), (--fsdp --grad-ckpt) whose SFT and GRPO plans fit
    `margin` of a GPU of gpu_gib: -> (its flags as a list, {stage: GiB a rank}), or (None, the last plans) when none
    fits."""
    plans = {}
    for fsdp, ckpt in ((False, False), (False, True), (True, False), (True, True)):
        if fsdp and ranks == 1:
            continue  # FSDP2 over one rank shards nothing
        kw = dict(ranks=ranks, seq_len=seq_len, dtype_bytes=dtype_bytes, device="cuda", fsdp=fsdp, grad_ckpt=ckpt,
                  kl=kl, gpu_gib=gpu_gib, gpu_memory=gpu_memory)
        plans = {s: max(memory_gib(s, cfg, P, **kw)) for s in ("sft", "grpo")}
        if max(plans.values()) <= margin * gpu_gib:
            return ["--fsdp"] * fsdp + ["--grad-ckpt"] * ckpt, plans
    return None, plans


def peak_flop_s(device_name=None):
    """Dense bf16 peak FLOP/s of the GPU named (GPU_PEAK), or None where the name says nothing."""
    return next((v for k, v in GPU_PEAK.items() if device_name and k in device_name), None)


def time_s(P, *, train_tokens=0, generated_tokens=0, flop_s, devices=1):
    """Seconds of compute: training 6 P FLOPs a token at MFU["train"], sampling 2 P a token (prefill and decode) at
    MFU["generate"], over `devices` of flop_s each. Sandboxes, verifiers and the weight sync are not in it."""
    return (6 * P * train_tokens / MFU["train"] + 2 * P * generated_tokens / MFU["generate"]) / (flop_s * devices)
