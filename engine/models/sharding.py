"""The Llama family's sharding table: which slice of each of its checkpoint tensors one
tensor-parallel rank holds (Megatron-style), by the names its checkpoints use.

Column-parallel (the output dim is split): q/k/v and gate/up projections, with their biases.
Row-parallel (the input dim is split, one all-reduce after): o_proj and down_proj; their biases
stay whole and are added once, after the all-reduce. Vocabulary-parallel: the embedding and the
LM head (tied or not) hold a contiguous slice of the vocabulary rows. Norms (q/k norms included:
one weight over head_dim, shared by every head) are replicated.

With fewer KV heads than ranks, each KV head is replicated on the ranks whose query heads use
it (rank r holds KV head r // (ranks / kv_heads)). With one rank every tensor is whole.

Mixture-of-experts layers (engine/moe/) split every expert as a dense MLP is split:
each rank holds a slice of each expert's intermediate dimension (gate/up rows, down columns;
Mixtral's w1/w3 and w2), and of the shared expert's; the router and the shared-expert gate are
replicated. Which intermediate size a gate/up/down tensor splits is told by its name
(`.experts.`, `.shared_expert.`, else the dense MLP's).

Slices are decided by checkpoint name: a rank's merged qkv_proj (gate_up_proj) stacks its
slices of q, k and v (gate and up), each found by its own name
(LlamaForCausalLM.checkpoint_tensors). The generic part (a Split, a whole layout, shapes
and slices from `split`) is engine/parallel/shard_layout.py.
"""

from __future__ import annotations

from engine.models.hf_config import ModelConfig
from engine.parallel.shard_layout import ShardLayout, Split

# Parameter name suffix -> (split dim, which size is split).
COLUMN = {
    "q_proj.weight": "q",
    "q_proj.bias": "q",
    "k_proj.weight": "kv",
    "k_proj.bias": "kv",
    "v_proj.weight": "kv",
    "v_proj.bias": "kv",
    "gate_proj.weight": "mlp",
    "gate_proj.bias": "mlp",
    "up_proj.weight": "mlp",
    "up_proj.bias": "mlp",
    "w1.weight": "expert",  # Mixtral's experts: gate (w1), up (w3), down (w2)
    "w3.weight": "expert",
    "embed_tokens.weight": "vocab",
    "lm_head.weight": "vocab",
}
ROW = {"o_proj.weight": "q", "down_proj.weight": "mlp", "w2.weight": "expert"}


class Sharding(ShardLayout):
    """The local sizes and tensor slices of rank `rank` of `size` for one model config.

    Raises ValueError at construction when `size` does not divide what it must split.
    """

    def __init__(self, cfg: ModelConfig, rank: int = 0, size: int = 1) -> None:
        _check_divisible(cfg, size)
        self.config = cfg
        self.rank, self.size = rank, size
        self.num_heads = cfg.num_heads // size
        self.num_kv_heads = max(1, cfg.num_kv_heads // size)
        if cfg.num_kv_heads >= size:
            kv_first = rank * self.num_kv_heads
        else:  # replicated: the KV head of this rank's query heads
            kv_first = rank // (size // cfg.num_kv_heads)
        self.intermediate_size = cfg.intermediate_size // size
        self.vocab_size = cfg.vocab_size // size
        self.vocab_start = rank * self.vocab_size
        d = cfg.head_dim
        self._ranges = {
            "q": (rank * self.num_heads * d, self.num_heads * d, cfg.num_heads * d),
            "kv": (kv_first * d, self.num_kv_heads * d, cfg.num_kv_heads * d),
            "mlp": (rank * self.intermediate_size, self.intermediate_size, cfg.intermediate_size),
            "vocab": (self.vocab_start, self.vocab_size, cfg.vocab_size),
        }
        expert = cfg.moe.expert_intermediate_size if cfg.moe else 0
        shared = cfg.moe.shared_expert_intermediate_size if cfg.moe else 0
        self.expert_intermediate_size = expert // size  # each expert's, this rank's
        self.shared_expert_intermediate_size = shared // size
        self._ranges["expert"] = (rank * (expert // size), expert // size, expert)
        self._ranges["shared_expert"] = (rank * (shared // size), shared // size, shared)

    def split(self, name: str) -> Split | None:
        if self.size == 1:
            return None
        suffix = ".".join(name.split(".")[-2:])
        kind, dim = (COLUMN.get(suffix), 0) if suffix in COLUMN else (ROW.get(suffix), 1)
        if kind is None:
            return None
        if kind == "mlp" and ".experts." in name:
            kind = "expert"
        elif kind == "mlp" and ".shared_expert." in name:
            kind = "shared_expert"
        start, length, full = self._ranges[kind]
        return Split(dim, start, start + length, full)

    def for_rank(self, rank: int) -> Sharding:
        return Sharding(self.config, rank, self.size)


def _check_divisible(cfg: ModelConfig, size: int) -> None:
    def refuse(what: str) -> ValueError:
        return ValueError(f"tensor_parallel_size: {size} {what}")

    if cfg.num_heads % size:
        raise refuse(f"does not divide num_attention_heads={cfg.num_heads}")
    kv = cfg.num_kv_heads
    if kv >= size and kv % size:
        raise refuse(f"does not divide num_key_value_heads={kv}")
    if kv < size and size % kv:
        raise refuse(f"is not a multiple of num_key_value_heads={kv} (KV heads are replicated)")
    if cfg.intermediate_size % size:
        raise refuse(f"does not divide intermediate_size={cfg.intermediate_size}")
    if cfg.vocab_size % size:
        raise refuse(f"does not divide vocab_size={cfg.vocab_size}")
    if cfg.moe is not None:
        mixtral = cfg.architecture == "MixtralForCausalLM"
        key = "intermediate_size" if mixtral else "moe_intermediate_size"
        if cfg.moe.expert_intermediate_size % size:
            raise refuse(f"does not divide {key}={cfg.moe.expert_intermediate_size}")
        if cfg.moe.shared_expert_intermediate_size % size:
            shared = cfg.moe.shared_expert_intermediate_size
            raise refuse(f"does not divide shared_expert_intermediate_size={shared}")
