"""A real run's plan refuses, before anything runs, what the model or the node cannot hold: a context beyond the
model's positions, an engine whose KV cache cannot hold one context, a batch of tasks that does not split over the
GPUs; and it plans the presets' memory as the stages take it."""
import json

import pytest

from actobs import plan
from scripts import plan as run_plan

# Qwen3-8B's config.json (its published shape): 40,960 positions, no rope scaling
QWEN3_8B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 40960, "tie_word_embeddings": False, "rope_scaling": None}
P_8B = 8_190_735_360  # plan.n_params(QWEN3_8B), counted on the meta device in test_the_8b_count


def test_the_8b_count():
    assert plan.n_params(QWEN3_8B) == P_8B


def test_positions_are_the_configs():
    assert plan.positions(QWEN3_8B) == 40960


def test_a_context_beyond_the_models_positions_is_refused_with_the_flag_to_change():
    out = plan.length_problems(QWEN3_8B, P_8B, {"EVAL (evaluate.py)": (65536, 8192, None),
                                                "GRPO (grpo.py)": (16384, 32768, None),
                                                "SFT (sft.py)": (40960, None, None)})
    assert out == ["EVAL (evaluate.py): --max-len 65536 exceeds the model's 40960 positions (config.json "
                   "max_position_embeddings): set --max-len <= 40960, or extend the model's positions (YaRN rope "
                   "scaling in its config.json, max_position_embeddings raised to match)",
                   "GRPO (grpo.py): --max-new-tokens 32768 exceeds its --max-len 16384"]


def test_an_engine_whose_kv_cache_cannot_hold_one_context_is_refused():
    """8B in bf16 is 15.3 GiB of weights: 0.35 of an 80 GiB GPU leaves 10.7 GiB of KV cache, 144 KiB a token (36
    layers x 8 KV heads x 128 x K and V x 2 bytes): 78,232 tokens. 0.2 of it leaves nothing."""
    assert plan.kv_tokens(QWEN3_8B, P_8B, share=0.35, gpu_gib=80) == 78_232
    assert plan.kv_tokens(QWEN3_8B, P_8B, share=0.2, gpu_gib=80) == 0
    assert plan.length_problems(QWEN3_8B, P_8B, {"GRPO": (16384, 4096, 0.35)}, gpu_gib=80) == []
    out, = plan.length_problems(QWEN3_8B, P_8B, {"GRPO": (16384, 4096, 0.2)}, gpu_gib=80)
    assert out.startswith("GRPO: an engine's KV cache (0.2 of 80 GiB, less 15.3 GiB of weights and 2 GiB) holds 0 "
                          "tokens, fewer than --max-len 16384: raise --gpu-memory")


@pytest.mark.parametrize("n, ranks, want", [(32, 8, None), (32, 6, "30 or 36"), (4, 8, "8"), (16, 1, None)])
def test_tasks_that_do_not_split_over_the_gpus_name_the_nearest_that_do(n, ranks, want):
    assert plan.divisible(n, ranks) == want


def run_folder(tmp_path, cfg, stages):
    (tmp_path / "base" / "model").mkdir(parents=True)
    (tmp_path / "base" / "model" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "settings.json").write_text(json.dumps({"stages": {"arms": "actionsft actobs", "preset": "paper",
                                                                   **stages}}))
    return tmp_path


def test_the_plan_stops_the_run_before_it_starts(tmp_path, capsys):
    """scripts.plan on a run folder set as a preset that asks 65,536 positions of Qwen3-8B and 30 tasks a step of 8
    GPUs: it exits naming each array and flag, before it reads the rows (there are none here)."""
    run = run_folder(tmp_path, QWEN3_8B, {"sft": "--max-len 16384", "grpo": "--tasks-per-step 30 --max-len 16384",
                                          "eval": "--max-len 65536 --max-new-tokens 8192", "probe": "--max-len 16384"})
    with pytest.raises(SystemExit) as e:
        run_plan.main([str(run), "--gpus", "8", "--gpu-gib", "80", "--gpu-name", "H100"])
    assert str(e.value) == (
        "plan: the run cannot start as set (ablation.sh's arrays of the preset 'paper'):\n"
        "  EVAL (evaluate.py): --max-len 65536 exceeds the model's 40960 positions (config.json "
        "max_position_embeddings): set --max-len <= 40960, or extend the model's positions (YaRN rope scaling in its "
        "config.json, max_position_embeddings raised to match)\n"
        "  GRPO (grpo.py): --tasks-per-step 30 does not split over the 8 GPUs (one rank each): 24 or 32")
