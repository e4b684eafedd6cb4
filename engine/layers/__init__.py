"""The decoder layer's fused kernels: each a Triton kernel beside the torch code it must equal.

`rms_norm.py` (RMSNorm, fused with the residual add before it), `silu_and_mul.py` (the MLP's
activation over the gate/up projection's output) and `rotary_kv.py` (rotary on q and k, and K
and V into the paged KV cache, in one kernel; the attention backends call it);
`grouped_gemm_kernel.py` (the MoE experts' GEMMs for pairs grouped by expert, one launch per
projection; engine/models/moe.py holds the torch path it equals). The `*_kernel`
/ `rotary_kv` modules import triton and are imported only when a Triton path is chosen
(`kernel_choice.py`), so the package works without triton. `linear.py` is the projections'
GEMM: oneDNN's on the CPU (bfloat16 decode steps on AMX CPUs: `cpu_gemm.py`'s C kernel),
F.linear elsewhere; `native.py` builds the CPU's C kernels (`cpu_gemm.c`, `cpu_ops.c`).

A folder below both `models` and `attention`: the model's modules use the norm and activation,
the Triton attention backend uses the rotary kernel. It imports torch and triton only, no
other engine module, so either side may import it without a cycle.
"""
