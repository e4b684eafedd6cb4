"""Grammars: structured-output constraints compiled once each, off the step loop.

xgrammar compiles a Constraint against the model's vocabulary (its tokenizer.json, padded to
the model's vocab size, with the model's EOS ids as the stop tokens: the mask allows EOS only
where the text is complete). One thread compiles, in order of arrival; xgrammar is imported
there at first use (it takes seconds and imports transformers). `compile` returns a Future at
once, from a cache of at most `capacity` constraints, least recently used first out (failures
are kept too: a bad constraint sent again is refused at once). `on_done`, set by the engine
process, runs on the compile thread after each compile: it wakes the engine's loop.

How each kind compiles:
- json_schema: the schema as schema_rules.py checks and rewrites it (json_schema_grammar.py), no
  properties beyond the schema's unless it allows them;
- json_object: the schema {"type": "object"} with any properties;
- both: compact JSON (", " and ": " between tokens, nothing else) when `json_whitespace` is 0,
  else any JSON whitespace in runs of at most `json_whitespace` characters (a sampled model
  cannot loop on newlines);
- regex: the regex; grammar: the GBNF text, from its rule `root`;
- choice: a grammar whose root is the alternatives, each a string literal.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine.messages import Constraint
from engine.structured.json_schema_grammar import json_schema_grammar
from engine.structured.schema_rules import SchemaRuleError, check_schema

CACHE_ENTRIES = 256
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: .*? is false: )?")


class ConstraintError(ValueError):
    """The constraint itself is wrong: its message names the field (INVALID_ARGUMENT)."""


class Grammars:
    def __init__(
        self,
        model_path: Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        capacity: int = CACHE_ENTRIES,
        json_whitespace: int = 0,
    ) -> None:
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.capacity = capacity
        self.json_whitespace = json_whitespace
        self.on_done: Callable[[], None] = lambda: None
        self._cache: OrderedDict[Constraint, Future[Any]] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: Any = None  # xgrammar.GrammarCompiler, made on the compile thread

    def compile(self, constraint: Constraint) -> Future[Any]:
        """The constraint's compiled grammar, now or later: an xgrammar CompiledGrammar, or a
        ConstraintError. Call from one thread (the engine's)."""
        future = self._cache.get(constraint)
        if future is not None:
            self._cache.move_to_end(constraint)
            return future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="sluice-grammar")
        future = self._executor.submit(self._compile, constraint)
        future.add_done_callback(lambda _: self.on_done())
        self._cache[constraint] = future
        if len(self._cache) > self.capacity:  # requests waiting on it hold its future
            self._cache.popitem(last=False)
        return future

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, constraint: Constraint) -> Any:
        compiler = self._compiler or self._make_compiler()
        kind, text = constraint.kind, constraint.text
        try:
            if kind in ("json_schema", "json_object"):
                checked = check_schema(text if kind == "json_schema" else '{"type": "object"}')
                spaces = self.json_whitespace
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

    def _make_compiler(self) -> Any:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.model_path / "tokenizer.json"))
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
        )
        threads = min(8, os.cpu_count() or 1)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        return self._compiler


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
