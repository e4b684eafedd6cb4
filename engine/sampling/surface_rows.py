"""Each request's sampling surface as arrays, built once per request, and a step's tensors.

What does not change while a request runs (its allowed ids; logit_bias, bad_token_ids and
one-token bad words as (id, value) pairs, bans valued -inf) is a `RowSurface` made when its
sampling slot is filled (engine/sampling/sampling_slots.py). A step adds what depends on the
tokens: the last id of each longer bad word whose other ids end the output, then pads the
rows into the SamplingBatch's tensors (engine/sampling/surface.py applies them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.protocol.messages import SamplingParams
from engine.scheduling.request import Request

NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class RowSurface:
    allowed: np.ndarray  # int64 ids; empty: every token
    bias_ids: np.ndarray  # int64
    bias_values: np.ndarray  # float32, -inf for a ban
    words: tuple[tuple[int, ...], ...]  # bad words of two or more ids, matched per step


def row_surface(params: SamplingParams) -> RowSurface | None:
    """A request's surface, or None when it has none."""
    if not params.has_surface:
        return None
    bans = list(params.bad_token_ids) + [w[0] for w in params.bad_word_ids if len(w) == 1]
    ids = list(params.logit_bias) + bans
    values = list(params.logit_bias.values()) + [float("-inf")] * len(bans)
    return RowSurface(
        allowed=np.array(params.allowed_token_ids, dtype=np.int64),
        bias_ids=np.array(ids, dtype=np.int64),
        bias_values=np.array(values, dtype=np.float32),
        words=tuple(w for w in params.bad_word_ids if len(w) > 1),
    )


def has_long_bad_words(req: Request) -> bool:
    """The request bans by what its output ends with: the sampler reads its tokens."""
    return any(len(w) > 1 for w in req.params.bad_word_ids)


def banned_by_words(req: Request, words: tuple[tuple[int, ...], ...]) -> list[int]:
    """The last id of each word whose other ids end the request's output (vLLM's rule)."""
    output = req.token_ids[req.prompt_len :]
    banned = []
    for word in words:
        prefix = len(word) - 1
        if len(output) >= prefix and tuple(output[len(output) - prefix :]) == word[:-1]:
            banned.append(word[-1])
    return banned


def surface_tensors(
    reqs: Sequence[Request],
    surfaces: Sequence[RowSurface | None],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, ...]:
    """(allowed_ids, allowed_rows, bias_ids, bias_values) of a step, None where no row has any:
    ids padded with vocab_size (no token), values with 0."""
    allowed = [s.allowed if s is not None else NO_IDS for s in surfaces]
    ids, values = [], []
    for req, s in zip(reqs, surfaces, strict=True):
        if s is None:
            ids.append(NO_IDS)
            values.append(np.zeros(0, dtype=np.float32))
            continue
        row_ids, row_values = s.bias_ids, s.bias_values
        if s.words and (extra := banned_by_words(req, s.words)):
            row_ids = np.concatenate([row_ids, np.array(extra, dtype=np.int64)])
            row_values = np.concatenate([row_values, np.full(len(extra), -np.inf, np.float32)])
        ids.append(row_ids)
        values.append(row_values)
    out: list[torch.Tensor | None] = [None] * 4
    if any(len(a) for a in allowed):
        out[0] = _to_device(_padded(allowed, vocab_size, np.int64), device)
        rows_with = np.array([len(a) > 0 for a in allowed], dtype=np.bool_)
        out[1] = _to_device(rows_with, device)
    if any(len(i) for i in ids):
        out[2] = _to_device(_padded(ids, vocab_size, np.int64), device)
        out[3] = _to_device(_padded(values, 0.0, np.float32), device)
    return tuple(out)


def _padded(rows: list[np.ndarray], pad: float, dtype: type) -> np.ndarray:
    width = max(1, max(len(r) for r in rows))
    padded: np.ndarray = np.full((len(rows), width), pad, dtype=dtype)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    return padded


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=False)
