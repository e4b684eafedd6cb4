"""Kernels of one graphed decode step, per layer and outside the layers, with eager kernels.

Counts exactly the function a CUDA graph captures (`CUDAGraphRunner._forward`: embed ->
layers -> final norm -> LM head), run once with capture=False, under a TorchDispatchMode:
every aten op it sees is a kernel except views (a result that aliases an input) and
allocations, and a Triton launch counts once (its launcher is wrapped; under the interpreter
it dispatches many aten ops, which are not counted). The mode sees some composite ops whole
(`aten.linear`: one GEMM). The attention backend and the layer kernels are forced to Triton
(on the CPU under TRITON_INTERPRET=1, set before triton is imported). No torch.compile.
bfloat16 unless `--dtype` says otherwise: the graphed step's dtype on CUDA (a float32 step
makes no casts, so it counts fewer).

The model is the shape's real layer (hidden, heads, head_dim, intermediate, biases) and
vocabulary with `--count-layers` layers (2 by default) and random weights: a layer's kernels do
not depend on how many layers there are, so the count per layer is the real model's. On CUDA
an aten op is one kernel launch or more (cuBLAS may add one for a bias, for example); on the
CPU this is the count a graph of the same step would hold.

    python -m bench.decode --shape qwen2.5-0.5b --count-kernels
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# Allocations are not kernels (an `empty` launches nothing).
ALLOCATIONS = ("aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty")


def use_interpreter_off_cuda(device: str) -> None:
    """NOTE: must run before triton is first imported."""
    if not device.startswith("cuda"):
        os.environ["TRITON_INTERPRET"] = "1"


class KernelCounter:
    """Kernels dispatched while active, by the layer they ran in (None: outside the layers)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                if not counter.paused and is_kernel(func, (args, kwargs), out):
                    counter.record(str(func.overloadpacket))
                return out

        self.mode = Mode()
        self.paused = 0
        self.layer: int | None = None
        self.kernels: defaultdict[int | None, Counter[str]] = defaultdict(Counter)

    def record(self, name: str) -> None:
        self.kernels[self.layer][name] += 1

    def in_layer(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.layer = index
            try:
                return forward(*args, **kwargs)
            finally:
                self.layer = None

        return wrapped

    @contextmanager
    def triton_launches(self) -> Iterator[None]:
        """Each Triton kernel launch counts as one kernel, whatever it dispatches itself."""
        import triton.runtime.interpreter as interpreter
        import triton.runtime.jit as jit

        classes = [jit.JITFunction, interpreter.InterpretedFunction]
        originals = [cls.run for cls in classes]
        counter = self

        def counted(run: Callable[..., Any]) -> Callable[..., Any]:
            def launch(kernel: Any, *args: Any, **kwargs: Any) -> Any:
                if not counter.paused and not kwargs.get("warmup"):
                    counter.record(f"triton:{kernel.__name__}")
                counter.paused += 1
                try:
                    return run(kernel, *args, **kwargs)
                finally:
                    counter.paused -= 1

            return launch

        for cls, run in zip(classes, originals, strict=True):
            cls.run = counted(run)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for cls, run in zip(classes, originals, strict=True):
                cls.run = run  # type: ignore[method-assign]


def is_kernel(func: Any, inputs: Any, out: Any) -> bool:
    """An aten op that launches work: one that writes an input (an in-place op) or makes a new
    tensor, but not an allocation; an op whose result aliases an input is a view (or a no-op
    such as `.float()` of a float32 tensor)."""
    if str(func.overloadpacket) in ALLOCATIONS:
        return False
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return True
    inputs_seen = {t.untyped_storage().data_ptr() for t in _tensors(inputs)}
    return not any(t.untyped_storage().data_ptr() in inputs_seen for t in _tensors(out))


def _tensors(tree: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    # Strided tensors only: a weight in oneDNN's packed layout (CPU linear) has no storage.
    return [
        t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.layout == torch.strided
    ]


def model_config(shape: str, layers: int) -> Any:
    from bench.checkpoints import SHAPES
    from engine.models.hf_config import parse_model_config

    spec = SHAPES[shape]
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(spec.arch)
    architecture = architecture or "Qwen3ForCausalLM"
    raw = {**spec.config, "num_hidden_layers": layers, "architectures": [architecture]}
    if spec.arch == "qwen2":
        raw.setdefault("use_sliding_window", False)
    return parse_model_config(raw, {}, max_model_len=4096)


def count_shape(
    shape: str, device: str, dtype: str, layers: int = 2, rows: int = 1
) -> dict[str, Any]:
    """The JSON document for `--shape shape`, built with `layers` layers."""
    result = {
        "shape": shape,
        **count_decode_kernels(model_config(shape, layers), device, dtype, rows),
    }
    result["note"] = (
        f"built with {layers} of the shape's layers: the kernels of a layer do not depend on "
        "the layer count; kernels_per_layer is the most any layer launched"
    )
    return result


def _random_model(cfg: Any, dev: Any, dtype: str, page_size: int) -> tuple[Any, Any]:
    """(a Llama of config `cfg` with random weights on `dev`, its Triton attention backend);
    built as this revision's or an older one's engine takes it (the count runs on both)."""
    import torch

    from engine.attention import make_backend
    from engine.models.llama import LlamaForCausalLM

    try:
        from engine.layers.rope import RotaryEmbedding
    except ImportError:  # a revision from before the model interface
        from engine.models.rope import RotaryEmbedding  # type: ignore[no-redef]

    args: tuple[Any, ...] = (dev, cfg.head_dim**-0.5, page_size)
    if "dtype" in inspect.signature(make_backend).parameters:  # since the cpu backend
        args += (getattr(torch, dtype),)
    backend = make_backend("triton", *args)
    kwargs: dict[str, Any] = {}
    if "triton_kernels" in inspect.signature(LlamaForCausalLM).parameters:
        # Older revisions (before the fused layer) have no layer kernels: the before count.
        kwargs["triton_kernels"] = True
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg, backend, **kwargs).to(getattr(torch, dtype))
    model.rotary = RotaryEmbedding(
        cfg.head_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling
    )
    model.rotary.to(dev)  # float32 tables, as engine/weights/loading.py builds them
    model.requires_grad_(False).eval()
    return model, backend


def count_decode_kernels(cfg: Any, device: str, dtype: str, rows: int = 1) -> dict[str, Any]:
    """Kernels per layer and outside the layers of a decode step of `rows` sequences (padded
    rows, as the graph runs them) of a model of config `cfg` with random weights."""
    import torch

    from engine.execution.cuda_graph import CUDAGraphRunner
    from engine.kv_cache.page_pool import PagePool

    dev = torch.device(device)
    page_size, pages = 16, 64
    model, backend = _random_model(cfg, dev, dtype, page_size)
    pool = PagePool(
        pages, page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, getattr(torch, dtype), dev
    )
    runner = CUDAGraphRunner(model, pool.layer_caches(), pool, rows, pages, capture=False)
    size = runner.bucket(rows)
    assert size is not None

    with torch.inference_mode():
        runner._forward(size)  # compile the Triton kernels outside the count
        counter = KernelCounter()
        for i, layer in enumerate(model.model.layers):
            layer.forward = counter.in_layer(i, layer.forward)
        try:
            with counter.triton_launches(), counter.mode:
                runner._forward(size)
        finally:
            for layer in model.model.layers:
                del layer.forward
    per_layer = [sum(counter.kernels[i].values()) for i in range(cfg.num_layers)]
    splits = getattr(backend, "num_splits", lambda *_: None)(size, cfg.num_kv_heads)
    return {
        "benchmark": "decode_kernel_count",
        "device": device,
        "dtype": dtype,
        "rows": size,
        "decode_splits": splits,
        "kernels_per_layer": max(per_layer),
        "kernels_outside_layers": sum(counter.kernels[None].values()),
        "kernels_per_step": sum(sum(c.values()) for c in counter.kernels.values()),
        "kernels_by_layer": per_layer,
        "layer_kernels": dict(sorted(counter.kernels[cfg.num_layers - 1].items())),
        "outside_kernels": dict(sorted(counter.kernels[None].items())),
        "layers_built": cfg.num_layers,
    }


def main(args: argparse.Namespace) -> int:
    """bench.decode --count-kernels: print the count of one shape as JSON."""
    from bench.common import set_threads

    use_interpreter_off_cuda(args.device)
    set_threads(args.threads)
    # bf16 on any device: the dtype a graphed step runs in (a float32 step makes no casts).
    dtype = args.dtype or "bfloat16"
    result = count_shape(args.shape, args.device, dtype, args.count_layers, args.count_rows)
    print(json.dumps(result, indent=2), flush=True)
    return 0
