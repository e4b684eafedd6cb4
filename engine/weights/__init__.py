"""Weights: loading a checkpoint at start, and swapping new weights in while serving.

`loading` (safetensors checkpoints into the registry's model by name), `checkpoint_reader`
(a checkpoint directory's tensors by the model's names), `quantization` (a checkpoint's
`quantization_config`: what loads, which tensors make one) and `dequantize` (the formats'
arithmetic), `in_format` (the tensors a model keeps quantized: `fp8_format` and `fp8_layers`
for FP8 projections, `mxfp4_experts` for gpt-oss's MXFP4 experts; a rank's share, what an
update writes), `checks` (what an
update's source can be refused for before anything pauses), `staging` (read and validate, then
swap), `sharded_update` (the same over every tensor-parallel rank), `transfer_group` (a
trainer's process group, for distributed updates; `group_join` joins it beside the engine
loop), `buckets` (their layout), `distributed` (staging them) and `weight_updater` (the update
state machine of one engine). Tensors are cut through the model's ShardLayout, by checkpoint
name: nothing here names a family's weights.

May import: engine.attention.backend, engine.kv_cache, engine.layers, engine.models.base, engine.moe, engine.models.hf_config, engine.parallel, engine.protocol, engine.scheduling
"""
