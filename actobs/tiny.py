"""
The small random Qwen3 this project builds for laptops, tests and the CPU run (no hub access needed): a byte-level
BPE with Qwen's special tokens trained here on the texts it will read (pre-split by Qwen's pattern or by names),
the model's config, and the FLOPs of a token's forward pass through such a decoder.
"""
import torch

from actobs.labels import PREFIX_TEMPLATE


QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen2/3's pre-tokenizer split pattern


# Letters, digits, punctuation and white space each their own pieces: a name has the same tokens wherever it stands
# (QWEN_SPLIT glues one space or punctuation mark to the letters after it, so d8n8n.ini in an `ls` listing and in
# /etc/svc/d8n8n.ini start with different tokens, and a copy by content finds no earlier occurrence to follow).
# About 1.33x the tokens of QWEN_SPLIT on the base model's terminal sessions.
NAME_SPLIT = r"\p{L}+|\p{N}|[^\s\p{L}\p{N}]+|\s+"
SPLITS = {"qwen": QWEN_SPLIT, "names": NAME_SPLIT}


def pre_split(split="qwen"):
    """The BPE's pre-tokenizer step that cuts text by SPLITS[split]: no merge crosses its pieces, so a value is the
    same tokens wherever it is the same piece (`.pre_tokenize_str(text)` lists them)."""
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Split(Regex(SPLITS[split]), behavior="isolated")


QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def tiny_config(vocab_size, hidden, layers, heads, kv_heads, **overrides):
    """The small random Qwen3 the project builds (build_tiny, the benchmarks): MLP 3x hidden, head size hidden /
    heads, tied embeddings, 32k positions; overrides are further Qwen3Config fields."""
    from transformers import Qwen3Config
    return Qwen3Config(**{"vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 3 * hidden,
                          "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                          "head_dim": hidden // heads, "tie_word_embeddings": True, "max_position_embeddings": 32768,
                          **overrides})


def build_tiny(out_dir, texts, vocab_size=4096, hidden=256, layers=4, heads=4, kv_heads=2, seed=0, split="qwen"):
    """Train a byte-level BPE with Qwen's special tokens on `texts` (pre-split by SPLITS[split]), build a random
    Qwen3 around it, and save both (with the prefix-preserving chat template) to out_dir. Returns out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_split(split), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(QWEN_SPECIAL) - len(QWEN_ADDED), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    bpe.add_special_tokens(QWEN_SPECIAL)
    bpe.add_tokens(QWEN_ADDED)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = PREFIX_TEMPLATE
    torch.manual_seed(seed)
    cfg = tiny_config(len(tok), hidden, layers, heads, kv_heads, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None)
    Qwen3ForCausalLM(cfg).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)


def forward_flops(cfg, context):
    """FLOPs of one token's forward pass through a dense decoder (the Qwen3 / Llama form; cfg: its Hugging Face
    config as a dict) attending to `context` earlier tokens: 2 per weight of the matmuls (attention projections,
    MLP, the head; the embedding lookup costs none) and 4 per attention dimension and layer for each attended
    token (the scores and the weighted values). A training step costs 3 times this (the backward pass: twice)."""
    d, L, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or d // heads
    weights = L * (2 * d * head_dim * (heads + cfg["num_key_value_heads"]) + 3 * d * cfg["intermediate_size"])
    return 2 * (weights + cfg["vocab_size"] * d) + 4 * L * heads * head_dim * context
