"""Mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) through the engine: greedy ids
and logprobs equal transformers'; a batch that preempts, prefills in chunks, shares a cached
prefix and samples n > 1 gives the unconstrained engine's tokens; updates naming single experts
land in the stacked expert weights; a level-2 sleep frees and reloads them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.hf_config import UnsupportedModelError, load_model_config
from engine.moe.block import SparseMoeBlock
from engine.protocol.messages import WeightsPhase
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 48
CASES = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe_shared_expert": ("qwen2_moe", {}),
    # Layer 1 dense (mlp_only_layers), top-k weights renormalised.
    "qwen3_moe_dense_layer_norm_topk": ("qwen3_moe", {"mlp_only_layers": [1]}),
    # Every second layer sparse (decoder_sparse_step), top-k weights as the softmax gives them.
    "qwen3_moe_sparse_step_raw_topk": (
        "qwen3_moe",
        {"num_hidden_layers": 3, "decoder_sparse_step": 2, "norm_topk_prob": False},
    ),
}
OVERRIDES = {"qwen3_moe_dense_layer_norm_topk": {"norm_topk_prob": True}}


def make_engine(checkpoint: Path, **overrides: object) -> LLMEngine:
    config = {"device": "cpu", "dtype": "float32", **overrides}
    return LLMEngine(EngineConfig(model=str(checkpoint), **config))  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = CASES[request.param]
    overrides = {**overrides, **OVERRIDES.get(request.param, {})}
    return make_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe")


def test_greedy_ids_and_logprobs_equal_hf_generate(checkpoint: Path) -> None:
    engine = make_engine(checkpoint)
    batch = prompts(engine.info.vocab_size, count=8)
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    results = engine.generate(batch, params)  # all batched together

    hf = load_hf_model(checkpoint)
    for prompt, result in zip(batch, results, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert result.error is None
        assert result.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(result.logprobs), chosen, atol=1e-4, rtol=0)
        assert result.top_logprobs is not None
        hf_top_lps, hf_top_ids = hf_logprobs.topk(5, dim=-1)
        assert torch.equal(torch.tensor([ids for ids, _ in result.top_logprobs]), hf_top_ids)
        lps = torch.tensor([lps for _, lps in result.top_logprobs])
        torch.testing.assert_close(lps, hf_top_lps, atol=1e-4, rtol=0)


def test_the_sparse_and_dense_layers_follow_the_config(checkpoint: Path) -> None:
    cfg = load_model_config(checkpoint)
    assert cfg.moe is not None
    layers = make_engine(checkpoint).model.model.layers
    sparse = [i for i, layer in enumerate(layers) if isinstance(layer.feed_forward, SparseMoeBlock)]
    assert sparse == list(cfg.moe.sparse_layers)
    assert 0 < len(sparse) <= len(layers)


def test_preemption_chunked_prefill_prefix_cache_and_n_give_the_unconstrained_tokens(
    qwen2_moe: Path,
) -> None:
    shared = [0, 11, 12, 13, 14, 15, 16, 17, 18]  # two full pages: a prefix-cache hit
    batch = [[*shared, 40 + k] for k in range(4)] + prompts(300, count=4)[1:]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    expected = [r.token_ids for r in make_engine(qwen2_moe).generate(batch, params, n=2)]
    # 16 pages of 4 tokens for up to 6 sequences of 10-50 tokens: requests must be preempted;
    # 16 tokens a step: the longer prompts are prefilled in chunks.
    tight = make_engine(
        qwen2_moe, num_kv_pages=16, page_size=4, max_num_seqs=6, max_num_batched_tokens=16
    )
    results = tight.generate(batch, params, n=2)
    assert [r.token_ids for r in results] == expected
    assert results[0].token_ids != results[1].token_ids  # n = 2 sampled two sequences
    stats = tight.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert tight.pool.num_free + tight.cache.num_cached == tight.pool.num_pages


def test_an_update_naming_one_expert_lands_in_the_stacked_weights(
    qwen2_moe: Path, tmp_path: Path
) -> None:
    other = make_checkpoint(tmp_path / "other", "qwen2_moe", seed=1)
    engine = make_engine(qwen2_moe)
    block = engine.model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    inter = block.experts.inter
    new = load_file(other / "model.safetensors")
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    before = block.experts.gate_up_proj.detach().clone()
    assert engine.update_weights({name: new[name]}).phase is WeightsPhase.APPLIED
    after = block.experts.gate_up_proj.detach()
    assert torch.equal(after[3, inter:], new[name])
    after_others = torch.cat([after[:3], after[4:]])
    assert torch.equal(after_others, torch.cat([before[:3], before[4:]]))
    assert torch.equal(after[3, :inter], before[3, :inter])  # its gate rows untouched
    # A whole checkpoint: the engine then serves exactly what the other checkpoint's does.
    batch = prompts(engine.info.vocab_size, count=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert engine.update_weights(other).phase is WeightsPhase.APPLIED
    want = [r.token_ids for r in make_engine(other).generate(batch, greedy)]
    assert [r.token_ids for r in engine.generate(batch, greedy)] == want


def test_level_2_sleep_frees_the_stacked_experts_and_wake_reloads_them(qwen2_moe: Path) -> None:
    engine = make_engine(qwen2_moe)
    batch = prompts(engine.info.vocab_size, count=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = [r.token_ids for r in engine.generate(batch, greedy)]
    experts = engine.model.model.layers[0].mlp.experts
    engine.sleep(level=2)
    assert experts.gate_up_proj.untyped_storage().nbytes() == 0
    assert experts._views is None  # no view (nor packed copy) keeps the old weights
    assert engine.wake_up().reloaded
    assert [r.token_ids for r in engine.generate(batch, greedy)] == before


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_moe_configs_are_refused_naming_the_key(
    qwen2_moe: Path, tmp_path: Path, change: dict[str, object], key: str
) -> None:
    directory = Path(shutil.copytree(qwen2_moe, tmp_path / "bad"))
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(UnsupportedModelError, match=key):
        load_model_config(directory)
