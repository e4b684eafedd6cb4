"""A vLLM worker-protocol GenerateRequest as a sluice.v1 GenerateRequest, or a Refusal.

The worker protocol has no admission of its own: its request becomes a sluice.v1 request and
goes through GenerationServicer.submit like any other. This module reads the proto3 zero
defaults as vLLM's servicer does (top_p 0, top_k 0, repetition_penalty 0 and n 0 mean unset),
takes vLLM's default logprobs mode (raw: the model's logits), and refuses every field Sluice
cannot honour by its vLLM name, INVALID_ARGUMENT, before anything else is judged: a field is
never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.v1 import generation_pb2 as pb

from service.rpc.refusal import Refusal, invalid_argument
from service.vllm_worker.pb import vllm_engine_pb2 as vpb

UINT64 = 2**64
# vLLM's logprobs=-1 asks for the whole vocabulary; Sluice returns at most this many per token.
MAX_TOP_LOGPROBS = 20

# sluice.v1 field paths (as admission names them) -> the worker protocol's: whole paths first,
# then prefixes, which map every path under them ("sampling.top_p" -> "sampling_params.top_p").
FIELD_PATHS = {
    "token_ids": "tokenized.input_ids",
    "token_ids.ids": "tokenized.input_ids",
    "prompt": "input",
    "n": "sampling_params.n",
    "output.prompt_logprobs": "sampling_params.prompt_logprobs",
    "output.prompt_logprobs_start": "sampling_params.prompt_logprobs",
    "output.top_logprobs": "sampling_params.logprobs",
    "output.logprobs": "sampling_params.logprobs",
}
FIELD_PREFIXES = (
    ("sampling.", "sampling_params."),
    ("stop.", "sampling_params."),
    ("structured.", "sampling_params."),
)


@dataclass(frozen=True)
class LogprobCounts:
    """How many top logprobs each side asked for (vLLM's logprobs and prompt_logprobs):
    None when not asked; 0 for the chosen token's alone."""

    output: int | None
    prompt: int | None


def unsupported(request: vpb.GenerateRequest) -> list[tuple[str, str]]:
    """The fields of `request` Sluice does not serve, each with why."""
    params = request.sampling_params
    errors: list[tuple[str, str]] = []
    if params.WhichOneof("constraint") == "structural_tag":
        errors.append(("sampling_params.structural_tag", "structural tags are not supported"))
    if params.HasField("truncate_prompt_tokens"):
        errors.append(
            (
                "sampling_params.truncate_prompt_tokens",
                "prompts are never truncated: a prompt too long for the context is refused",
            )
        )
    if request.HasField("kv_transfer_params"):
        errors.append(("kv_transfer_params", "prefill/decode disaggregation is not supported"))
    if request.HasField("kv_transfer_params_json"):
        errors.append(("kv_transfer_params_json", "prefill/decode disaggregation is not supported"))
    if request.HasField("mm_inputs"):
        errors.append(("mm_inputs", "the served model takes text only"))
    if request.extra_mm_inputs:
        errors.append(("extra_mm_inputs", "the served model takes text only"))
    if request.HasField("media_refs"):
        errors.append(("media_refs", "the served model takes text only"))
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        errors.append(("data_parallel_rank", "this worker has one data-parallel rank, 0"))
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name) and not 0 <= getattr(params, name) <= MAX_TOP_LOGPROBS:
            errors.append(
                (
                    f"sampling_params.{name}",
                    f"must be in [0, {MAX_TOP_LOGPROBS}] (-1, the whole vocabulary, is not "
                    "supported)",
                )
            )
    if any(token_id < 0 for token_id in params.logit_bias):
        errors.append(("sampling_params.logit_bias", "token ids must be >= 0"))
    return errors


def logprob_counts(params: vpb.SamplingParams) -> LogprobCounts:
    return LogprobCounts(
        output=params.logprobs if params.HasField("logprobs") else None,
        prompt=params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
    )


def to_sluice(request: vpb.GenerateRequest) -> pb.GenerateRequest:
    """The sluice.v1 request that asks for what `request` asks for; raises Refusal
    (INVALID_ARGUMENT naming the worker-protocol field) for a field Sluice does not serve."""
    if errors := unsupported(request):
        raise invalid_argument(errors)
    params = request.sampling_params
    sluice = pb.GenerateRequest(
        request_id=request.request_id,
        sampling=_sampling(params),
        stop=_stop(params),
        output=_output(params),
        structured=_structured(params),
    )
    match request.WhichOneof("input"):
        case "text":
            sluice.text = request.text
        case "tokenized":
            sluice.token_ids.ids.extend(request.tokenized.input_ids)
        # Neither: left unset, and admission refuses it (field `prompt`, named `input` here).
    if params.n:
        sluice.n = params.n
    return sluice


def _sampling(params: vpb.SamplingParams) -> pb.SamplingParams:
    sampling = pb.SamplingParams(logit_bias=dict(params.logit_bias))
    if params.HasField("temperature"):
        sampling.temperature = params.temperature
    if params.top_p:  # 0: unset (1.0)
        sampling.top_p = params.top_p
    if params.top_k:
        sampling.top_k = params.top_k
    if params.min_p:
        sampling.min_p = params.min_p
    if params.frequency_penalty:
        sampling.frequency_penalty = params.frequency_penalty
    if params.presence_penalty:
        sampling.presence_penalty = params.presence_penalty
    if params.repetition_penalty:  # 0: unset (1.0)
        sampling.repetition_penalty = params.repetition_penalty
    if params.HasField("seed"):
        sampling.seed = params.seed % UINT64  # a negative int32 seed as its two's complement
    return sampling


def _stop(params: vpb.SamplingParams) -> pb.StopParams:
    stop = pb.StopParams(
        min_tokens=params.min_tokens,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )
    if params.HasField("max_tokens"):  # unset: the rest of the context, as vLLM
        stop.max_tokens = params.max_tokens
    return stop


def _output(params: vpb.SamplingParams) -> pb.OutputOptions:
    """vLLM's logprobs=N is the chosen token's logprob plus the N most likely; prompt logprobs
    likewise. sluice.v1 has one top_logprobs for both sides: the larger, each side cut to its
    own N when the response is built. Raw logprobs: vLLM's default logprobs mode."""
    counts = logprob_counts(params)
    output = pb.OutputOptions(
        logprobs=counts.output is not None,
        prompt_logprobs=counts.prompt is not None,
        top_logprobs=max(counts.output or 0, counts.prompt or 0),
        skip_special_tokens=params.skip_special_tokens,
    )
    if counts.output is not None or counts.prompt is not None:
        output.logprob_mode = pb.LOGPROB_MODE_RAW
    # spaces_between_special_tokens: Sluice decodes with the checkpoint's fast tokenizer
    # (tokenizer.json), where vLLM does not apply it either; it changes nothing.
    return output


def _structured(params: vpb.SamplingParams) -> pb.StructuredOutput | None:
    # grammar_from_first_token: Sluice runs no reasoning parser; every constraint starts at the
    # first generated token, which is what the flag asks for.
    match params.WhichOneof("constraint"):
        case "json_schema":
            return pb.StructuredOutput(json_schema=params.json_schema)
        case "regex":
            return pb.StructuredOutput(regex=params.regex)
        case "grammar":
            return pb.StructuredOutput(grammar=params.grammar)
        case "json_object":
            return pb.StructuredOutput(json_object=params.json_object)
        case "choice":
            return pb.StructuredOutput(choice=pb.ChoiceList(choices=params.choice.choices))
    return None


def renamed(refusal: Refusal) -> Refusal:
    """`refusal` with its field violations named as the worker protocol names them."""
    if not refusal.violations:
        return refusal
    violations = [(_worker_path(field), why) for field, why in refusal.violations]
    return invalid_argument(violations) if refusal.code.name == "INVALID_ARGUMENT" else refusal


def _worker_path(path: str) -> str:
    if path in FIELD_PATHS:
        return FIELD_PATHS[path]
    for sluice, worker in FIELD_PREFIXES:
        if path.startswith(sluice):
            return worker + path.removeprefix(sluice)
    return path
