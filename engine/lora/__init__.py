"""LoRA adapters served beside the base model: read from PEFT directories, resident in stacked
per-module weights, and added to the projections of the tokens that select them.

adapter_file.py (a PEFT directory read and checked against the model; its adapter_config.json by
engine/protocol/validation/adapter_config.py, which the service runs first), lora_weights.py (one
projection's stacked adapter weights and a step's LoRA pass over them), adapter_slots.py
(AdapterSlots: one tensor-parallel rank's slices of every projection's slots, and how rank 0's
slot writes and a step's slots reach the other ranks), registry.py (AdapterRegistry: which
adapter is resident in which slot), adapter_update.py (an adapter updated in place under a new
policy version, and what its requests do then), lora_kernel.py (the step's segmented LoRA
matmul on Triton, CUDA only).

Of the rest of the engine it uses the projections the weights attach to (models), a step's
requests and the scheduler whose requests a replace moves (scheduling), what rank 0 tells the
other ranks (parallel.step_channel) and the grouped GEMM for the shrink (layers).
May import: engine.layers, engine.models.base, engine.parallel.step_channel, engine.protocol, engine.scheduling
"""
