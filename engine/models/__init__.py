"""Models: the Llama family as Hugging Face configs describe it, and its config and RoPE.

May import `engine.attention.metadata` and `engine.parallel` (tensor_parallel, sharding).
"""
