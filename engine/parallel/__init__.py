"""Tensor parallelism: the rank group, its worker processes and what rank 0 tells them.

`tensor_parallel` (one rank's place in the group and its collectives), `sharding` (which
slice of each tensor a rank holds), `step_channel` (rank 0's messages), `worker_group` (rank
0's handle on the workers), `tp_worker` (ranks 1..N-1) and `rank_beats` (workers' signs of
life). May import `models.hf_config`, `execution.step_inputs`; `tp_worker` also loads its shard
(`execution.model_shard`) and follows weight updates (`weights.sharded_update`).
"""
