"""A tensor-parallel worker process: rank 1..N-1 of one engine.

Started by rank 0 (engine/parallel/worker_group.py) with the 'spawn' context. It loads its shard
of the model the same way rank 0 does (engine/execution/model_shard.py), and of the speculative
draft model if there is one, then follows rank 0's messages on the StepChannel until STOP: a
step's forward on its shard (with its LoRA adapters), a draft model's pass on its shard of the
draft, a LoRA adapter slot's write (its slices), a weight update's staging and swap, a gather of
its parameters, joining a trainer's weight-transfer group. It has no scheduler, no sampler and
no pipe: rank 0 owns the page tables and the requests. Any failure ends the process (exit
status 1), which rank 0's watcher turns into the end of the whole engine.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import structlog

from engine.logs import configure_logging
from engine.parallel.rank_beats import RankBeats
from engine.parent_death import die_with_parent
from engine.protocol.config import EngineConfig

log = structlog.get_logger("sluice.engine")


def worker_main(config: EngineConfig, path: str, rank: int, port: int, beats: RankBeats) -> None:
    beats.start_beating(rank - 1)  # first: rank 0 judges this worker by it from now on
    configure_logging(config.log_level, config.log_format, process=f"engine-rank{rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as rank 0: Ctrl-C is the service's to handle
    die_with_parent()  # NOTE: rank 0 spawns us from its main thread, which lives as long as it
    try:
        _run(config, Path(path), rank, port)
    except BaseException as exc:
        log.critical(
            "engine.worker_crashed", rank=rank, reason=f"{type(exc).__name__}: {exc}", exc_info=exc
        )
        raise SystemExit(1) from None
    log.info("engine.worker_exiting", rank=rank)


def _run(config: EngineConfig, path: Path, rank: int, port: int) -> None:
    import torch

    from engine.execution.model_shard import load_shard, resolve_device, resolve_dtype
    from engine.lora.adapter_slots import AdapterSlots, follow_slot, followed_step
    from engine.models.hf_config import load_model_config
    from engine.parallel.step_channel import Op
    from engine.parallel.tensor_parallel import join_group, leave_group
    from engine.speculative.draft_pass import load_draft_follower
    from engine.weights.sharded_update import follow_stage, gather_parameters
    from engine.weights.transfer_group import TransferGroup, follow_join, follow_joined
    from engine.weights.update_target import UpdateTarget

    size = config.tensor_parallel_size
    torch.set_num_threads(rank_threads(config))
    started = time.monotonic()
    device = resolve_device(config.device, rank, size)
    dtype = resolve_dtype(config.dtype, device)
    tp = join_group(rank, size, port, device)
    cfg = load_model_config(path, config.max_model_len)
    shard = load_shard(config, cfg, path, tp, device, dtype)
    channel = shard.runner.open_channel()
    draft = load_draft_follower(config, path, cfg, tp, device, dtype, shard.pool)
    update_target = UpdateTarget(shard.model, draft.model if draft is not None else None)
    adapters = AdapterSlots(shard.model, config.max_loras, config.max_lora_rank)  # rank 0 fills
    transfer = TransferGroup()  # this rank's membership of a trainer's group, if any
    seconds = round(time.monotonic() - started, 3)
    log.info("engine.worker_loaded", rank=rank, device=str(device), seconds=seconds)
    while True:
        header, copies = channel.receive()
        match header.op:
            case Op.STEP:
                lora = (
                    followed_step(channel, adapters, header.num_seqs, device)
                    if header.lora
                    else None
                )
                shard.runner.follow(header, copies, lora)
            case Op.DRAFT:
                assert draft is not None, "rank 0 runs no draft model without one here"
                draft.follow(header)
            case Op.LORA:
                follow_slot(channel, adapters)
            case Op.STAGE:
                follow_stage(update_target, transfer)
            case Op.JOIN:
                follow_join(shard.model, transfer)
            case Op.JOINED:
                follow_joined(shard.model, transfer)
            case Op.GATHER:
                gather_parameters(shard.model)
            case Op.PING:
                pass
            case Op.STOP:
                transfer.leave()
                leave_group()
                return


def rank_threads(config: EngineConfig) -> int:
    """Torch threads per rank: `cpu_threads`, else on the CPU the cores shared out among the
    ranks (N processes of one thread per core would fight over every core)."""
    if config.cpu_threads is not None:
        return config.cpu_threads
    import torch

    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return torch.get_num_threads()
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
