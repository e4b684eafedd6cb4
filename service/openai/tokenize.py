"""vLLM's `/tokenize` and `/detokenize`, over sluice.v1's own Tokenize and RenderChat rules.

/tokenize: {"prompt"} or {"messages"} (rendered with the chat template, as RenderChat does) ->
{"count", "max_model_len", "tokens"[, "token_strs"]}; a text that could not be a prompt is
refused without being encoded (sluice.v1 Tokenize's rule). /detokenize: {"tokens"} ->
{"prompt"}, ids checked against the vocabulary.
"""

from __future__ import annotations

from typing import Any

from service.openai.chat import chat_prompt
from service.openai.schemas import DetokenizeRequest, TokenizeRequest
from service.openai.translate import FieldError
from service.rpc.admission import text_violations
from service.rpc.chat import render
from service.rpc.refusal import invalid_argument
from service.rpc.servicer import GenerationServicer


async def tokenize(servicer: GenerationServicer, body: TokenizeRequest) -> dict[str, Any]:
    """Raises Refusal or FieldError; the servicer must be serving (the caller checks)."""
    tokenizer, info = servicer.tokenizer, servicer.engine.info
    assert tokenizer is not None and info is not None
    if (body.prompt is None) == (body.messages is None):
        raise FieldError("prompt", "send exactly one of prompt and messages")
    if body.messages is not None:
        prompt = chat_prompt(body.messages, body.add_generation_prompt, body.continue_final_message)
        _, ids = await render(
            prompt,
            servicer.chat_template,
            info,
            tokenizer,
            servicer.config.max_chat_messages,
            field="messages",
        )
    else:
        assert body.prompt is not None
        if violations := text_violations(body.prompt, info, tokenizer):
            raise invalid_argument([("prompt", d) for _, d in violations])
        ids = await tokenizer.encode(body.prompt, body.add_special_tokens)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": info.max_model_len}
    answer["tokens"] = ids
    if body.return_token_strs:
        answer["token_strs"] = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    return answer


def detokenize(servicer: GenerationServicer, body: DetokenizeRequest) -> dict[str, Any]:
    tokenizer, info = servicer.tokenizer, servicer.engine.info
    assert tokenizer is not None and info is not None
    if len(body.tokens) > info.max_model_len:
        raise FieldError("tokens", f"at most {info.max_model_len} ids (the context)")
    if any(not 0 <= t < info.vocab_size for t in body.tokens):
        raise FieldError("tokens", f"ids must be in [0, {info.vocab_size})")
    return {"prompt": tokenizer.decode(body.tokens)}
