"""The Gemma 3 bench shapes are configs the engine serves with both layer kinds (sliding windows
shorter than the context, the full layers' rope scaled), read from what transformers' own config
class writes; every shape bench/run_gpu.sh names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import transformers

from bench.checkpoints import SHAPES
from engine.models.gemma_config import FULL, SLIDING, gemma_config
from engine.models.hf_config import parse_model_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["small-gemma3", "gemma-3-4b-6l"])
def test_a_gemma3_shape_has_sliding_and_full_layers(name: str) -> None:
    shape = SHAPES[name]
    assert shape.arch == "gemma3_text"
    raw = transformers.Gemma3TextConfig(**shape.config).to_dict()
    raw["architectures"] = ["Gemma3ForCausalLM"]
    cfg = parse_model_config(raw, {})
    gemma = gemma_config(cfg)
    assert {FULL, SLIDING} == set(gemma.layer_types)
    assert gemma.window == shape.config["sliding_window"] < cfg.max_model_len
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "linear"
    assert gemma.local_scaling is None and gemma.local_theta < cfg.rope_theta


def test_every_shape_the_gpu_suite_names_exists() -> None:
    script = (REPO / "bench" / "run_gpu.sh").read_text()
    named = set(re.findall(r"--shape (\S+)", script))
    named |= {n for line in re.findall(r"\$CK ([^\n]+)", script) for n in line.split()}
    assert named and named <= set(SHAPES), named - set(SHAPES)
