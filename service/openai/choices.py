"""Choices: the state of an OpenAI answer's choices, fed with sluice.v1 events.

Shared by completions and chat: the text, token ids and versions of each choice, how it
finished (OpenAI's finish_reason, vLLM's stop_reason), and the usage. The shapes each endpoint
sends are built from this state by the endpoint's own module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.v1 import generation_pb2 as pb

from service.openai.fanout import Event

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_STOP_STRING: "stop",
    pb.FINISH_REASON_LENGTH: "length",
}
# A choice that ended for one of these reasons is no answer: the request fails with this
# HTTP status (a stream, whose status is sent, ends with an error event instead).
FAILURES = {
    pb.FINISH_REASON_CANCELLED: 499,
    pb.FINISH_REASON_DEADLINE_EXCEEDED: 504,
    pb.FINISH_REASON_ABORTED: 503,  # the engine was lost or stopped: retry
    pb.FINISH_REASON_ERROR: 500,
}


@dataclass
class Choice:
    index: int
    policy_version: int = 0  # of the weights behind the latest tokens
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop string that ended it (vLLM's name)
    version_spans: list[dict[str, int]] = field(default_factory=list)
    failure: tuple[int, str] | None = None  # (HTTP status, message)

    def extensions(self) -> dict[str, Any]:
        """Sluice's per-choice fields beside OpenAI's."""
        return {"policy_version": self.policy_version, "version_spans": self.version_spans}

    def chunk_ending(self) -> dict[str, Any]:
        """The fields a streamed chunk's choice ends with: why it finished (None until it has),
        and its policy version; its version spans once it has finished."""
        ending: dict[str, Any] = {
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "policy_version": self.policy_version,
        }
        if self.finish_reason is not None:
            ending["version_spans"] = self.version_spans
        return ending


class Choices:
    """Every choice of one answer: choice `prompt * n + index`."""

    def __init__(self, prompts: int, n: int) -> None:
        self.n = n
        self.choices = [Choice(i) for i in range(prompts * n)]
        self.started: list[pb.Started | None] = [None] * prompts
        self.completion_tokens = 0

    def absorb(self, event: Event) -> Choice | None:
        """Apply one event; returns the choice it belongs to (None for `started`)."""
        response = event.response
        kind = response.WhichOneof("event")
        if kind == "started":
            self.started[event.prompt] = response.started
            for choice in self._of_prompt(event.prompt):
                choice.policy_version = response.started.policy_version
            return None
        choice = self.choices[event.prompt * self.n + response.index]
        if kind == "tokens":
            chunk = response.tokens
            choice.text.append(chunk.text)
            choice.token_ids.extend(chunk.token_ids)
            choice.policy_version = chunk.policy_version
        elif kind == "finished":
            finished = response.finished
            self.completion_tokens += finished.usage.completion_tokens
            choice.version_spans = [
                {"policy_version": s.policy_version, "start": s.start, "end": s.end}
                for s in finished.version_spans
            ]
            if finished.reason in FINISH_REASONS:
                choice.finish_reason = FINISH_REASONS[finished.reason]
                choice.stop_reason = finished.matched_stop or None
            else:
                name = pb.FinishReason.Name(finished.reason).removeprefix("FINISH_REASON_")
                message = finished.message or f"the request ended {name}"
                choice.failure = (FAILURES.get(finished.reason, 500), message)
        return choice

    def _of_prompt(self, prompt: int) -> list[Choice]:
        return self.choices[prompt * self.n : (prompt + 1) * self.n]

    def failure(self) -> tuple[int, str] | None:
        return next((c.failure for c in self.choices if c.failure is not None), None)

    def usage(self) -> dict[str, Any]:
        prompt = sum(s.prompt_tokens for s in self.started if s is not None)
        cached = sum(s.cached_tokens for s in self.started if s is not None)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
