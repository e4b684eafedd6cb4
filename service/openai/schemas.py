"""The OpenAI request bodies as pydantic models: shapes and types only.

What a field's value means (ranges, the context, the vocabulary) is judged once, by sluice.v1's
admission, after translation; here a body is refused only for a wrong shape or type, or for a
field Sluice cannot honour (`unsupported`). Fields OpenAI documents that change nothing here
(`user`, `parallel_tool_calls`, ...) and fields no one documents are accepted and ignored, as
vLLM does. vLLM's extensions that sluice.v1 has (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output, return_token_ids)
are accepted under vLLM's names.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The most top logprobs per position sluice.v1 returns (OutputOptions.top_logprobs' bound).
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class Sampling(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # ignored: OpenAI's abuse tracking
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        errors = []
        if self.suffix:
            errors.append(("suffix", "is not supported (no fill-in-the-middle)"))
        if self.best_of is not None and self.best_of != self.n:
            errors.append(("best_of", "must equal n when set (no server-side ranking)"))
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            errors.append(("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]"))
        if isinstance(self.prompt, list) and not self.prompt:
            errors.append(("prompt", "must not be empty"))
        return errors


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatRequest(Sampling):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    # vLLM's extensions
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False

    def unsupported(self) -> list[tuple[str, str]]:
        errors = []
        if self.tools and self.tool_choice != "none":
            errors.append(
                ("tools", "tool calls are not parsed here: send tool_choice 'none' or no tools")
            )
        if self.functions:
            errors.append(("functions", "function calls are not parsed here"))
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            errors.append(("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]"))
        if self.top_logprobs and not self.logprobs:
            errors.append(("top_logprobs", "needs logprobs true"))
        rf = self.response_format
        no_schema = rf is not None and (
            rf.json_schema is None or rf.json_schema.json_schema is None
        )
        if rf is not None and rf.type == "json_schema" and no_schema:
            errors.append(("response_format.json_schema.schema", "is required"))
        return errors

    def completion_limit(self) -> int | None:
        """max_completion_tokens, else the deprecated max_tokens; None: the rest of the context."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
