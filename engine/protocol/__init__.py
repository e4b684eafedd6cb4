"""The engine's contract with the service: the pipe's messages (requests, outputs, admin
messages), the sampling parameters, the engine's config and settings, and the result types.

Standard library only: the service process imports this package without torch.
May import: nothing
"""
