"""The engine on the fused layer (Triton attention backend and layer kernels) gives the greedy
tokens of the torch path, which tests/engine/models/test_hf_equivalence.py holds to HF.

Float32 on the CPU through Triton's interpreter, or compiled on CUDA: tiny Llama (GQA,
untied), Qwen2 (q/k/v bias, tied), Qwen3 (q/k norm through the norm kernel, head_dim 32), and
the MoE Qwen2-MoE and Mixtral (each expert's activation through the SiLU-and-mul kernel).

NOTE: `use_triton` (tests/support/triton_interpreter.py) runs at collection: it chooses the
interpreter before anything imports triton.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.tiny_models import make_checkpoint
from tests.support.triton_interpreter import use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
use_triton(DEVICE)


MODELS = ["llama", "qwen2", "qwen3", "qwen2_moe", "mixtral"]


@pytest.fixture(scope="module", params=MODELS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def greedy(checkpoint: Path, kernels: str) -> list[list[int]]:
    config = EngineConfig(
        model=str(checkpoint),
        device=DEVICE,
        dtype="float32",
        attention_backend="torch_ref" if kernels == "torch" else "triton",
        layer_kernels=kernels,
        page_size=16,
        enforce_eager=True,
        warmup=False,  # a full step under the interpreter takes minutes
    )
    engine = LLMEngine(config)
    norms = [m for m in engine.model.modules() if type(m).__name__ == "RMSNorm"]
    assert norms and all(m.triton == (kernels == "triton") for m in norms)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[0, *range(5, 5 + n)] for n in (3, 20)]
    return [r.token_ids for r in engine.generate(prompts, params)]


def test_the_fused_layer_gives_the_torch_paths_greedy_tokens(checkpoint: Path) -> None:
    assert greedy(checkpoint, "triton") == greedy(checkpoint, "torch")


def test_forcing_the_layer_kernels_to_triton_needs_cuda_or_the_interpreter() -> None:
    from engine.layers.kernel_choice import use_triton_kernels

    assert use_triton_kernels("torch", torch.device("cpu")) is False
    assert use_triton_kernels("auto", torch.device("cpu")) is False
    assert use_triton_kernels("triton", torch.device(DEVICE)) is True  # the interpreter is on
    with pytest.raises(ValueError, match="layer_kernels"):
        use_triton_kernels("fused", torch.device("cpu"))
