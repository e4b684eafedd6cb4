"""The Hugging Face reference of the benchmarks: a decode loop over the model's forward, KV cached.

`generate(min_new_tokens=n)` cannot stand in for an engine under `ignore_eos`: it masks EOS out
of the logits, so where the engine picks EOS it picks the next best token, and its timing
includes that mask. This loop calls the forward itself (prefill once, then one token per step
through `past_key_values`) and picks from the raw logits: greedy argmax at temperature 0, else
a draw from softmax(logits / temperature) with no top-k or top-p, as the benchmarks' engines do.

Prompts run as one left-padded batch, positions counted from each row's first real token, as
HF generate does; every row decodes `new_tokens` steps.
"""

from __future__ import annotations

from typing import Any


def decode_loop(
    model: Any,
    prompts: list[list[int]],
    new_tokens: int,
    temperature: float = 0.0,
    pad_id: int = 0,
    generator: Any = None,
) -> list[list[int]]:
    """Each prompt's `new_tokens` next ids, all prompts in one left-padded batch."""
    import torch

    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    # NOTE: as HF generate numbers them; pad positions get 0 (they are masked out anyway).
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    picked: list[Any] = []
    cache = None
    with torch.inference_mode():
        for _ in range(new_tokens):
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()  # [batch, vocab]
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                ids = torch.multinomial(probs, 1, generator=generator)  # [batch, 1]
            else:
                ids = logits.argmax(dim=-1, keepdim=True)  # [batch, 1]
            picked.append(ids)
            mask = torch.cat([mask, mask.new_ones((len(prompts), 1))], dim=-1)
            positions = positions[:, -1:] + 1
    if not picked:
        return [[] for _ in prompts]
    return torch.cat(picked, dim=-1).tolist()


def load_model(model_dir: Any, dtype: str = "float32", device: str = "cpu") -> Any:
    """The checkpoint as an HF model in eval mode, transformers' logging quiet."""
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)
    )
    return model.to(device).eval()


def token_identity(engine: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """How many sequences are token for token the same, and where the others first differ."""
    diverged = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(engine, reference, strict=True)
        if x != y
    ]
    return {
        "identical": len(engine) - len(diverged),
        "of": len(engine),
        "first_divergence": sorted(diverged),  # token index, one per differing sequence
    }
