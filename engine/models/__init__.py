"""Models: what the runner needs of a model, the registry of families, and the Llama family.

`base` (CausalLM: the interface every family implements; `model_class` resolves an
architecture to its class), `registry` (architecture name -> the module and class that build
it), `hf_config` (a checkpoint's config.json read into ModelConfig), and the Llama family:
`llama` (the model: Llama, Mistral, Qwen2/3 and their MoE kin Mixtral, Qwen2-MoE, Qwen3-MoE),
`llama_family` (one row per member: biases, q/k norm, MoE checkpoint names) and `sharding` (its
sharding table: which slice of each of its checkpoint tensors a rank holds); `phi3`
(Phi-3/Phi-4: the Llama layers with fused qkv/gate-up checkpoint tensors, their sharding table
and a sliding window on every layer); the Gemma family: `gemma` (Gemma 2 and Gemma 3 text:
sliding and full layers, soft caps, two rope bases; Llama's sharding table) and `gemma_config`
(their keys of config.json, checked); gpt-oss:
`gpt_oss` (its layers on the Llama-shaped decoder), `gpt_oss_config` (its config keys) and
`gpt_oss_sharding` (its sinks and fused experts across ranks).

May import: engine.attention, engine.layers, engine.moe, engine.parallel.tensor_parallel, engine.parallel.shard_layout
"""
