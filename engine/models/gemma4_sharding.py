"""Gemma 4's sharding table: which slice of each of its checkpoint tensors a tensor-parallel rank
holds, by the names its checkpoints use (Megatron-style, as the Llama family's table).

Column-parallel: q/k/v (a layer's own head size and KV head count: sliding and full layers
differ) and the MLP's gate/up (a double-wide layer's twice as wide). Row-parallel: o_proj and
down_proj. Vocabulary-parallel: the token embedding, the LM head and the per-layer input
embedding (`embed_tokens_per_layer`, the bulk of the small models' weights). With fewer KV heads
than ranks a layer's KV heads are replicated (rank r holds head r // (ranks / kv_heads)).

The experts are split by expert: a rank holds experts [r * E / ranks, (r + 1) * E / ranks)
whole (`experts.gate_up_proj` stacks each expert's gate rows then its up rows, so a slice of its
intermediate dimension would be two ranges of the checkpoint tensor, not one). Norms, the
router, the per-layer input gate and projection, `layer_scalar` are replicated.
"""

from __future__ import annotations

from engine.models.gemma4_config import Gemma4Config
from engine.models.hf_config import ModelConfig
from engine.parallel.shard_layout import ShardLayout, Split

# Checkpoint name suffix -> (split dim, which range of the layer).
SPLITS = {
    "q_proj.weight": (0, "q"),
    "q_proj.bias": (0, "q"),
    "k_proj.weight": (0, "kv"),
    "k_proj.bias": (0, "kv"),
    "v_proj.weight": (0, "kv"),
    "v_proj.bias": (0, "kv"),
    "o_proj.weight": (1, "q"),
    "gate_proj.weight": (0, "mlp"),
    "up_proj.weight": (0, "mlp"),
    "down_proj.weight": (1, "mlp"),
    "experts.gate_up_proj": (0, "experts"),
    "experts.down_proj": (0, "experts"),
}
VOCAB = {
    "model.embed_tokens.weight": "vocab",
    "lm_head.weight": "vocab",
    "model.embed_tokens_per_layer.weight": "per_layer_vocab",
}


class Gemma4Sharding(ShardLayout):
    """Rank `rank` of `size`'s local sizes and slices; ValueError naming the config key at
    construction when `size` does not divide what it splits."""

    def __init__(self, cfg: ModelConfig, gemma: Gemma4Config, rank: int = 0, size: int = 1):
        _check_divisible(cfg, gemma, size)
        self.config, self.gemma = cfg, gemma
        self.rank, self.size = rank, size
        self.num_heads = cfg.num_heads // size
        self.vocab_size = cfg.vocab_size // size
        self.vocab_start = rank * self.vocab_size
        self.per_layer_vocab_size = gemma.per_layer_vocab_size // size
        self.num_kv_heads: list[int] = []  # per layer, this rank's
        self.intermediate_size: list[int] = []  # per layer, this rank's
        self._layer_ranges: list[dict[str, tuple[int, int, int]]] = []
        for layer in gemma.layers:
            kv = layer.num_kv_heads
            local_kv = max(1, kv // size)
            kv_first = rank * local_kv if kv >= size else rank // (size // kv)
            inter = cfg.intermediate_size * (2 if layer.double_wide_mlp else 1)
            d = layer.head_dim
            self.num_kv_heads.append(local_kv)
            self.intermediate_size.append(inter // size)
            self._layer_ranges.append(
                {
                    "q": (rank * self.num_heads * d, self.num_heads * d, cfg.num_heads * d),
                    "kv": (kv_first * d, local_kv * d, kv * d),
                    "mlp": (rank * (inter // size), inter // size, inter),
                }
            )
        experts = gemma.moe.num_experts if gemma.moe else 0
        self.num_experts = experts // size  # this rank's
        self.expert_start = rank * self.num_experts
        self._ranges = {
            "vocab": (self.vocab_start, self.vocab_size, cfg.vocab_size),
            "per_layer_vocab": (
                rank * self.per_layer_vocab_size,
                self.per_layer_vocab_size,
                gemma.per_layer_vocab_size,
            ),
            "experts": (self.expert_start, self.num_experts, experts),
        }

    def split(self, name: str) -> Split | None:
        if self.size == 1:
            return None
        if name in VOCAB:
            return self._split(0, self._ranges[VOCAB[name]])
        parts = name.split(".")
        if len(parts) < 4 or parts[:2] != ["model", "layers"]:
            return None
        suffix = ".".join(parts[-2:])
        if suffix not in SPLITS:
            return None
        dim, kind = SPLITS[suffix]
        ranges = self._ranges if kind == "experts" else self._layer_ranges[int(parts[2])]
        return self._split(dim, ranges[kind])

    @staticmethod
    def _split(dim: int, span: tuple[int, int, int]) -> Split:
        start, length, full = span
        return Split(dim, start, start + length, full)

    def for_rank(self, rank: int) -> Gemma4Sharding:
        return Gemma4Sharding(self.config, self.gemma, rank, self.size)


def _check_divisible(cfg: ModelConfig, gemma: Gemma4Config, size: int) -> None:
    def refuse(what: str) -> ValueError:
        return ValueError(f"tensor_parallel_size: {size} {what}")

    if cfg.num_heads % size:
        raise refuse(f"does not divide num_attention_heads={cfg.num_heads}")
    for layer in gemma.layers:
        kv, key = layer.num_kv_heads, f"num_key_value_heads={layer.num_kv_heads} ({layer.kind})"
        if kv >= size and kv % size:
            raise refuse(f"does not divide {key}")
        if kv < size and size % kv:
            raise refuse(f"is not a multiple of {key} (KV heads are replicated)")
    if cfg.intermediate_size % size:
        raise refuse(f"does not divide intermediate_size={cfg.intermediate_size}")
    if cfg.vocab_size % size:
        raise refuse(f"does not divide vocab_size={cfg.vocab_size}")
    if gemma.per_layer_input_size and gemma.per_layer_vocab_size % size:
        raise refuse(f"does not divide vocab_size_per_layer_input={gemma.per_layer_vocab_size}")
    if gemma.moe is not None and gemma.moe.num_experts % size:
        raise refuse(f"does not divide num_experts={gemma.moe.num_experts}")
