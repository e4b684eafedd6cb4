"""The engine's contract with the service: the pipe's messages (requests, outputs, admin
messages) and the error codes their answers carry, the sampling parameters, the engine's config
and settings, the result types, and in validation/ the rules both processes apply to requests,
JSON schemas and adapter configs.

Standard library only: the service process imports this package without torch.
May import: nothing
"""
