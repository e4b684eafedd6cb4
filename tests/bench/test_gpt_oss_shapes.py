"""The gpt-oss bench shapes are configs the engine serves with both layer kinds (windows shorter
than the context), read from what transformers' own config class writes; gpt-oss-20b-4l has
gpt-oss-20b's layer (transformers' GptOssConfig defaults, which are the released models'
layer dimensions) with 32 experts, and bench/run_gpu.sh builds and runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from bench.checkpoints import SHAPES
from engine.models.gpt_oss import layer_windows
from engine.models.hf_config import parse_model_config

REPO = Path(__file__).resolve().parents[2]
LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
    "vocab_size",
    "max_position_embeddings",
    "num_experts_per_tok",
    "rms_norm_eps",
)


@pytest.mark.parametrize("name", ["small-gpt-oss", "gpt-oss-20b-4l"])
def test_a_gpt_oss_shape_has_sliding_and_full_layers(name: str) -> None:
    shape = SHAPES[name]
    assert shape.arch == "gpt_oss"
    raw = transformers.GptOssConfig(**shape.config).to_dict()
    raw["architectures"] = ["GptOssForCausalLM"]
    cfg = parse_model_config(raw, {})
    windows = layer_windows(cfg)
    assert None in windows and shape.config["sliding_window"] in windows
    assert shape.config["sliding_window"] < cfg.max_model_len
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "yarn"
    assert cfg.moe is not None and cfg.moe.expert_bias and cfg.moe.softmax_after_topk


def test_gpt_oss_20b_4l_has_the_released_layer_and_runs_on_the_gpu_suite() -> None:
    released = transformers.GptOssConfig().to_dict()
    shape = SHAPES["gpt-oss-20b-4l"].config
    assert {k: shape[k] for k in LAYER_KEYS} == {k: released[k] for k in LAYER_KEYS}
    assert shape["num_local_experts"] == 32  # gpt-oss-20b's (GptOssConfig's 128: the 120b's)
    script = (REPO / "bench" / "run_gpu.sh").read_text()
    assert "$CK gpt-oss-20b-4l" in script and "--shape gpt-oss-20b-4l" in script
