"""bench/step/verify_cost.py at a tiny size: the oracle's proposals are all kept, the tokens equal
the run without speculation, and each (batch, proposals) cell is reported against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.step.verify_cost as verify_cost
from tests.support.tiny_models import make_checkpoint


def test_the_oracle_runs_give_the_baselines_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_checkpoint(tmp_path / "tiny", "llama")
    argv = ["--model", str(model), "--batches", "1", "3", "--proposals", "2", "--max-tokens", "9"]
    assert verify_cost.main([*argv, "--repeat", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    cells = [(r["batch"], r["proposals"]) for r in result["records"]]
    assert cells == [(1, 0), (1, 2), (3, 0), (3, 2)]
    assert all(r["same_tokens"] and r["cpu_ms_per_token"] > 0 for r in result["records"])
    assert all(r["ratio_to_off"] == 1.0 for r in result["records"] if r["proposals"] == 0)
