"""Tensor parallelism: the rank group, its worker processes and what rank 0 tells them.

`tensor_parallel` (one rank's place in the group and its collectives), `shard_layout` (which
slice of each tensor a rank holds, through a model family's table: ShardLayout and Split),
`step_channel` (rank 0's messages; a step's host int buffers), `worker_group` (rank 0's handle
on the workers, which run engine/tp_worker.py) and `rank_beats` (workers' signs of life).
Below models, execution, weights and lora: it names no model and no step type of theirs.
`worker_group` is given engine/tp_worker.py's `worker_main` as its spawn target.

May import: engine.protocol, engine.parent_death
"""
