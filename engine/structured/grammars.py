"""Grammars: structured-output constraints compiled once each, off the step loop.

xgrammar compiles a Constraint against the model's vocabulary (its tokenizer.json, padded to
the model's vocab size, with the model's EOS ids as the stop tokens: the mask allows EOS only
where the text is complete). Worker processes compile (compile_pool.py: each compile bounded in
time and memory, killed when every waiter left, fair between callers); the engine's TokenizerInfo
is made on a pool thread at first use (xgrammar's import takes seconds and imports
transformers). `compile` returns a Future at once, from a cache of at most `capacity`
constraints, least recently used first out (failures are kept too: a bad constraint sent again
is refused at once). `on_done`, set by the engine process, runs on a pool thread after each
compile: it wakes the engine's loop.

How each kind compiles:
- json_schema: the schema as validation/schema_rules.py checks and rewrites it (json_schema_grammar.py), no
  properties beyond the schema's unless it allows them;
- json_object: the schema {"type": "object"} with any properties;
- both: compact JSON (", " and ": " between tokens, nothing else) when `json_whitespace` is 0,
  else any JSON whitespace in runs of at most `json_whitespace` characters (a sampled model
  cannot loop on newlines);
- regex: the regex; grammar: the GBNF text, from its rule `root`;
- choice: a grammar whose root is the alternatives, each a string literal.
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from engine.protocol.messages import Constraint
from engine.protocol.validation.schema_rules import SchemaRuleError, check_schema
from engine.structured.compile_pool import CompileLimits, CompilePool
from engine.structured.compile_queue import CompileJob
from engine.structured.constraint_error import ConstraintError
from engine.structured.json_schema_grammar import json_schema_grammar

__all__ = ["ConstraintError", "Grammars", "choice_grammar", "compile_with", "tokenizer_info"]

CACHE_ENTRIES = 256
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: .*? is false: )?")


class Grammars:
    def __init__(
        self,
        model_path: Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        limits: CompileLimits | None = None,
        capacity: int = CACHE_ENTRIES,
        json_whitespace: int = 0,
    ) -> None:
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.capacity = capacity
        self.json_whitespace = json_whitespace
        self.limits = limits or CompileLimits()
        self.on_done: Callable[[], None] = lambda: None
        self._cache: OrderedDict[Constraint, CompileJob] = OrderedDict()
        self._pool: CompilePool | None = None

    @property
    def pool(self) -> CompilePool:
        """The compile workers (started at the first compile, or here)."""
        if self._pool is None:
            compile_fn = functools.partial(compile_with, json_whitespace=self.json_whitespace)
            self._pool = CompilePool(self.limits, self._tokenizer_info, compile_fn)
        return self._pool

    def compile(self, constraint: Constraint, caller: str = "") -> Future[Any]:
        """The constraint's compiled grammar, now or later: an xgrammar CompiledGrammar, or a
        ConstraintError. Each call that finds it still compiling waits on it: `abandon` when
        the wait ends early. `caller` names who asks (compile_queue.py: fairness). Call from
        one thread (the engine's)."""
        job = self._cache.get(constraint)
        if job is not None:
            self._cache.move_to_end(constraint)
            if not job.future.done():
                job.waiters += 1
            return job.future
        job = self.pool.submit(constraint, caller)
        job.future.add_done_callback(lambda _: self.on_done())
        self._cache[constraint] = job
        if len(self._cache) > self.capacity:  # requests waiting on it hold its future
            self._cache.popitem(last=False)
        return job.future

    def abandon(self, constraint: Constraint) -> None:
        """A wait on the constraint's compile ended before it did (a caller left, a request
        was aborted); the last one's cancels the compile, queued or running."""
        job = self._cache.get(constraint)
        if job is None or job.future.done():
            return
        job.waiters -= 1
        if job.waiters == 0 and self._pool is not None:
            del self._cache[constraint]  # asked again, it compiles again
            self._pool.abandon(job)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def _tokenizer_info(self) -> Any:
        return tokenizer_info(self.model_path, self.vocab_size, self.eos_token_ids)


def tokenizer_info(model_path: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """xgrammar's TokenizerInfo of the model: its tokenizer.json, padded to `vocab_size`."""
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_path / "tokenizer.json"))
    return xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
    )


def compile_with(compiler: Any, constraint: Constraint, json_whitespace: int = 0) -> Any:
    """The constraint compiled by an xgrammar GrammarCompiler (in a compile worker); JSON with
    whitespace runs of at most `json_whitespace` characters (0: compact)."""
    kind, text = constraint.kind, constraint.text
    try:
        if kind in ("json_schema", "json_object"):
            checked = check_schema(text if kind == "json_schema" else '{"type": "object"}')
            spaces = json_whitespace
            grammar = json_schema_grammar(checked, spaces > 0, spaces, kind == "json_schema")
            return compiler.compile_grammar(grammar)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "grammar":
            return compiler.compile_grammar(text)
        return compiler.compile_grammar(choice_grammar(constraint.choices))
    except SchemaRuleError as exc:
        raise ConstraintError(f"{constraint.field}: {exc}") from None
    except RuntimeError as exc:  # how xgrammar reports a document it cannot compile
        raise ConstraintError(f"{constraint.field}: {_message(exc)}") from None


def choice_grammar(choices: Sequence[str]) -> str:
    """GBNF whose root is exactly one of `choices`."""
    return "root ::= " + " | ".join(_literal(c) for c in choices)


def _literal(text: str) -> str:
    """`text` as a GBNF string literal: quotes, backslashes and control characters escaped."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _message(exc: RuntimeError) -> str:
    """xgrammar's message without its timestamp and source location."""
    return _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__
