"""gpt-oss (GptOssForCausalLM) from checkpoints written by transformers' own save_pretrained:
greedy ids equal HF `generate` and logprobs within 1e-4 in float32, with prompts far longer
than the sliding window (8 tokens), through the engine and through `sluice serve` (gRPC); the
same tokens with small pages, chunked prefill, preemption and prefix-cache hits; each layer's
window declared in the KV layout; routed experts equal HF's routers; weight updates (whole
checkpoints and single fused expert tensors) serve what HF serves with the new weights; a
level-2 sleep frees and reloads the experts and their biases; keys Sluice cannot honour
refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from sluice_client import AsyncClient

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.base import LayerKV
from engine.models.hf_config import UnsupportedModelError, load_model_config
from engine.protocol.generation_result import GenerationResult
from engine.protocol.messages import WeightsPhase
from tests.support.server_process import server_process
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 24
CASES: dict[str, dict[str, Any]] = {
    "alternating_window_8": {},  # sliding, full (GptOssConfig's default layer_types)
    # Three layers of kinds in another order, a 16-token window, one KV head for four queries.
    "full_first_window_16_one_kv_head": {
        "num_hidden_layers": 3,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
        "sliding_window": 16,
        "num_key_value_heads": 1,
    },
}


def make_engine(checkpoint: Path, **overrides: object) -> LLMEngine:
    # No warm-up: its full-length steps cost seconds a test and check nothing here.
    config = {"device": "cpu", "dtype": "float32", "warmup": False, **overrides}
    return LLMEngine(EngineConfig(model=str(checkpoint), **config))  # type: ignore[arg-type]


def greedy(tokens: int = NEW_TOKENS, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, **extra)


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    return make_checkpoint(directory, "gpt_oss", **CASES[request.param])


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss")


@pytest.fixture(scope="module")
def hf(gpt_oss: Path) -> Any:
    return load_hf_model(gpt_oss)


def assert_equals_hf(model: Any, prompt: list[int], result: GenerationResult) -> torch.Tensor:
    """HF's greedy ids are the result's, its logprobs within 1e-4; HF's log-softmax rows."""
    expected, hf_logprobs = hf_greedy(model, prompt, len(result.token_ids))
    assert result.error is None
    assert result.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
    if result.logprobs:
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(result.logprobs), chosen, atol=1e-4, rtol=0)
    return hf_logprobs


def test_greedy_ids_and_logprobs_equal_hf_generate(checkpoint: Path) -> None:
    engine = make_engine(checkpoint)
    batch = prompts(engine.info.vocab_size, count=6)  # 4..44 tokens: past every window
    results = engine.generate(batch, greedy(logprobs=True, top_logprobs=5))
    model = load_hf_model(checkpoint)
    for prompt, result in zip(batch, results, strict=True):
        hf_logprobs = assert_equals_hf(model, prompt, result)
        hf_top_lps, hf_top_ids = hf_logprobs.topk(5, dim=-1)
        assert result.top_logprobs is not None
        assert torch.equal(torch.tensor([ids for ids, _ in result.top_logprobs]), hf_top_ids)
        lps = torch.tensor([lps for _, lps in result.top_logprobs])
        torch.testing.assert_close(lps, hf_top_lps, atol=1e-4, rtol=0)


def test_the_kv_layout_declares_each_layers_window(checkpoint: Path) -> None:
    cfg = load_model_config(checkpoint)
    raw = json.loads((checkpoint / "config.json").read_text())
    window = raw["sliding_window"]
    want = [window if kind == "sliding_attention" else None for kind in raw["layer_types"]]
    layout = make_engine(checkpoint).model.kv_layout
    assert [layout.layer(i) for i in range(cfg.num_layers)] == [
        LayerKV(cfg.num_kv_heads, cfg.head_dim, w) for w in want
    ]


def test_small_pages_chunked_prefill_preemption_and_prefix_hits_keep_hf_tokens(
    gpt_oss: Path, hf: Any
) -> None:
    shared = [0, *range(11, 31)]  # five full pages of 4 tokens: a prefix-cache hit, past the window
    batch = [[*shared, 40 + k] for k in range(3)] + prompts(300, count=5)[2:]
    # 24 pages of 4 tokens for up to 6 sequences of 20-60 tokens: requests are preempted;
    # 16 tokens a step: the longer prompts are prefilled in chunks that straddle the window.
    tight = make_engine(
        gpt_oss, num_kv_pages=24, page_size=4, max_num_seqs=6, max_num_batched_tokens=16
    )
    results = tight.generate(batch, greedy(16, logprobs=True))
    stats = tight.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0, stats
    for prompt, result in zip(batch, results, strict=True):
        assert_equals_hf(hf, prompt, result)


def hf_routing(model: Any, ids: list[int]) -> torch.Tensor:
    """[positions, layers, top_k]: the expert ids GptOssTopKRouter picks at each position
    (one forward over `ids`; the router returns (logits, scores, ids))."""
    chosen: list[torch.Tensor] = []
    routers = [m for m in model.modules() if type(m).__name__ == "GptOssTopKRouter"]
    hooks = [r.register_forward_hook(lambda m, i, out: chosen.append(out[2])) for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(chosen, dim=1)


def test_routed_experts_equal_hf_routers(gpt_oss: Path, hf: Any) -> None:
    engine = make_engine(gpt_oss)
    assert (engine.info.moe_layers, engine.info.moe_top_k, engine.info.num_experts) == (2, 2, 4)
    batch = prompts(engine.info.vocab_size, count=4)
    results = engine.generate(batch, greedy(12, routed_experts=True), n=1)
    for result in results:
        assert result.routed_experts is not None
        sequence = result.prompt_token_ids + result.token_ids
        want = hf_routing(hf, sequence[:-1])[len(result.prompt_token_ids) - 1 :]
        assert torch.equal(torch.tensor(result.routed_experts).view(want.shape), want)


def test_weight_updates_serve_what_hf_serves_with_the_new_weights(
    gpt_oss: Path, tmp_path: Path
) -> None:
    other = make_checkpoint(tmp_path / "other", "gpt_oss", seed=1)
    engine = make_engine(gpt_oss)
    block = engine.model.model.layers[0].mlp
    new = load_file(other / "model.safetensors")
    # One fused tensor ([experts, hidden, 2 * inter], gate/up interleaved) lands whole.
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert engine.update_weights({name: new[name]}).phase is WeightsPhase.APPLIED
    assert torch.equal(block.experts.gate_up_proj.detach().transpose(1, 2), new[name])
    # A whole checkpoint: the engine then serves exactly what HF serves on it.
    assert engine.update_weights(other).phase is WeightsPhase.APPLIED
    batch = prompts(engine.info.vocab_size, count=3)
    results = engine.generate(batch, greedy(12, logprobs=True))
    model = load_hf_model(other)
    for prompt, result in zip(batch, results, strict=True):
        assert_equals_hf(model, prompt, result)


def test_level_2_sleep_frees_the_experts_and_wake_reloads_them(gpt_oss: Path) -> None:
    engine = make_engine(gpt_oss)
    batch = prompts(engine.info.vocab_size, count=3)
    before = [r.token_ids for r in engine.generate(batch, greedy(12))]
    experts = engine.model.model.layers[0].mlp.experts
    engine.sleep(level=2)
    assert experts.gate_up_proj.untyped_storage().nbytes() == 0
    assert experts.gate_up_proj_bias.untyped_storage().nbytes() == 0
    assert engine.wake_up().reloaded
    assert [r.token_ids for r in engine.generate(batch, greedy(12))] == before


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ],
)
def test_keys_sluice_cannot_honour_are_refused_by_name(
    gpt_oss: Path, tmp_path: Path, change: dict[str, object], key: str
) -> None:
    directory = Path(shutil.copytree(gpt_oss, tmp_path / "bad"))
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(UnsupportedModelError, match=key):
        load_model_config(directory)


def test_a_released_style_config_reads_as_gpt_oss_config_does(gpt_oss: Path) -> None:
    """Keys left out take GptOssConfig's defaults (attention biases, eps 1e-5, a 128-token
    window on every other layer from the first, YaRN); 4.x's `rope_scaling` reads too."""
    raw = json.loads((gpt_oss / "config.json").read_text())
    for key in ("attention_bias", "rms_norm_eps", "layer_types", "sliding_window"):
        del raw[key]
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    directory = gpt_oss.parent / "released_style"
    shutil.copytree(gpt_oss, directory, dirs_exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    cfg = load_model_config(directory)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.rms_norm_eps) == (True, True, 1e-5)
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert cfg.sliding_window == 128
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "yarn"


@pytest.mark.asyncio
async def test_greedy_ids_and_logprobs_through_grpc_equal_hf(
    gpt_oss: Path, hf: Any, tmp_path: Path
) -> None:
    batch = prompts(300, count=6)[3:]  # 28..44 tokens: several windows
    flags = ("--model", str(gpt_oss), "--device", "cpu", "--dtype", "float32")
    with server_process(tmp_path / "server.log", *flags) as server:
        server.wait_health("SERVING")
        async with AsyncClient(server.target) as client:
            completions = [
                await client.complete(p, max_tokens=16, temperature=0.0, logprobs=True)
                for p in batch
            ]
    for prompt, completion in zip(batch, completions, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, 16)
        assert list(completion.token_ids) == expected
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(completion.logprobs), chosen, atol=1e-4, rtol=0)
