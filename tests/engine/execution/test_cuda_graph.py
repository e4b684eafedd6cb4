"""CUDA graph buckets, padding and the padded decode step, checked on the CPU.

Without CUDA the graph runner runs its padded, capture-safe step eagerly (`capture=False`):
the same static buffers, padding rows and full-width block tables a captured graph replays.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.execution.cuda_graph import (
    MAX_GRAPH_BATCH,
    CUDAGraphRunner,
    GraphOutput,
    graph_batch_sizes,
    pad_decode_rows,
)
from engine.execution.step_inputs import StepInputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True)


def make_engine(checkpoint: Path, **overrides: object) -> LLMEngine:
    config = {"model": str(checkpoint), "device": "cpu", "dtype": "float32", **overrides}
    return LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]


def with_padded_decode(engine: LLMEngine, max_batch: int | None = None) -> list[int]:
    """Route the engine's decode steps through the graph runner, run eagerly. Returns a list
    that grows by each graphed step's real batch size; every step checks that its padded
    rows write their KV to the scratch slot and attend to the scratch page alone."""
    runner = engine.runner
    runner.attach_graphs(capture=False)
    graphs = runner.graphs
    assert graphs is not None
    if max_batch is not None:
        graphs.batch_sizes = graph_batch_sizes(max_batch)
    sizes: list[int] = []
    run = graphs.run

    def counted(
        host: StepInputs, arrays: object, num_seqs: int, width: int, patch: object = None
    ) -> GraphOutput:
        sizes.append(num_seqs)
        out = run(host, arrays, num_seqs, width, patch)  # type: ignore[arg-type]
        size = graphs.bucket(num_seqs)
        inputs, pool = graphs.inputs, engine.pool
        assert (inputs.slot_mapping[num_seqs:size] == pool.scratch_slot).all()
        assert (inputs.seq_lens[num_seqs:size] == 1).all()
        table = inputs.block_table(size, graphs.max_pages, page_major=True)
        assert (table[num_seqs:, 0] == pool.scratch_page).all()
        return out

    graphs.run = counted  # type: ignore[method-assign]
    return sizes


def some_prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [[0, *torch.randint(2, 300, (4 + 7 * i,), generator=gen).tolist()] for i in range(count)]


def test_batch_sizes_double_to_8_then_step_by_8_to_64_then_by_16() -> None:
    assert graph_batch_sizes(128) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]


def test_a_decode_batch_runs_at_the_smallest_bucket_that_holds_it(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=128)
    engine.runner.attach_graphs(capture=False)
    graphs = engine.runner.graphs
    assert graphs is not None
    assert [graphs.bucket(n) for n in (1, 3, 4, 5, 9, 64, 65, 128)] == [1, 4, 4, 8, 16, 64, 80, 128]
    assert graphs.bucket(129) is None  # above the largest: eager


def test_graphs_stop_at_the_largest_captured_batch(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=MAX_GRAPH_BATCH + 100, num_kv_pages=64)
    engine.runner.attach_graphs(capture=False)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.max_batch == MAX_GRAPH_BATCH
    assert graphs.bucket(MAX_GRAPH_BATCH + 1) is None


def test_padding_rows_point_at_the_scratch_page_and_leave_real_rows_alone() -> None:
    width, scratch, page_size = 3, 9, 4
    host = StepInputs.allocate(8, 8, width, 1, torch.device("cpu"))
    arrays = host.numpy()
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
        getattr(arrays, name)[:] = 7  # stale values of an earlier, larger step
    arrays.query_start_loc[:4] = [0, 1, 2, 3]
    pad_decode_rows(arrays, 3, 8, width, scratch, page_size)
    assert arrays.slot_mapping.tolist() == [7] * 3 + [scratch * page_size] * 5
    assert arrays.seq_lens.tolist() == [7] * 3 + [1] * 5
    assert arrays.positions.tolist() == [7] * 3 + [0] * 5
    assert arrays.input_ids.tolist() == [7] * 3 + [0] * 5
    assert arrays.query_start_loc.tolist() == list(range(9))
    tables = arrays.block_table(8, width, page_major=True)  # a graph's layout
    assert (tables[:3] == 7).all() and (tables[3:] == scratch).all()
    assert (arrays.block_tables[8 * width :] == 7).all()  # nothing past this step's pages


def test_padded_decode_gives_the_tokens_and_logprobs_of_the_unpadded_one(
    tiny_llama: Path,
) -> None:
    # 5 requests of different lengths finish at different steps: batches of 5, 4, ... run at
    # buckets 8 and 4 with stale rows from the larger steps turned into padding.
    prompts = some_prompts(5)
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=True)
        for i in range(5)
    ]
    expected = make_engine(tiny_llama).generate(prompts, params)
    engine = make_engine(tiny_llama)
    sizes = with_padded_decode(engine)
    got = engine.generate(prompts, params)
    assert {5, 4, 3, 2, 1} <= set(sizes)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for g, e in zip(got, expected, strict=True):
        assert g.logprobs is not None and e.logprobs is not None
        np.testing.assert_allclose(g.logprobs, e.logprobs, rtol=0, atol=1e-5)


def test_padded_rows_write_kv_only_to_the_scratch_page(tiny_llama: Path) -> None:
    # No warm-up: its requests leave KV in the pages they freed; here every page starts zero.
    engine = make_engine(tiny_llama, enable_prefix_cache=False, warmup=False)
    with_padded_decode(engine)
    prompts = some_prompts(3)
    engine.add_request("a", prompts[0], GREEDY)
    engine.add_request("b", prompts[1], GREEDY)
    engine.add_request("c", prompts[2], GREEDY)
    for _ in range(3):
        engine.step()  # prefill, then decodes of 3 at bucket 4
    pool = engine.pool
    used = {page for seqs in engine.requests.values() for r in seqs for page in r.pages}
    untouched = [p for p in range(pool.num_pages) if p not in used]
    assert (
        untouched
        and pool.k[:, untouched].abs().sum() == 0
        and pool.v[:, untouched].abs().sum() == 0
    )
    assert pool.k[:, pool.scratch_page].abs().sum() > 0  # the padding row wrote there


def test_batches_above_the_largest_bucket_run_eagerly(tiny_llama: Path) -> None:
    prompts = some_prompts(4)
    params = [
        SamplingParams(temperature=0.0, max_tokens=3 + 4 * i, ignore_eos=True) for i in range(4)
    ]
    expected = make_engine(tiny_llama).generate(prompts, params)
    engine = make_engine(tiny_llama)
    sizes = with_padded_decode(engine, max_batch=2)
    got = engine.generate(prompts, params)
    assert sizes and max(sizes) <= 2  # 4 and 3 decoded eagerly
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]


def test_a_fork_on_a_one_token_step_samples_its_siblings_from_the_leader_row(
    tiny_llama: Path,
) -> None:
    # A prompt of 16k + 1 tokens seen before hits the prefix cache for all but its last token,
    # so its step feeds one token and samples n rows from it: a decode step whose sampled
    # rows are not one per token.
    prompt = some_prompts(1)[0][:1] + list(range(2, 34))  # 33 tokens
    seeded = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=3)
    expected = make_engine(tiny_llama)
    expected.generate([prompt], GREEDY)
    want = expected.generate([prompt], seeded, n=3)
    engine = make_engine(tiny_llama)
    engine.generate([prompt], GREEDY)
    sizes = with_padded_decode(engine)
    got = engine.generate([prompt], seeded, n=3)
    assert sizes[0] == 1 and got[0].cached_tokens == 32
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_enforce_eager_attaches_no_graph_runner_and_cpu_never_captures(tiny_llama: Path) -> None:
    assert make_engine(tiny_llama).runner.graphs is None  # CPU: no CUDA graphs
    assert make_engine(tiny_llama, enforce_eager=True).runner.graphs is None


@pytest.mark.parametrize(("name", "expected"), [("auto", "cpu"), ("torch_ref", "torch_ref")])
def test_the_cpu_engine_uses_the_cpu_backend_unless_told(
    tiny_llama: Path, name: str, expected: str
) -> None:
    engine = make_engine(tiny_llama, attention_backend=name)
    assert engine.model.backend.name == expected


def test_an_unknown_attention_backend_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model=str(tiny_llama), attention_backend="flash")


def test_graph_runner_is_built_for_the_pools_scratch_page(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, num_kv_pages=10)
    pool = engine.pool
    assert pool.k.shape[1] == 11 and pool.scratch_page == 10 and pool.num_free == 10
    runner = CUDAGraphRunner(
        engine.model, engine.runner.kv_caches, pool, 4, engine.runner.max_pages, capture=False
    )
    assert (runner.inputs.slot_mapping == pool.scratch_slot).all()
    assert (runner.inputs.block_tables == pool.scratch_page).all()


def test_a_page_major_table_keeps_each_rows_first_pages_in_one_prefix() -> None:
    host = StepInputs.allocate(4, 4, 8, 1, torch.device("cpu"))
    arrays = host.numpy()
    table = arrays.block_table(4, 3, page_major=True)
    for i in range(4):
        table[i] = [10 * i, 10 * i + 1, 10 * i + 2]
    assert arrays.block_tables[:4].tolist() == [0, 10, 20, 30]  # page 0 of every row
    # A graph captured 8 pages wide sees the same rows through its own view.
    assert host.block_table(4, 8, page_major=True)[:, :3].tolist() == table.tolist()


def test_serve_flags_reach_the_engine_config() -> None:
    from service.cli import build_parser, service_config

    argv = ["--attention-backend", "triton", "--enforce-eager", "--compile"]
    engine = service_config(build_parser().parse_args(argv)).engine
    assert (engine.attention_backend, engine.enforce_eager, engine.compile) == (
        "triton",
        True,
        True,
    )
    defaults = service_config(build_parser().parse_args([])).engine
    assert (defaults.attention_backend, defaults.enforce_eager, defaults.compile) == (
        "auto",
        False,
        False,
    )


def test_forcing_triton_on_the_cpu_needs_the_interpreter() -> None:
    pytest.importorskip("triton")
    from engine.attention import make_backend
    from engine.attention.triton_paged import interpreting

    if interpreting():
        assert make_backend("triton", torch.device("cpu"), 1.0, 16, torch.float32).name == "triton"
    else:
        with pytest.raises(ValueError, match="triton needs CUDA"):
            make_backend("triton", torch.device("cpu"), 1.0, 16, torch.float32)


def test_compiling_allows_one_recompile_per_bucket(tiny_llama: Path) -> None:
    import torch._dynamo.config as dynamo

    engine = make_engine(tiny_llama, max_num_seqs=128)
    runner = CUDAGraphRunner(
        engine.model, engine.runner.kv_caches, engine.pool, 128, 4, capture=False, compile=True
    )
    assert dynamo.recompile_limit >= len(runner.batch_sizes) == 15
