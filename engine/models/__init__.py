"""Models: the Llama family as Hugging Face configs describe it, its config, RoPE and the
merged (q/k/v, gate/up) projections.

May import `engine.attention.metadata`, `engine.layers` (the norms and the activation) and
`engine.parallel` (tensor_parallel, sharding).
"""
