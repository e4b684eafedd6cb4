"""bench/peers/offline.py's parts that need no vLLM: the shared workload, the children's commands and
environment, the JSON summary, and the Sluice worker against the HF argmax loop."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench import report
from bench.hf_reference import decode_loop
from bench.peers import offline, workers
from bench.workload import make_workload
from tests.support.tiny_models import load_hf_model


def test_greedy_workload_is_the_same_for_both_workers() -> None:
    args = offline.parse_args(["--num-requests", "6", "--scale", "0.05", "--threads", "2"])
    first = make_workload(320, args.scale, args.num_requests, temperature=0.0)
    again = make_workload(320, args.scale, args.num_requests, temperature=0.0)
    spec = offline.spec_for(args, Path("/m"), first)
    assert (spec["prompts"], spec["output_lens"]) == (again.prompts, again.output_lens)
    assert spec["max_model_len"] == max(
        len(p) + n for p, n in zip(first.prompts, first.output_lens, strict=True)
    )
    assert (spec["kv_cache_gib"], spec["max_num_seqs"], spec["max_num_batched_tokens"]) == (
        1,
        128,
        2048,
    )


def test_vllm_worker_runs_by_path_isolated_and_gets_cores_and_kv_cache() -> None:
    command = offline.worker_command("vllm", Path("/v/bin/python"), Path("s"), Path("o"))
    assert command[:2] == ["/v/bin/python", "-P"] and command[2].endswith("bench/peers/workers.py")
    assert offline.worker_command("sluice", Path("/v"), Path("s"), Path("o"))[:3] == [
        sys.executable,
        "-m",
        "bench.peers.workers",
    ]
    env = offline.worker_env("vllm", 2, 1, Path("/v/bin/python"), ["VLLM_X=a=b"])
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("1", "0-1")
    assert env["VLLM_X"] == "a=b"
    sluice = offline.worker_env("sluice", 2, 1, Path("/v"), ["OMP_WAIT_POLICY=PASSIVE"])
    assert "VLLM_CPU_KVCACHE_SPACE" not in sluice and sluice["OMP_WAIT_POLICY"] == "PASSIVE"


def record(rate: float, tokens: list[list[int]]) -> dict[str, Any]:
    return {"output_tokens_per_s": rate, "seconds": 1.0, "load_seconds": 2.0,
            "peak_rss_mib": 300.0, "peak_rss_tree_mib": 310.0, "token_ids": tokens}  # fmt: skip


def test_summary_has_each_runs_ratio_the_median_and_token_identity() -> None:
    a, b = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    runs = [
        {"first": "sluice", "sluice": record(300.0, a), "vllm": record(100.0, b)},
        {"first": "vllm", "sluice": record(200.0, a), "vllm": record(200.0, b)},
        {"first": "sluice", "sluice": record(150.0, a), "vllm": record(100.0, [[1, 2], [3, 4]])},
    ]
    summary = offline.summarize(runs)
    assert summary["ratios"] == [3.0, 1.0, 1.5]
    assert summary["median_ratio"] == 1.5
    assert summary["runs"][1]["first"] == "vllm"
    assert summary["runs"][0]["vllm"] == {
        k: v for k, v in record(100.0, b).items() if k != "token_ids"
    }
    assert summary["token_identity_sluice_vllm"] == {
        "identical": 1,
        "of": 2,
        "first_divergence": [1],
    }
    assert summary["repeatable"] == {"sluice": True, "vllm": False}
    json.dumps(summary)  # plain data


def test_sluice_worker_output_is_the_hf_argmax_loop(tiny_llama: Path, tmp_path: Path) -> None:
    workload = make_workload(320, 0.02, 3, temperature=0.0)
    args = offline.parse_args(["--threads", "1", "--kv-cache-gib", "1"])
    spec = {**offline.spec_for(args, tiny_llama, workload), "kv_cache_gib": 0.01}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    workers.main(["sluice", str(tmp_path / "spec.json"), str(tmp_path / "out.json")])
    out = json.loads((tmp_path / "out.json").read_text())
    model = load_hf_model(tiny_llama)
    expected = [
        decode_loop(model, [p], n)[0]
        for p, n in zip(workload.prompts, workload.output_lens, strict=True)
    ]
    assert out["token_ids"] == expected
    assert out["output_tokens"] == workload.output_tokens and out["peak_rss_tree_mib"] > 0


def test_report_renders_each_run_the_median_and_identity() -> None:
    a = [[1, 2], [3, 4]]
    runs = [
        {"first": "sluice", "sluice": record(300.0, a), "vllm": record(100.0, a)},
        {"first": "vllm", "sluice": record(100.0, a), "vllm": record(200.0, a)},
    ]
    hf = {"requests": 2, "sluice": {"identical": 2}, "vllm": {"identical": 1}}
    workload = make_workload(320, 0.05, 2, temperature=0.0).describe()
    result = {"model": "tiny-hd32", "dtype": "float32", "threads": 2, "kv_cache_gib": 1,
              "max_num_seqs": 128, "max_num_batched_tokens": 2048, "workload": workload,
              "vllm_version": "0.32.0", "hf_check": hf, **offline.summarize(runs)}  # fmt: skip
    text = report.peer_vllm(result)
    assert "| 0 | sluice | 300 | 100 | 3.00 |" in text and "| 1 | vllm | 100 | 200 | 0.50 |" in text
    assert "median sluice / vLLM: **1.75x**" in text
    assert "token-identical sequences: 2 of 2" in text and "sluice 2, vLLM 1" in text
