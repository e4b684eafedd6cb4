"""Gemma 2 and Gemma 3 served by `python -m service` from their unchanged checkpoint
directories: the client's greedy ids and logprobs equal transformers', on prompts longer than
the sliding window; a checkpoint with a key Sluice cannot honour stops the server with a log
line naming the key, exit status 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from sluice_client import Client

from tests.support.server_process import server_process
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 16


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_greedy_ids_and_logprobs_through_the_service_equal_hf(arch: str, tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / arch, arch)
    batch = prompts(320, count=4)[1:]  # 12..28 tokens: past the window of 8
    flags = ["--model", str(checkpoint), "--device", "cpu", "--dtype", "float32"]
    with server_process(tmp_path / "server.log", *flags, "--page-size", "4") as server:
        server.wait_health("SERVING", timeout=120)
        with Client(server.target) as client:
            completions = [
                client.complete(
                    prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True
                )
                for prompt in batch
            ]
    hf = load_hf_model(checkpoint)
    for prompt, completion in zip(batch, completions, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert completion.reason == "LENGTH", completion.finished
        assert list(completion.token_ids) == expected, f"prompt of {len(prompt)} tokens diverged"
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        got = torch.tensor(list(completion.logprobs), dtype=torch.float32)
        torch.testing.assert_close(got, chosen, atol=1e-4, rtol=0)


def test_a_key_sluice_cannot_honour_stops_the_server_naming_it(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "gemma3", "gemma3_text")
    shutil.copytree(checkpoint, bad := tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_activation": "gelu"}))
    with server_process(tmp_path / "server.log", "--model", str(bad), "--device", "cpu") as server:
        assert server.proc.wait(120) == 1  # exited first: the log is complete
        [event] = server.events("server.engine_failed_to_start")
        assert "hidden_activation='gelu'" in event["error"], event
