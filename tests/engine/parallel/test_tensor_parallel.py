"""Tensor parallelism on the CPU (gloo, 2 ranks): token-exact against one rank and against HF.

Two ranks split every layer; greedy ids must equal one rank's and transformers', logprobs within
1e-4; batching with preemption, the prefix cache and n > 1 give one rank's tokens; weight
updates (checkpoint, tensor file, in-process, live) swap on both ranks or on none; a size that
does not divide the model is refused before any worker starts; a killed worker, or a stopped one
while the engine is idle, takes the engine down and the service restarts the whole group.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sluice_client import Client, build_request

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.protocol.messages import InflightPolicy, TensorRef, UpdateWeights, WeightsPhase
from engine.weights.staging import WeightUpdateError
from tests.support.server_process import force_kill, server_process, wait_gone
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)


def make_engine(model: Path, ranks: int, **overrides: object) -> LLMEngine:
    # One torch thread per rank: two ranks of two threads on two cores run 10-100x slower.
    config = {"device": "cpu", "dtype": "float32", "cpu_threads": 1, **overrides}
    return LLMEngine(EngineConfig(model=str(model), tensor_parallel_size=ranks, **config))  # type: ignore[arg-type]


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    """Engines a test makes; their workers are stopped after it."""
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_give_one_ranks_and_hf_greedy_ids(arch, tmp_path, engines) -> None:
    """Llama (GQA), Qwen2 (q/k/v bias, tied embeddings), Qwen3 (q/k norm, explicit head_dim)."""
    checkpoint = make_checkpoint(tmp_path / arch, arch)
    one = make_engine(checkpoint, 1)
    engines.append(two := make_engine(checkpoint, 2))
    batch = prompts(one.info.vocab_size, count=4)
    single, split = one.generate(batch, GREEDY), two.generate(batch, GREEDY)
    hf = load_hf_model(checkpoint)
    for prompt, a, b in zip(batch, single, split, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert b.token_ids == a.token_ids == expected[:NEW_TOKENS]
        chosen = hf_logprobs[:NEW_TOKENS].gather(-1, torch.tensor(b.token_ids)[:, None])
        torch.testing.assert_close(torch.tensor(b.logprobs), chosen.squeeze(-1), atol=1e-4, rtol=0)
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0
        )


def test_batching_with_preemption_prefix_cache_and_n_match_one_rank(tiny_llama, engines) -> None:
    # 14 pages of 4 tokens for 6 sequences of ~30 tokens: requests must be preempted.
    small = {"num_kv_pages": 14, "page_size": 4, "max_num_seqs": 6}
    one = make_engine(tiny_llama, 1, **small)
    engines.append(two := make_engine(tiny_llama, 2, **small))
    shared = [0, 11, 12, 13, 14, 15, 16, 17, 18]  # two full pages: a prefix-cache hit
    batch = [[*shared, 40 + k] for k in range(3)]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    expected = [r.token_ids for r in one.generate(batch, params, n=2)]
    results = two.generate(batch, params, n=2)
    assert [r.token_ids for r in results] == expected
    assert results[0].token_ids != results[1].token_ids  # n = 2 sampled two sequences
    later = [[*shared, 99]]  # its first two pages are cached by now
    assert two.generate(later, GREEDY)[0].token_ids == one.generate(later, GREEDY)[0].token_ids
    stats = two.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0, stats


def test_prompt_logprobs_at_two_ranks_equal_one_rank_in_chunks_and_alone(
    tiny_llama, engines
) -> None:
    # A 16-token budget splits the prompts into chunks; max_tokens 0 scores without sampling.
    one = make_engine(tiny_llama, 1, max_num_batched_tokens=16)
    engines.append(two := make_engine(tiny_llama, 2, max_num_batched_tokens=16))
    batch = prompts(one.info.vocab_size, count=6)[3:]  # 28, 36 and 44 tokens
    scored = SamplingParams(max_tokens=0, prompt_logprobs=True, top_logprobs=2)
    params = [scored, GREEDY, replace(GREEDY, prompt_logprobs=True)]
    single, split = one.generate(batch, params), two.generate(batch, params)
    for a, b in zip(single, split, strict=True):
        assert b.token_ids == a.token_ids
        if a.prompt_logprobs is None:
            assert b.prompt_logprobs is None
            continue
        assert b.prompt_logprobs is not None and b.prompt_logprobs.start == 1
        torch.testing.assert_close(
            torch.tensor(b.prompt_logprobs.logprobs),
            torch.tensor(a.prompt_logprobs.logprobs),
            atol=1e-4,
            rtol=0,
        )
    assert split[0].prompt_logprobs is not None and split[0].prompt_logprobs.top_logprobs


def test_weight_updates_swap_on_every_rank(tmp_path, engines) -> None:
    first = make_checkpoint(tmp_path / "a", "qwen2", seed=0)
    second = make_checkpoint(tmp_path / "b", "qwen2", seed=1)
    batch = prompts(300, count=2)
    want_first = [r.token_ids for r in make_engine(first, 1).generate(batch, GREEDY)]
    want_second = [r.token_ids for r in make_engine(second, 1).generate(batch, GREEDY)]
    assert want_first != want_second
    engines.append(two := make_engine(first, 2))

    def served() -> list[list[int]]:
        return [r.token_ids for r in two.generate(batch, GREEDY)]

    # A checkpoint directory: each rank reads its own slices.
    assert two.update_weights(second).phase is WeightsPhase.APPLIED
    assert served() == want_second and two.policy_version == 1
    # A tensor file (what the service writes from inline chunks).
    tensors = load_file(first / "model.safetensors")
    path, refs = write_tensor_file(tmp_path / "inline.bin", tensors)
    inline = UpdateWeights("inline", 0, InflightPolicy.ABORT, tensor_file=str(path), tensors=refs)
    two.start_weight_update(inline)  # ABORT swaps at once
    assert two.updater.outcome(inline).phase is WeightsPhase.APPLIED
    assert served() == want_first and two.policy_version == 2
    # In-process tensors: broadcast from rank 0.
    assert two.update_weights(load_file(second / "model.safetensors")).phase is WeightsPhase.APPLIED
    assert served() == want_second
    # live_weights: whole parameters on rank 0, every rank's slice swapped on exit.
    with two.live_weights() as params:
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
    assert served() == want_first and two.policy_version == 4


@pytest.mark.parametrize(
    "overrides",
    [{"num_key_value_heads": 1}, {"attention_bias": True, "mlp_bias": True}],
    ids=["kv_heads_replicated", "qkv_and_mlp_bias"],
)
def test_two_ranks_update_one_projection_of_a_merged_weight_as_one_rank(
    overrides, tmp_path, engines
) -> None:
    """Each rank's qkv_proj and gate_up_proj stack its slices of q, k, v and gate, up: an update
    naming one of them writes that slice on every rank, and live_weights gives them back whole."""
    checkpoint = make_checkpoint(tmp_path / "llama", "llama", **overrides)
    saved = load_file(checkpoint / "model.safetensors")
    one = make_engine(checkpoint, 1)
    engines.append(two := make_engine(checkpoint, 2))
    with two.live_weights() as live:  # gathered from both ranks, by checkpoint name
        assert {n: t.shape for n, t in live.items()} == {n: t.shape for n, t in saved.items()}
        assert all(torch.equal(live[name], tensor) for name, tensor in saved.items())
    generator = torch.Generator().manual_seed(3)
    names = ["model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    names += [n for n in ("model.layers.1.self_attn.k_proj.bias",) if n in saved]
    update = {name: torch.randn(saved[name].shape, generator=generator) * 0.5 for name in names}
    batch = prompts(one.info.vocab_size, count=2)
    before = [r.token_ids for r in one.generate(batch, GREEDY)]
    for engine in (one, two):
        assert engine.update_weights(update).phase is WeightsPhase.APPLIED
    hf = load_hf_model(checkpoint)
    for name, tensor in update.items():
        hf.state_dict()[name].copy_(tensor)
    single, split = one.generate(batch, GREEDY), two.generate(batch, GREEDY)
    for prompt, a, b in zip(batch, single, split, strict=True):
        assert b.token_ids == a.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)[0][:NEW_TOKENS]
    assert [r.token_ids for r in single] != before  # the update changed what is served


def test_a_refused_update_changes_no_rank(tiny_llama, engines) -> None:
    engines.append(two := make_engine(tiny_llama, 2))
    batch = prompts(300, count=2)
    before = [r.token_ids for r in two.generate(batch, GREEDY)]
    tensors = load_file(tiny_llama / "model.safetensors")
    bad = {name: tensor * 0 for name, tensor in tensors.items()}  # would change every output
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)  # ...but this is refused
    with pytest.raises(WeightUpdateError, match="up_proj") as refused:
        two.update_weights(bad)
    assert refused.value.code == "INVALID_ARGUMENT"
    assert [r.token_ids for r in two.generate(batch, GREEDY)] == before
    assert two.policy_version == 0


def test_a_size_that_does_not_divide_the_heads_is_refused_at_start(tiny_llama) -> None:
    with pytest.raises(
        ValueError, match="tensor_parallel_size: 3 does not divide num_attention_heads=4"
    ):
        make_engine(tiny_llama, 3)


def write_tensor_file(
    path: Path, tensors: dict[str, torch.Tensor]
) -> tuple[Path, tuple[TensorRef, ...]]:
    refs, offset = [], 0
    with path.open("wb") as fh:
        for name, tensor in tensors.items():
            data = tensor.contiguous().numpy().tobytes()
            fh.write(data)
            refs.append(TensorRef(name, "F32", tuple(tensor.shape), offset, len(data)))
            offset += len(data)
    return path, tuple(refs)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_worker_restarts_the_group_through_the_service(tiny_llama, tmp_path) -> None:
    expected = make_engine(tiny_llama, 1).generate([[0, 17, 42, 99]], GREEDY)[0].token_ids
    flags = ("--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32")
    with server_process(
        tmp_path / "server.log", *flags, "--tensor-parallel-size", "2", "--cpu-threads", "1"
    ) as server:
        server.wait_health("SERVING")
        worker = int(server.wait_for("engine.worker_spawned")["worker_pid"])
        os.kill(worker, 9)
        died = server.wait_for("engine.worker_died")
        assert died["worker_pid"] == worker
        restarted = int(server.wait_for("engine.worker_spawned", 2, timeout=60)["worker_pid"])
        server.wait_health("SERVING")
        request = build_request(
            [0, 17, 42, 99], temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True
        )
        with Client(server.target) as client:
            assert client.complete(request).token_ids == expected
    assert wait_gone(restarted, 10), "a worker outlived the server"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stopped_worker_of_an_idle_engine_restarts_the_group_within_the_heartbeat_timeout(
    tiny_llama, tmp_path
) -> None:
    flags = ("--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32")
    flags += ("--tensor-parallel-size", "2", "--cpu-threads", "1", "--heartbeat-timeout", "6")
    with server_process(tmp_path / "server.log", *flags) as server:
        server.wait_health("SERVING")
        worker = int(server.wait_for("engine.worker_spawned")["worker_pid"])
        os.kill(worker, signal.SIGSTOP)  # rank 0 alone would go on heartbeating
        try:
            server.wait_health("NOT_SERVING", timeout=6 + 2)
        finally:
            force_kill(worker)  # whatever the test saw, leave no stopped worker behind
        hung = server.wait_for("engine.worker_hung")
        assert hung["worker_pid"] == worker
        server.wait_for("engine.worker_spawned", 2, timeout=60)
        server.wait_health("SERVING", timeout=60)
        with Client(server.target) as client:
            assert client.complete([0, 17, 42, 99], max_tokens=3).reason == "LENGTH"
