"""An adapter's `adapter_config.json`: read safely, parsed strictly, and checked before any of
it reaches the engine's arithmetic.

The one place every adapter config passes: the service checks a directory's config and a
streamed one before it sends the load (service/engine_link/adapter_link.py,
service/rpc/adapter_stream.py), and the engine checks it again when it reads the directory
(engine/lora/adapter_file.py), so a file changed in between is caught too.

Reading (`read_config_bytes`): only a regular file (a symlink to one is followed), at most
MAX_CONFIG_BYTES; a FIFO, a device (/dev/zero) or a directory is refused after `fstat`, before
any byte is read, and the open never blocks (O_NONBLOCK: a FIFO without a writer).

Parsing (`parse_config`): JSON whose numbers are all finite and whose integers have at most
MAX_INT_DIGITS digits; Python's json accepts NaN, Infinity, 1e400 (inf) and 10**400, which
would reach the engine as a non-finite or overflowing scaling. Each number out of range is
named by its path (`lora_alpha`, `alpha_pattern.q_proj`, `layers_to_transform[2]`).

Checking (`check_config`): the fields the engine computes with, against peft 0.21's LoraConfig:
`r` an integer in [1, max_rank]; `lora_alpha` a number with |alpha| <= MAX_LORA_ALPHA and the
scaling (alpha / r, or alpha / sqrt(r) with `use_rslora`) within MAX_SCALING; `lora_dropout`
in [0, 1] (unused at inference, but peft refuses others); the boolean switches booleans (a
string "false" is truthy). What the engine does not compute is refused by name as before.
Every failure is a ValueError whose message starts with the field's name.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 65536  # a real config is about 1 KB
MAX_INT_DIGITS = 15  # every integer a config holds (ranks, layer indices, token ids) is far less
MAX_LORA_ALPHA = 1e6  # real ones are 1 to a few thousand
MAX_SCALING = 1e4  # alpha / r: real ones are 0.1 to a few hundred
# adapter_config.json keys whose non-default values change the arithmetic: refused.
UNSUPPORTED = ("use_dora", "lora_bias", "fan_in_fan_out", "rank_pattern", "alpha_pattern")
# Switches that must be JSON booleans when present: `if config.get(key)` reads a string as on.
BOOLEANS = ("use_rslora", "use_dora", "lora_bias", "fan_in_fan_out", "inference_mode")


@dataclass(frozen=True)
class _OutOfRange:
    """A number the parse hooks kept out of the result, to be named by its path."""

    text: str


def read_config_bytes(directory: str | Path) -> bytes:
    """The bytes of `directory`/adapter_config.json. FileNotFoundError when it is absent;
    ValueError (naming the file) when it is not a regular file or exceeds MAX_CONFIG_BYTES;
    other OSErrors as the system says."""
    path = Path(directory) / CONFIG_FILE
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{CONFIG_FILE}: not a regular file ({_kind(mode)})")
        chunks, left = [], MAX_CONFIG_BYTES + 1  # one byte more tells a file too large
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    if left <= 0:
        raise ValueError(f"{CONFIG_FILE}: larger than {MAX_CONFIG_BYTES} bytes")
    return b"".join(chunks)


def parse_config(text: str | bytes) -> dict[str, object]:
    """The config object of `text`; ValueError when it is not a JSON object or holds a number
    that is not finite or has more than MAX_INT_DIGITS digits (named by its path)."""
    try:
        config = json.loads(
            text,
            parse_constant=_OutOfRange,  # NaN, Infinity, -Infinity
            parse_float=_finite_float,
            parse_int=_bounded_int,
        )
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{CONFIG_FILE}: is not JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{CONFIG_FILE}: nested too deeply") from None
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE}: is not a JSON object")
    _refuse_out_of_range(config)
    return config


def check_config(config: dict[str, object], max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling (peft's LoraLayer.update_layer: alpha / r, or
    alpha / sqrt(r) with rsLoRA); ValueError naming the first field the engine cannot serve."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type: {config['peft_type']!r} is not LORA")
    for key in BOOLEANS:
        if key in config and not isinstance(config[key], bool):
            raise ValueError(f"{key}: {config[key]!r} is not a boolean")
    for key in UNSUPPORTED:
        if config.get(key):
            raise ValueError(f"{key}: {_short(config[key])} is not supported")
    if config.get("modules_to_save"):
        raise ValueError(f"modules_to_save: {_short(config['modules_to_save'])} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"bias: {_short(config['bias'])} is not supported (only 'none')")
    dropout = config.get("lora_dropout", 0.0)
    if not _is_number(dropout) or not 0 <= dropout <= 1:  # type: ignore[operator]
        raise ValueError(f"lora_dropout: {dropout!r} is not a number in [0, 1]")
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)  # peft's LoraConfig defaults
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"r: {_short(r)} is not a positive integer")
    if r > max_rank:
        raise ValueError(f"r: rank {r} is above max_lora_rank={max_rank}")
    if not _is_number(alpha):
        raise ValueError(f"lora_alpha: {_short(alpha)} is not a number")
    assert isinstance(alpha, int | float)
    if abs(alpha) > MAX_LORA_ALPHA:
        raise ValueError(
            f"lora_alpha: {alpha!r} is out of range (|lora_alpha| <= {MAX_LORA_ALPHA:g})"
        )
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    if abs(scaling) > MAX_SCALING:
        raise ValueError(
            f"lora_alpha: {alpha!r} with r={r} scales by {scaling:g}, out of range "
            f"(|scaling| <= {MAX_SCALING:g})"
        )
    return r, float(scaling)


def _finite_float(text: str) -> float | _OutOfRange:
    value = float(text)
    return value if math.isfinite(value) else _OutOfRange(text)


def _bounded_int(text: str) -> int | _OutOfRange:
    # NOTE: the digits are counted before int() converts them: 10**400 is never built.
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _OutOfRange(text)


def _refuse_out_of_range(config: dict[str, object]) -> None:
    """ValueError naming the first number the parse hooks kept out (walked without recursion:
    the parser accepts nesting as deep as the interpreter's recursion limit)."""
    stack: list[tuple[str, object]] = [("", config)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, _OutOfRange):
            text = (
                value.text
                if len(value.text) <= 24
                else f"{value.text[:20]}... ({len(value.text)} characters)"
            )
            raise ValueError(
                f"{where or CONFIG_FILE}: {text} is out of range (numbers must be finite, "
                f"integers at most {MAX_INT_DIGITS} digits)"
            )
        if isinstance(value, dict):
            items = [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        stack.extend(reversed(items))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a plain file"
