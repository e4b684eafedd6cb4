"""The built-in demo model (`--model demo`): a small Llama trained on the CPU on first use.

The first call trains a byte-level BPE tokenizer and a 4-layer Llama on `demo_corpus.txt`
(public-domain English: Genesis 1-3 and other King James passages, the Declaration of
Independence, Lincoln, Aesop, Alice, Grimm, poems and novel openings) and writes an ordinary
Hugging Face checkpoint into the cache; every later call returns that directory at once. The
server then loads it through exactly the same code as any downloaded checkpoint.

Its chat template (`chat_template.jinja`, written beside the tokenizer as transformers writes
it) makes `sluice chat` work against it: each turn a "Role: text" paragraph.

`ensure_demo_checkpoint(size="draft")` builds the demo's draft model the same way, beside it:
a smaller Llama on the same corpus with the same tokenizer, for speculative decoding's `draft`
method (`--speculative-draft-model`; bench/speculative.py). `size="copy"` builds the demo's
copy model: the demo's shape and tokenizer, trained longer on copy units (copy_units.py) and
the corpus, so that it repeats a passage in its prompt as real LLMs do; bench/speculative.py
measures prompt lookup's proposals on it. Neither is built unless asked for.

The build is deterministic (fixed seed, fixed step count) and takes about 80 s on two idle CPU
cores, far longer when other processes keep them busy (docs/architecture.md, "The demo model").
The directory name carries a hash of the recipe, the corpus and the chat template, so a changed
recipe builds anew beside the old one instead of reusing stale weights.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import json
import logging
import math
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.attention.torch_ref import TorchRefAttention
from engine.demo.copy_units import copy_units
from engine.demo.recipe import COPY_RECIPE, DRAFT_RECIPE, RECIPE, SIZES, DemoRecipe
from engine.models.hf_config import parse_model_config
from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger("engine.demo")  # its name before it moved into engine/demo/

BOS, EOS = "<s>", "</s>"
BYTE_LEVEL_SPACE = "\u0120"  # how byte-level BPE spells " "
LOG_EVERY_S = 5.0


def ensure_demo_checkpoint(
    cache_root: Path | None = None, train_steps: int | None = None, size: str = "demo"
) -> Path:
    """Return the directory of the demo checkpoint, building it on first use.

    cache_root None = ~/.cache/sluice. The directory name includes a hash of the recipe
    (corpus + hyperparameters), so a changed recipe builds anew. Safe when several processes
    call it at once (file lock; build into a temp dir, then atomic rename). train_steps overrides
    the recipe's step count (tests use a handful of steps; the result then goes to a differently
    named directory). size "draft" is the demo's draft model (DRAFT_RECIPE), "copy" its copy
    model (COPY_RECIPE), each cached beside it.
    """
    base = _recipe(size)
    recipe = base if train_steps is None else dataclasses.replace(base, steps=train_steps)
    return _ensure(recipe, cache_root, size)


def cached_demo_checkpoint(cache_root: Path | None = None, size: str = "demo") -> Path | None:
    """The directory of the demo checkpoint (or of another size) if it is already built, else
    None; builds nothing."""
    final = _final_dir(_recipe(size), cache_root, load_corpus(), size)
    return final if final.is_dir() else None


def _recipe(size: str) -> DemoRecipe:
    """The recipe of a size, looked up when called (tests replace RECIPE)."""
    if size not in SIZES:
        raise ValueError(f"size: expected one of {SIZES}, got {size!r}")
    return {"demo": RECIPE, "draft": DRAFT_RECIPE, "copy": COPY_RECIPE}[size]


def _final_dir(recipe: DemoRecipe, cache_root: Path | None, corpus: str, size: str) -> Path:
    """Named by everything the build writes: a changed template builds anew, as a changed
    recipe does (a cache built before the template existed is not reused)."""
    root = Path(cache_root) if cache_root is not None else Path.home() / ".cache" / "sluice"
    prefix = "demo" if size == "demo" else f"demo-{size}"
    return root / f"{prefix}-{recipe.fingerprint(corpus, load_chat_template())}"


def _ensure(recipe: DemoRecipe, cache_root: Path | None, size: str) -> Path:
    corpus = load_corpus()
    final = _final_dir(recipe, cache_root, corpus, size)
    root = final.parent
    if final.is_dir():  # NOTE: only a finished build is ever renamed to this name
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f".{final.name}.lock"):
        if final.is_dir():  # another process built it while we waited
            return final
        for leftover in root.glob(f".{final.name}-*"):  # staging of a builder that was killed
            shutil.rmtree(leftover, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            build_demo_checkpoint(recipe, corpus, staging)
            staging.rename(final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return final


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("demo model: another process is building it; waiting (%s)", path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_corpus() -> str:
    return resources.files("engine.demo").joinpath("demo_corpus.txt").read_text(encoding="utf-8")


def load_chat_template() -> str:
    return resources.files("engine.demo").joinpath("chat_template.jinja").read_text("utf-8")


def build_demo_checkpoint(recipe: DemoRecipe, corpus: str, out: Path) -> None:
    """Train the tokenizer and the model and write a Hugging Face checkpoint into `out`."""
    started = time.monotonic()
    logger.info("demo model: building in %s (once; about a minute on two idle CPU cores)", out)
    tokenizer = train_tokenizer(corpus, recipe.vocab_size)
    bos, eos = _token_id(tokenizer, BOS), _token_id(tokenizer, EOS)
    config = _hf_config(recipe, bos, eos)
    stream = training_stream(tokenizer, corpus, recipe)
    logger.info("demo model: corpus %d chars -> %d tokens to train on", len(corpus), len(stream))

    # NOTE: one thread: with two, torch's OpenMP pool slows 10-100x whenever anything else
    # is busy on a 2-core machine (the same weights either way, measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
            torch.manual_seed(recipe.seed)
            model = _train(recipe, config, stream, started)
    finally:
        torch.set_num_threads(threads)

    # Checkpoint names and shapes (q/k/v and gate/up apart); clones, since safetensors
    # refuses tensors that share storage, as the rows of a merged projection do.
    state = {name: t.clone() for name, t in model.checkpoint_tensors().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(load_chat_template(), encoding="utf-8")
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "model_max_length": recipe.context,
            "clean_up_tokenization_spaces": False,
        },
    )
    logger.info("demo model: ready in %.1f s: %s", time.monotonic() - started, out)


def train_tokenizer(corpus: str, vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every UTF-8 string encodes; encode() prepends <s>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(paragraphs(corpus), trainer)
    bos = _token_id(tokenizer, BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tokenizer


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    assert token_id is not None, f"{token!r} is not in the demo vocabulary"
    return token_id


def paragraphs(corpus: str) -> list[str]:
    return [p.strip() for p in corpus.split("\n\n") if p.strip()]


def training_stream(tokenizer: Tokenizer, corpus: str, recipe: DemoRecipe) -> torch.Tensor:
    """What the model trains on, [tokens] int64: the corpus (`copy.corpus_copies` times), then
    the recipe's copy units."""
    stream = _token_stream(tokenizer, corpus, recipe)
    if recipe.copy is None:
        return stream

    def encode(text: str) -> list[int]:  # <s> prepended, as a prompt is served
        return tokenizer.encode(text).ids

    eos = _token_id(tokenizer, EOS)
    stream = stream.repeat(recipe.copy.corpus_copies)
    units = copy_units(recipe.copy, paragraphs(corpus), encode, eos, len(stream), recipe.seed)
    return torch.cat([stream, torch.tensor(units, dtype=torch.long)])


def _token_stream(tokenizer: Tokenizer, corpus: str, recipe: DemoRecipe) -> torch.Tensor:
    """The corpus as `<s> paragraph </s>` units end to end: [tokens] int64.

    Prompts are served with <s> prepended, so a prompt reads as the start of a paragraph, and
    the model ends its paragraph with </s>. (Whole works as units read worse: the model took
    every prompt for a title and broke off a line later.) A few words (`bare_space_rate`) are
    encoded as a bare space and then the word without its space, which is how a prompt ending in
    a space ("The ") arrives: byte-level BPE glues each space to the word after it, so a model
    that never saw a bare space before a word continues such prompts with gibberish.
    """
    pre_tokenizer, bpe = tokenizer.pre_tokenizer, tokenizer.model
    bos, eos, space = (_token_id(tokenizer, t) for t in (BOS, EOS, BYTE_LEVEL_SPACE))
    rng = random.Random(recipe.seed)
    ids: list[int] = []
    for paragraph in paragraphs(corpus):
        ids.append(bos)
        for piece, _ in pre_tokenizer.pre_tokenize_str(paragraph):
            spaced_word = piece.startswith(BYTE_LEVEL_SPACE) and len(piece) > 1
            if spaced_word and rng.random() < recipe.bare_space_rate:
                ids.append(space)
                piece = piece[1:]
            ids.extend(token.id for token in bpe.tokenize(piece))
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def _hf_config(recipe: DemoRecipe, bos: int, eos: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": recipe.vocab_size,
        "hidden_size": recipe.hidden_size,
        "intermediate_size": recipe.intermediate_size,
        "num_hidden_layers": recipe.num_layers,
        "num_attention_heads": recipe.num_heads,
        "num_key_value_heads": recipe.num_heads,
        "head_dim": recipe.hidden_size // recipe.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": recipe.context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": True,
        "initializer_range": recipe.init_std,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _train(
    recipe: DemoRecipe, config: dict[str, Any], stream: torch.Tensor, started: float
) -> LlamaForCausalLM:
    """Next-token prediction on random windows of the stream; deterministic given the seed."""
    cfg = parse_model_config(config, {"eos_token_id": config["eos_token_id"]})
    model = LlamaForCausalLM(cfg, TorchRefAttention(scale=cfg.head_dim**-0.5))
    _init_weights(model, recipe)
    optimizer = _optimizer(model, recipe)
    windows = torch.Generator().manual_seed(recipe.seed)
    progress = _Progress(recipe.steps, started)
    model.train()
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(recipe, step)
        starts = torch.randint(
            len(stream) - recipe.context, (recipe.batch_size,), generator=windows
        )
        batch = torch.stack([stream[s : s + recipe.context + 1] for s in starts.tolist()])
        logits = model.dense_forward(batch[:, :-1])  # [batch, context, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        progress.update(step, loss.item())
    return model.eval()


def _optimizer(model: LlamaForCausalLM, recipe: DemoRecipe) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]  # norm weights: no decay
    groups: list[dict[str, Any]] = [
        {"params": matrices, "weight_decay": recipe.weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, 0.95))


class _Progress:
    """Logs the loss every few seconds; the first server start waits on this build."""

    def __init__(self, steps: int, started: float) -> None:
        self.steps, self.started = steps, started
        self.recent: collections.deque[float] = collections.deque(maxlen=50)
        self.last_log = 0.0

    def update(self, step: int, loss: float) -> None:
        self.recent.append(loss)
        now = time.monotonic()
        if now - self.last_log < LOG_EVERY_S and step + 1 < self.steps:
            return
        self.last_log = now
        mean = sum(self.recent) / len(self.recent)
        logger.info(
            "demo model: step %d/%d, loss %.3f (mean of the last %d steps), %.0f s",
            step + 1,
            self.steps,
            mean,
            len(self.recent),
            now - self.started,
        )


def _init_weights(model: LlamaForCausalLM, recipe: DemoRecipe) -> None:
    """GPT-2 style: N(0, std) matrices, residual outputs scaled down by depth; norms at 1."""
    residual_std = recipe.init_std / math.sqrt(2 * recipe.num_layers)
    with torch.no_grad():
        # By checkpoint tensor, in module order: each projection draws as when it was its own
        # parameter (a merged one is drawn part by part).
        for name, param in model.checkpoint_tensors().items():
            if param.dim() < 2:
                continue
            residual = name.endswith(("o_proj.weight", "down_proj.weight"))
            param.normal_(0.0, residual_std if residual else recipe.init_std)


def _learning_rate(recipe: DemoRecipe, step: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at the last step."""
    warmup = min(recipe.warmup_steps, max(recipe.steps // 10, 1))
    if step < warmup:
        return recipe.lr * (step + 1) / warmup
    progress = (step - warmup) / max(recipe.steps - warmup, 1)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return recipe.lr * (recipe.min_lr_ratio + (1.0 - recipe.min_lr_ratio) * cosine)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
