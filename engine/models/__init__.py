"""Models: the Llama family as Hugging Face configs describe it (and its mixture-of-experts kin:
Mixtral, Qwen2-MoE, Qwen3-MoE), its config, RoPE, the merged (q/k/v, gate/up) projections and
the MoE block.

May import `engine.attention.metadata`, `engine.layers` (the norms and the activation) and
`engine.parallel` (tensor_parallel, sharding).
"""
