"""Execution: one scheduled batch turned into a forward pass on the device.

`model_runner` (packs a batch, runs the model, samples), `launched_step` (a step in flight
between the runner's launch and collect; the CPU's device thread), `step_inputs` (the flat step
tensors, and a step's inputs filled into them), `kv_group_inputs` (the other KV groups' slots
and tables), `step_rows` (the rows the LM head computes),
`prompt_scoring` (prompt logprobs), `cuda_graph` (decode steps captured and
replayed), `model_shard` (one rank's model, KV pool and runner, built the same way on every
rank) and `host_malloc` (a CPU engine's glibc malloc settings). The model is held through
engine.models.base's CausalLM, built by the registry's class: nothing here names a family.

May import: engine.attention, engine.demo, engine.kv_cache, engine.layers, engine.lora, engine.models.base, engine.models.hf_config, engine.moe, engine.parallel, engine.protocol, engine.sampling, engine.scheduling, engine.weights.loading
"""
