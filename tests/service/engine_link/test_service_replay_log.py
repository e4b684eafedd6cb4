"""ReplayLog.changed: a checkpoint directory rewritten, replaced or removed since its update."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from engine.protocol.messages import DistributedTensors, TensorRef, TensorSpec, UpdateWeights
from service.engine_link.checkpoint_fingerprint import checkpoint_fingerprint
from service.engine_link.replay_log import ReplayLog


def make_checkpoint(directory: Path) -> Path:
    directory.mkdir()
    (directory / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (directory / name).write_bytes(b"\0" * 64)
    return directory


def logged(directory: Path) -> ReplayLog:
    replay_log = ReplayLog()
    update = UpdateWeights("u1", 0, checkpoint_dir=str(directory))
    replay_log.record(update, 1, checkpoint_fingerprint(str(directory)))
    return replay_log


def later(path: Path) -> None:
    """Rewritten a second later (the same size): only its modification time tells."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def test_an_unchanged_directory_replays_also_after_inline_updates(tmp_path: Path) -> None:
    replay_log = logged(make_checkpoint(tmp_path / "ckpt"))
    ref = TensorRef("w", "F32", (1,), 0, 4)
    replay_log.record(UpdateWeights("u2", 0, tensor_file="/nowhere", tensors=(ref,)), 2)
    assert replay_log.changed() is None


@pytest.mark.parametrize("change", ["a shard rewritten", "the index edited", "a shard added"])
def test_a_changed_directory_is_reported_with_its_version(tmp_path: Path, change: str) -> None:
    directory = make_checkpoint(tmp_path / "ckpt")
    replay_log = logged(directory)
    match change:
        case "a shard rewritten":
            later(directory / "model-00002-of-00002.safetensors")
        case "the index edited":
            (directory / "model.safetensors.index.json").write_text('{"weight_map": {"x": 1}}')
        case "a shard added":
            (directory / "model-00003-of-00003.safetensors").write_bytes(b"\0")
    changed = replay_log.changed()
    assert changed is not None and changed.checkpoint_dir == str(directory)
    assert changed.policy_version == 1


def test_a_removed_directory_is_reported(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path / "ckpt")
    replay_log = logged(directory)
    shutil.rmtree(directory)
    assert replay_log.changed() is not None


def test_a_later_checkpoint_update_takes_its_own_fingerprint(tmp_path: Path) -> None:
    first = make_checkpoint(tmp_path / "a")
    replay_log = logged(first)
    later(first / "model-00001-of-00002.safetensors")
    second = make_checkpoint(tmp_path / "b")
    update = UpdateWeights("u2", 0, checkpoint_dir=str(second))
    replay_log.record(update, 2, checkpoint_fingerprint(str(second)))
    assert replay_log.changed() is None
    replay_log.clear()
    assert replay_log.changed() is None


def test_a_distributed_update_makes_the_log_unreplayable_until_one_replaces_every_tensor() -> None:
    replay_log = ReplayLog()
    spec = TensorSpec("w", "F32", (1,))
    replay_log.record(UpdateWeights("d", 0, distributed=DistributedTensors((spec,), 64)), 1)
    ref = TensorRef("w", "F32", (1,), 0, 4)
    replay_log.record(UpdateWeights("i", 0, tensor_file="/nowhere", tensors=(ref,)), 2)
    assert not replay_log.replayable and replay_log.policy_version == 2
    whole = UpdateWeights("all", 0, tensor_file="/nowhere-too", tensors=(ref,))
    replay_log.record(whole, 3, replaced_all=True)  # supersedes both
    assert replay_log.replayable and [e.update_id for e in replay_log.entries()] == ["all"]
