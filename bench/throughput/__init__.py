"""Offline throughput through LLMEngine.generate: the nano-vllm workload beside HF (`offline`),
the prefix cache (`prefix`), LoRA adapters (`lora`), the GPU fast path against eager
(`fast_path`), and the per-expert MoE loop `offline --moe-loop` compares against (`moe_loop`).

May import: bench (top-level helpers), engine.
"""
