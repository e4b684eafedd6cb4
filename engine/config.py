"""The engine's one frozen configuration. Standard library only: the service imports it too."""

from __future__ import annotations

from dataclasses import dataclass

from engine.messages import MAX_POLICY_VERSION

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch_ref", "triton")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "console")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine process needs to start, resolved once.

    `model` is a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json).
    The KV cache is sized by `num_kv_pages` if given, else by `kv_cache_memory` bytes, else by
    a default budget for the device; never by max_num_seqs x max_model_len.
    """

    model: str
    device: str = "auto"  # auto = cuda when available, else cpu
    dtype: str = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    max_num_seqs: int = 128  # running requests per step
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunks + decodes)
    page_size: int = 16  # tokens per KV page
    kv_cache_memory: int | None = None  # bytes for K and V pages
    num_kv_pages: int | None = None  # overrides kv_cache_memory
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"  # auto = triton on CUDA when importable, else torch_ref
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    compile: bool = False  # torch.compile the decode step
    seed: int = 0  # seeds the per-request seeds of unseeded requests
    policy_version: int = 0  # version of the weights loaded at start
    # The engine process logs as the service does (engine/logs.py): same level, same format.
    log_level: str = "info"  # one of LOG_LEVELS
    log_format: str = "json"  # json: one object per line; console: for a person at a terminal

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: a checkpoint directory is required")
        if self.device not in DEVICES:
            raise ValueError(f"device: expected one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend: expected one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: expected one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format: expected one of {LOG_FORMATS}, got {self.log_format!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")
        for name in ("max_model_len", "kv_cache_memory", "num_kv_pages"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be at least 1 when set")
        if not 0 <= self.policy_version <= MAX_POLICY_VERSION:
            raise ValueError(f"policy_version: must be in [0, {MAX_POLICY_VERSION}]")
