"""Text: tokenizing prompts and turning engine tokens back into text.

`tokenizer` (encode, incremental detokenize), `chat_template` and `chat_environment` (rendering
a conversation as transformers does), `fast_decode` (per-id tables for the decoders that
allow them), `stop_strings` (matching across chunks) and `completion` (one index's outputs as
TokenChunk and Finished events).
May import: engine.protocol.messages, sluice.v1
"""
