"""Sampling: the next token of every row, with per-row parameters and no host sync.

`sampler` (the torch reference), `fused_sampler` (the same contract as Triton kernels: the
vocabulary passes in `fused_passes`, the radix select in `fused_select`, top-p on gathered
survivors in `fused_survivors`, the merge in `fused_finish`, shared device functions in
`fused_blocks`), `sampling_math` (the decision arithmetic both reproduce bit for bit;
`fused_math` is it in Triton), `sampler_choice` (which one a device gets), `sampling_slots` +
`sampling_inputs` (a step's SamplingBatch from each request's row) and `surface_rows` (a
request's sampling surface as arrays). May import `engine.attention` (whether
Triton is available), nothing else.
"""
