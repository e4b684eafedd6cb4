"""Phi-3 and Phi-4 (`Phi3ForCausalLM`) from unchanged `save_pretrained` checkpoints of tiny
random Phi3Config models: greedy ids equal transformers' `generate`, logprobs within 1e-4 in
float32, through the engine and through gRPC; two tensor-parallel ranks equal one (the fused
qkv_proj and gate_up_proj tensors cut projection by projection); weight updates by the fused
names; LoRA adapters made by peft on the fused modules; what cannot be computed refused by key.

The cases: Phi-3-mini's shape (every layer's sliding window shorter than the prompts), and
Phi-4-mini's (LongRoPE, 0.75 partial rotary, tied embeddings, a window that never bites), with
prompts longer than LongRoPE's original context (so transformers uses the long factors, as
the engine does for a served context past it) and, served within it, shorter ones (the short
factors).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from sluice_client import Client, build_request

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.hf_config import UnsupportedModelError, load_model_config, parse_model_config
from engine.parallel.shard_layout import Split
from engine.protocol.messages import WeightsPhase
from engine.weights.staging import WeightUpdateError
from tests.support.lora_adapters import make_adapter, peft_greedy, peft_model
from tests.support.server_process import server_process
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 24
ORIGINAL = 64  # LongRoPE's original_max_position_embeddings
SERVED = 256


def longrope(rotary_dim: int) -> dict[str, Any]:
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.2 * i for i in range(half)],
        "long_factor": [1.5 + 1.5 * i for i in range(half)],
        "original_max_position_embeddings": ORIGINAL,
    }


CASES: dict[str, dict[str, Any]] = {
    "phi3_mini_sliding": {"sliding_window": 40},
    "phi4_mini_longrope_partial": {
        "partial_rotary_factor": 0.75,  # 12 of each head's 16 dimensions
        "original_max_position_embeddings": ORIGINAL,  # Phi3Config's own key (default 4096)
        "rope_parameters": {**longrope(12), "partial_rotary_factor": 0.75},
        "tie_word_embeddings": True,
        "sliding_window": 1024,  # past the served context: never bites
    },
}
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # peft's Phi-3 modules
# Everything at once, for the tensor-parallel and LoRA checks.
ALL = {**CASES["phi4_mini_longrope_partial"], "sliding_window": 40, "tie_word_embeddings": False}


def checkpoint_of(directory: Path, seed: int = 0, **overrides: Any) -> Path:
    return make_checkpoint(
        directory, "phi3", seed=seed, max_position_embeddings=SERVED, **overrides
    )


def make_engine(checkpoint: Path, **overrides: Any) -> LLMEngine:
    config = {"device": "cpu", "dtype": "float32", **overrides}
    return LLMEngine(EngineConfig(model=str(checkpoint), **config))


def long_prompts(vocab_size: int, count: int) -> list[list[int]]:
    """Prompts of 68..124 tokens: past the window (40) and LongRoPE's original context (64)."""
    return [p for p in prompts(vocab_size, 16) if len(p) > ORIGINAL][:count]


def assert_equal_hf(hf: Any, batch: list[list[int]], token_ids: list, logprobs: list) -> None:
    for prompt, ids, lps in zip(batch, token_ids, logprobs, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert list(ids) == expected, f"prompt of {len(prompt)} tokens diverged"
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        got = torch.tensor(list(lps), dtype=torch.float32)
        torch.testing.assert_close(got, chosen, atol=1e-4, rtol=0)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """CASES' checkpoints by name, each written once."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = checkpoint_of(tmp_path_factory.mktemp(name), **CASES[name])
        return cache[name]

    return get


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest, made: Callable[[str], Path]) -> Path:
    return made(request.param)


@pytest.fixture(scope="module")
def everything(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint_of(tmp_path_factory.mktemp("phi_all"), **ALL)


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    """Engines a test makes; their workers are stopped after it."""
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.close()


@pytest.mark.parametrize("backend", ["cpu", "torch_ref"])
def test_greedy_ids_and_logprobs_equal_hf_generate(case: Path, backend: str) -> None:
    """On the cpu backend (its C rotary kernel; windowed decode rows on torch_ref's path) and
    on torch_ref, the reference."""
    engine = make_engine(case, attention_backend=backend)
    assert engine.model.backend.name == backend
    batch = long_prompts(engine.info.vocab_size, 3)
    results = engine.generate(batch, GREEDY)
    assert all(r.error is None for r in results)
    ids, lps = [r.token_ids for r in results], [r.logprobs for r in results]
    assert_equal_hf(load_hf_model(case), batch, ids, lps)
    assert engine.pool.num_free + engine.cache.num_cached == engine.pool.num_pages


def test_longrope_is_a_rope_type_of_the_llama_family_too(tmp_path: Path) -> None:
    """transformers' Llama takes any rope type its rotary class knows; LongRoPE reads the
    same there (rope.py is shared), for prompts past the original context."""
    rope = {**longrope(16), "partial_rotary_factor": 1.0}
    checkpoint = make_checkpoint(
        tmp_path / "llama", "llama", max_position_embeddings=SERVED, rope_parameters=rope
    )
    engine = make_engine(checkpoint)
    batch = long_prompts(engine.info.vocab_size, 2)
    results = engine.generate(batch, GREEDY)
    ids, lps = [r.token_ids for r in results], [r.logprobs for r in results]
    assert_equal_hf(load_hf_model(checkpoint), batch, ids, lps)


def test_served_within_the_original_context_longrope_uses_the_short_factors(
    made: Callable[[str], Path],
) -> None:
    case = made("phi4_mini_longrope_partial")
    short = make_engine(case, max_model_len=ORIGINAL)
    batch = [p for p in prompts(short.info.vocab_size, 6) if len(p) + NEW_TOKENS <= ORIGINAL]
    results = short.generate(batch, GREEDY)
    ids, lps = [r.token_ids for r in results], [r.logprobs for r in results]
    assert_equal_hf(load_hf_model(case), batch, ids, lps)
    # The long factors (a served context past the original) give other logprobs: the two
    # comparisons with transformers check different tables.
    other = make_engine(case).generate(batch, GREEDY)
    gaps = [
        abs(a - b)
        for r, o in zip(results, other, strict=True)
        for a, b in zip(r.logprobs, o.logprobs, strict=True)
    ]
    assert max(gaps) > 1e-3


def test_the_sliding_window_decides_tokens_the_prompts_reach_past_it(
    made: Callable[[str], Path], tmp_path: Path
) -> None:
    """Without the window the same weights give other tokens: the equality with transformers
    above checks the window."""
    case = made("phi3_mini_sliding")
    unwindowed = Path(shutil.copytree(case, tmp_path / "unwindowed"))
    raw = json.loads((unwindowed / "config.json").read_text())
    (unwindowed / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
    engine = make_engine(case)
    assert {engine.model.kv_layout.layer(i).sliding_window for i in range(2)} == {40}
    batch = long_prompts(engine.info.vocab_size, 4)
    windowed = [r.token_ids for r in engine.generate(batch, GREEDY)]
    assert [r.token_ids for r in make_engine(unwindowed).generate(batch, GREEDY)] != windowed


def test_chunked_prefill_preemption_and_the_prefix_cache_keep_the_windowed_tokens(
    everything: Path,
) -> None:
    """A sliding window over a cached prefix, prompts prefilled in chunks, preempted and
    resumed requests: the tokens of an engine with room for all at once."""
    shared = prompts(300, 16)[12]  # 100 tokens: 12 full pages of 8, past the window
    batch = [[*shared, 40 + k] for k in range(3)] + long_prompts(300, 2)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    expected = [r.token_ids for r in make_engine(everything).generate(batch, params)]
    tight = make_engine(
        everything, num_kv_pages=24, page_size=8, max_num_seqs=4, max_num_batched_tokens=32
    )
    assert [r.token_ids for r in tight.generate(batch, params)] == expected
    stats = tight.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0, stats


@pytest.mark.timeout(180)
def test_greedy_ids_and_logprobs_through_grpc_equal_hf(everything: Path, tmp_path) -> None:
    flags = ("--model", str(everything), "--device", "cpu", "--dtype", "float32")
    batch = long_prompts(300, 2)
    with server_process(tmp_path / "server.log", *flags) as server:
        server.wait_health("SERVING")
        with Client(server.target) as client:
            completions = [
                client.complete(
                    build_request(
                        p, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True
                    )
                )
                for p in batch
            ]
    ids = [c.token_ids for c in completions]
    assert_equal_hf(load_hf_model(everything), batch, ids, [c.logprobs for c in completions])


def test_two_ranks_cut_the_fused_tensors_and_adapters_as_one_rank_holds_them(
    everything: Path, tmp_path: Path, engines: list[LLMEngine]
) -> None:
    """Greedy ids (base and with a peft adapter on the fused modules) equal one rank's and
    transformers'/peft's; live weights gathered from both ranks equal the checkpoint's; an
    update naming the fused qkv_proj reaches both ranks' slices."""
    adapter = make_adapter(everything, tmp_path / "lora", r=8, targets=FUSED_TARGETS)
    lora = {"max_loras": 1, "max_lora_rank": 8, "cpu_threads": 1}
    one = make_engine(everything, **lora)
    engines.append(two := make_engine(everything, tensor_parallel_size=2, **lora))
    batch = long_prompts(one.info.vocab_size, 2)
    tuned = replace(GREEDY, adapter="lora")
    for engine in (one, two):
        engine.load_adapter("lora", adapter)
    for params in (GREEDY, tuned):
        a, b = one.generate(batch, params), two.generate(batch, params)
        assert [r.token_ids for r in b] == [r.token_ids for r in a]
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(
                torch.tensor(y.logprobs), torch.tensor(x.logprobs), atol=1e-4, rtol=0
            )
    reference = peft_model(everything, adapter)
    for prompt, result in zip(batch, two.generate(batch, tuned), strict=True):
        assert result.token_ids == peft_greedy(reference, prompt, NEW_TOKENS)[0]

    weights = load_file(everything / "model.safetensors")
    with two.live_weights() as live:  # gathered from both ranks, by checkpoint name
        assert set(live) == set(weights)
        assert all(torch.equal(live[name], tensor) for name, tensor in weights.items())

    other = load_file(checkpoint_of(tmp_path / "other", seed=1, **ALL) / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    for engine in (one, two):
        assert engine.update_weights({name: other[name]}).phase is WeightsPhase.APPLIED
    with two.live_weights() as live:
        assert torch.equal(live[name], other[name])
    after_one, after_two = one.generate(batch, GREEDY), two.generate(batch, GREEDY)
    assert [r.token_ids for r in after_two] == [r.token_ids for r in after_one]


def test_a_peft_adapter_on_the_fused_modules_equals_peft(everything: Path, tmp_path) -> None:
    adapters = {
        "all": make_adapter(everything, tmp_path / "all", r=8, targets=FUSED_TARGETS),
        "qkv": make_adapter(
            everything, tmp_path / "qkv", r=4, targets=("qkv_proj",), use_rslora=True, seed=1
        ),
    }
    engine = make_engine(everything, max_loras=2, max_lora_rank=8)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    batch = long_prompts(engine.info.vocab_size, 2)
    cases = [(name, p) for p in batch for name in ("", *adapters)]
    params = [replace(GREEDY, adapter=name) for name, _ in cases]
    results = engine.generate([p for _, p in cases], params)
    models = {name: peft_model(everything, adapters.get(name)) for name in ("", *adapters)}
    for (name, prompt), result in zip(cases, results, strict=True):
        expected, logprobs = peft_greedy(models[name], prompt, NEW_TOKENS)
        assert result.token_ids == expected, f"adapter {name!r}"
        torch.testing.assert_close(
            torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0
        )


def test_an_adapter_naming_unfused_projections_is_refused_by_module(everything, tmp_path) -> None:
    directory = make_adapter(everything, tmp_path / "a", r=4, targets=FUSED_TARGETS)
    tensors = load_file(directory / "adapter_model.safetensors")
    renamed = {k.replace("qkv_proj", "q_proj"): v for k, v in tensors.items()}
    save_file(renamed, directory / "adapter_model.safetensors")
    engine = make_engine(everything, max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"self_attn\.q_proj: the base model has no such module"):
        engine.load_adapter("a", directory)


def test_an_update_by_the_fused_names_lands_in_the_merged_weights(
    everything: Path, tmp_path: Path
) -> None:
    other_dir = checkpoint_of(tmp_path / "other", seed=1, **ALL)
    other = load_file(other_dir / "model.safetensors")
    engine = make_engine(everything)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    assert engine.update_weights({name: other[name]}).phase is WeightsPhase.APPLIED
    assert torch.equal(engine.model.model.layers[0].mlp.gate_up_proj.weight, other[name])
    assert engine.update_weights(other_dir).phase is WeightsPhase.APPLIED
    batch = long_prompts(engine.info.vocab_size, 2)
    want = [r.token_ids for r in make_engine(other_dir).generate(batch, GREEDY)]
    assert [r.token_ids for r in engine.generate(batch, GREEDY)] == want
    wrong = other["model.layers.0.self_attn.qkv_proj.weight"][:-16]  # v's rows missing
    with pytest.raises(WeightUpdateError, match=r"qkv_proj\.weight: shape \(112, 64\) != model"):
        engine.update_weights({"model.layers.0.self_attn.qkv_proj.weight": wrong})


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
    from engine.attention.torch_ref import TorchRefAttention
    from engine.models.phi3 import Phi3ForCausalLM

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
