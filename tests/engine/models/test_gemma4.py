"""Gemma 4 (text, dense and MoE) equals transformers 5.23's Gemma4ForCausalLM on tiny random
checkpoints that transformers itself writes: logits of whole sequences; greedy ids and logprobs
(within 1e-4, float32) through the engine's paged cache, prompts far longer than the sliding
window, on the cpu and torch_ref backends and over gRPC; preemption, chunked prefill, the
prefix cache and prompt logprobs; routed experts; LoRA (peft); two tensor-parallel ranks equal
to one; weight updates; and each config value it does not compute refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from sluice_client import Client, build_request

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.attention.torch_ref import TorchRefAttention
from engine.layers.rope import RotaryEmbedding, inverse_frequencies
from engine.models.gemma4 import Gemma4ForCausalLM
from engine.models.gemma4_config import parse_gemma4
from engine.models.hf_config import UnsupportedModelError, load_model_config, parse_model_config
from engine.protocol.messages import WeightsPhase
from engine.weights.loading import build_model
from tests.support.lora_adapters import make_adapter, peft_greedy, peft_model
from tests.support.server_process import server_process
from tests.support.tiny_gemma4 import CASES, make_gemma4_checkpoint
from tests.support.tiny_models import hf_greedy, load_hf_model, prompts

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)


def make_engine(checkpoint: Path, **overrides: Any) -> LLMEngine:
    config = {"device": "cpu", "dtype": "float32", **overrides}
    return LLMEngine(EngineConfig(model=str(checkpoint), **config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4")
    return {name: make_gemma4_checkpoint(root / name, **o) for name, o in CASES.items()}


@pytest.fixture(scope="module")
def hf_models(checkpoints: dict[str, Path]) -> dict[str, Any]:
    return {name: load_hf_model(path) for name, path in checkpoints.items()}


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    """Engines a test makes; their tensor-parallel workers are stopped after it."""
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.close()


def assert_greedy_equals_hf(hf: Any, batch: list[list[int]], results: list[Any]) -> None:
    for prompt, result in zip(batch, results, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert getattr(result, "error", None) is None  # an engine result's; a Completion has none
        assert result.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(result.logprobs), chosen, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_of_whole_sequences_equal_hf(case, checkpoints, hf_models) -> None:
    path = checkpoints[case]
    cfg = load_model_config(path)
    model = build_model(cfg, path, TorchRefAttention(1.0), torch.device("cpu"), torch.float32)
    assert isinstance(model, Gemma4ForCausalLM)
    ids = torch.randint(3, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_models[case](ids).logits.float()
        torch.testing.assert_close(model.dense_forward(ids), expected, atol=1e-4, rtol=0)


def test_attention_biases_equal_hf(tmp_path) -> None:
    """q/k/v/o biases; on keys-as-values layers the values carry k_proj's bias."""
    path = make_gemma4_checkpoint(tmp_path, **CASES["moe"], attention_bias=True)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    biases = [n for n in tensors if n.endswith("_proj.bias")]  # transformers inits them to 0
    assert {n.split(".")[-2] for n in biases} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for name in biases:
        tensors[name] = torch.randn(tensors[name].shape, generator=gen) * 0.5
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = load_model_config(path)
    model = build_model(cfg, path, TorchRefAttention(1.0), torch.device("cpu"), torch.float32)
    ids = torch.randint(3, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = load_hf_model(path)(ids).logits.float()
        torch.testing.assert_close(model.dense_forward(ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("case", "backend"),
    [(case, "cpu") for case in sorted(CASES)] + [("ple_kv_shared", "torch_ref")],
)
def test_greedy_ids_and_logprobs_equal_hf_generate(case, backend, checkpoints, hf_models) -> None:
    """Prompts of 4..20 tokens and 16 new ones against an 8-token window."""
    engine = make_engine(checkpoints[case], attention_backend=backend)
    batch = prompts(engine.info.vocab_size, count=3)
    assert_greedy_equals_hf(hf_models[case], batch, engine.generate(batch, GREEDY))


def test_a_served_gemma4_streams_hf_greedy_ids_over_grpc(checkpoints, hf_models, tmp_path) -> None:
    """The service's engine process, its default backend, a prompt past the window."""
    prompt = prompts(320, count=3)[2]
    flags = ("--model", str(checkpoints["ple_kv_shared"]), "--device", "cpu", "--dtype", "float32")
    with server_process(tmp_path / "server.log", *flags) as server:
        server.wait_health("SERVING")
        request = build_request(
            prompt, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True
        )
        with Client(server.target) as client:
            completion = client.complete(request)
    assert_greedy_equals_hf(hf_models["ple_kv_shared"], [prompt], [completion])


def test_preemption_chunked_prefill_and_prefix_cache_keep_hf_tokens_and_prompt_logprobs(
    checkpoints, hf_models
) -> None:
    """Sharing layers read their source's pages mid-prefill, across preemptions and cached
    prefixes: the tokens of an unconstrained engine; prompt logprobs (every position through
    every layer, prefilled in chunks) equal HF's."""
    shared = [0, 11, 12, 13, 14, 15, 16, 17, 18]  # two full pages: a prefix-cache hit
    batch = [[*shared, 40 + k] for k in range(3)] + prompts(320, count=4)[2:]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # 28 page ids of 4 tokens, shared by the full and the sliding layers' KV groups, for up to
    # 5 sequences of 10-36 tokens: requests must be preempted; 8 tokens a step: prompts are
    # prefilled in chunks.
    tight = make_engine(
        checkpoints["ple_kv_shared"],
        num_kv_pages=28,
        page_size=4,
        max_num_seqs=5,
        max_num_batched_tokens=8,
    )
    tight.generate([batch[0]], params)  # its two full pages are cached from now on
    results = tight.generate(batch, params)
    stats = tight.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0, stats
    roomy = make_engine(checkpoints["ple_kv_shared"])  # equal to HF's: the test above
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy.generate(batch, params)]
    hf = hf_models["ple_kv_shared"]
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=True)
    for prompt, result in zip(batch[-2:], tight.generate(batch[-2:], scoring), strict=True):
        with torch.no_grad():
            logprobs = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        expected = logprobs[:-1].gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
        assert result.prompt_logprobs is not None and result.prompt_logprobs.start == 1
        got = torch.tensor(result.prompt_logprobs.logprobs)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_kv_layout_lists_each_cache_owning_layer_with_its_shape_and_window(checkpoints) -> None:
    """5 layers (sliding, full, sliding | sliding, full): the last two read layers 2 and 1's
    KV and own none; full layers have 32-wide heads, sliding ones 16-wide with the window."""
    cfg = load_model_config(checkpoints["ple_kv_shared"])
    with torch.device("meta"):
        model = Gemma4ForCausalLM(cfg, TorchRefAttention(1.0))
    layout = model.kv_layout
    assert [(kv.num_kv_heads, kv.head_dim, kv.sliding_window) for kv in layout.layers] == [
        (2, 16, 8),
        (2, 32, None),
        (2, 16, 8),
    ]
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (3, 2, 32)
    assert model.cache_index == [0, 1, 2, 2, 1]


def hf_routing(model: Any, ids: list[int]) -> torch.Tensor:
    """[positions, layers, top_k]: the expert ids transformers' routers choose for each
    position of `ids` (each Gemma4TextRouter returns (probabilities, weights, ids))."""
    chosen: list[torch.Tensor] = []
    routers = [m for m in model.modules() if type(m).__name__ == "Gemma4TextRouter"]
    hooks = [r.register_forward_hook(lambda m, i, out: chosen.append(out[2])) for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(chosen, dim=1)


def test_the_kv_pool_fits_its_byte_budget(checkpoints) -> None:
    """Pages are counted at the pool's layout (3 cache-owning layers of 2 x 32), not at the
    config's 5 layers of 2 x 16 (which would allot 1.2x the budget)."""
    budget = 1 << 20
    engine = make_engine(checkpoints["ple_kv_shared"], kv_cache_memory=budget, page_size=4)
    pool = engine.pool
    assert len(pool.layer_caches()) == 3
    page_bytes = sum(storage[0].nbytes for storage in pool.storage)  # one page id, K and V
    assert budget - page_bytes < pool.num_pages * page_bytes <= budget


def test_routed_experts_equal_hf_routers(checkpoints, hf_models) -> None:
    engine = make_engine(checkpoints["moe"])
    batch = prompts(engine.info.vocab_size, count=2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, routed_experts=True)
    for result in engine.generate(batch, params):
        # Token i's experts: those of the position whose logits produced it.
        sequence = result.prompt_token_ids + result.token_ids
        routing = hf_routing(hf_models["moe"], sequence[:-1])
        expected = routing[len(result.prompt_token_ids) - 1 :]
        assert result.routed_experts is not None
        assert torch.equal(torch.tensor(result.routed_experts).view(expected.shape), expected)


@pytest.mark.parametrize("case", ["moe", "ple_kv_shared"])
def test_two_ranks_give_one_ranks_and_hf_greedy_ids(case, checkpoints, hf_models, engines) -> None:
    """moe: experts split by expert, the one global KV head replicated on both ranks;
    ple_kv_shared: the per-layer embedding split by vocabulary, double-wide MLPs."""
    ranks = [make_engine(checkpoints[case], cpu_threads=1, tensor_parallel_size=n) for n in (1, 2)]
    engines.extend(ranks)
    batch = prompts(ranks[0].info.vocab_size, count=2)
    one, two = (engine.generate(batch, GREEDY) for engine in ranks)
    assert [r.token_ids for r in two] == [r.token_ids for r in one]
    assert_greedy_equals_hf(hf_models[case], batch, two)


def test_a_weight_update_serves_the_new_checkpoints_tokens(tmp_path, checkpoints) -> None:
    other = make_gemma4_checkpoint(tmp_path / "other", seed=1, **CASES["moe"])
    engine = make_engine(checkpoints["moe"])
    batch = prompts(engine.info.vocab_size, count=2)
    before = [r.token_ids for r in engine.generate(batch, GREEDY)]
    update = engine.update_weights(load_file(other / "model.safetensors"))
    assert update.phase is WeightsPhase.APPLIED
    after = [r.token_ids for r in engine.generate(batch, GREEDY)]
    assert after == [r.token_ids for r in make_engine(other).generate(batch, GREEDY)]
    assert after != before


@pytest.mark.parametrize("case", ["moe", "ple_kv_shared"])
def test_an_adapter_on_every_projection_gives_pefts_tokens(case, checkpoints, tmp_path) -> None:
    """peft attaches to the projections each layer has: sharing layers have no k/v_proj, full
    layers of the moe case no v_proj (keys as values); the experts take no adapter."""
    adapter = make_adapter(checkpoints[case], tmp_path / "adapter", r=8, seed=3)
    engine = make_engine(checkpoints[case], max_loras=1, max_lora_rank=8)
    engine.load_adapter("a", adapter)
    batch = prompts(engine.info.vocab_size, count=2)
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True, adapter="a"
    )
    reference = peft_model(checkpoints[case], adapter)
    for prompt, result in zip(batch, engine.generate(batch, params), strict=True):
        expected, logprobs = peft_greedy(reference, prompt, 8)
        assert result.error is None and result.token_ids == expected
        torch.testing.assert_close(
            torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0
        )


def test_n_siblings_forked_on_a_partial_page_equal_one_request(checkpoints) -> None:
    engine = make_engine(checkpoints["ple_kv_shared"], page_size=4)
    prompt = prompts(engine.info.vocab_size, count=3)[2] + [5]  # 21 tokens: a partial page
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = engine.generate([prompt], params)[0].token_ids
    assert [r.token_ids for r in engine.generate([prompt], params, n=2)] == [alone, alone]


def test_proportional_rope_equals_transformers_and_leaves_the_other_dims_exactly() -> None:
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Gemma4TextConfig(head_dim=256, global_head_dim=512)
    expected, _ = ROPE_INIT_FUNCTIONS["proportional"](config, layer_type="full_attention")
    scaling = {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert torch.equal(inverse_frequencies(512, 1_000_000.0, scaling), expected)
    rotary = RotaryEmbedding(512, 64, 1_000_000.0, scaling)
    q = torch.randn(64, 2, 512)
    rotated, _ = rotary(torch.arange(64), q, q)
    angles = 64  # a quarter of each half-head's 256 angles rotates
    for still in (slice(angles, 256), slice(256 + angles, 512)):
        assert torch.equal(rotated[..., still], q[..., still])
    assert not torch.equal(rotated[1:, :, :angles], q[1:, :, :angles])


def config_json(checkpoints: dict[str, Path], case: str = "k_eq_v_untied") -> dict[str, Any]:
    raw: dict[str, Any] = json.loads((checkpoints[case] / "config.json").read_text())
    return raw


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"use_bidirectional_attention": "vision"}, "use_bidirectional_attention"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        (
            {
                "layer_types": [
                    "sliding_attention",
                    "chunked",
                    "sliding_attention",
                    "full_attention",
                ]
            },
            "layer_types",
        ),
        (
            {"per_layer_config": {"1": {"head_dim": 32, "rope_theta": 1.0}}},
            "per_layer_config.1.rope_theta",
        ),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
                }
            },
            "rope_parameters.full_attention.rope_type",
        ),
        ({"vision_config": {"hidden_size": 8}}, "vision_config"),
        (
            {"vocab_size_per_layer_input": 100, "hidden_size_per_layer_input": 8},
            "vocab_size_per_layer_input",
        ),
    ],
)
def test_a_config_value_it_does_not_compute_is_refused_by_name(change, key, checkpoints) -> None:
    raw = config_json(checkpoints) | change
    with pytest.raises(UnsupportedModelError, match=key):
        parse_model_config(raw, {})


def test_older_global_keys_read_as_transformers_reads_them(checkpoints) -> None:
    """Checkpoints written before `per_layer_config` say `global_head_dim` and
    `num_global_key_value_heads` (the latter only counted with attention_k_eq_v)."""
    raw = config_json(checkpoints)
    written = parse_gemma4(raw)
    del raw["per_layer_config"]
    older = raw | {"global_head_dim": 32, "num_global_key_value_heads": 1}
    assert parse_gemma4(older) == written
    full = [layer for layer in parse_gemma4(older | {"attention_k_eq_v": False}).layers][-1]
    assert (full.head_dim, full.num_kv_heads, full.k_eq_v) == (32, 2, False)


def test_a_rank_count_that_does_not_divide_the_experts_is_refused(checkpoints) -> None:
    cfg = parse_model_config(config_json(checkpoints, "moe") | {"num_experts": 6}, {})
    Gemma4ForCausalLM.shard_layout(cfg, 0, 2)  # 6 experts, 4 heads, 2 KV heads, ...
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide num_experts=6"):
        Gemma4ForCausalLM.shard_layout(cfg, 0, 4)
