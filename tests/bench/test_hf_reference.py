"""The HF reference of the benchmarks (bench/hf_reference.py) and bench/throughput/offline.py's use of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.hf_reference import decode_loop, token_identity
from bench.throughput import offline
from tests.support.tiny_models import load_hf_model

PROMPTS = [[0, 5, 9, 33, 7], [0, 100], [0, 17, 250, 3, 3, 3, 80, 41, 12]]  # left padding needed


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def test_decode_loop_is_hf_greedy_generate_with_eos_out_of_play(tiny_llama: Path) -> None:
    model = load_hf_model(tiny_llama)
    ids, mask = left_padded(PROMPTS)
    expected = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,  # nothing stops or masks: the plain argmax of every step
        pad_token_id=0,
    )[:, ids.shape[1] :].tolist()
    assert decode_loop(model, PROMPTS, 12, pad_id=0) == expected


def test_decode_loop_of_one_prompt_is_the_same_in_a_padded_batch(tiny_llama: Path) -> None:
    model = load_hf_model(tiny_llama)
    alone = [decode_loop(model, [p], 10)[0] for p in PROMPTS]
    assert decode_loop(model, PROMPTS, 10) == alone


def test_token_identity_counts_sequences_and_where_they_diverge() -> None:
    same, other = [[1, 2, 3], [4, 5], [6, 7, 8]], [[1, 2, 3], [4, 9], [0, 7, 8]]
    assert token_identity(same, same) == {"identical": 3, "of": 3, "first_divergence": []}
    assert token_identity(same, other) == {"identical": 1, "of": 3, "first_divergence": [0, 1]}


def test_offline_keeps_its_fields_and_counts_greedy_identity_with_hf(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE: main() points the process's logging at sys.stderr, here this test's captured
    # stream: left in place, every later test's log line would hit the closed stream.
    monkeypatch.setattr("engine.logs.configure_logging", lambda *args, **kwargs: None)
    argv = ["--model", str(tiny_llama), "--num-requests", "4", "--scale", "0.02",
            "--temperature", "0", "--hf-batch-sizes", "4", "--threads", "1"]  # fmt: skip
    assert offline.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    for field in ("engine", "hf", "hf_runs", "all_engine_tokens_per_s", "all_hf_tokens_per_s",
                  "ratio_engine_over_hf", "engine_one_rank", "ratio_ranks_over_one_rank"):  # fmt: skip
        assert field in result
    assert result["hf"]["generated_tokens_with_padding"] >= result["hf"]["output_tokens"]
    identity = {"identical": 4, "of": 4, "first_divergence": []}
    assert result["token_identity_engine_hf"] == {"4": identity}  # JSON keys are strings
