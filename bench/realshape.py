"""
A real architecture with nothing downloaded, the one home of what bench.gpu_check and bench.rehearsal start from:
Qwen3-0.6B's config (narrowed on request), a random init of it saved as a Hugging Face checkpoint in bf16 (as the
hub's is), and a tokenizer trained here. The tokenizer is a small byte-level BPE with Qwen's special tokens
(tiny.build_tiny) and the Qwen3 chat template of tests/fixtures as its own; the model's vocabulary stays the
config's 151,936 rows, padded far past the BPE's few thousand tokens (a real Qwen3 pads too, from ~151.7k tokens),
so the embedding, the head and the logits have the real size and a sampled id past the BPE decodes to nothing.
"""
import json
from pathlib import Path

import torch

from actobs import tiny

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
QWEN3_TEMPLATE = FIXTURES / "qwen3_chat_template.jinja"  # the template the Qwen3 models ship (SOURCES.md)
NEMOTRON_ROWS = FIXTURES / "nemotron_terminal_sample.json"  # three published Nemotron-Terminal-Corpus rows

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 rope_theta=1000000, max_position_embeddings=40960, rms_norm_eps=1e-6)


def narrow(cfg, hidden=None, layers=None):
    """A copy of the config dict `cfg` with the residual width `hidden` (the MLP at 3x it, Qwen3-0.6B's ratio) and
    `layers` layers where given. The attention's heads and head size stay: the KV cache per token is cfg's."""
    cfg = dict(cfg)
    if hidden:
        cfg.update(hidden_size=hidden, intermediate_size=3 * hidden)
    if layers:
        cfg.update(num_hidden_layers=layers)
    return cfg


def nemotron_rows():
    """The conversations of the three Nemotron-Terminal-Corpus rows in tests/fixtures, as published."""
    return [r["conversations"] for r in json.loads(NEMOTRON_ROWS.read_text())]


def checkpoint(out, texts, cfg, bpe_vocab=4096, seed=0):
    """OUT: a BPE of bpe_vocab tokens trained on `texts` (Qwen's special tokens, Qwen3's chat template as its own)
    and a random init of `cfg` (a dict; its vocab_size may exceed the BPE's) in bf16. -> OUT as a str."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
    tiny.build_tiny(out, texts, vocab_size=bpe_vocab, hidden=64, layers=1)  # the tokenizer; its model replaced below
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = QWEN3_TEMPLATE.read_text()
    tok.save_pretrained(out)
    if len(tok) > cfg["vocab_size"]:
        raise ValueError(f"the BPE has {len(tok)} tokens, more than the config's vocab_size {cfg['vocab_size']}")
    for f in Path(out).glob("model*.safetensors"):  # build_tiny's
        f.unlink()
    torch.manual_seed(seed)
    config = Qwen3Config(**cfg, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)  # initialised in bf16
    return str(out)
