"""adapter_config.json checked before anything computes with it: every number finite and
bounded (Python's json reads NaN, Infinity, 1e400 and 10**400 without complaint), the fields
peft's LoraConfig defines and the engine uses in range, named on refusal; read only from a
regular file of bounded size, never blocking on a FIFO nor reading a device."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from engine.protocol.validation.adapter_config import (
    MAX_CONFIG_BYTES,
    check_config,
    parse_config,
    read_config_bytes,
)


def checked(text: str, max_rank: int = 64) -> tuple[int, float]:
    return check_config(parse_config(text), max_rank)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"lora_alpha": NaN}', "lora_alpha"),
        ('{"lora_alpha": Infinity}', "lora_alpha"),
        ('{"lora_alpha": -Infinity}', "lora_alpha"),
        ('{"lora_alpha": 1e400}', "lora_alpha"),
        ('{"lora_alpha": 1' + "0" * 400 + "}", "lora_alpha"),
        ('{"r": 8' + "0" * 30 + "}", "r"),
        ('{"alpha_pattern": {"q_proj": NaN}}', "alpha_pattern.q_proj"),
        ('{"layers_to_transform": [0, 1, 1e999]}', "layers_to_transform[2]"),
    ],
)
def test_a_number_python_reads_but_the_engine_cannot_serve_is_refused_by_its_path(
    text: str, field: str
) -> None:
    python = json.loads(text)  # the reference: Python's json takes every one of them
    assert python
    with pytest.raises(ValueError) as refused:
        parse_config(text)
    assert str(refused.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"lora_alpha": 1e308}, "lora_alpha: 1e[+]308 is out of range"),
        ({"lora_alpha": 1e5, "r": 1}, "lora_alpha: 100000.0 with r=1 scales by 100000"),
        ({"r": 0}, "r: 0 is not a positive integer"),
        ({"r": 8.0}, "r: 8.0 is not a positive integer"),
        ({"r": True}, "r: True is not a positive integer"),
        ({"r": 128}, "r: rank 128 is above max_lora_rank=64"),
        ({"lora_alpha": "16"}, "lora_alpha: '16' is not a number"),
        ({"lora_dropout": 1.5}, r"lora_dropout: 1.5 is not a number in \[0, 1\]"),
        ({"lora_dropout": -0.1}, r"lora_dropout: -0.1 is not a number in \[0, 1\]"),
        ({"use_rslora": "false"}, "use_rslora: 'false' is not a boolean"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern: .* is not supported"),
    ],
)
def test_a_field_out_of_range_is_refused_naming_it(config: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        checked(json.dumps(config))


def test_a_config_peft_saves_gives_peft_scaling(tmp_path: Path) -> None:
    """peft's own files pass, with peft's scaling (LoraLayer.update_layer): alpha / r, or
    alpha / sqrt(r) with rsLoRA."""
    from peft import LoraConfig

    for r, alpha, rslora in ((8, 16, False), (4, 8, True), (16, 32.5, False)):
        directory = tmp_path / f"{r}-{alpha}-{rslora}"
        LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, lora_dropout=0.05).save_pretrained(
            directory
        )
        rank, scaling = check_config(parse_config(read_config_bytes(directory)), max_rank=64)
        assert rank == r
        assert scaling == pytest.approx(alpha / (math.sqrt(r) if rslora else r))


def test_nesting_past_the_parsers_depth_is_refused_not_raised(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_config('{"a": ' * 100_000 + "1" + "}" * 100_000)


@pytest.mark.timeout(10)
def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "adapter_config.json")  # no writer: a plain open would block forever
    with pytest.raises(ValueError, match=r"adapter_config\.json: not a regular file \(a FIFO\)"):
        read_config_bytes(tmp_path)


@pytest.mark.timeout(10)
def test_a_link_to_dev_zero_is_refused_before_reading(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=r"not a regular file \(a character device\)"):
        read_config_bytes(tmp_path)


def test_a_file_past_the_cap_is_refused_and_a_link_to_a_regular_file_is_read(
    tmp_path: Path,
) -> None:
    (tmp_path / "real.json").write_text('{"r": 8}')
    (tmp_path / "adapter_config.json").symlink_to(tmp_path / "real.json")
    assert read_config_bytes(tmp_path) == b'{"r": 8}'
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_bytes(b" " * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ValueError, match=f"larger than {MAX_CONFIG_BYTES} bytes"):
        read_config_bytes(big)
    with pytest.raises(FileNotFoundError):
        read_config_bytes(tmp_path / "nowhere")
