"""Sampling: the next token of every row, with per-row parameters and no host sync.

`sampler` (the torch reference), `fused_sampler` (the same contract as Triton kernels: the
vocabulary passes in `fused_passes`, the radix select in `fused_select`, top-p on gathered
survivors in `fused_survivors`, the merge in `fused_finish`, shared device functions in
`fused_blocks`), `sampling_math` (the decision arithmetic both reproduce bit for bit;
`fused_math` is it in Triton), `cpu_race` (the CPU's race and argmax in C), `surface` (logit
bias, allowed and banned ids) and `sampler_choice` (which one a device gets). A step's batch:
`sampling_slots` (each running request's sampling row, written once into its block-table
slot), `surface_rows` (its sampling surface as arrays) and `sampling_inputs` (a step's
SamplingBatch from those rows, into the step buffers the runner passes in).
May import: engine.layers.kernel_choice, engine.layers.native, engine.kv_cache.block_table, engine.scheduling.request, engine.structured.grammar_mask, engine.protocol.messages
"""
