"""Tiny random PEFT LoRA adapters, made and run by peft itself: the reference for the engine's.

`make_adapter` wraps a tiny checkpoint's Hugging Face model with `get_peft_model` and saves the
adapter with `save_pretrained`, as a trainer would. peft initialises B to zero (the adapter
would change nothing), so every A and B is drawn from a seeded generator first.
`peft_greedy` is the reference: peft's model on HF, an argmax loop over whole sequences.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.tiny_models import load_hf_model

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def make_adapter(
    checkpoint: Path,
    directory: Path,
    r: int,
    targets: tuple[str, ...] = ATTENTION + MLP,
    alpha: float = 16,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.2,
) -> Path:
    """Write a random rank-`r` adapter of `checkpoint` for `targets` into `directory`."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora)
    model = get_peft_model(load_hf_model(checkpoint), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(directory)
    return Path(directory)


def peft_model(checkpoint: Path, adapter: Path | None) -> Any:
    """peft's model of `adapter` on the checkpoint's HF model (the HF model alone for None)."""
    from peft import PeftModel

    base = load_hf_model(checkpoint)
    return base if adapter is None else PeftModel.from_pretrained(base, adapter).eval()


def peft_greedy(model: Any, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """`new_tokens` greedy ids (no EOS stops them) and each one's log-probability, by an argmax
    loop over the whole sequence (no KV cache)."""
    import torch

    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            lp = logits.log_softmax(-1)
            token = int(lp.argmax())
            ids.append(token)
            logprobs.append(float(lp[token]))
    return ids[len(prompt) :], logprobs
