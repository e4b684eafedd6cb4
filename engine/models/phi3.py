"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): the Llama layers, with what their checkpoints differ in.

transformers' Phi-3 is Llama's decoder (RMSNorm, grouped-query attention, SiLU-gated MLP, tied
or untied head) with four differences, each handled here:
- fused checkpoint tensors: `self_attn.qkv_proj` (q rows, then k, then v) and
  `mlp.gate_up_proj` (gate rows, then up) are single tensors. The engine's merged projections
  already stack them so; they are `fused` here, so `checkpoint_tensors` names each whole by
  its checkpoint name, a weight update names them so, and a LoRA adapter (peft targets the
  fused modules) attaches to each whole. Tensor parallelism cuts them projection by projection
  (`Phi3Sharding`): a rank holds its heads' q rows, its KV heads' k and v rows, stacked.
- LongRoPE (`rope_type: longrope`) and a partial rotary (`partial_rotary_factor`: Phi-4-mini
  rotates 0.75 of each head): engine/layers/rope.py computes both (ModelConfig carries them).
  LongRoPE's short or long factors are chosen once, by the served context.
- `sliding_window` on every layer (Phi-3-mini-4k: 2047): when it is smaller than the served
  context, every layer attends through that window (LayerAttention) and the KV layout says so;
  otherwise it never bites and the layers are plain.
- no biases: transformers builds every projection without one, whatever the config says.
What else the config asks that this cannot compute is refused by name (`check_config`).
"""

from __future__ import annotations

from dataclasses import replace

from engine.attention.backend import AttentionBackend, LayerAttention
from engine.layers.merged_linear import MergedLinear
from engine.models.base import KVLayout, LayerKV
from engine.models.hf_config import ModelConfig, UnsupportedModelError
from engine.models.llama import LlamaAttention, LlamaForCausalLM
from engine.models.sharding import Sharding
from engine.parallel.shard_layout import Split
from engine.parallel.tensor_parallel import TensorParallel


def check_config(cfg: ModelConfig) -> None:
    """Refuse, by key, what transformers' Phi-3 computes and this engine does not."""
    if cfg.hidden_act != "silu":
        raise UnsupportedModelError(f"hidden_act={cfg.hidden_act!r} is not supported (only 'silu')")


def sliding_window(cfg: ModelConfig) -> int | None:
    """The window every layer attends through, or None when it never bites (no window, or
    one that holds the whole served context: a query at position i sees keys j > i - W)."""
    window = cfg.sliding_window
    return window if window is not None and window < cfg.max_model_len else None


class Phi3Sharding(Sharding):
    """The Llama table, plus the fused tensors: `qkv_proj.weight` is split into this rank's q
    rows, then its k rows, then its v rows (each by heads, as the Llama table splits q_proj,
    k_proj and v_proj); `gate_up_proj.weight` into its gate rows, then its up rows."""

    def split(self, name: str) -> Split | None:
        if self.size == 1:
            return None
        if name.endswith("qkv_proj.weight"):
            return self._fused(("q", "kv", "kv"))
        if name.endswith("gate_up_proj.weight"):
            return self._fused(("mlp", "mlp"))
        return super().split(name)

    def _fused(self, kinds: tuple[str, ...]) -> Split:
        ranges, offset = [], 0
        for kind in kinds:
            start, length, full = self._ranges[kind]
            ranges.append((offset + start, offset + start + length))
            offset += full
        (start, stop), *rest = ranges
        return Split(0, start, stop, offset, tuple(rest))

    def for_rank(self, rank: int) -> Phi3Sharding:
        return Phi3Sharding(self.config, rank, self.size)


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
        triton_kernels: bool = False,
    ) -> None:
        check_config(cfg)
        cfg = replace(cfg, qkv_bias=False, o_bias=False, mlp_bias=False)
        super().__init__(cfg, backend, tp, triton_kernels)
        for module in self.modules():
            if isinstance(module, MergedLinear):  # qkv_proj, gate_up_proj: whole tensors
                module.fused = True
        window = sliding_window(cfg)
        if window is not None:
            for module in self.modules():
                if isinstance(module, LlamaAttention):
                    module.kind = LayerAttention(sliding_window=window)

    @classmethod
    def shard_layout(cls, cfg: ModelConfig, rank: int, size: int) -> Phi3Sharding:
        check_config(cfg)
        return Phi3Sharding(cfg, rank, size)

    @property
    def kv_layout(self) -> KVLayout:
        cfg, heads = self.config, self.sharding.num_kv_heads
        window = sliding_window(cfg)
        if window is None:
            return KVLayout(cfg.num_layers, heads, cfg.head_dim)
        layers = tuple(LayerKV(heads, cfg.head_dim, window) for _ in range(cfg.num_layers))
        return KVLayout(cfg.num_layers, heads, cfg.head_dim, layers)
