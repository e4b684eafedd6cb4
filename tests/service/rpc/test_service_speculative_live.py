"""Speculative decoding through `python -m service`: with --speculative-method ngram the
client's greedy ids and logprobs equal transformers' generate, a stop string ends the text
where it is first found, each sample's usage counts its proposed and accepted tokens (those
before a stop string too), a request that opts out is never proposed for, and server info
names the method; with --speculative-method draft, an inline UpdateWeights sets the draft's
tensors."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from sluice_client import Client

from tests.support.server_process import server_process
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint

NEW_TOKENS = 24


def copy_heavy(count: int) -> list[list[int]]:
    """Prompts that repeat a span: prompt lookup finds matches."""
    rng = random.Random(2)
    spans = [[rng.randrange(3, 300) for _ in range(5 + i)] for i in range(count)]
    return [[1, *span, *span, *span] for span in spans]


def test_greedy_through_the_service_with_ngram_equals_hf(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "llama", "llama")
    batch = copy_heavy(3)
    flags = ["--model", str(checkpoint), "--device", "cpu", "--dtype", "float32"]
    flags += ["--speculative-method", "ngram", "--ngram-min", "1", "--page-size", "4"]
    with server_process(tmp_path / "server.log", *flags) as server:
        server.wait_health("SERVING", timeout=120)
        with Client(server.target) as client:
            info = client.info()
            options = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
            done = [client.complete(p, logprobs=True, **options) for p in batch]
            opted = client.complete(batch[0], speculative=False, **options)
            # A stop string in the middle of what the second prompt generates.
            full = done[1].text
            stop = full[len(full) // 2 : len(full) // 2 + 3]
            stopped = client.complete(batch[1], stop=[stop], **options)
    assert (info.speculative_method, info.num_speculative_tokens) == ("ngram", 4)
    hf = load_hf_model(checkpoint)
    for prompt, completion in zip(batch, done, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert list(completion.token_ids) == expected
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        got = torch.tensor(list(completion.logprobs), dtype=torch.float32)
        torch.testing.assert_close(got, chosen, atol=1e-4, rtol=0)
    usage = [c.finished.usage for c in done]  # type: ignore[union-attr]
    assert sum(u.proposed_tokens for u in usage) > 0
    assert all(0 <= u.accepted_tokens <= u.proposed_tokens for u in usage)
    assert list(opted.token_ids) == list(done[0].token_ids)
    assert (opted.finished.usage.proposed_tokens, opted.finished.usage.accepted_tokens) == (0, 0)  # type: ignore[union-attr]
    assert stopped.reason == "STOP_STRING" and stopped.text == full[: full.index(stop)]
    # Its usage counts the proposals made before the stop string (prompt lookup proposes from
    # the first step on these prompts), not the zeros of a sample ended before its last output.
    cut = stopped.finished.usage  # type: ignore[union-attr]
    assert 0 < cut.proposed_tokens <= usage[1].proposed_tokens


def test_an_inline_update_sets_the_draft_models_tensors(tmp_path: Path) -> None:
    """UpdateWeights through the service, its tensors named `draft.` + the draft's names: the
    draft (another checkpoint's weights) becomes the model, so every greedy proposal is kept."""
    from safetensors.torch import load_file

    checkpoint = make_checkpoint(tmp_path / "llama", "llama")
    draft = make_checkpoint(tmp_path / "draft", "llama", seed=1)
    token = tmp_path / "admin.token"
    token.write_text("draft-admin-token\n")
    flags = ["--model", str(checkpoint), "--device", "cpu", "--dtype", "float32"]
    flags += ["--speculative-method", "draft", "--speculative-draft-model", str(draft)]
    flags += ["--admin-token-file", str(token)]
    model = load_file(str(checkpoint / "model.safetensors"))
    tensors = {
        f"draft.{name}": ("F32", tuple(t.shape), t.contiguous().numpy().tobytes())
        for name, t in model.items()
    }
    prompt, options = copy_heavy(1)[0], {"max_tokens": NEW_TOKENS, "ignore_eos": True}
    with server_process(tmp_path / "server.log", *flags) as server:
        server.wait_health("SERVING", timeout=120)
        with Client(server.target, admin_token="draft-admin-token") as client:
            before = client.complete(prompt, temperature=0.0, **options)
            applied = client.update_weights_inline(tensors, inflight="abort")
            after = client.complete(prompt, temperature=0.0, **options)
    assert applied.policy_version == 1
    old, new = before.finished.usage, after.finished.usage  # type: ignore[union-attr]
    assert old.accepted_tokens < old.proposed_tokens  # another checkpoint's proposals
    assert new.proposed_tokens > 0 and new.accepted_tokens == new.proposed_tokens
    assert list(after.token_ids) == list(before.token_ids)
    assert set(after.policy_versions) == {1}
