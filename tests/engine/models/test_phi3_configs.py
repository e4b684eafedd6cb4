"""Phi-3/Phi-4 config.json: Microsoft's shipped configs read as transformers reads them (the
window, the partial rotary, LongRoPE's factors by the served context, a rank's fused rows), and
what cannot be computed refused naming the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention.torch_ref import TorchRefAttention
from engine.models.hf_config import UnsupportedModelError, load_model_config, parse_model_config
from engine.models.phi3 import Phi3ForCausalLM
from engine.parallel.shard_layout import Split
from tests.engine.models.test_phi3 import ALL, checkpoint_of, longrope, make_engine
from tests.support.tiny_models import make_checkpoint


@pytest.fixture(scope="module")
def everything(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint_of(tmp_path_factory.mktemp("phi_all"), **ALL)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"hidden_act": "gelu_new"}, "hidden_act"),
        ({"rope_parameters": {**longrope(12), "short_factor": [1.0] * 8}}, "short_factor"),
        ({"rope_parameters": {**longrope(12), "partial_rotary_factor": 0.7}}, "partial_rotary"),
        (
            {"rope_parameters": {**longrope(12), "original_max_position_embeddings": None}},
            "original_max_position_embeddings",
        ),
    ],
)
def test_what_cannot_be_computed_is_refused_naming_the_key(
    everything: Path, tmp_path: Path, change: dict[str, Any], key: str
) -> None:
    directory = Path(shutil.copytree(everything, tmp_path / "bad"))
    raw = json.loads((directory / "config.json").read_text())
    raw = {**raw, **change}
    if key == "original_max_position_embeddings":  # 4.x keeps it at the top level too
        del raw[key]
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=key):
        load_model_config(directory)
        make_engine(directory)


def test_a_partial_rotary_stays_refused_for_the_llama_family(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path / "llama", "llama")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "partial_rotary_factor": 0.5}))
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        load_model_config(directory)


def shipped_config(name: str) -> dict[str, Any]:
    """config.json as Microsoft ships them (transformers 4.x keys; factor values invented)."""
    common = {
        "architectures": ["Phi3ForCausalLM"],
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
    }
    if name == "Phi-3-mini-4k-instruct":
        return common | {
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "max_position_embeddings": 4096,
            "rope_scaling": None,
            "sliding_window": 2047,
            "tie_word_embeddings": False,
            "vocab_size": 32064,
        }
    factors = {"short_factor": [1.0] * 48, "long_factor": [1.5] * 48, "type": "longrope"}
    return common | {  # Phi-4-mini-instruct
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "partial_rotary_factor": 0.75,
        "rope_scaling": factors,
        "sliding_window": 262144,
        "tie_word_embeddings": True,
        "vocab_size": 200064,
        "full_attn_mod": 1,  # keys of Microsoft's own modelling code, which transformers ignores
        "lm_head_bias": False,
    }


@pytest.mark.parametrize(
    ("name", "served", "window", "rope"),
    [
        ("Phi-3-mini-4k-instruct", None, 2047, None),
        ("Phi-4-mini-instruct", 8192, None, "long_factor"),
        ("Phi-4-mini-instruct", 4096, None, "short_factor"),
    ],
)
def test_shipped_configs_read_as_transformers_reads_them(
    name: str, served: int | None, window: int | None, rope: str | None
) -> None:
    cfg = parse_model_config(shipped_config(name), {}, served)
    with torch.device("meta"):
        model = Phi3ForCausalLM(cfg, TorchRefAttention(1.0, 16))
    assert {model.kv_layout.layer(i).sliding_window for i in range(cfg.num_layers)} == {window}
    rotary = int(cfg.head_dim * cfg.partial_rotary_factor)
    assert model.rotary.cos.shape == (cfg.max_model_len, rotary)
    if rope is not None:
        assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 32.0
        inv = 1.0 / (
            torch.tensor(cfg.rope_scaling[rope]) * 10000.0 ** (torch.arange(0, 96, 2) / 96)
        )
        model.init_buffers(torch.device("cpu"))
        assert torch.allclose(model.rotary.cos[1, :48] / model.rotary.cos[0, 0], inv.cos())
    assert Phi3ForCausalLM.shard_layout(cfg, 1, 2).split(
        "model.layers.0.self_attn.qkv_proj.weight"
    ) == Split(0, cfg.num_heads * cfg.head_dim // 2, cfg.num_heads * cfg.head_dim, *qkv_rest(cfg))


def qkv_rest(cfg: Any) -> tuple[int, tuple[tuple[int, int], ...]]:
    """Rank 1 of 2: the second half of q's rows, of k's and of v's."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return q + 2 * kv, ((q + kv // 2, q + kv), (q + kv + kv // 2, q + 2 * kv))
