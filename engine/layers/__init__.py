"""Layers: the building blocks every model family is made of, each kernel beside the torch code
it must equal.

The tensor-parallel projections and embedding: `merged_linear.py` (column-parallel: several
checkpoint projections of one input in one GEMM), `parallel_linear.py` (RowParallelLinear, one
all-reduce; and LoraPass, what a projection asks of a step's adapters), `vocab_embedding.py`
(VocabParallelEmbedding); `rope.py` (rotary tables as transformers computes them). The fused
kernels: `rms_norm.py` (RMSNorm, fused with the residual add before it), `silu_and_mul.py` (the
MLP's activation) and `rotary_kv.py` (rotary on q and k, and K and V into the paged KV cache,
in one kernel; the attention backends call it); `grouped_gemm_kernel.py` (GEMMs for rows
grouped by expert or adapter, one launch: the MoE experts' and LoRA's shrink);
`fp8_linear_kernel.py` (a linear on FP8 block-scaled weights) and `fp8_projection.py` (a
projection that holds its weight in FP8 and runs that kernel); `mxfp4_grouped_gemm_kernel.py`
(the experts' grouped GEMMs on MXFP4 weights). The Gemma families' norm, `gemma_rms_norm.py` ((1 + weight) in float32), and MLP activation,
`gelu_and_mul.py` (GeLU-tanh gate), are torch only. The `*_kernel`
/ `rotary_kv` modules import triton and are imported only when a Triton path is chosen
(`kernel_choice.py`), so the package works without triton. `linear.py` is the projections'
GEMM: oneDNN's on the CPU (bfloat16 decode steps on AMX CPUs: `cpu_gemm.py`'s C kernel),
F.linear elsewhere; `native.py` builds the CPU's C kernels (`cpu_gemm.c`, `cpu_ops.c`).

Below models, moe and attention: it names no family and no weight of one.

May import: engine.parallel.tensor_parallel
"""
