"""The soak: minutes of mixed traffic, live weight updates and engine kills against one real
server (`run`), split into its server, traffic, driver, per-request checks and verdict.

May import: bench (top-level helpers), sluice_client.
"""
