"""The sampler alone: the fused Triton kernel against the torch sampler (`fused`), and the
CPU sampler's C passes against torch's elementwise ops (`cpu_passes`).

May import: bench (top-level helpers), engine.
"""
