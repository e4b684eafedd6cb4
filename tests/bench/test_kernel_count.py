"""The graphed decode step launches at most 12 kernels per layer and 4 outside the layers.

A count, not a timing (bench/step/kernel_count.py): the function a CUDA graph captures, run eagerly
with the Triton attention backend and layer kernels (under Triton's interpreter on the CPU),
in bfloat16 so that every dtype cast a real step makes is counted. Tiny Qwen2 (q/k/v bias,
tied embeddings) and Llama configs: a layer's kernel count does not depend on its width.

NOTE: `use_triton` (tests/support/triton_interpreter.py) runs at collection: it chooses the
interpreter before anything imports triton.
"""

from __future__ import annotations

import pytest
import torch

import engine.layers.linear as linear_module
from bench.step.kernel_count import count_decode_kernels
from engine.models.hf_config import parse_model_config
from tests.support.tiny_models import ARCH_DEFAULTS, BASE_CONFIG
from tests.support.triton_interpreter import use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
use_triton(DEVICE)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
KERNELS_PER_LAYER = 12
KERNELS_OUTSIDE = 4  # embedding, final norm (with the last residual add), LM head, logits cast


@pytest.fixture(autouse=True)
def linear_as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with no oneDNN bfloat16 GEMM (AVX2) a bfloat16 linear widens to float32: two
    casts more per projection, on the CPU only. The count stands for a CUDA step: there the
    projections run F.linear, and so they do here."""
    if DEVICE == "cpu" and not linear_module.NATIVE_BF16:
        monkeypatch.setattr(linear_module, "_ONEDNN", False)


def tiny_config(arch: str):  # type: ignore[no-untyped-def]
    raw = {**BASE_CONFIG, **ARCH_DEFAULTS[arch], "vocab_size": 320}
    return parse_model_config({**raw, "architectures": [ARCHITECTURES[arch]]}, {})


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("rows", [1, 16])
def test_a_graphed_decode_step_launches_few_kernels(arch: str, rows: int) -> None:
    result = count_decode_kernels(tiny_config(arch), DEVICE, "bfloat16", rows)
    assert result["kernels_outside_layers"] <= KERNELS_OUTSIDE, result["outside_kernels"]
    layer = result["layer_kernels"]
    assert result["kernels_per_layer"] <= KERNELS_PER_LAYER, layer
    # Merged projections: qkv, o, gate_up, down (oneDNN's linear on the CPU).
    assert layer.get("aten.linear", 0) + layer.get("mkldnn._linear_pointwise", 0) == 4, layer
    # One launch each for both norms (with their adds), rotary with the KV write, SiLU-and-mul.
    assert layer["triton:_rms_norm"] == 2
    assert layer["triton:_rotary_kv"] == layer["triton:_silu_and_mul"] == 1
    # The split-merging launch only when the context is split.
    assert layer.get("triton:_decode_reduce", 0) == (result["decode_splits"] > 1)


def test_the_count_sees_views_as_free_and_casts_as_kernels() -> None:
    from bench.step.kernel_count import KernelCounter

    counter = KernelCounter()
    x = torch.ones(4, 8)
    with torch.inference_mode(), counter.mode:  # as the count runs the step
        x.view(8, 4).t()[1:]  # views
        x.float()  # a float32 tensor already: no copy
        torch.empty(3)  # an allocation
        x.to(torch.bfloat16)  # a cast: a kernel
        x.add_(1)  # in place: a kernel
    kernels = counter.kernels[None]
    assert sum(kernels.values()) == 2 and kernels["aten.add_"] == 1, kernels


def test_bench_decode_prints_the_count_as_one_json_document(capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from bench.decode import main

    assert (
        main(["--shape", "tiny", "--device", DEVICE, "--count-kernels", "--count-rows", "2"]) == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["shape"] == "tiny" and result["rows"] == 2 and result["layers_built"] == 2
    assert result["kernels_outside_layers"] <= KERNELS_OUTSIDE
    assert result["kernels_per_layer"] == max(result["kernels_by_layer"])
