"""Admission control: turn a GenerateRequest into an engine AddRequest, or refuse it.

Every refusal before admission is a `Refusal` with one deliberate status code (the table in
docs/service.md):
UNAVAILABLE and RESOURCE_EXHAUSTED (with google.rpc.RetryInfo and the grpc-retry-pushback-ms
trailer), DEADLINE_EXCEEDED, INVALID_ARGUMENT (with google.rpc.BadRequest naming fields),
ALREADY_EXISTS, NOT_FOUND (an adapter that is not loaded, naming `adapter`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import grpc
from sluice.v1 import generation_pb2 as pb

from engine.protocol.messages import AddRequest, LogprobMode, ModelInfo, SamplingParams
from engine.protocol.validation.request_rules import (
    empty_prompt,
    newer_than_served,
    no_experts,
    no_room,
    not_loaded,
    outside_vocabulary,
    samples_of_a_score,
    samples_out_of_range,
    scores_past_the_prompt,
)
from service.config import DEFAULT_MAX_CHAT_MESSAGES, MAX_REQUEST_ID_LENGTH
from service.rpc.chat import chat_violations, no_template, render
from service.rpc.refusal import Refusal, invalid_argument
from service.rpc.sampling_surface import bad_word_ids, surface_violations
from service.rpc.structured import constraint, schema_violations
from service.text.chat_template import ChatTemplate
from service.text.completion import OutputSettings
from service.text.tokenizer import Tokenizer

# Stop strings are matched on every token's text. OpenAI and TGI (by default) take 4; 32 of up
# to 256 characters leave room for chat and tool-call markers and keep matching cheap.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
# Stop token ids are checked at every step (and suppressed until min_tokens); eos variants and
# turn markers are a handful.
MAX_STOP_TOKEN_IDS = 256

# engine.protocol.messages.SamplingParams field -> the proto field path callers see.
FIELD_PATHS = {
    **{
        name: f"sampling.{name}"
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "seed",
            "logit_bias",
            "allowed_token_ids",
            "bad_token_ids",
        )
    },
    "bad_word_ids": "sampling.bad_words",
    **{name: f"stop.{name}" for name in ("max_tokens", "min_tokens", "stop_token_ids")},
    "top_logprobs": "output.top_logprobs",
    "prompt_logprobs_start": "output.prompt_logprobs_start",
    "logprob_mode": "output.logprob_mode",
    "sampling_support": "output.sampling_support",
}
LOGPROB_MODES = {
    pb.LOGPROB_MODE_UNSPECIFIED: None,
    pb.LOGPROB_MODE_RAW: LogprobMode.RAW,
    pb.LOGPROB_MODE_PROCESSED: LogprobMode.PROCESSED,
    pb.LOGPROB_MODE_SAMPLED: LogprobMode.SAMPLED,
}
# A Started event with prompt logprobs holds, per scored position, a float and a TopLogprobs of
# k ids and k floats: at most this many bytes for k = 0, plus this many per top logprob. A
# request whose scores could pass the server's largest message is refused before any work.
PROMPT_SCORE_BYTES = 16
TOP_LOGPROB_BYTES = 10


@dataclass(frozen=True)
class Admission:
    """A validated request: what the engine runs and what the service does with its output."""

    request: AddRequest
    output: OutputSettings


def sampling_params(
    req: pb.GenerateRequest, surface: bool = True, bad_words: tuple[tuple[int, ...], ...] = ()
) -> SamplingParams:
    """The engine's parameters for a request; proto defaults where a field is unset. Without
    `surface`, no logit_bias, allowed or bad ids; `bad_words` tokenized (bad_word_ids)."""
    s, stop, out = req.sampling, req.stop, req.output
    defaults = SamplingParams()
    return SamplingParams(
        logit_bias=dict(s.logit_bias) if surface else {},
        allowed_token_ids=tuple(s.allowed_token_ids) if surface else (),
        bad_token_ids=tuple(s.bad_token_ids) if surface else (),
        bad_word_ids=bad_words,
        temperature=s.temperature if s.HasField("temperature") else defaults.temperature,
        top_p=s.top_p if s.HasField("top_p") else defaults.top_p,
        top_k=s.top_k if s.HasField("top_k") else defaults.top_k,
        min_p=s.min_p if s.HasField("min_p") else defaults.min_p,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        repetition_penalty=(
            s.repetition_penalty
            if s.HasField("repetition_penalty")
            else defaults.repetition_penalty
        ),
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=stop.max_tokens if stop.HasField("max_tokens") else None,
        min_tokens=stop.min_tokens,
        stop_token_ids=tuple(stop.stop_token_ids),
        ignore_eos=stop.ignore_eos,
        logprobs=out.logprobs or out.top_logprobs > 0,
        top_logprobs=out.top_logprobs,
        raw_logprobs=out.raw_logprobs,
        prompt_logprobs=out.prompt_logprobs,
        prompt_logprobs_start=(
            out.prompt_logprobs_start
            if out.HasField("prompt_logprobs_start")
            else defaults.prompt_logprobs_start
        ),
        logprob_mode=LOGPROB_MODES.get(out.logprob_mode),
        sampling_support=out.sampling_support,
        structured=constraint(req),
        adapter=req.adapter,
        routed_experts=out.routed_experts,
        speculative=req.speculative if req.HasField("speculative") else defaults.speculative,
    )


def field_violations(
    req: pb.GenerateRequest,
    info: ModelInfo,
    tokenizer: Tokenizer,
    max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES,
) -> list[tuple[str, str]]:
    """Every invalid field of a request that can be judged without tokenizing. Each check
    costs little next to receiving the request: a prompt that cannot fit is refused here."""
    errors: list[tuple[str, str]] = []
    if len(req.request_id) > MAX_REQUEST_ID_LENGTH:
        errors.append(("request_id", f"must be at most {MAX_REQUEST_ID_LENGTH} characters"))
    errors += _prompt_violations(req, info, tokenizer, max_chat_messages)
    samples = samples_out_of_range(req.n, info.max_num_seqs) if req.HasField("n") else None
    if samples is None and req.stop.HasField("max_tokens"):
        samples = samples_of_a_score(req.n, req.stop.max_tokens)
    if samples is not None:
        errors.append(("n", samples))
    errors += _stop_violations(req.stop)
    if why := no_experts(req.output.routed_experts, info.moe_layers > 0):
        errors.append(("output.routed_experts", why))
    if req.output.logprob_mode not in LOGPROB_MODES:
        errors.append(("output.logprob_mode", f"unknown mode {req.output.logprob_mode}"))
    surface = surface_violations(req.sampling)  # before the lists are copied
    errors += surface
    errors += schema_violations(req)
    params = sampling_params(req, surface=not surface)
    errors += [(FIELD_PATHS.get(f, f), d) for f, d in params.errors(info.vocab_size)]
    return errors


def _prompt_violations(
    req: pb.GenerateRequest, info: ModelInfo, tokenizer: Tokenizer, max_chat_messages: int
) -> list[tuple[str, str]]:
    match req.WhichOneof("prompt"):
        case None:
            return [("prompt", "set text, token_ids or chat")]
        case "chat":
            return chat_violations(req.chat, info, tokenizer, max_chat_messages)
        case "text":
            if why := empty_prompt(len(req.text)):
                return [("text", why)]
            return text_violations(req.text, info, tokenizer)
    ids = req.token_ids.ids
    if why := empty_prompt(len(ids)):
        return [("token_ids.ids", why)]
    if why := no_room(len(ids), info.max_model_len):
        return [("prompt", why)]
    if why := outside_vocabulary(ids, info.vocab_size):
        return [("token_ids.ids", why)]
    return []


def text_violations(text: str, info: ModelInfo, tokenizer: Tokenizer) -> list[tuple[str, str]]:
    """`text` if it is too long to be a prompt, judged by its size alone (not encoded)."""
    limit = tokenizer.max_text_bytes(info.max_model_len)
    # A character is 1 to 4 UTF-8 bytes: most texts need no encode (a copy) to be judged.
    if len(text) <= limit // 4:
        return []
    size = len(text.encode())
    if size <= limit:
        return []
    return [
        (
            "text",
            f"{size} bytes cannot fit in the context of {info.max_model_len} tokens "
            f"(at most {limit} bytes for this tokenizer)",
        )
    ]


def _stop_violations(stop: pb.StopParams) -> list[tuple[str, str]]:
    errors: list[tuple[str, str]] = []
    if len(stop.stop) > MAX_STOP_STRINGS:
        errors.append(("stop.stop", f"at most {MAX_STOP_STRINGS} stop strings"))
    elif any(not s for s in stop.stop):
        errors.append(("stop.stop", "stop strings must not be empty"))
    elif any(len(s) > MAX_STOP_STRING_CHARS for s in stop.stop):
        errors.append(
            ("stop.stop", f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        )
    if len(stop.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        errors.append(("stop.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids"))
    return errors


async def admit(
    req: pb.GenerateRequest,
    *,
    info: ModelInfo,
    tokenizer: Tokenizer,
    policy_version: int,
    deadline: float | None,
    retry_after: float,
    max_message_bytes: int,
    chat_template: ChatTemplate | None = None,
    max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES,
    adapters: Mapping[str, int] = MappingProxyType({}),
) -> Admission:
    """Validate and tokenize (a chat prompt rendered with `chat_template` first); raises
    Refusal. Queue and duplicate checks are the caller's, made right before submitting (no
    await in between). `retry_after`: the delay suggested to a request refused for weights
    older than its `min_policy_version`. `adapters`: the LoRA adapters loaded, with their
    policy versions (one unloaded after this check is the engine's ERROR output); a request
    that names one compares its `min_policy_version` with that."""
    if deadline is not None and deadline <= time.time():
        raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline has already passed")
    if req.WhichOneof("prompt") == "chat" and chat_template is None:
        raise no_template()
    violations = field_violations(req, info, tokenizer, max_chat_messages)
    if violations:
        raise invalid_argument(violations)
    if why := not_loaded(req.adapter, adapters):
        raise Refusal(
            grpc.StatusCode.NOT_FOUND,
            f"adapter: {why} (Admin LoadAdapter; ServerInfo.adapters lists those that are)",
            [("adapter", "no adapter of this name is loaded")],
        )
    prompt = await _prompt_ids(req, info, tokenizer, chat_template, max_chat_messages)
    bad_words = await bad_word_ids(list(req.sampling.bad_words), tokenizer)
    params = sampling_params(req, bad_words=bad_words)
    if bad_words and (errors := params.errors(info.vocab_size)):  # what the words became
        raise invalid_argument([(FIELD_PATHS.get(f, f), d) for f, d in errors])
    if violations := size_violations(req, len(prompt), info, max_message_bytes):
        raise invalid_argument(violations)
    served = adapters[req.adapter] if req.adapter else policy_version
    min_version = req.min_policy_version if req.HasField("min_policy_version") else None
    if newer_than_served(min_version, served, req.adapter):
        # UNAVAILABLE with a retry delay, not FAILED_PRECONDITION: the weights it asks for are
        # on their way (an update in progress here, or already applied on another replica
        # behind the same balancer), so the clients' retry policy tries again by itself.
        whose = f"of adapter {req.adapter!r}" if req.adapter else "served"
        raise Refusal(
            grpc.StatusCode.UNAVAILABLE,
            f"min_policy_version {min_version} is newer than the policy version {served} {whose}",
            retry_after=retry_after,
        )
    return _admission(req, prompt, params, deadline, min_version)


async def _prompt_ids(
    req: pb.GenerateRequest,
    info: ModelInfo,
    tokenizer: Tokenizer,
    chat_template: ChatTemplate | None,
    max_chat_messages: int,
) -> list[int]:
    """The prompt's token ids: the text encoded, the chat rendered and encoded, or the ids."""
    if req.WhichOneof("prompt") == "text":
        prompt = await tokenizer.encode(req.text, add_special_tokens=True)
    elif req.WhichOneof("prompt") == "chat":
        _, prompt = await render(
            req.chat, chat_template, info, tokenizer, max_chat_messages, checked=True
        )
    else:
        prompt = list(req.token_ids.ids)
    if why := no_room(len(prompt), info.max_model_len):  # the message of too many token ids
        raise invalid_argument([("prompt", why)])
    return prompt


def size_violations(
    req: pb.GenerateRequest, prompt_len: int, info: ModelInfo, max_message_bytes: int
) -> list[tuple[str, str]]:
    """What only the tokenized prompt tells: prompt logprobs or routed experts that could not
    be sent."""
    if req.output.prompt_logprobs:
        routed = routed_bytes(info) * req.output.routed_experts
        if violations := prompt_logprobs_violations(req, prompt_len, max_message_bytes, routed):
            return violations
    if req.output.routed_experts:
        return routed_experts_violations(req, prompt_len, info, max_message_bytes)
    return []


def _admission(
    req: pb.GenerateRequest,
    prompt: list[int],
    params: SamplingParams,
    deadline: float | None,
    min_version: int | None,
) -> Admission:
    request = AddRequest(
        request_id=req.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt,
        params=params,
        n=req.n if req.HasField("n") else 1,
        priority=req.priority,
        deadline=deadline,
        min_policy_version=min_version,
    )
    output = OutputSettings(
        stop=tuple(req.stop.stop),
        include_stop_str_in_output=req.stop.include_stop_str_in_output,
        skip_special_tokens=(
            req.output.skip_special_tokens if req.output.HasField("skip_special_tokens") else True
        ),
    )
    return Admission(request, output)


def prompt_logprobs_violations(
    req: pb.GenerateRequest, prompt_len: int, max_message_bytes: int, routed: int = 0
) -> list[tuple[str, str]]:
    """What only the tokenized prompt tells of a request for prompt logprobs (`routed`: the
    bytes of a position's routed experts, when asked for)."""
    errors = []
    start = sampling_params(req).prompt_logprobs_start
    if why := scores_past_the_prompt(start, prompt_len):
        errors.append(("output.prompt_logprobs_start", why))
    per_position = PROMPT_SCORE_BYTES + TOP_LOGPROB_BYTES * req.output.top_logprobs + routed
    size = (prompt_len - start) * per_position
    if size > max_message_bytes:
        errors.append(
            (
                "output.prompt_logprobs",
                f"the scores of {prompt_len - start} positions could pass the largest message "
                f"the server sends ({max_message_bytes} bytes): score fewer positions "
                "(prompt_logprobs_start) or ask for fewer top_logprobs (or no routed_experts)",
            )
        )
    return errors


def routed_experts_violations(
    req: pb.GenerateRequest, prompt_len: int, info: ModelInfo, max_message_bytes: int
) -> list[tuple[str, str]]:
    """A request whose completion's routed experts could pass the largest message: every
    token it may generate in one TokenChunk (a slow reader's chunk gathers them all)."""
    tokens = info.max_model_len - prompt_len
    if req.stop.HasField("max_tokens"):
        tokens = min(tokens, req.stop.max_tokens)
    per_token = (
        routed_bytes(info) + PROMPT_SCORE_BYTES + TOP_LOGPROB_BYTES * req.output.top_logprobs
    )
    if tokens * per_token <= max_message_bytes:
        return []
    fits = max_message_bytes // per_token
    return [
        (
            "output.routed_experts",
            f"the routed experts of {tokens} tokens ({info.moe_layers} MoE layers x "
            f"{info.moe_top_k} experts each) could pass the largest message the server sends "
            f"({max_message_bytes} bytes): ask for at most {fits} tokens (stop.max_tokens)",
        )
    ]


def routed_bytes(info: ModelInfo) -> int:
    """The most bytes one token's routed experts take in a message: MoE layers x top-k ids,
    each a varint of up to the largest expert id."""
    id_bytes = (max(info.num_experts - 1, 1).bit_length() + 6) // 7
    return info.moe_layers * info.moe_top_k * id_bytes
