"""Where a decode step's time goes: `python -m bench.decode`'s modes. Host time alone
(`host_only`), overlapped against plain steps (`overlap`), the kernels of a graphed step
(`kernel_count`), the ops outside the forward (`op_count`) and per-part timers (`timers`).

May import: bench (top-level helpers), engine.
"""
