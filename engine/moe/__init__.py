"""Mixture of experts: the MoE feed-forward any family with experts builds its sparse layers of.

`config` (MoeConfig: experts, top-k, sizes, routing flags; a family's config reader fills it),
`experts` (`route`, and StackedExperts: every expert's weights stacked, their GEMMs grouped by
expert: a torch loop, or one grouped-GEMM launch per projection on Triton), `block`
(SparseMoeBlock: router, experts and an optional gated shared expert, one all-reduce),
`routed_experts` (the expert ids a step records for the rows that asked, and their host copy)
`clamped_swiglu` (gpt-oss's expert activation) and `packed_experts` (gpt-oss's MXFP4 stacks,
kept packed on the Triton path).
A folder of its own, below models/ as layers/ is: it names no family (a family passes its
checkpoint names and its rank's sizes), so every family with experts shares it and the runner,
the sleep and the kernels' tests reach it without going through a model.

May import: engine.layers, engine.parallel.tensor_parallel
"""
