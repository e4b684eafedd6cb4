"""Random-weight Hugging Face checkpoints of real model shapes, for benchmarks.

Written with transformers' `save_pretrained`, so the engine and HF load identical files. The
tokenizer is the tests' byte-level BPE trained on the fly (tests/support/tiny_models.py), topped up with
added pseudo-word tokens to the model's vocabulary size: every id a random model samples then
detokenizes to real text in the service, as with a real checkpoint.

`ensure_checkpoint("qwen2.5-0.5b")` builds once into a cache folder named after the recipe and
returns it; later calls return it at once.

    python -m bench.checkpoints tiny small              # build (or find) and print the paths
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.shapes import SHAPES, Shape

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROOT = Path(os.environ.get("SLUICE_BENCH_CACHE", "~/.cache/sluice/bench")).expanduser()
RECIPE_VERSION = 1  # bump when the way checkpoints are written changes

__all__ = ["SHAPES", "Shape", "ensure_checkpoint"]


def ensure_checkpoint(
    name: str, root: Path = DEFAULT_ROOT, dtype: str = "float32", device: str = "cpu"
) -> Path:
    """The checkpoint directory of shape `name` in `dtype`, built on first use.

    `device` only says where the random weights are drawn (cuda is much faster for 8B); the
    files are the same either way for a given seed and device type.
    """
    shape = SHAPES[name]
    recipe = json.dumps([RECIPE_VERSION, shape.arch, shape.config, dtype], sort_keys=True)
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:10]
    directory = root / f"{name}-{dtype}-{digest}"
    if (directory / "DONE").is_file():
        return directory
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".{directory.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    write_checkpoint(partial, shape, dtype, device)
    (partial / "DONE").write_text(recipe)
    try:
        partial.rename(directory)
    except OSError:  # another process finished the same checkpoint first
        shutil.rmtree(partial, ignore_errors=True)
    return directory


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="built if missing")
    p.add_argument("--model", type=Path, help="a checkpoint directory (overrides --shape)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")


def resolve_model(args: argparse.Namespace) -> tuple[Path, str]:
    """(checkpoint directory, dtype name) for the model flags."""
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.model is not None:
        return args.model, dtype
    return ensure_checkpoint(args.shape, dtype=dtype, device=args.device), dtype


def write_checkpoint(
    directory: Path, shape: Shape, dtype: str = "float32", device: str = "cpu", seed: int = 0
) -> Path:
    """Write config.json, safetensors, generation_config.json and tokenizer.json."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    directory.mkdir(parents=True, exist_ok=True)
    tok = tiny_models().make_tokenizer()
    _fill_vocabulary(tok, shape.vocab_size)
    tok.save(str(directory / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )
    classes: dict[str, tuple[Any, Any]] = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }
    config_class, model_class = classes[shape.arch]
    config = config_class(bos_token_id=bos, eos_token_id=eos, **shape.config)
    torch.manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    with torch.device(device):
        model = model_class._from_config(config, dtype=torch_dtype)
    model.eval().save_pretrained(directory)
    del model
    return directory


@functools.cache
def tiny_models() -> Any:
    """tests/support/tiny_models.py, loaded by path: `tests` is not a package, and the name may be
    taken by a stray site-packages `tests` on other machines."""
    spec = importlib.util.spec_from_file_location(
        "tiny_models", REPO / "tests" / "support" / "tiny_models.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fill_vocabulary(tok: Any, vocab_size: int) -> None:
    """Add pseudo-word tokens until the tokenizer covers every id of the model's vocabulary."""
    have = tok.get_vocab_size()
    if have > vocab_size:
        raise ValueError(f"the tokenizer has {have} tokens, more than vocab_size={vocab_size}")
    if have == vocab_size:
        return
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    known = set(tok.get_vocab())
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < vocab_size - have:
        word = "".join(rng.choice(syllables) for _ in range(rng.randint(2, 5)))
        if word not in seen and word not in known:
            seen.add(word)
            words.append(word)
    tok.add_tokens(words)
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="where random weights are drawn")
    args = parser.parse_args(argv)
    for name in args.shapes:
        start = time.perf_counter()
        path = ensure_checkpoint(name, args.root, args.dtype, args.device)
        print(f"{name}: {path} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
