"""The real lm-eval (pinned) against the OpenAI front, on tasks shipped beside this file (no
download): `local-completions` loglikelihoods equal HF transformers' on the same checkpoint,
and `local-chat-completions` generations equal sluice.v1's greedy answer to the same chats."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lm_eval import simple_evaluate
from lm_eval.api.registry import get_model
from sluice.v1 import generation_pb2 as pb
from sluice_client import build_request

from tests.service.openai.conftest import API_TOKEN
from tests.support.tiny_models import load_hf_model

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

TASKS = Path(__file__).parent / "lm_eval_tasks"
DATA = TASKS / "proverbs.jsonl"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", API_TOKEN)  # lm-eval's local models send it


def task(name: str) -> dict[str, Any]:
    config = yaml.safe_load((TASKS / name).read_text())
    config["dataset_kwargs"]["data_files"]["test"] = str(DATA)
    return config


def evaluate(lm: Any, config: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    results = simple_evaluate(model=lm, tasks=[config], log_samples=True, **kwargs)
    assert results is not None
    return results


def hf_loglikelihoods(model: Any, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """HF's log-probability of each continuation after its context: one forward of every
    sequence, right-padded (a causal model's logits at real positions ignore the padding)."""
    sequences = [context + continuation for context, continuation in pairs]
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        logprobs = model(ids, attention_mask=mask).logits.float().log_softmax(-1)
    scores = []
    for row, (context, continuation) in enumerate(pairs):
        positions = torch.arange(len(context) - 1, len(context) + len(continuation) - 1)
        scores.append(float(logprobs[row, positions, torch.tensor(continuation)].sum()))
    return scores


async def test_local_completions_loglikelihoods_equal_hf(front):
    lm = get_model("local-completions")(
        base_url=front.base_url + "/v1/completions",
        model=front.model,
        tokenizer=str(front.checkpoint),
        tokenizer_backend="huggingface",
        max_length=512,
        batch_size=16,  # 16 token-id prompts per request: choice i is prompt i
    )
    results = await asyncio.to_thread(evaluate, lm, task("proverbs_loglikelihood.yaml"))
    samples = results["samples"]["sluice_proverbs_loglikelihood"]
    assert len(samples) == 30
    pairs, served = [], []
    for sample in samples:
        for (text, ending), response in zip(sample["arguments"], sample["resps"], strict=True):
            pairs.append(lm._encode_pair(text, ending))  # the ids lm-eval sent
            served.append(response[0][0])
    assert len(served) == 90
    expected = hf_loglikelihoods(load_hf_model(front.checkpoint), pairs)
    assert served == pytest.approx(expected, abs=1e-4)


async def test_local_chat_completions_generations_equal_sluice_greedy(front):
    lm = get_model("local-chat-completions")(
        base_url=front.base_url + "/v1/chat/completions", model=front.model
    )
    config = task("proverbs_generate.yaml")
    results = await asyncio.to_thread(evaluate, lm, config, apply_chat_template=True, limit=8)
    samples = results["samples"]["sluice_proverbs_generate"]
    assert len(samples) == 8
    for sample in samples:
        ((context, _),) = sample["arguments"]
        messages = json.loads(context.prompt)  # lm-eval's JsonChatStr
        request = build_request("", max_tokens=8, temperature=0.0, stop=["."])
        request.chat.messages.extend(
            pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages
        )
        direct = await front.grpc.complete(request)
        assert sample["resps"][0][0] == direct.text
