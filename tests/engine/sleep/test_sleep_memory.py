"""Sleep gives the KV cache's memory (level 1) and the weights' (level 2) back to the system:
the process's resident set and its address space shrink by at least what was freed, while the
per-step buffers stay in the heap glibc is told to keep (engine/execution/host_malloc.py).
Measured in a fresh interpreter, from /proc/self/status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_models import make_checkpoint

KV_CACHE_BYTES = 256 << 20

SCRIPT = """
import json, sys
from pathlib import Path
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.execution.host_malloc import MAPPED_MIN_BYTES

def sizes():
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmSize"):
            found[key] = int(value.split()[0]) * 1024
    return found

def storages(tensors):
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

config = EngineConfig(model=sys.argv[1], device="cpu", dtype="float32",
                      kv_cache_memory=int(sys.argv[2]))
engine = LLMEngine(config)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
prompt = [0, 17, 42, 99, 123, 7, 88, 5]
before_ids = engine.generate([prompt], params)[0].token_ids
kv = sum(storages([engine.pool.k, engine.pool.v]).values())
weights = storages(engine.model.parameters()).values()
big_weights = sum(n for n in weights if n >= MAPPED_MIN_BYTES)
awake = sizes()
level1 = engine.sleep(level=1)
asleep1 = sizes()
engine.wake_up()
woken = sizes()
level2 = engine.sleep(level=2)
asleep2 = sizes()
engine.wake_up()
after_ids = engine.generate([prompt], params)[0].token_ids
print(json.dumps({"kv": kv, "weights": sum(weights), "big_weights": big_weights,
                  "released1": level1.released_bytes, "released2": level2.released_bytes,
                  "awake": awake, "asleep1": asleep1, "woken": woken, "asleep2": asleep2,
                  "same": before_ids == after_ids}))
"""


@pytest.fixture(scope="module")
def model_with_large_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two layers of 3 MiB projections: weights of a MiB and more, like a real model's."""
    return make_checkpoint(
        tmp_path_factory.mktemp("sleep_llama"),
        "llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
    )


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_sleep_returns_the_kv_pool_and_the_weights_to_the_system(
    model_with_large_weights: Path,
) -> None:
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_with_large_weights), str(KV_CACHE_BYTES)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    kv, big_weights = got["kv"], got["big_weights"]
    assert kv > KV_CACHE_BYTES * 0.9 and got["released1"] == kv
    assert got["released2"] == kv + got["weights"] and big_weights > 0.9 * got["weights"]
    awake, asleep1, woken, asleep2 = got["awake"], got["asleep1"], got["woken"], got["asleep2"]
    # Level 1: the pool's pages and its address space (before: only the pages, 4 MiB of space).
    assert awake["VmRSS"] - asleep1["VmRSS"] >= kv, got
    assert awake["VmSize"] - asleep1["VmSize"] >= kv, got
    assert woken["VmRSS"] - asleep1["VmRSS"] >= kv * 0.9, got  # reallocated and touched
    # Level 2: the weights too (those of a MiB and more are mappings of their own).
    assert woken["VmRSS"] - asleep2["VmRSS"] >= kv + big_weights, got
    assert woken["VmSize"] - asleep2["VmSize"] >= kv + big_weights, got
    assert got["same"]
