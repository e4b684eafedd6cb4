"""The CPU compute path: the AMX linear kernel beside oneDNN, decode attention of a sliding-window
layer beside a full one, and where an offline run's time goes under torch.profiler.

May import: bench (top-level helpers), engine.
"""
