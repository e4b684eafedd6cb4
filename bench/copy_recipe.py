"""Train a variant of the demo's copy model and measure whether it copies, without the engine.

Builds a checkpoint exactly as `ensure_demo_checkpoint(size="copy")` does (build_demo_checkpoint
on the demo corpus), from COPY_RECIPE with the flags' changes, into `--out` (kept: then
`python -m bench.speculative --model DIR` measures it through the engine) or a temporary
directory. Then, per task of bench/speculative.py (greedy, `--prompts` prompts, `--max-tokens`
tokens each, from the same passages as the bench), prompt lookup's hit rate on the outputs
(`lookup_rate`: whether the model copies, whatever a proposer does), and the mean loss on
`--windows` random windows of the demo's own training stream (`corpus_loss`: whether its text
is still the corpus's); `--compare DIR` adds the same figures for another checkpoint (the demo).

    python -m bench.copy_recipe --steps 2000 --share 0.5 --scrambled 0.5 --heads 4 \
        --compare ~/.cache/sluice/demo-<hash>

`--measure-only DIR` measures a built checkpoint (the cached copy model) without training.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit, log, set_threads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, help="default: COPY_RECIPE's")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--share", type=float, help="copy units' share of the training stream")
    p.add_argument("--min-words", type=int)
    p.add_argument("--max-words", type=int)
    p.add_argument("--min-repeats", type=int)
    p.add_argument("--max-repeats", type=int)
    p.add_argument("--scrambled", type=float, help="share of units of random distinct words")
    p.add_argument("--replaced", type=float, help="share of a running-text span's words replaced")
    p.add_argument("--corpus-copies", type=int, help="the corpus tiled: that many times the units")
    p.add_argument("--out", type=Path, help="keep the checkpoint here (a new directory)")
    p.add_argument("--compare", type=Path, nargs="*", default=[], help="checkpoints beside it")
    p.add_argument("--measure-only", type=Path, help="measure this checkpoint; train nothing")
    p.add_argument("--prompts", type=int, default=12, help="per task")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--passage-words", type=int, default=24)
    p.add_argument("--cue-words", type=int, default=4)
    p.add_argument("--windows", type=int, default=64)
    return p.parse_args(argv)


def recipe(args: argparse.Namespace) -> Any:
    """COPY_RECIPE with the flags given."""
    from engine.demo.checkpoint import COPY_RECIPE

    assert COPY_RECIPE.copy is not None
    units = {
        "share": args.share,
        "min_words": args.min_words,
        "max_words": args.max_words,
        "min_repeats": args.min_repeats,
        "max_repeats": args.max_repeats,
        "scrambled": args.scrambled,
        "replaced": args.replaced,
        "corpus_copies": args.corpus_copies,
    }
    shape = {"steps": args.steps, "lr": args.lr, "num_layers": args.layers}
    shape["batch_size"] = args.batch_size
    shape["num_heads"] = args.heads
    copy = dataclasses.replace(
        COPY_RECIPE.copy, **{k: v for k, v in units.items() if v is not None}
    )
    changed = {k: v for k, v in shape.items() if v is not None}
    return dataclasses.replace(COPY_RECIPE, copy=copy, **changed)


def evaluate(directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Prompt lookup's hit rate on greedy outputs per task, and the loss on corpus windows."""
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer

    from bench.speculative_prompts import TASKS, passages, prompt_text
    from bench.speculative_prompts import lookup_rate as hit_rate
    from engine.attention.torch_ref import TorchRefAttention
    from engine.demo.checkpoint import RECIPE, load_corpus, training_stream
    from engine.models.hf_config import load_model_config
    from engine.models.llama import LlamaForCausalLM
    from engine.protocol.config import EngineConfig
    from engine.weights.loading import load_weights

    cfg = load_model_config(directory)
    model = LlamaForCausalLM(cfg, TorchRefAttention(scale=cfg.head_dim**-0.5))
    load_weights(model, directory)
    model.eval()
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    lookup = (EngineConfig().ngram_min, EngineConfig().ngram_max)  # ngram's defaults
    result: dict[str, Any] = {"model": directory.name}
    chosen = passages(args.passage_words)[: args.prompts]
    with torch.no_grad():
        for task in TASKS:
            rates = []
            for passage in chosen:
                prompt = tokenizer.encode(prompt_text(task, passage, args.cue_words)).ids
                output = _greedy(model, prompt, args.max_tokens, cfg.max_model_len)
                rates.append(hit_rate(prompt, output, *lookup))
            result[f"{task}_lookup_rate"] = sum(rates) / len(rates)
        stream = training_stream(tokenizer, load_corpus(), RECIPE)  # the corpus alone
        context = RECIPE.context
        starts = torch.randint(
            len(stream) - context, (args.windows,), generator=torch.Generator().manual_seed(1)
        )
        batch = torch.stack([stream[s : s + context + 1] for s in starts.tolist()])
        logits = model.dense_forward(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        result["corpus_loss"] = loss.item()
        sample = tokenizer.encode(prompt_text("copy", chosen[0], args.cue_words)).ids
        result["copy_sample"] = tokenizer.decode(_greedy(model, sample, 24, cfg.max_model_len))
    return result


def _greedy(model: Any, prompt: list[int], count: int, context: int) -> list[int]:
    import torch

    seq = list(prompt)
    for _ in range(count):
        logits = model.dense_forward(torch.tensor([seq[-context:]]))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(1)  # as the demo's build does
    from engine.demo.checkpoint import build_demo_checkpoint, load_corpus

    chosen = recipe(args)
    if args.measure_only is not None:
        rows = [evaluate(directory, args) for directory in [args.measure_only, *args.compare]]
        return _report(rows, args, None)  # no recipe: the checkpoints say what they are
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch) / "copy"
        out.mkdir(parents=True)
        started = time.process_time()
        build_demo_checkpoint(chosen, load_corpus(), out)
        cpu_seconds = time.process_time() - started
        log(f"copy recipe: built in {cpu_seconds:.0f} CPU-s: {out}")
        rows = [{**evaluate(out, args), "build_cpu_seconds": cpu_seconds}]
    rows += [evaluate(directory, args) for directory in args.compare]
    return _report(rows, args, chosen)


def _report(rows: list[dict[str, Any]], args: argparse.Namespace, chosen: Any) -> int:
    result = {
        "benchmark": "copy_recipe",
        "recipe": dataclasses.asdict(chosen) if chosen is not None else None,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "results": rows,
    }
    keys = ["model", "copy_lookup_rate", "free_lookup_rate", "corpus_loss"]
    emit(
        result,
        ["model", "copy lookup", "free lookup", "corpus loss"],
        [[row[k] for k in keys] for row in rows],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
