"""Execution: one scheduled batch turned into a forward pass on the device.

`model_runner` (packs a batch, runs the model, samples), `launched_step` (a step in flight
between the runner's launch and collect; the CPU's device thread), `step_inputs` (the flat step
tensors), `sampling_slots` (each running request's sampling row, written once),
`sampling_inputs` (a step's SamplingBatch from those rows), `routed_experts` (the sampled
rows' MoE routing, when asked), `cuda_graph` (decode steps captured
and replayed), `model_shard` (one rank's model, KV pool and runner, built the same way on
every rank) and `host_malloc` (a CPU engine's glibc malloc settings). May import `models`,
`attention`, `sampling`, `scheduling`, `parallel` and `weights.loading`.
"""
