"""End to end: a server started on an FP8 checkpoint as released serves the in-process
engine's tokens (which tests/engine/weights/test_quantized_checkpoints.py holds to
transformers'), takes Admin.UpdateWeights from another FP8 checkpoint, and refuses one whose
quantization it does not compute with INVALID_ARGUMENT naming the key, serving on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
from sluice_client import Client, build_request

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.quantized_checkpoints import quantize_checkpoint
from tests.support.server_process import server_process
from tests.support.tiny_models import make_checkpoint

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "quantized-admin"
QWEN3 = {
    "hidden_size": 256,
    "intermediate_size": 384,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
PROMPTS = [[0, 17, 42, 99, 123, 7], [0, 5, 6, 7, 8, 9, 10, 11]]
MAX_TOKENS = 8


def fp8_checkpoint(directory: Path, seed: int) -> Path:
    return quantize_checkpoint(make_checkpoint(directory, "qwen3", seed=seed, **QWEN3), "fp8")


def engine_ids(checkpoint: Path) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r.token_ids for r in engine.generate(PROMPTS, params)]


def served_ids(client: Client) -> list[list[int]]:
    return [
        client.complete(
            build_request(p, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        ).token_ids
        for p in PROMPTS
    ]


def test_an_fp8_checkpoint_serves_and_updates_over_grpc(tmp_path: Path) -> None:
    a, b = fp8_checkpoint(tmp_path / "a", 0), fp8_checkpoint(tmp_path / "b", 1)
    static = Path(shutil.copytree(b, tmp_path / "static"))
    config = json.loads((static / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (static / "config.json").write_text(json.dumps(config))
    (tmp_path / "admin_token").write_text(ADMIN_TOKEN)
    flags = ("--model", str(a), "--device", "cpu", "--dtype", "float32")
    flags += ("--admin-token-file", str(tmp_path / "admin_token"))
    with server_process(tmp_path / "server.log", *flags) as server:
        server.wait_health("SERVING", timeout=120)
        with Client(server.target, admin_token=ADMIN_TOKEN) as client:
            assert served_ids(client) == engine_ids(a)
            with pytest.raises(grpc.RpcError) as refused:
                client.update_weights(str(static))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "activation_scheme 'static'" in str(refused.value.details())
            assert served_ids(client) == engine_ids(a)
            client.update_weights(str(b))
            assert served_ids(client) == engine_ids(b)
