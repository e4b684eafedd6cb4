"""engine/layers/cpu_ops.py (C on the CPU) against the layers' torch references: bfloat16 to
the last bit, float32 to rounding (the variance is summed in another order); on the strided
views the layers pass; and the layers run it in inference only."""

from __future__ import annotations

import pytest
import torch

from engine.layers import cpu_ops
from engine.layers.rms_norm import RMSNorm, rms_norm_ref
from engine.layers.silu_and_mul import silu_and_mul_ref


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _built() -> None:
    assert cpu_ops._lib() is not None, "cpu_ops.c did not build (is a C compiler installed?)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_the_residual_add(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 2 * 96, generator=gen)[:, 96:].to(dtype)  # a column view
    residual = torch.randn(9, 96, generator=gen).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    with torch.inference_mode():
        out, stream = cpu_ops.rms_norm(x, weight, 1e-6, residual)
        want, want_stream = rms_norm_ref(x, weight, 1e-6, residual)
        alone = cpu_ops.rms_norm(x, weight, 1e-5)[0]
        heads = cpu_ops.rms_norm(x.view(9, 3, 32), weight[:32], 1e-6)[0]  # q/k norms' shape
    close(out, want)
    assert torch.equal(stream, want_stream)
    close(alone, rms_norm_ref(x, weight, 1e-5)[0])
    close(heads, rms_norm_ref(x.view(9, 3, 32), weight[:32], 1e-6)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_on_the_gate_up_halves(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up = (8 * torch.randn(6, 2 * 200, generator=gen)).to(dtype)
    gate_up[0, 0] = -200.0  # far past exp's float32 range
    gate, up = gate_up.chunk(2, dim=-1)
    with torch.inference_mode():
        got = cpu_ops.silu_and_mul(gate, up)
    want = silu_and_mul_ref(gate, up)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want)


def test_the_layers_use_it_in_inference_only() -> None:
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(3, 16)
    assert not cpu_ops.usable(x)  # autograd recording: torch's code, which has gradients
    norm(x).sum().backward()
    assert norm.weight.grad is not None
    with torch.inference_mode():
        assert cpu_ops.usable(x) and not cpu_ops.usable(x.double())
