"""`/v1/completions`: an OpenAI completion request as sluice.v1 GenerateRequests (one per
prompt), and their events as OpenAI's answer, whole or streamed.

`echo` puts the prompt's text (and, with `logprobs`, its scores from sluice.v1's prompt
logprobs) before the completion; with max_tokens 0 only the prompt is scored (lm-eval's
loglikelihood asks for max_tokens 1 and drops the last token itself).
"""

from __future__ import annotations

import time
from typing import Any

from sluice.v1 import generation_pb2 as pb

from service.openai.choices import Choices
from service.openai.fanout import Event, FanOut
from service.openai.logprobs import CompletionLogprobs
from service.openai.schemas import CompletionRequest
from service.openai.translate import fill, request_id, set_max_tokens
from service.text.tokenizer import Tokenizer


def requests(body: CompletionRequest, adapter: str) -> list[pb.GenerateRequest]:
    """One GenerateRequest per prompt; a FieldError for a value sluice.v1 cannot hold."""
    prompt = body.prompt
    prompts: list[str | list[int]] = []
    if isinstance(prompt, str):
        prompts.append(prompt)
    elif all(isinstance(p, int) for p in prompt):
        prompts.append([p for p in prompt if isinstance(p, int)])
    else:
        prompts.extend(p for p in prompt if not isinstance(p, int))
    rid = request_id("cmpl")
    made = []
    for i, one in enumerate(prompts):
        req = pb.GenerateRequest(request_id=rid if len(prompts) == 1 else f"{rid}-{i}")
        if isinstance(one, str):
            req.text = one
        else:
            req.token_ids.ids.extend(one)
        fill(req, body, adapter)
        set_max_tokens(req, body.max_tokens, "max_tokens")
        if body.logprobs is not None:
            req.output.logprobs = True
            req.output.top_logprobs = body.logprobs
        # max_tokens 0 is sluice.v1's "score the prompt only", which needs prompt logprobs.
        req.output.prompt_logprobs = body.echo and (
            body.logprobs is not None or body.max_tokens == 0
        )
        made.append(req)
    return made


class CompletionAnswer:
    """The answer's state; `chunks` for a stream, `body` for the whole answer."""

    def __init__(
        self, body: CompletionRequest, fanout: FanOut, model: str, tokenizer: Tokenizer
    ) -> None:
        self.request = body
        self.fanout = fanout
        self.model = model
        self.tokenizer = tokenizer
        self.id = fanout.submitted[0].admission.request.request_id
        self.created = int(time.time())
        self.choices = Choices(len(fanout.submitted), body.n)
        self.logprobs = [
            CompletionLogprobs(tokenizer, body.skip_special_tokens)
            if body.logprobs is not None
            else None
            for _ in self.choices.choices
        ]

    def chunks(self, event: Event) -> list[dict[str, Any]]:
        """The choices' stream chunks this event makes (none for an empty one)."""
        choice = self.choices.absorb(event)
        response = event.response
        if choice is None:  # started: the echo goes first
            if not self.request.echo:
                return []
            return [
                self._echo(event.prompt * self.request.n + i, event.prompt)
                for i in range(self.request.n)
            ]
        entry: dict[str, Any] = {"index": choice.index, "text": "", "logprobs": None}
        if response.HasField("tokens"):
            entry["text"] = response.tokens.text
            entry["logprobs"] = self._take_logprobs(choice.index, response.tokens)
            if self.request.return_token_ids:
                entry["token_ids"] = list(response.tokens.token_ids)
        elif choice.failure is not None:
            return []
        return [self._chunk([entry | choice.chunk_ending()])]

    def _echo(self, index: int, prompt: int) -> dict[str, Any]:
        ids = self.fanout.prompt_ids(prompt)
        text = self.tokenizer.decode(ids, self.request.skip_special_tokens)
        entry: dict[str, Any] = {"index": index, "text": text, "logprobs": None}
        logprobs = self.logprobs[index]
        started = self.choices.started[prompt]
        if logprobs is not None and started is not None:
            logprobs.add_prompt(ids, started.prompt_logprobs)
            entry["logprobs"] = logprobs.take()
        if self.request.return_token_ids:
            entry["prompt_token_ids"] = ids
        entry["finish_reason"] = None
        return self._chunk([entry])

    def _take_logprobs(self, index: int, chunk: pb.TokenChunk) -> dict[str, Any] | None:
        logprobs = self.logprobs[index]
        if logprobs is None:
            return None
        logprobs.add_tokens(chunk)
        return logprobs.take()

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._chunk([]), "usage": self.choices.usage()}

    def body(self, events: list[Event]) -> dict[str, Any]:
        """The whole answer, from every event (each choice's logprobs merged in order)."""
        merged: list[dict[str, Any] | None] = [None] * len(self.choices.choices)
        for event in events:
            for chunk in self.chunks(event):
                for entry in chunk["choices"]:
                    merged[entry["index"]] = _merge(merged[entry["index"]], entry)
        choices = []
        for choice, entry in zip(self.choices.choices, merged, strict=True):
            entry = entry or {"index": choice.index, "text": "", "logprobs": None}
            entry.update(finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)
            entry.update(choice.extensions())
            if self.request.return_token_ids:
                entry["prompt_token_ids"] = self.fanout.prompt_ids(choice.index // self.request.n)
                entry["token_ids"] = choice.token_ids
            choices.append(entry)
        return {**self._chunk(choices), "usage": self.choices.usage()}


def _merge(into: dict[str, Any] | None, entry: dict[str, Any]) -> dict[str, Any]:
    if into is None:
        return {**entry, "logprobs": _copy(entry["logprobs"])}
    into["text"] += entry["text"]
    if entry["logprobs"] is not None:
        if into["logprobs"] is None:
            into["logprobs"] = _copy(entry["logprobs"])
        else:
            for key, values in entry["logprobs"].items():
                into["logprobs"][key] += values
    return into


def _copy(logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if logprobs is None else {k: list(v) for k, v in logprobs.items()}
