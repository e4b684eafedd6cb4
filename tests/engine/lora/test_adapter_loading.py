"""Loading and unloading adapters: one that does not fit is a ValueError that names what is
wrong and changes nothing; a request for an adapter not loaded is its ERROR output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from tests.support.lora_adapters import make_adapter
from tests.support.tiny_models import make_checkpoint


@pytest.fixture(scope="module")
def adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("adapter") / "a", r=8)


def make_engine(checkpoint: Path, max_loras: int = 2, max_lora_rank: int = 8) -> LLMEngine:
    config = EngineConfig(
        model=str(checkpoint),
        device="cpu",
        dtype="float32",
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
    )
    return LLMEngine(config)


def params(adapter: str = "", max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, adapter=adapter)


def refused(engine: LLMEngine, path: Path, says: str, name: str = "x") -> None:
    before = engine.adapters()
    with pytest.raises(ValueError, match=says):
        engine.load_adapter(name, path)
    assert engine.adapters() == before


def copy_with(adapter: Path, to: Path, config: dict | None = None, rename: tuple = ()) -> Path:
    """The adapter at `to`, its config updated with `config`, one tensor name replaced."""
    to.mkdir()
    cfg = json.loads((adapter / "adapter_config.json").read_text()) | (config or {})
    (to / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    if rename:
        tensors = {k.replace(*rename): v for k, v in tensors.items()}
    save_file(tensors, str(to / "adapter_model.safetensors"))
    return to


def test_a_request_for_an_adapter_not_loaded_is_its_error_output(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    [result] = engine.generate([[0, 5, 6]], params("nobody"))
    assert result.finish_reason is FinishReason.ERROR
    assert result.error == "adapter: 'nobody' is not loaded"


def test_a_rank_above_the_maximum_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_llama, max_lora_rank=4)
    refused(
        engine, make_adapter(tiny_llama, tmp_path / "r8", r=8), "rank 8 is above max_lora_rank=4"
    )


def test_a_target_module_the_model_lacks_is_refused(
    tiny_llama: Path, adapter: Path, tmp_path: Path
) -> None:
    engine = make_engine(tiny_llama)
    bad = copy_with(adapter, tmp_path / "bad", rename=("layers.1.", "layers.7."))
    refused(engine, bad, r"target module model\.layers\.7\.\S+: the base model has no such")


def test_weights_of_another_shape_are_refused(tiny_llama: Path, tmp_path: Path) -> None:
    other = make_checkpoint(tmp_path / "wider", "llama", hidden_size=96)
    engine = make_engine(tiny_llama)
    refused(engine, make_adapter(other, tmp_path / "wide", r=4), "do not fit a rank-4 adapter")


def test_an_unsupported_target_or_option_is_refused(
    tiny_llama: Path, adapter: Path, tmp_path: Path
) -> None:
    engine = make_engine(tiny_llama)
    lm_head = make_adapter(tiny_llama, tmp_path / "head", r=4, targets=("lm_head",))
    refused(engine, lm_head, "lm_head")  # names the first tensor it cannot serve
    refused(engine, copy_with(adapter, tmp_path / "dora", {"use_dora": True}), "use_dora")
    refused(engine, tmp_path, "no adapter_config.json")


def test_a_refused_load_leaves_the_loaded_adapters_serving(
    tiny_llama: Path, adapter: Path, tmp_path: Path
) -> None:
    engine = make_engine(tiny_llama, max_loras=1)
    engine.load_adapter("a", adapter)
    expected = engine.generate([[0, 5, 6, 7]], params("a"))[0].token_ids
    refused(engine, adapter, "'a': already loaded", name="a")
    refused(engine, make_adapter(tiny_llama, tmp_path / "r16", r=16), "max_lora_rank=8")
    assert engine.generate([[0, 5, 6, 7]], params("a"))[0].token_ids == expected
    assert [a.name for a in engine.adapters()] == ["a"]


def test_a_load_beyond_max_loras_evicts_the_least_recently_used_unpinned_adapter(
    tiny_llama: Path, adapter: Path, tmp_path: Path
) -> None:
    engine = make_engine(tiny_llama, max_loras=2)
    other = make_adapter(tiny_llama, tmp_path / "b", r=4, seed=1)
    engine.load_adapter("a", adapter, pinned=True)
    engine.load_adapter("b", other)
    engine.load_adapter("c", adapter)
    assert engine.lora.resident == ["a", "c"]  # b was the only one not pinned
    alone = make_engine(tiny_llama)
    alone.load_adapter("b", other)
    expected = alone.generate([[0, 5, 6, 7]], params("b"))[0].token_ids
    assert engine.generate([[0, 5, 6, 7]], params("b"))[0].token_ids == expected
    assert engine.lora.resident == ["a", "b"] and engine.lora.evictions == 2


def test_pinning_every_slot_is_refused(tiny_llama: Path, adapter: Path) -> None:
    engine = make_engine(tiny_llama, max_loras=2)
    engine.load_adapter("a", adapter, pinned=True)
    with pytest.raises(ValueError, match="none of max_loras=2 slots for the others"):
        engine.load_adapter("b", adapter, pinned=True)
    assert [a.name for a in engine.adapters()] == ["a"]


def test_an_adapter_in_use_is_not_unloaded_and_after_unloading_is_unknown(
    tiny_llama: Path, adapter: Path
) -> None:
    engine = make_engine(tiny_llama)
    engine.load_adapter("a", adapter)
    engine.add_request("r", [0, 5, 6], params("a", max_tokens=3))
    with pytest.raises(ValueError, match="'a': 1 requests in flight run it"):
        engine.unload_adapter("a")
    while engine.has_work():
        engine.step()
    engine.unload_adapter("a")
    assert engine.adapters() == []
    [result] = engine.generate([[0, 5, 6]], params("a"))
    assert result.finish_reason is FinishReason.ERROR
    with pytest.raises(ValueError, match="not loaded"):
        engine.unload_adapter("a")


def test_a_reloaded_adapter_computes_as_the_first_load(tiny_llama: Path, adapter: Path) -> None:
    engine = make_engine(tiny_llama)
    engine.load_adapter("a", adapter)
    first = engine.generate([[0, 5, 6, 7]], params("a"))[0].token_ids
    engine.unload_adapter("a")
    engine.load_adapter("a", adapter)
    assert engine.generate([[0, 5, 6, 7]], params("a"))[0].token_ids == first


def test_without_adapters_the_base_model_runs_no_lora_pass(tiny_llama: Path) -> None:
    off = make_engine(tiny_llama, max_loras=0)
    assert off.lora.slots.weights == {}
    with pytest.raises(ValueError, match="max_loras is 0"):
        off.load_adapter("a", Path("."))
    engine = make_engine(tiny_llama)
    engine.add_request("r", [0, 5, 6], params())
    req = engine.requests["r"][0]
    assert engine.lora.step([req], [3], engine.device) is None  # nothing resident


def test_an_moe_models_experts_are_no_targets_its_dense_layers_are(tmp_path: Path) -> None:
    """A Qwen2-MoE with a dense first layer: its attention and dense MLP take adapters; the MoE
    block's projections (the shared expert's) are not targets, so an adapter naming them is
    refused rather than loaded and silently unused."""
    checkpoint = make_checkpoint(tmp_path / "moe", "qwen2_moe", mlp_only_layers=[0])
    targets = set(make_engine(checkpoint).lora.slots.shapes)
    assert "model.layers.0.mlp.gate_proj" in targets
    assert "model.layers.1.self_attn.q_proj" in targets
    assert not [t for t in targets if "layers.1.mlp" in t]


@pytest.mark.parametrize("alpha", ["1e308", "1" + "0" * 400, "1e400", "NaN", "Infinity"])
def test_a_lora_alpha_out_of_range_is_refused_and_the_engine_serves_on(
    tiny_llama: Path, adapter: Path, tmp_path: Path, alpha: str
) -> None:
    """1e308 overflowed the float32 scaling when the adapter took a slot (a crash, every
    request lost), 10**400 overflowed alpha / r at once, NaN and Infinity served NaN: each
    is refused at the load, naming lora_alpha, and the loaded adapter serves as before."""
    engine = make_engine(tiny_llama, max_loras=1)
    engine.load_adapter("a", adapter)
    expected = engine.generate([[0, 5, 6, 7]], params("a"))[0].token_ids
    bad = copy_with(adapter, tmp_path / "bad", {"lora_alpha": 8})
    config = bad / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 8', f'"lora_alpha": {alpha}'))
    assert json.loads(config.read_text())  # Python's json reads it: the engine must not
    refused(engine, bad, "lora_alpha")
    assert engine.generate([[0, 5, 6, 7]], params("a"))[0].token_ids == expected


def test_more_tensors_than_the_model_has_projections_for_are_refused_before_reading_them(
    tiny_llama: Path, adapter: Path, tmp_path: Path
) -> None:
    engine = make_engine(tiny_llama)
    many = copy_with(adapter, tmp_path / "many")
    tensors = load_file(str(many / "adapter_model.safetensors"))
    limit = 2 * len(engine.lora.slots.shapes)
    extra = {f"base_model.model.x{i}.lora_A.weight": torch.zeros(1) for i in range(limit)}
    save_file(tensors | extra, str(many / "adapter_model.safetensors"))
    refused(
        engine,
        many,
        f"tensor count: .* holds {len(tensors) + limit} tensors, more than the {limit}",
    )
