"""The engine core: who owns a request and who owns a step.

`llm_engine` (LLMEngine, the facade: requests in, steps, stats; its admin calls in
`weight_calls` (weights, sleep) and `adapter_calls` (LoRA adapters)), `request_table`
(RequestTable: the requests in flight, the outputs made outside a step, the seed rng and the
arrival counter; every way a request starts or ends), `step_loop` (StepLoop: schedule, launch,
collect, postprocess; the plain and the overlapped loop side by side), `postprocess`
(Postprocessor: what a step's samples do to their requests), `output_columns` (a step's outputs
as columns, read as RequestOutputs), `request_output` (one request's RequestOutput),
`in_process` (the admin calls that wait for their outcome), `warmup` (the start-up warm-up) and
`generate` (LLMEngine.generate's loop) and `model_parts` (the model, KV pool, runner, adapters
and tensor-parallel workers, loaded at start-up). The top of the engine's stack: every
package below it, and `engine.tp_worker` for the workers' spawn target; never `engine.process`.
May import: engine.execution, engine.kv_cache, engine.layers, engine.logs, engine.lora, engine.models, engine.parallel, engine.protocol, engine.sampling, engine.scheduling, engine.sleep, engine.speculative, engine.structured, engine.tp_worker, engine.weights
"""
