"""Building GenerateRequests and collecting their events, shared by the async and sync clients."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.v1 import generation_pb2 as pb

from sluice_client.structured import structured_output

# A prompt: text, token ids, or a chat (a list of message dicts, or a ChatPrompt).
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]] | pb.ChatPrompt


def chat_prompt(
    messages: Sequence[Mapping[str, Any]] | pb.ChatPrompt,
    *,
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> pb.ChatPrompt:
    """A ChatPrompt from messages as transformers takes them: dicts with `role` and `content`;
    any other key (`tool_calls`, `tool_call_id`, `reasoning_content`...) goes to the template
    as part of the message (ChatMessage.extra_json); None-valued keys are dropped, as
    transformers drops them (see chat_message). `tools`: JSON-able tool definitions;
    `template_kwargs`: extra template variables (e.g. {"enable_thinking": False}).
    None leaves add_generation_prompt unset (the server's default: true)."""
    if isinstance(messages, pb.ChatPrompt):
        prompt = pb.ChatPrompt()
        prompt.CopyFrom(messages)
    else:
        prompt = pb.ChatPrompt()
        for message in messages:
            prompt.messages.append(chat_message(message))
    if tools is not None:
        prompt.tools_json = json.dumps(list(tools))
    if add_generation_prompt is not None:
        prompt.add_generation_prompt = add_generation_prompt
    if continue_final_message:
        prompt.continue_final_message = True
    if template_kwargs is not None:
        prompt.template_kwargs_json = json.dumps(dict(template_kwargs))
    return prompt


def chat_message(message: Mapping[str, Any]) -> pb.ChatMessage:
    """A ChatMessage the template sees as transformers would see `message`: without its
    None-valued keys (`content=None`, `tool_calls=None`, as OpenAI-style clients send them).
    Text content travels in `content`; any other (a list of content blocks), or none at all,
    in extra_json (`"content": null` there: the template sees no content key)."""
    kept = {k: v for k, v in message.items() if v is not None}
    content = kept.pop("content", None)
    extra = {k: v for k, v in kept.items() if k != "role"}
    if not isinstance(content, str):
        extra["content"] = content
    return pb.ChatMessage(
        role=str(kept.get("role", "")),
        content=content if isinstance(content, str) else "",
        extra_json=json.dumps(extra) if extra else "",
    )


def is_chat(prompt: object) -> bool:
    """A ChatPrompt, or a non-empty sequence of message mappings."""
    if isinstance(prompt, pb.ChatPrompt):
        return True
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) for m in prompt)
    )


def build_request(
    prompt: Prompt,
    *,
    request_id: str = "",
    max_tokens: int | None = None,
    min_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    allowed_token_ids: Iterable[int] = (),
    bad_words: Iterable[str] = (),
    bad_token_ids: Iterable[int] = (),
    stop: Iterable[str] = (),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    include_stop_str_in_output: bool = False,
    logprobs: bool = False,
    top_logprobs: int = 0,
    raw_logprobs: bool = False,
    prompt_logprobs: bool = False,
    prompt_logprobs_start: int | None = None,
    logprob_mode: str | None = None,
    sampling_support: bool = False,
    routed_experts: bool = False,
    skip_special_tokens: bool | None = None,
    n: int | None = None,
    min_policy_version: int | None = None,
    priority: int = 0,
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    json_schema: Mapping[str, Any] | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
    adapter: str = "",
    speculative: bool | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest; None leaves a field unset (the server's default applies).
    `prompt`: text, token ids, or a chat: a list of messages ({"role", "content", ...}) or a
    ChatPrompt, rendered by the server's chat template; `tools`, `add_generation_prompt`,
    `continue_final_message` and `template_kwargs` apply to a chat (see `chat_prompt`).
    `logprob_mode`: "RAW", "PROCESSED" or "SAMPLED" (LogprobMode without its prefix).
    `logit_bias` (token id -> bias), `allowed_token_ids`, `bad_words`, `bad_token_ids`: the
    sampling surface (SamplingParams in the proto). `json_schema` (a dict or JSON text),
    `json_object`, `regex`, `grammar` (GBNF) and `choice` (a list of strings): at most one,
    the constraint on the completion's text (see `structured_output`). `adapter`: the name of a
    LoRA adapter the server has loaded (Admin LoadAdapter); "" is the base model.
    `speculative=False` opts the request out of the server's speculative decoding (None: the
    server's default, speculate when it does); the tokens are the same either way."""
    sampling = pb.SamplingParams(
        logit_bias=dict(logit_bias or {}),
        allowed_token_ids=list(allowed_token_ids),
        bad_words=list(bad_words),
        bad_token_ids=list(bad_token_ids),
    )
    for name, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("min_p", min_p),
        ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty),
        ("repetition_penalty", repetition_penalty),
        ("seed", seed),
    ):
        if value is not None:
            setattr(sampling, name, value)
    stop_params = pb.StopParams(
        min_tokens=min_tokens,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        include_stop_str_in_output=include_stop_str_in_output,
    )
    if max_tokens is not None:
        stop_params.max_tokens = max_tokens
    output = pb.OutputOptions(
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        raw_logprobs=raw_logprobs,
        prompt_logprobs=prompt_logprobs,
        sampling_support=sampling_support,
        routed_experts=routed_experts,
    )
    if logprob_mode is not None:
        output.logprob_mode = pb.LogprobMode.Value(f"LOGPROB_MODE_{logprob_mode.upper()}")
    if prompt_logprobs_start is not None:
        output.prompt_logprobs_start = prompt_logprobs_start
    if skip_special_tokens is not None:
        output.skip_special_tokens = skip_special_tokens
    request = pb.GenerateRequest(
        request_id=request_id,
        sampling=sampling,
        stop=stop_params,
        output=output,
        priority=priority,
        adapter=adapter,
    )
    chat_options = {
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "template_kwargs": template_kwargs,
    }
    if is_chat(prompt):
        request.chat.CopyFrom(chat_prompt(prompt, **chat_options))  # type: ignore[arg-type]
    elif any(chat_options.values()) or add_generation_prompt is not None:
        raise ValueError(
            "tools, add_generation_prompt, continue_final_message and "
            "template_kwargs apply to a chat prompt (a list of messages)"
        )
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    if n is not None:
        request.n = n
    if min_policy_version is not None:
        request.min_policy_version = min_policy_version
    if speculative is not None:
        request.speculative = speculative
    structured = structured_output(
        json_schema=json_schema,
        json_object=json_object,
        regex=regex,
        grammar=grammar,
        choice=choice,
    )
    if structured is not None:
        request.structured.CopyFrom(structured)
    return request


@dataclass
class Completion:
    """Everything one request (one index) streamed back, put together; or, with `refused`
    set, a GenerateStream start that was refused before admission (nothing else follows)."""

    request_id: str
    index: int = 0
    started: pb.Started | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    # One per token with sampling_support=True: the ids it could have been drawn from ([]: all)
    sampling_support: list[list[int]] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)  # one per token
    # With routed_experts=True (mixture-of-experts models): the chunks' routed experts as sent,
    # flattened [token, MoE layer, k]; `experts_of` unflattens them
    routed_experts: list[int] = field(default_factory=list)
    finished: pb.Finished | None = None
    refused: pb.Refused | None = None

    @property
    def prompt_logprobs(self) -> list[float] | None:
        """The prompt's scores (`prompt_logprobs=True`): one per position from
        `started.prompt_logprobs.start`; None when not asked for (or not started)."""
        if self.started is None or not self.started.HasField("prompt_logprobs"):
            return None
        return list(self.started.prompt_logprobs.logprobs)

    def experts_of(self, moe_layers: int, experts_per_token: int) -> list[list[list[int]]]:
        """The routed experts per token: [token][MoE layer][k], highest weight first
        (`moe_layers` and `experts_per_token` as ServerInfo gives them)."""
        width = moe_layers * experts_per_token
        flat = self.routed_experts
        return [
            [
                flat[t + layer * experts_per_token : t + (layer + 1) * experts_per_token]
                for layer in range(moe_layers)
            ]
            for t in range(0, len(flat), width)
        ]

    @property
    def reason(self) -> str:
        """The finish reason's short name ("STOP", "LENGTH", ...), "REFUSED" for a refused
        start, or "" while running."""
        if self.refused is not None:
            return "REFUSED"
        if self.finished is None:
            return ""
        return pb.FinishReason.Name(self.finished.reason).removeprefix("FINISH_REASON_")

    def add(self, event: pb.GenerateResponse) -> None:
        match event.WhichOneof("event"):
            case "started":
                self.started = event.started
            case "tokens":
                chunk = event.tokens
                self.token_ids.extend(chunk.token_ids)
                self.text += chunk.text
                self.logprobs.extend(chunk.logprobs)
                self.sampling_support += [list(s.ids) for s in chunk.sampling_support]
                self.routed_experts.extend(chunk.routed_experts)
                self.policy_versions.extend([chunk.policy_version] * len(chunk.token_ids))
            case "finished":
                self.finished = event.finished
            case "refused":
                self.refused = event.refused


class Collector:
    """Groups events by (request_id, index) into Completions.

    A `refused` event is not part of any request, even one with the same id in flight: each
    gets a Completion of its own in `refused`, in the order received (its `refused.start_index`
    says which start of the stream it was).
    """

    def __init__(self) -> None:
        self.completions: dict[tuple[str, int], Completion] = {}
        self.refused: list[Completion] = []
        self._started: dict[str, pb.Started] = {}  # by request id

    def add(self, event: pb.GenerateResponse) -> Completion:
        if event.WhichOneof("event") == "refused":
            refusal = Completion(event.request_id, event.index, refused=event.refused)
            self.refused.append(refusal)
            return refusal
        key = (event.request_id, event.index)
        completion = self.completions.get(key)
        if completion is None:
            completion = self.completions[key] = Completion(event.request_id, event.index)
            # NOTE: `started` is sent once per request, with index 0, before any other index's
            # first event: a sample seen later gets it here.
            completion.started = self._started.get(event.request_id)
        completion.add(event)
        if event.WhichOneof("event") == "started":
            self._started[event.request_id] = event.started
            for (rid, _), other in self.completions.items():
                if rid == event.request_id:
                    other.started = event.started
        return completion

    def of_one_request(self, n: int) -> Completion | list[Completion]:
        """The result of `complete`: the one Completion of a request of n = 1, or the n of a
        request of n > 1 in index order (fewer only if the call ended early)."""
        samples = sorted(self.completions.values(), key=lambda c: c.index)
        assert samples, "the server sent no events"
        return samples if n > 1 else samples[0]


def samples_asked(prompt: object, params: dict[str, object]) -> int:
    """n of a `complete` call: of the GenerateRequest given, else its `n=` keyword (default 1)."""
    if isinstance(prompt, pb.GenerateRequest):
        return prompt.n if prompt.HasField("n") else 1
    n = params.get("n")
    return n if isinstance(n, int) else 1
