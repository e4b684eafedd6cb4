"""Reading HF configs of both transformers generations, and loading safetensors by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.hf_config import UnsupportedModelError, parse_model_config
from tests.support.tiny_models import load_hf_model, make_checkpoint

LLAMA_4X = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "torch_dtype": "bfloat16",
    "eos_token_id": [1, 2],
}


def test_transformers_4x_keys_are_read() -> None:
    cfg = parse_model_config(LLAMA_4X, {}, max_model_len=1024)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.checkpoint_dtype == "bfloat16"
    assert cfg.eos_token_ids == (1, 2)
    assert cfg.max_model_len == 1024 and cfg.max_position_embeddings == 8192
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2


def test_transformers_5x_rope_parameters_and_generation_eos_are_read() -> None:
    raw = {k: v for k, v in LLAMA_4X.items() if k not in ("rope_theta", "rope_scaling")}
    raw["rope_parameters"] = {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}
    cfg = parse_model_config(raw, {"eos_token_id": [7, 8, 9]})
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.eos_token_ids == (7, 8, 9)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"rope_scaling": {"type": "dynamic", "factor": 4.0}}, "dynamic"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        # Mistral and Qwen2/3 compute their windows; a member that does not refuses one.
        ({"architectures": ["MixtralForCausalLM"], "sliding_window": 4096}, "sliding_window"),
    ],
)
def test_unsupported_configs_fail_naming_the_key(change: dict, named: str) -> None:
    with pytest.raises(UnsupportedModelError, match=named):
        parse_model_config({**LLAMA_4X, **change}, {})


def test_sliding_window_is_accepted_when_it_covers_the_served_context() -> None:
    mistral = {**LLAMA_4X, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert parse_model_config(mistral, {}, max_model_len=4096).max_model_len == 4096
    qwen2 = {
        **LLAMA_4X,
        "architectures": ["Qwen2ForCausalLM"],
        "sliding_window": 32,
        "use_sliding_window": False,
    }
    assert parse_model_config(qwen2, {}).qkv_bias


def test_sharded_checkpoint_loads_and_generates_like_the_single_file(
    tiny_llama: Path, tmp_path: Path
) -> None:
    sharded = make_checkpoint(tmp_path / "sharded", "llama", max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [[0, 11, 12, 13]]
    one = LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))
    many = LLMEngine(EngineConfig(model=str(sharded), device="cpu", dtype="float32"))
    assert many.generate(prompt, params)[0].token_ids == one.generate(prompt, params)[0].token_ids
    hf = load_hf_model(sharded)
    for name, tensor in many.model.checkpoint_tensors().items():
        assert torch.equal(tensor, hf.state_dict()[name]), name


@pytest.mark.parametrize("damage", ["drop", "reshape", "extra"])
def test_damaged_checkpoints_are_refused_with_the_tensor_named(
    tiny_llama: Path, tmp_path: Path, damage: str
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    if damage == "drop":
        del tensors[name]
    elif damage == "reshape":
        tensors[name] = tensors[name][:, :-1].contiguous()
    else:
        name = "model.layers.9.mlp.up_proj.weight"
        tensors[name] = torch.zeros(2, 2)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        LLMEngine(EngineConfig(model=str(broken), device="cpu", dtype="float32"))


def test_missing_config_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu"))


def test_engine_modules_shared_with_the_service_do_not_import_torch_or_grpc() -> None:
    import subprocess
    import sys

    code = "import engine, engine.protocol.messages, engine.protocol.config, engine.process, sys; print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
