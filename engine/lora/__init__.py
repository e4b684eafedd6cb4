"""LoRA adapters served beside the base model: read from PEFT directories, resident in stacked
per-module weights, and added to the projections of the tokens that select them.

adapter_file.py (a PEFT directory read and checked against the model), lora_weights.py (one
projection's stacked adapter weights and a step's LoRA pass over them), registry.py
(AdapterRegistry: which adapter is resident in which slot), lora_kernel.py (the step's
segmented LoRA matmul on Triton, CUDA only).

May import `engine.models` (the projections the weights attach to), `engine.scheduling`
(a step's requests) and `engine.layers.grouped_gemm_kernel` (the shrink).
"""
