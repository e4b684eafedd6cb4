"""engine/layers/linear.py: oneDNN's float32 CPU linear equals F.linear to float32 rounding,
on the strided column views the layers pass; with autograd recording, and for small weights,
F.linear itself runs. The tests of the packed path lower `ONEDNN_MIN_WEIGHT` to 0 so that
their small weights take it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.layers.linear as linear_module
from engine.layers.linear import linear


@pytest.fixture
def packed_always(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "ONEDNN_MIN_WEIGHT", 0)


@pytest.mark.usefixtures("packed_always")
def test_inference_linear_equals_f_linear_on_strided_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 2 * 96, generator=gen)[:, 96:]  # a column view, as split() gives
    weight, bias = torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    expected = F.linear(x.double(), weight.double(), bias.double()).float()
    with torch.inference_mode():
        got = linear(x, weight, bias)
        unbiased = linear(x.unsqueeze(0), weight, None)  # [batch, tokens, in] too
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unbiased[0], expected - bias, rtol=1e-5, atol=1e-5)


def test_training_linear_is_f_linear_and_has_gradients() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=gen)
    weight = torch.randn(8, 32, generator=gen, requires_grad=True)
    out = linear(x, weight, None)
    assert torch.equal(out, F.linear(x, weight))  # bit for bit: the same op
    out.sum().backward()
    assert weight.grad is not None


@pytest.mark.usefixtures("packed_always")
def test_packed_weights_follow_in_place_updates_through_views() -> None:
    """On the CPU the weight runs in oneDNN's packed layout, cached beside it: a copy into the
    weight, or into a view of its rows (as a weight update writes merged projections), must
    reach the next call."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 64, generator=gen)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 6e-2)):
        weight = torch.nn.Parameter(torch.randn(48, 64, generator=gen).to(dtype))
        with torch.inference_mode():
            before = linear(x.to(dtype), weight, None)
            torch.testing.assert_close(before, F.linear(x.to(dtype), weight), rtol=tol, atol=tol)
            weight.detach()[:16].copy_(torch.randn(16, 64, generator=gen).to(dtype))
            after = linear(x.to(dtype), weight, None)
            expected = F.linear(x.double(), weight.double()).to(dtype)
        torch.testing.assert_close(after, expected, rtol=tol, atol=tol)
        assert not torch.equal(after[:, :16], before[:, :16])


@pytest.mark.parametrize("packed", [True, False])
def test_bfloat16_without_native_support_runs_widened_and_rounds_once(
    monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    """On a CPU where oneDNN has no bfloat16 GEMM (AVX2) the linear widens to float32: the
    result is the float32 product rounded to bfloat16 once, within one bfloat16 step of the
    exact product, and the float32 copy (packed or not) still follows in-place updates."""
    monkeypatch.setattr(linear_module, "NATIVE_BF16", False)
    monkeypatch.setattr(linear_module, "ONEDNN_MIN_WEIGHT", 0 if packed else 1 << 40)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    weight = torch.randn(48, 64, generator=gen).bfloat16()
    bias = torch.randn(48, generator=gen).bfloat16()
    with torch.inference_mode():
        for _ in range(2):
            got = linear(x, weight, bias)
            assert got.dtype == torch.bfloat16
            exact = F.linear(x.double(), weight.double(), bias.double())
            torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-3)
            weight[:8].mul_(-1)  # the second pass must see it


def test_small_weights_run_f_linear_itself() -> None:
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(16, 128, generator=gen), torch.randn(256, 128, generator=gen)
    assert weight.numel() < linear_module.ONEDNN_MIN_WEIGHT
    with torch.inference_mode():
        assert torch.equal(linear(x, weight, None), F.linear(x, weight))  # bit for bit
    assert not hasattr(weight, "_cpu_copy")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepack_makes_at_load_the_copies_the_first_calls_would(dtype: torch.dtype) -> None:
    from engine.layers import cpu_gemm

    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(512, linear_module.ONEDNN_MIN_WEIGHT // 512, generator=gen).to(dtype)
    linear_module.prepack(weight)
    made = set(weight._cpu_copy[1])  # type: ignore[attr-defined]
    assert made == ({"onednn", "amx"} if cpu_gemm.runs(dtype) else {"onednn"})
    with torch.inference_mode():
        for rows in (1, 300):  # a decode step's rows and a prefill's
            x = torch.randn(rows, weight.shape[1], generator=gen).to(dtype)
            tol = 1e-4 if dtype == torch.float32 else 6e-2
            got = linear(x, weight, None)
            torch.testing.assert_close(got, F.linear(x, weight), rtol=tol, atol=tol)
    assert set(weight._cpu_copy[1]) == made  # type: ignore[attr-defined]
    small = torch.randn(8, 8, generator=gen)
    linear_module.prepack(small)
    assert not hasattr(small, "_cpu_copy")
