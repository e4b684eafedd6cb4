"""Completion: turns one index's engine outputs into TokenChunk and Finished events."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.v1 import generation_pb2 as pb

from engine.protocol.messages import FinishReason, RequestOutput
from service.text.stop_strings import StopMatch, StopStringMatcher
from service.text.tokenizer import Tokenizer

FINISH_REASONS: dict[FinishReason, pb.FinishReason.ValueType] = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.DEADLINE_EXCEEDED: pb.FINISH_REASON_DEADLINE_EXCEEDED,
    FinishReason.ABORTED: pb.FINISH_REASON_ABORTED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
REASONS = {code: reason for reason, code in FINISH_REASONS.items()}


@dataclass(frozen=True)
class OutputSettings:
    """The service-side output options of one request."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@dataclass
class _Chunk:
    policy_version: int
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[pb.TopLogprobs] = field(default_factory=list)
    sampling_support: list[pb.TokenIds] = field(default_factory=list)
    routed_experts: list[int] = field(default_factory=list)  # flattened [token, layer, k]


class Completion:
    """One index of one request. `absorb` is called with every output waiting for it, and
    returns the events to send: at most one TokenChunk per policy version, then Finished.

    A stop string found in the text finishes the completion here (`finished_early`); the
    caller then aborts the request in the engine and ignores its remaining outputs.
    """

    def __init__(
        self, request_id: str, index: int, tokenizer: Tokenizer, settings: OutputSettings
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.finished = False
        self.finish_reason: FinishReason | None = None  # the reason its `finished` event gives
        self.finished_early = False
        self._detokenizer = tokenizer.detokenizer(settings.skip_special_tokens)
        self._stops = StopStringMatcher(list(settings.stop), settings.include_stop_str_in_output)
        self._completion_tokens = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._proposed_tokens = 0  # speculative decoding: the engine's latest counts
        self._accepted_tokens = 0
        self._spans: list[list[int]] = []  # [policy_version, start, end] per version

    def absorb(self, outputs: list[RequestOutput]) -> list[pb.GenerateResponse]:
        events: list[pb.GenerateResponse] = []
        chunk: _Chunk | None = None
        for output in outputs:
            if self.finished:
                break
            if output.prompt_tokens:
                self._prompt_tokens = output.prompt_tokens
                self._cached_tokens = output.cached_tokens
            if output.spec_tokens is not None:  # so far: a stop string may end it early
                self._proposed_tokens, self._accepted_tokens = output.spec_tokens
            if output.new_token_ids:
                if chunk is not None and chunk.policy_version != output.policy_version:
                    events.append(self._chunk_event(chunk))  # a chunk never mixes versions
                    chunk = None
                if chunk is None:
                    chunk = _Chunk(output.policy_version)
                if self._stops:
                    if self._absorb_until_stop(chunk, output, events):
                        return events
                else:  # no stop strings: the whole output at once
                    self._add_tokens(chunk, output, len(output.new_token_ids))
                    for token_id in output.new_token_ids:
                        chunk.text.append(self._detokenizer.step(token_id))
            if output.finished:
                # Flush what the detokenizer and the stop matcher still hold: the completion's
                # tail, or a stop string that the last (multi-byte) piece completed.
                matched, message = "", output.error or ""
                assert output.finish_reason is not None
                reason = FINISH_REASONS[output.finish_reason]
                match self._stops.feed(self._detokenizer.flush()):
                    case StopMatch(text=text, stop=stop):
                        reason, matched, message = pb.FINISH_REASON_STOP_STRING, stop, ""
                    case str() as text:
                        text += self._stops.flush()
                if text:
                    chunk = chunk or _Chunk(output.policy_version)
                    chunk.text.append(text)
                if chunk is not None:
                    events.append(self._chunk_event(chunk))
                return [*events, self._finish(reason, matched, message)]
        if chunk is not None:
            events.append(self._chunk_event(chunk))
        return events

    def _absorb_until_stop(
        self, chunk: _Chunk, output: RequestOutput, events: list[pb.GenerateResponse]
    ) -> bool:
        """Feed `output`'s tokens one by one to the stop matcher; True when a stop string ended
        the completion (the chunk, up to the token that completed it, and `finished` are then
        in `events`)."""
        for i, token_id in enumerate(output.new_token_ids):
            match self._stops.feed(self._detokenizer.step(token_id)):
                case StopMatch(text=text, stop=stop):
                    self._add_tokens(chunk, output, i + 1)
                    chunk.text.append(text)
                    events.append(self._chunk_event(chunk))
                    events.append(self._finish(pb.FINISH_REASON_STOP_STRING, matched=stop))
                    self.finished_early = True
                    return True
                case str() as text:
                    chunk.text.append(text)
        self._add_tokens(chunk, output, len(output.new_token_ids))
        return False

    def _add_tokens(self, chunk: _Chunk, output: RequestOutput, count: int) -> None:
        """The first `count` tokens of `output` join `chunk`."""
        chunk.token_ids.extend(output.new_token_ids[:count])
        if output.logprobs is not None:
            chunk.logprobs.extend(output.logprobs[:count])
        if output.top_logprobs is not None:
            for ids, logprobs in output.top_logprobs[:count]:
                chunk.top_logprobs.append(pb.TopLogprobs(token_ids=ids, logprobs=logprobs))
        if output.sampling_support is not None:
            chunk.sampling_support += [pb.TokenIds(ids=s) for s in output.sampling_support[:count]]
        if output.routed_experts is not None:
            for ids in output.routed_experts[:count]:
                chunk.routed_experts += ids
        start = self._completion_tokens
        self._completion_tokens += count
        # Plain ints; the protobuf spans are built once, at the finish.
        spans = self._spans
        if spans and spans[-1][0] == output.policy_version:
            spans[-1][2] = self._completion_tokens
        else:
            spans.append([output.policy_version, start, self._completion_tokens])

    def _chunk_event(self, chunk: _Chunk) -> pb.GenerateResponse:
        tokens = pb.TokenChunk(
            token_ids=chunk.token_ids,
            text="".join(chunk.text),
            logprobs=chunk.logprobs,
            top_logprobs=chunk.top_logprobs,
            policy_version=chunk.policy_version,
            sampling_support=chunk.sampling_support,
            routed_experts=chunk.routed_experts,
        )
        return pb.GenerateResponse(request_id=self.request_id, index=self.index, tokens=tokens)

    def _finish(
        self, reason: pb.FinishReason.ValueType, matched: str = "", message: str = ""
    ) -> pb.GenerateResponse:
        self.finished = True
        self.finish_reason = REASONS[reason]
        finished = pb.Finished(
            reason=reason,
            matched_stop=matched,
            usage=pb.Usage(
                prompt_tokens=self._prompt_tokens,
                completion_tokens=self._completion_tokens,
                cached_tokens=self._cached_tokens,
                proposed_tokens=self._proposed_tokens,
                accepted_tokens=self._accepted_tokens,
            ),
            version_spans=[
                pb.VersionSpan(policy_version=v, start=start, end=end)
                for v, start, end in self._spans
            ],
            message=message,
        )
        return pb.GenerateResponse(request_id=self.request_id, index=self.index, finished=finished)

    @property
    def completion_tokens(self) -> int:
        return self._completion_tokens
