"""SamplingParams: how a request samples, stops and what it reports, as the engine applies it.

Standard library only, like engine/protocol/messages.py (which re-exports every name here): the service
builds these from a GenerateRequest, a trainer in process builds them directly.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
# A token's sampling support holds at most top_k ids (plus ties at the k-th logit, at most
# SUPPORT_TIES of them): top_k bounds it, up to this.
MAX_SUPPORT_TOP_K = 1024
SUPPORT_TIES = 64
# Temperatures below this sample greedily (vLLM's threshold): dividing logits by less
# overflows float32 to inf, and softmax of inf is NaN.
GREEDY_TEMPERATURE = 1e-5
# Repetition penalty scales a logit by at most 1000x; with temperature >= 1e-5 (1e5x) a logit
# stays finite in float32 (3.4e38) unless it already exceeds 3.4e30, far above any model's.
REPETITION_PENALTY_RANGE = (0.001, 1000.0)
_FLOAT32_MAX = 3.4028234663852886e38  # finite Python floats above this are inf on the device
# The sampling surface (logit_bias, allowed_token_ids, bad_token_ids, bad_word_ids): bounded so
# that a step's masks stay small. OpenAI takes 300 logit_bias entries in [-100, 100].
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_TOKEN_ID_LIST = 1024  # allowed_token_ids, bad_token_ids
MAX_BAD_WORD_IDS = 128  # token sequences (the service sends two per bad word)
MAX_BAD_WORD_TOKENS = 64  # tokens per sequence
# Structured output (GenerateRequest.structured): each document at most this many UTF-8 bytes;
# a choice list of 1 to MAX_CHOICES strings, their total also within MAX_CONSTRAINT_BYTES. Large
# real API schemas (100-700 kB) compile in seconds; what a document costs to compile is bounded
# by the engine's compile time and memory limits (engine/structured/compile_pool.py), not here.
MAX_CONSTRAINT_BYTES = 1 << 20
MAX_CHOICES = 1024
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


class LogprobMode(enum.StrEnum):
    """Which distribution logprobs are taken from (engine/sampling/sampler.py)."""

    RAW = "raw"  # the model's logits
    PROCESSED = "processed"  # after penalties and temperature, before truncation (default)
    SAMPLED = "sampled"  # after top-k, top-p and min-p, renormalised: what the token was drawn from


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint on the completion's text (engine/structured/): `kind` is
    one of CONSTRAINT_KINDS; `text` the JSON schema, regex or GBNF grammar; `choices` the
    strings of a "choice". Hashable: equal constraints share one compiled grammar."""

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """The request field it came from, as errors name it."""
        return f"structured.{self.kind}"

    def errors(self) -> list[tuple[str, str]]:
        """Its bounds, checked before anything looks at the document itself."""
        if self.kind not in CONSTRAINT_KINDS:
            return [("structured", f"unknown kind {self.kind!r}")]
        size = len(self.text.encode()) + sum(len(c.encode()) for c in self.choices)
        if size > MAX_CONSTRAINT_BYTES:
            return [(self.field, f"at most {MAX_CONSTRAINT_BYTES} bytes")]
        if self.kind == "choice":
            if not 1 <= len(self.choices) <= MAX_CHOICES:
                return [("structured.choice.choices", f"must hold 1 to {MAX_CHOICES} strings")]
            if not all(self.choices):
                return [("structured.choice.choices", "every choice must be non-empty")]
        elif self.kind != "json_object" and not self.text:
            return [(self.field, "must not be empty")]
        return []


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping parameters, as the engine applies them.

    A temperature below GREEDY_TEMPERATURE (0 included) is greedy. Log-probabilities are
    log_softmax of the logits after penalties (and min_tokens suppression) divided by
    temperature (a greedy one counts as 1), before top-k/top-p/min-p; with raw_logprobs,
    log_softmax of the unmodified logits. Every float field must be finite in float32.
    With prompt_logprobs, the first output also carries the prompt's log-probabilities from
    position prompt_logprobs_start on (PromptLogprobs); max_tokens may then be 0: the prompt
    is scored and nothing is generated.

    The sampling surface applies to the raw logits first (engine/sampling/surface.py), before
    penalties: with allowed_token_ids every other token is -inf, bad_token_ids are -inf, each
    bad_word_ids sequence bans its last token where the output ends with the rest of it (a
    one-token sequence always), logit_bias (token id -> bias) is added. Raw logprobs and
    prompt logprobs do not see it. A `structured` constraint masks, at the same point, every
    token that cannot continue a valid text (engine/structured/). `adapter` names the LoRA
    adapter the request runs, "" the base model.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None  # None = fill the context
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    raw_logprobs: bool = False
    prompt_logprobs: bool = False
    prompt_logprobs_start: int = 1  # the first prompt position scored (0 has no context)
    logprob_mode: LogprobMode | None = None  # None: PROCESSED (RAW with raw_logprobs)
    sampling_support: bool = False  # return the ids each token could have been drawn from
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: tuple[int, ...] = ()  # () = every token
    bad_token_ids: tuple[int, ...] = ()
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # the service tokenises bad_words into these
    structured: Constraint | None = None
    # The resident LoRA adapter (engine/lora/) that computes this request, by its name; "" is
    # the base model. An adapter not loaded when the request starts is its ERROR output.
    adapter: str = ""
    # Mixture-of-experts models: with each sampled token, the experts each MoE layer's router
    # chose in the forward pass whose logits produced it (RequestOutput.routed_experts).
    routed_experts: bool = False
    # False: this request never speculates, whatever the server's --speculative-method (its
    # tokens are the same either way; speculation changes only how fast they come).
    speculative: bool = True

    @property
    def has_surface(self) -> bool:
        """Any of logit_bias, allowed_token_ids, bad_token_ids, bad_word_ids is set."""
        return bool(
            self.logit_bias or self.allowed_token_ids or self.bad_token_ids or self.bad_word_ids
        )

    @property
    def greedy(self) -> bool:
        """The one rule for "this request samples greedily"; the engine decides by it alone."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def mode(self) -> LogprobMode:
        """The distribution logprobs come from: raw_logprobs is RAW."""
        if self.raw_logprobs:
            return LogprobMode.RAW
        return self.logprob_mode or LogprobMode.PROCESSED

    @property
    def support_bound(self) -> int:
        """The most ids a token's sampling support lists, ties at the k-th logit aside: 1 when
        greedy, top_k when set, 0 when nothing truncates (the support is every token)."""
        if self.greedy:
            return 1
        return self.top_k if self.top_k > 0 else 0

    def errors(self, vocab_size: int | None = None) -> list[tuple[str, str]]:
        """Every invalid field as (field name, description); empty when the params are valid.

        The names are SamplingParams field names; the service maps them to its request's."""
        errs: list[tuple[str, str]] = []
        low, high = REPETITION_PENALTY_RANGE
        ranges = {
            "temperature": (self.temperature >= 0.0, "must be >= 0"),
            "top_p": (0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            "min_p": (0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            "frequency_penalty": (-2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            "presence_penalty": (-2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            "repetition_penalty": (
                low <= self.repetition_penalty <= high,
                f"must be in [{low:g}, {high:g}]",
            ),
        }
        for name, (in_range, why) in ranges.items():
            value = getattr(self, name)
            if not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
                errs.append((name, "must be finite (as a float32)"))
            elif not in_range:
                errs.append((name, why))
        if self.top_k < 0:
            errs.append(("top_k", "must be >= 0 (0 disables top-k)"))
        if self.seed is not None and not 0 <= self.seed < 2**64:
            errs.append(("seed", "must be in [0, 2**64)"))
        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs else 1):
            errs.append(("max_tokens", "must be >= 1 (0 only to score a prompt)"))
        if self.prompt_logprobs_start < 1:
            errs.append(("prompt_logprobs_start", "must be >= 1: position 0 has no context"))
        if self.min_tokens < 0:
            errs.append(("min_tokens", "must be >= 0"))
        elif self.max_tokens is not None and self.min_tokens > self.max_tokens:
            errs.append(("min_tokens", "must not exceed max_tokens"))
        if self.raw_logprobs and self.logprob_mode not in (None, LogprobMode.RAW):
            errs.append(("logprob_mode", "raw_logprobs means RAW: set one or the other"))
        truncates = not self.greedy and (self.top_k != 0 or self.top_p < 1.0 or self.min_p > 0.0)
        if self.sampling_support and truncates and not 1 <= self.top_k <= MAX_SUPPORT_TOP_K:
            errs.append(
                (
                    "sampling_support",
                    f"needs top_k in [1, {MAX_SUPPORT_TOP_K}] with top-k, top-p or min-p "
                    "(top_k bounds the support)",
                )
            )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            errs.append(("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]"))
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            errs.append(("stop_token_ids", f"every id must be in [0, {vocab_size})"))
        if self.has_surface:
            errs += self._surface_errors(vocab_size)
        if self.structured is not None:
            errs += self.structured.errors()
        return errs

    def _surface_errors(self, vocab_size: int | None) -> list[tuple[str, str]]:
        """The sampling surface's bounds: counts first, so that nothing looks at more."""
        errs: list[tuple[str, str]] = []

        def bad_ids(ids: object) -> bool:
            return any(
                not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size)
                for t in ids  # type: ignore[attr-defined]
            )

        in_range = f"every id must be in [0, {vocab_size})" if vocab_size else "ids must be >= 0"
        low, high = LOGIT_BIAS_RANGE
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            errs.append(("logit_bias", f"at most {MAX_LOGIT_BIAS} entries"))
        elif bad_ids(self.logit_bias):
            errs.append(("logit_bias", in_range))
        elif not all(low <= b <= high for b in self.logit_bias.values()):  # NaN fails too
            errs.append(("logit_bias", f"every bias must be in [{low:g}, {high:g}]"))
        for name in ("allowed_token_ids", "bad_token_ids"):
            ids = getattr(self, name)
            if len(ids) > MAX_TOKEN_ID_LIST:
                errs.append((name, f"at most {MAX_TOKEN_ID_LIST} ids"))
            elif bad_ids(ids):
                errs.append((name, in_range))
        words = self.bad_word_ids
        if len(words) > MAX_BAD_WORD_IDS:
            errs.append(("bad_word_ids", f"at most {MAX_BAD_WORD_IDS} token sequences"))
        elif not all(1 <= len(w) <= MAX_BAD_WORD_TOKENS for w in words):
            errs.append(("bad_word_ids", f"each sequence must be 1 to {MAX_BAD_WORD_TOKENS} ids"))
        elif any(bad_ids(w) for w in words):
            errs.append(("bad_word_ids", in_range))
        if self.allowed_token_ids and not errs:
            banned = set(self.bad_token_ids) | {w[0] for w in words if len(w) == 1}
            if banned.issuperset(self.allowed_token_ids):
                errs.append(("allowed_token_ids", "every allowed id is banned (bad ids or words)"))
        return errs


# ---- service -> engine ----
