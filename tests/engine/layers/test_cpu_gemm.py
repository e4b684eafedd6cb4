"""engine/layers/cpu_gemm.py: bfloat16 linear layers of few rows on AMX. Each result is the
exact product rounded once to bfloat16 (within one bfloat16 step of it: the float32 sums'
order differs from any other GEMM's), at tile edges in every dimension; linear() runs it for
bfloat16 up to MAX_ROWS rows and oneDNN above. The kernel tests need a CPU with AMX-BF16; the
packing test runs everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.layers.linear as linear_module
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.layers import cpu_gemm
from tests.support.tiny_models import make_checkpoint

needs_amx = pytest.mark.skipif(
    cpu_gemm._lib() is None, reason="this CPU (or its build) has no AMX-BF16"
)


def _within_one_bf16_step(got: torch.Tensor, exact: torch.Tensor) -> None:
    """|got - exact| at most one bfloat16 step of exact (2^-7 relative), or 1e-3 near 0."""
    assert got.dtype == torch.bfloat16
    err = (got.double() - exact).abs()
    bound = exact.abs() * 2.0**-7 + 1e-3
    assert bool((err <= bound).all()), f"worst {float((err - bound).max())} past the bound"


def test_pack_puts_each_weight_where_the_kernel_reads_it() -> None:
    """wp[block, chunk, pair, column, half] = W[16 block + column, 32 chunk + 2 pair + half],
    zero past W's edges, the block count even."""
    weight = torch.arange(40 * 70, dtype=torch.float32).view(40, 70).bfloat16()
    packed = cpu_gemm.pack(weight)
    assert packed.shape == (4, 3, 16, 16, 2)
    for block, chunk, pair, column, half in [(0, 0, 0, 0, 1), (1, 2, 2, 5, 0), (2, 1, 7, 7, 1)]:
        row, col = 16 * block + column, 32 * chunk + 2 * pair + half
        assert packed[block, chunk, pair, column, half] == weight[row, col]
    assert packed[2, 2, 3:].abs().sum() == 0  # K past 70
    assert packed[3].abs().sum() == 0  # rows past 40: the padding block
    assert packed.float().sum() == weight.float().sum()


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 64, 256])
@pytest.mark.parametrize(("out_features", "in_features"), [(1000, 800), (40, 96), (96, 64)])
def test_products_are_the_exact_product_rounded_once(
    rows: int, out_features: int, in_features: int
) -> None:
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    packed = cpu_gemm.pack(weight)
    for b in (None, bias):
        got = cpu_gemm.linear(x, packed, out_features, b)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        _within_one_bf16_step(got, exact)
        logits = cpu_gemm.linear(x, packed, out_features, b, out_float32=True)
        assert logits.dtype == torch.float32 and torch.equal(logits, got.float())


@needs_amx
def test_strided_and_batched_inputs() -> None:
    """A column view (as split() gives the layers) and a [batch, tokens, in] input."""
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 9, 2 * 64, generator=gen).bfloat16()
    x = wide[..., 64:]
    weight = torch.randn(48, 64, generator=gen).bfloat16()
    got = cpu_gemm.linear(x, cpu_gemm.pack(weight), 48, None)
    assert got.shape == (2, 9, 48)
    _within_one_bf16_step(got, F.linear(x.double(), weight.double()))
    empty = cpu_gemm.linear(x[:, :0], cpu_gemm.pack(weight), 48, None)
    assert empty.shape == (2, 0, 48)


@needs_amx
def test_linear_runs_amx_up_to_max_rows_and_onednn_above(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(linear_module, "ONEDNN_MIN_WEIGHT", 0)
    calls: list[int] = []
    kernel = cpu_gemm.linear

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_gemm, "linear", counted)
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(64, 64, generator=gen).bfloat16()
    wide = weight.float()  # made outside inference mode, as model weights are
    with torch.inference_mode():
        for rows in (1, cpu_gemm.MAX_ROWS, cpu_gemm.MAX_ROWS + 1):
            x = torch.randn(rows, 64, generator=gen).bfloat16()
            _within_one_bf16_step(
                linear_module.linear(x, weight, None), F.linear(x.double(), weight.double())
            )
            linear_module.linear(x.float(), wide, None)  # float32: never AMX
    assert calls == [1, cpu_gemm.MAX_ROWS]


NEAR_TIE = 0.25  # nats: as the GPU tests bound bfloat16 kernels' flips (test_gpu_fast_path.py)


@needs_amx
def test_a_bf16_engine_on_amx_gives_onednns_tokens_or_flips_only_at_near_ties(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy decoding through the engine, every linear of the model on AMX (the size gate
    lowered so the tiny model's weights take it) against every linear on oneDNN."""
    checkpoint = make_checkpoint(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    gen = torch.Generator().manual_seed(8)
    batch = [torch.randint(2, 300, (5 + 23 * k,), generator=gen).tolist() for k in range(8)]
    params = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    monkeypatch.setattr(linear_module, "ONEDNN_MIN_WEIGHT", 0)
    runs = {}
    for max_rows in (0, cpu_gemm.MAX_ROWS):
        monkeypatch.setattr(cpu_gemm, "MAX_ROWS", max_rows)
        engine = LLMEngine(EngineConfig(model=str(checkpoint), dtype="bfloat16"))
        runs[max_rows] = engine.generate(batch, params)
        engine.close()
    for got, want in zip(runs[cpu_gemm.MAX_ROWS], runs[0], strict=True):
        at = next(
            (
                i
                for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True))
                if a != b
            ),
            None,
        )
        if at is not None:
            ids, logprobs = want.top_logprobs[at]
            token = got.token_ids[at]
            assert token in ids and logprobs[0] - logprobs[ids.index(token)] < NEAR_TIE
