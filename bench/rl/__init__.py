"""What the RL-facing features cost: prompt scoring and SAMPLED logprobs (`outputs`), weight
sync over a process group beside streamed tensors (`weight_sync`), Sleep's memory (`sleep_memory`).

May import: bench (top-level helpers), bench.service, engine, sluice_client, tests.support.
"""
