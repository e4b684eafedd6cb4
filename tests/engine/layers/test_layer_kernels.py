"""Each of engine/layers' Triton kernels equals its torch reference in float32: compiled on
CUDA, else on the CPU through Triton's interpreter.

Shapes: qwen2.5-0.5b's (14 query heads over 2 KV heads, head_dim 64, hidden 896, inter 4864)
and Llama-3.2-1B's (32 over 8, head_dim 64, hidden 2048), a head_dim of 128, odd token
counts, inputs that are column views of one fused projection's output, and the padding rows
of a graphed step (token 0 at position 0, all writing the scratch slot).

NOTE: `use_triton` (tests/support/triton_interpreter.py) runs at collection: it chooses the
interpreter before anything imports triton.
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.rms_norm import rms_norm_ref
from engine.layers.rope import RotaryEmbedding
from engine.layers.silu_and_mul import silu_and_mul_ref
from tests.support.triton_interpreter import use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
use_triton(DEVICE)

from engine.layers.rms_norm_kernel import rms_norm  # noqa: E402 - after the interpreter choice
from engine.layers.rotary_kv import rotary_kv  # noqa: E402
from engine.layers.silu_and_mul_kernel import silu_and_mul  # noqa: E402

TOL = {"rtol": 1e-5, "atol": 1e-5}


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE)


@pytest.mark.parametrize(("tokens", "hidden"), [(1, 896), (7, 2048), (13, 64), (3, 100)])
def test_rms_norm_with_the_residual_add_equals_torch(tokens: int, hidden: int) -> None:
    x, residual, weight = (
        randn(tokens, hidden),
        randn(tokens, hidden, seed=1),
        randn(hidden, seed=2),
    )
    out, stream = rms_norm(x, weight, 1e-6, residual)
    expected, expected_stream = rms_norm_ref(x, weight, 1e-6, residual)
    torch.testing.assert_close(stream, expected_stream, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, **TOL)


def test_rms_norm_without_a_residual_returns_the_input_as_the_stream() -> None:
    x, weight = randn(5, 896), randn(896, seed=1)
    out, stream = rms_norm(x, weight, 1e-5)
    assert stream is x
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-5)[0], **TOL)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rms_norm_over_the_heads_of_a_strided_q_view(head_dim: int) -> None:
    # Qwen3's q norm: [tokens, heads, head_dim] columns of the fused q/k/v output.
    tokens, heads, kv_heads = 7, 16, 8
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = randn(head_dim, seed=1)
    out, _ = rms_norm(q, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm_ref(q, weight, 1e-6)[0], **TOL)


@pytest.mark.parametrize(("tokens", "inter"), [(1, 4864), (7, 8192), (13, 128), (2, 1000)])
def test_silu_and_mul_over_the_halves_of_a_gate_up_output_equals_torch(
    tokens: int, inter: int
) -> None:
    gate_up = randn(tokens, 2 * inter)  # gate half first
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate, up), silu_and_mul_ref(gate, up), **TOL)


def reference_rotary_kv(
    q, k, v, positions, rotary, k_cache, v_cache, slots
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_ref's rotary and KV write: RotaryEmbedding, then index_copy_ into the slots."""
    q, k = rotary(positions, q, k)
    kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
    return q, k_cache, v_cache


def check_rotary_kv(
    heads: int,
    kv_heads: int,
    head_dim: int,
    positions: list[int],
    slots: list[int],
    rotary_dim: int | None = None,
) -> None:
    tokens, page_size, pages = len(positions), 16, 8
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=3)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)  # strided views, as a fused projection gives them
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, 1e6, None, rotary_dim).to(DEVICE)
    cache = randn(pages, page_size, kv_heads, head_dim, seed=4)
    pos = torch.tensor(positions, device=DEVICE)
    slot = torch.tensor(slots, device=DEVICE)
    k_cache, v_cache = cache.clone(), cache.clone()
    got_q = rotary_kv(q, k, v, pos, rotary.cos, rotary.sin, k_cache, v_cache, slot)
    want_q, want_k, want_v = reference_rotary_kv(
        q, k, v, pos, rotary, cache.clone(), cache.clone(), slot
    )
    torch.testing.assert_close(got_q, want_q, **TOL)
    torch.testing.assert_close(k_cache, want_k, **TOL)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0)  # copied, not computed


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(14, 2, 64), (32, 8, 64), (16, 8, 128), (4, 4, 32)]
)
def test_rotary_and_kv_write_equal_torch_ref(heads: int, kv_heads: int, head_dim: int) -> None:
    # Seven tokens of two sequences: a prompt chunk at 0..3 and decode rows far out.
    positions = [0, 1, 2, 3, 17, 1000, 4095]
    slots = [32, 33, 34, 35, 5, 90, 127]
    check_rotary_kv(heads, kv_heads, head_dim, positions, slots)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "rotary_dim"),
    [(24, 8, 128, 96), (4, 2, 16, 12), (4, 2, 32, 8)],
)
def test_a_partial_rotary_rotates_the_leading_dimensions_as_torch_ref(
    heads: int, kv_heads: int, head_dim: int, rotary_dim: int
) -> None:
    """Phi-4-mini's 0.75 of a 128-dimension head (and odd-sized ones): the first rotary_dim
    dimensions rotate among themselves, the others reach q and the cache unchanged."""
    positions = [0, 1, 2, 3, 17, 1000, 4095]
    slots = [32, 33, 34, 35, 5, 90, 127]
    check_rotary_kv(heads, kv_heads, head_dim, positions, slots, rotary_dim)


def test_the_padding_rows_of_a_graphed_step_all_write_the_scratch_slot() -> None:
    # Rows 3..7 are padding: position 0, one scratch slot (112 = page 7's first). Real rows'
    # slots are untouched by them. Padding rows feed the same token, so any of their identical
    # writes may land last.
    heads, kv_heads, head_dim = 14, 2, 64
    tokens = 8
    positions = [9, 300, 41] + [0] * 5
    slots = [9, 44, 73] + [112] * 5
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=5)
    qkv[3:] = qkv[3]  # the padding rows' projections are equal: the same token at position 0
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (
        q.view(tokens, heads, head_dim),
        k.view(tokens, kv_heads, head_dim),
        v.view(tokens, kv_heads, head_dim),
    )
    rotary = RotaryEmbedding(head_dim, 512, 1e6, None).to(DEVICE)
    cache = randn(8, 16, kv_heads, head_dim, seed=6)
    pos, slot = torch.tensor(positions, device=DEVICE), torch.tensor(slots, device=DEVICE)
    k_cache, v_cache = cache.clone(), cache.clone()
    got_q = rotary_kv(q, k, v, pos, rotary.cos, rotary.sin, k_cache, v_cache, slot)
    want_q, want_k, want_v = reference_rotary_kv(
        q, k, v, pos, rotary, cache.clone(), cache.clone(), slot
    )
    torch.testing.assert_close(got_q, want_q, **TOL)
    torch.testing.assert_close(k_cache, want_k, **TOL)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0)
    torch.testing.assert_close(got_q[3:], got_q[3:4].expand(5, -1, -1), rtol=0, atol=0)
