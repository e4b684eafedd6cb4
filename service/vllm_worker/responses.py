"""WorkerResponses: one request's sluice.v1 events as worker-protocol responses.

stream=true: a GenerateStreamChunk per token chunk (the new ids, their count, their logprobs;
the prompt's logprobs on an index's first chunk), then a GenerateComplete per index with the
finish reason, the matched stop and the usage, speculative decoding's proposed (draft) and
accepted tokens included (its output_ids empty: the gateway accumulates the chunks, as with
vLLM, whose final message repeats only the last delta). stream=false: only the
GenerateComplete per index, with every output id and logprob.

The policy versions ride beside these messages (the protocol has no field for them): the
servicer sends `policy_version` as initial metadata and `version_spans_json()` as trailing
metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from sluice.v1 import generation_pb2 as pb

from service.vllm_worker.pb import vllm_engine_pb2 as vpb
from service.vllm_worker.request_mapping import LogprobCounts

# vLLM's finish reasons: "stop" (EOS, a stop token or a stop string), "length", "abort"
# (however the request was ended from outside), "error".
FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_STOP_STRING: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "abort",
    pb.FINISH_REASON_DEADLINE_EXCEEDED: "abort",
    pb.FINISH_REASON_ABORTED: "abort",
    pb.FINISH_REASON_ERROR: "error",
}


@dataclass
class _Sample:
    """What one index has produced so far."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[vpb.TopLogProbs] = field(default_factory=list)
    sent_first_chunk: bool = False


@dataclass
class WorkerResponses:
    """Feed every event of a request to `absorb`, in order; send what it returns."""

    stream: bool
    counts: LogprobCounts
    prompt_token_ids: list[int]
    stop_token_ids: frozenset[int]
    policy_version: int | None = None  # from `started`
    version_spans: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    _prompt_tokens: int = 0
    _cached_tokens: int = 0
    _input_logprobs: vpb.InputLogProbs | None = None
    _samples: dict[int, _Sample] = field(default_factory=dict)

    def absorb(self, event: pb.GenerateResponse) -> list[vpb.GenerateResponse]:
        match event.WhichOneof("event"):
            case "started":
                self._start(event.started)
            case "tokens":
                return self._tokens(event.index, event.tokens)
            case "finished":
                return [self._complete(event.index, event.finished)]
        return []

    def version_spans_json(self) -> str:
        """{"<index>": [{"policy_version", "start", "end"}, ...]}: sluice.v1's Finished spans."""
        spans = {
            str(index): [{"policy_version": v, "start": s, "end": e} for v, s, e in spans]
            for index, spans in sorted(self.version_spans.items())
        }
        return json.dumps(spans, separators=(",", ":"))

    def _start(self, started: pb.Started) -> None:
        self.policy_version = started.policy_version
        self._prompt_tokens = started.prompt_tokens
        self._cached_tokens = started.cached_tokens
        if self.counts.prompt is not None:
            self._input_logprobs = self._prompt_scores(started.prompt_logprobs)

    def _prompt_scores(self, scores: pb.PromptLogprobs) -> vpb.InputLogProbs:
        """One entry per prompt token, as vLLM: those before `start` (the first) have no
        value; top logprobs only when asked for more than the token's own."""
        top = self.counts.prompt or 0
        scored = vpb.InputLogProbs(token_ids=self.prompt_token_ids)
        for position in range(len(self.prompt_token_ids)):
            i = position - scores.start
            entry = vpb.InputTokenLogProb()
            if 0 <= i < len(scores.logprobs):
                entry.value = scores.logprobs[i]
            scored.token_logprobs.append(entry)
            if top:
                alternatives = vpb.TopLogProbs()
                if 0 <= i < len(scores.top_logprobs):
                    alternatives.token_ids.extend(scores.top_logprobs[i].token_ids[:top])
                    alternatives.values.extend(scores.top_logprobs[i].logprobs[:top])
                scored.top_logprobs.append(alternatives)
        return scored

    def _tokens(self, index: int, chunk: pb.TokenChunk) -> list[vpb.GenerateResponse]:
        sample = self._samples.setdefault(index, _Sample())
        if not chunk.token_ids:
            return []  # a text-only flush: the gateway detokenizes the ids itself
        top = self.counts.output or 0
        tops = [
            vpb.TopLogProbs(token_ids=t.token_ids[:top], values=t.logprobs[:top])
            for t in (chunk.top_logprobs if top else ())
        ]
        sample.token_ids.extend(chunk.token_ids)
        sample.logprobs.extend(chunk.logprobs)
        sample.top_logprobs.extend(tops)
        if not self.stream:
            return []
        delta = vpb.GenerateStreamChunk(
            token_ids=chunk.token_ids,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=len(chunk.token_ids),  # this chunk's, as vLLM (the gateway sums)
            cached_tokens=self._cached_tokens,
            index=index,
        )
        if self.counts.output is not None:
            delta.output_logprobs.CopyFrom(
                _output_logprobs(list(chunk.token_ids), list(chunk.logprobs), tops)
            )
        if not sample.sent_first_chunk and self._input_logprobs is not None:
            delta.input_logprobs.CopyFrom(self._input_logprobs)
        sample.sent_first_chunk = True
        return [vpb.GenerateResponse(chunk=delta)]

    def _complete(self, index: int, finished: pb.Finished) -> vpb.GenerateResponse:
        sample = self._samples.setdefault(index, _Sample())
        self.version_spans[index] = [
            (span.policy_version, span.start, span.end) for span in finished.version_spans
        ]
        complete = vpb.GenerateComplete(
            finish_reason=FINISH_REASONS[finished.reason],
            prompt_tokens=finished.usage.prompt_tokens,
            completion_tokens=finished.usage.completion_tokens,
            cached_tokens=finished.usage.cached_tokens,
            index=index,
            spec_draft_tokens=finished.usage.proposed_tokens,
            spec_accepted_tokens=finished.usage.accepted_tokens,
        )
        if not self.stream:
            complete.output_ids.extend(sample.token_ids)
            if self.counts.output is not None:
                complete.output_logprobs.CopyFrom(
                    _output_logprobs(sample.token_ids, sample.logprobs, sample.top_logprobs)
                )
        if self._input_logprobs is not None:
            complete.input_logprobs.CopyFrom(self._input_logprobs)
        if finished.reason == pb.FINISH_REASON_STOP_STRING:
            complete.matched_stop_str = finished.matched_stop
        elif (
            finished.reason == pb.FINISH_REASON_STOP
            and sample.token_ids
            and sample.token_ids[-1] in self.stop_token_ids
        ):
            complete.matched_token_id = sample.token_ids[-1]
        return vpb.GenerateResponse(complete=complete)


def _output_logprobs(
    token_ids: list[int], logprobs: list[float], tops: list[vpb.TopLogProbs]
) -> vpb.OutputLogProbs:
    return vpb.OutputLogProbs(token_logprobs=logprobs, token_ids=token_ids, top_logprobs=tops)
