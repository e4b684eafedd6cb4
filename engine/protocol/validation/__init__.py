"""The rules both processes apply to what a caller sends, in one place each: a new request
(request_rules.py: the service refuses a request that breaks one before sending it, the engine
ends one that reaches it anyway with ERROR), a JSON schema (schema_rules.py, with
pattern_grammar.py: the service checks it at admission, the engine before compiling it) and a
LoRA adapter's adapter_config.json (adapter_config.py: read safely, parsed strictly, checked).

Standard library only, like the rest of engine/protocol/: a rule that needs the model's limits
takes them as plain values.
May import: engine.protocol
"""
