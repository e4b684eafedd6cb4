"""The engine's one frozen configuration. Standard library only: the service imports it too."""

from __future__ import annotations

from dataclasses import dataclass

from engine.protocol.messages import MAX_POLICY_VERSION
from engine.protocol.settings import EXECUTION, MODEL, OBSERVABILITY, SCHEDULING, setting

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch_ref", "triton", "cpu")
SAMPLERS = ("auto", "torch", "triton")
LAYER_KERNELS = ("auto", "torch", "triton")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")
SPECULATIVE_METHODS = ("off", "ngram", "suffix", "draft")
# Each proposal verified is a step row of its own, allocated at start for every request that may
# propose: a bound keeps a mistyped flag from sizing those buffers out of memory.
MAX_SPECULATIVE_TOKENS = 64
MAX_JSON_WHITESPACE = 1024


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine process needs to start, resolved once.

    `model` is a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json).
    The KV cache is sized by `num_kv_pages` if given, else by `kv_cache_memory` bytes, else by
    a default budget for the device; never by max_num_seqs x max_model_len. Each field's help
    (its `sluice serve` flag's) is in its `setting`.
    """

    model: str = setting(
        "demo", "Hugging Face checkpoint directory, or 'demo' (trained on first use)", group=MODEL
    )
    device: str = setting(
        "auto", "auto = cuda when available, else cpu", group=MODEL, choices=DEVICES
    )
    dtype: str = setting(
        "auto", "auto = bfloat16 on cuda, float32 on cpu", group=MODEL, choices=DTYPES
    )
    seed: int = setting(0, "seeds the per-request seeds of requests that give none", group=MODEL)
    policy_version: int = setting(0, "policy version of the weights loaded at start", group=MODEL)
    max_model_len: int | None = setting(
        None, "context length in tokens (default: the checkpoint's)", group=SCHEDULING
    )
    max_num_seqs: int = setting(128, "sequences running at once per step", group=SCHEDULING)
    max_num_batched_tokens: int = setting(
        2048, "tokens per step: prompt chunks plus one per decoding sequence", group=SCHEDULING
    )
    page_size: int = setting(16, "tokens per KV cache page", group=SCHEDULING)
    kv_cache_memory: int | None = setting(
        None,
        "bytes for the KV cache, e.g. 2GiB (default: see --gpu-memory-utilization; 1 GiB "
        "at most on the CPU)",
        group=SCHEDULING,
        size=True,
    )
    num_kv_pages: int | None = setting(
        None, "KV cache pages; overrides --kv-cache-memory", group=SCHEDULING
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "CUDA without --kv-cache-memory: the fraction of the GPU memory still free after "
        "the weights are loaded that the KV cache takes, in (0, 1]",
        group=SCHEDULING,
    )
    enable_prefix_cache: bool = setting(
        True, "reuse the KV pages of shared prompt prefixes", group=SCHEDULING
    )
    attention_backend: str = setting(
        "auto",
        "auto = triton on CUDA when installed; on the CPU, cpu (decode attention in a C kernel "
        "built with the system's compiler) when it builds; else torch_ref",
        group=EXECUTION,
        choices=ATTENTION_BACKENDS,
    )
    sampler: str = setting(
        "auto",
        "auto = the fused triton kernel on CUDA when installed, else torch (same tokens)",
        group=EXECUTION,
        choices=SAMPLERS,
    )
    layer_kernels: str = setting(
        "auto",
        "the decoder layer's RMSNorm (with its residual add) and SiLU-and-multiply: auto = "
        "fused triton kernels on CUDA when installed, else torch",
        group=EXECUTION,
        choices=LAYER_KERNELS,
    )
    tensor_parallel_size: int = setting(
        1,
        "ranks one model is split over (Megatron-style): the engine process is rank 0 and "
        "starts N-1 worker processes, one device each (NCCL on CUDA, gloo on the CPU)",
        group=EXECUTION,
    )
    enforce_eager: bool = setting(False, "no CUDA graphs for decode steps", group=EXECUTION)
    compile: bool = setting(False, "torch.compile the decode step", group=EXECUTION)
    overlap_steps: bool = setting(
        False,
        "schedule and prepare step N+1 while the device runs step N (vLLM's async "
        "scheduling); same tokens as without it; off with --tensor-parallel-size above 1",
        group=EXECUTION,
    )
    warmup: bool = setting(
        True,
        "run one full step of throwaway requests before serving, so that the first requests "
        "do not pay the first-use costs (heap growth, kernel choice and compilation)",
        group=EXECUTION,
    )
    json_whitespace: int = setting(
        0,
        "whitespace between the tokens of JSON under json_schema and json_object: 0 = compact "
        "JSON, ', ' and ': ' only (vLLM's disable_any_whitespace); N = any JSON whitespace, "
        "in runs of at most N characters",
        group=EXECUTION,
    )
    # NOTE: torch's default is one thread per core; on a small machine its pool slows down
    # 10-100x whenever another process (the server, a client) is busy on the same cores.
    cpu_threads: int | None = setting(
        None,
        "torch threads of each engine rank (default: torch's, one per core; with "
        "--tensor-parallel-size N on the CPU, the cores shared out among the N ranks)",
        group=EXECUTION,
    )
    max_loras: int = setting(
        0,
        "LoRA adapters resident at once, each selectable per request (0: no LoRA, no memory "
        "for it); their stacked weights are allocated at start",
        group=MODEL,
    )
    max_lora_rank: int = setting(
        16, "the largest LoRA rank an adapter may have (the stacked weights' width)", group=MODEL
    )
    # Structured output: each constraint compiles in a worker process, bounded and killable
    # (engine/structured/compile_pool.py).
    grammar_compile_workers: int = setting(
        2,
        "processes that compile structured-output constraints; one caller (connection) uses "
        "one at a time",
        group=EXECUTION,
    )
    grammar_compile_timeout: float = setting(
        10.0,
        "seconds one constraint may take to compile before it is refused (INVALID_ARGUMENT)",
        group=EXECUTION,
    )
    grammar_compile_memory: int = setting(
        2 << 30,
        "address space one compile may take beyond a compile worker's own, e.g. 2GiB; a "
        "constraint that needs more is refused (INVALID_ARGUMENT)",
        group=EXECUTION,
        size=True,
    )
    # Speculative decoding (engine/speculative/): proposals verified in one forward pass.
    speculative_method: str = setting(
        "off",
        "propose tokens and verify them in one forward pass, with exactly the tokens of "
        "decoding without it: ngram (prompt lookup in the request's own tokens), suffix (its "
        "tokens and recently finished outputs), draft (a smaller checkpoint, "
        "--speculative-draft-model)",
        group=SCHEDULING,
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = setting(
        4, "the most tokens proposed per request per step (at most 64)", group=SCHEDULING
    )
    ngram_min: int = setting(
        2, "ngram and suffix: the shortest match that proposes", group=SCHEDULING
    )
    ngram_max: int = setting(
        4, "ngram: the longest match looked for (the longest wins)", group=SCHEDULING
    )
    speculative_draft_model: str | None = setting(
        None,
        "draft: the checkpoint directory of the draft model (same tokenizer as --model)",
        group=SCHEDULING,
    )
    speculative_max_batch: int = setting(
        8,
        "steps with more decoding requests than this do not speculate (verification costs "
        "more than it saves at large batches)",
        group=SCHEDULING,
    )
    # The engine process logs as the service does (engine/logs.py): same level, same format.
    log_level: str = setting("info", "both processes", group=OBSERVABILITY, choices=LOG_LEVELS)
    log_format: str = setting(
        "auto",
        "json: one object per line; console: for a person at a terminal; auto: console when "
        "stderr is a terminal, else json",
        group=OBSERVABILITY,
        choices=LOG_FORMATS,
    )

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
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler: expected one of {SAMPLERS}, got {self.sampler!r}")
        if self.layer_kernels not in LAYER_KERNELS:
            raise ValueError(
                f"layer_kernels: expected one of {LAYER_KERNELS}, got {self.layer_kernels!r}"
            )
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: expected one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format: expected one of {LOG_FORMATS}, got {self.log_format!r}")
        if not 0 <= self.json_whitespace <= MAX_JSON_WHITESPACE:
            raise ValueError(f"json_whitespace: must be 0 to {MAX_JSON_WHITESPACE}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")
        for name in ("max_model_len", "kv_cache_memory", "num_kv_pages", "cpu_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be at least 1 when set")
        if self.grammar_compile_workers < 1:
            raise ValueError("grammar_compile_workers: must be at least 1")
        if not self.grammar_compile_timeout > 0:
            raise ValueError("grammar_compile_timeout: must be positive")
        if self.grammar_compile_memory < 1 << 20:
            raise ValueError("grammar_compile_memory: must be at least 1MiB")
        if self.max_loras < 0:
            raise ValueError("max_loras: must be at least 0")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank: must be at least 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization: must be in (0, 1]")
        self._check_speculative()
        if not 0 <= self.policy_version <= MAX_POLICY_VERSION:
            raise ValueError(f"policy_version: must be in [0, {MAX_POLICY_VERSION}]")

    def _check_speculative(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method: expected one of {SPECULATIVE_METHODS}, "
                f"got {self.speculative_method!r}"
            )
        for name in ("num_speculative_tokens", "ngram_min", "speculative_max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens: at most {MAX_SPECULATIVE_TOKENS}")
        if self.ngram_max < self.ngram_min:
            raise ValueError("ngram_max: must be at least ngram_min")
        if self.speculative_method == "draft" and not self.speculative_draft_model:
            raise ValueError("speculative_draft_model: required with speculative_method draft")
