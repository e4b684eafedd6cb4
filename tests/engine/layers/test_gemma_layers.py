"""The Gemma families' layers equal transformers' modules (bit for bit in bfloat16, where their
rounding differs from the Llama family's): the (1 + weight) RMSNorm multiplied in float32
and rounded once, the embedding scale rounded to the weights' dtype (sqrt(3072) -> 55.5), the
GeLU-tanh gate."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3RMSNorm,
    Gemma3TextScaledWordEmbedding,
)

from engine.layers.gelu_and_mul import GELU_TANH, GeluTanhAndMul
from engine.layers.gemma_rms_norm import GemmaRMSNorm
from engine.layers.rms_norm import rms_norm_ref
from engine.layers.vocab_embedding import VocabParallelEmbedding
from engine.parallel.tensor_parallel import TensorParallel

DTYPES = [torch.float32, torch.bfloat16]


def assert_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norm_and_its_residual_add_equal_transformers(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(7, 96, generator=gen).to(dtype) for _ in range(2))
    weight = (torch.randn(96, generator=gen) * 0.5).to(dtype)
    hf = Gemma3RMSNorm(96, eps=1e-6).to(dtype)
    ours = GemmaRMSNorm(96, eps=1e-6).to(dtype)
    # float32 on the CPU runs the C norm, whose variance sums in another order: equal within
    # float32's rounding; elsewhere (bfloat16) the torch code, bit for bit.
    same = torch.testing.assert_close if dtype == torch.float32 else assert_equal
    with torch.no_grad():
        hf.weight.copy_(weight)
        ours.weight.copy_(weight)
        out, stream = ours(x, residual)
        assert torch.equal(stream, residual + x)
        same(out, hf(residual + x))
        same(ours(x), hf(x))
    if dtype == torch.bfloat16:  # the Llama norm's rounding is not Gemma's
        llama, _ = rms_norm_ref(x, (1 + weight.float()).to(dtype), 1e-6)
        assert not torch.equal(llama, hf(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_scaled_embedding_equals_transformers(dtype: torch.dtype) -> None:
    hidden = 3072  # sqrt is 55.43 in float32, 55.5 in bfloat16
    hf = Gemma3TextScaledWordEmbedding(16, hidden, padding_idx=None, embed_scale=hidden**0.5)
    ours = VocabParallelEmbedding(16, hidden, 0, TensorParallel(), scale=hidden**0.5)
    hf, ours = hf.to(dtype), ours.to(dtype)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        ids = torch.tensor([3, 0, 15, 3])
        assert torch.equal(ours(ids), hf(ids))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gelu_tanh_gate_equals_transformers(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(5, 64, generator=gen) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # strided halves, as the MLP passes them
    assert torch.equal(GeluTanhAndMul()(gate, up), ACT2FN[GELU_TANH](gate) * up)
