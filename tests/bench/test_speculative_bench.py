"""bench/speculative.py: every method runs beside `off` on the same prompts, each request from a
passage of its own (bench/speculative_prompts.py), and a cell whose tokens differ from off's is
reported, not fatal. The bench itself at a tiny size (a random tiny Llama as its own draft), in
seconds."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

import bench.speculative as spec
from bench.speculative_prompts import MODES, TASKS, Cell, build_cells, lookup_rate
from tests.support.tiny_models import make_checkpoint


def test_prompt_lookup_predicts_a_copied_continuation_and_prefers_the_longest_match() -> None:
    passage = list(range(10, 20))
    copy = passage[3:8]  # after the prompt's cue, passage[:3], the passage goes on
    assert lookup_rate(passage + passage[:3], copy, 2, 4) == 1.0
    assert lookup_rate(passage + passage[:3], [99, 98, 97], 2, 4) == 0.0
    # (1, 2, 3) was followed by 9; the later (2, 3) by 8: the longest n-gram decides.
    prompt = [1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3]
    assert lookup_rate(prompt, [9], 2, 3) == 1.0
    assert lookup_rate(prompt, [9], 2, 2) == 0.0


def test_every_prompt_of_a_run_has_a_passage_of_its_own() -> None:
    args = spec.parse_args(["--batches", "1", "4", "--min-requests", "3", "--passage-words", "6"])
    cells, warmup = build_cells(args, lambda text: [ord(c) for c in text], room=10_000)
    text = ["".join(map(chr, p)) for p in warmup + [p for c in cells for p in c.prompts]]
    passages = [t.split("\n")[0] for t in text]
    assert len(set(passages)) == len(passages)
    assert [(c.task, c.mode, c.batch, len(c.waves)) for c in cells] == [
        (task, mode, batch, waves)
        for task, mode in itertools.product(TASKS, MODES)
        for batch, waves in ((1, 3), (4, 1))
    ]
    for cell in cells:
        for prompt in ("".join(map(chr, p)) for p in cell.prompts):
            passage, *cue = prompt.split("\n")
            assert len(passage.split()) == 6
            assert cue == ([" ".join(passage.split()[:4])] if cell.task == "copy" else [])


def test_too_few_passages_is_a_clear_error() -> None:
    args = spec.parse_args(["--batches", "64", "--min-requests", "64", "--passage-words", "200"])
    with pytest.raises(ValueError, match="too few passages"):
        build_cells(args, lambda text: [0] * len(text.split()), room=10_000)


def test_every_method_runs_beside_off_and_other_tokens_are_reported_not_fatal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_checkpoint(tmp_path / "tiny")
    run_cell = spec.run_cell

    def one_cell_off_by_a_token(
        engine: Any, cell: Cell, args: argparse.Namespace, tag: str
    ) -> dict[str, Any]:
        run = run_cell(engine, cell, args, tag)
        if tag == "c0-ngram":  # as if its verification had emitted another last token
            run["token_ids"][0][-1] += 1
        return run

    monkeypatch.setattr(spec, "run_cell", one_cell_off_by_a_token)
    argv = ["--model", str(model), "--draft-model", str(model), "--batches", "1", "2"]
    argv += ["--min-requests", "2", "--max-tokens", "3", "--passage-words", "8", "--threads", "1"]
    argv += ["--repeat", "2"]  # two rounds, each on fresh engines
    assert spec.main(argv) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    methods = ["off", "ngram", "suffix", "draft"]
    cells = list(itertools.product(TASKS, MODES, [1, 2]))
    records = result["records"]
    assert [(r["task"], r["mode"], r["batch"], r["method"]) for r in records] == [
        (*cell, method) for cell in cells for method in methods
    ]
    for cell in zip(*[iter(records)] * len(methods), strict=True):
        off, off_cpu = cell[0]["output_tokens_per_s"], cell[0]["output_tokens_per_cpu_s"]
        for r in cell:
            assert r["output_tokens"] == 2 * 3
            assert len(r["all_output_tokens_per_s"]) == 2
            assert r["output_tokens_per_s"] == max(r["all_output_tokens_per_s"])
            assert r["ratio_to_off"] == pytest.approx(r["output_tokens_per_s"] / off)
            assert r["cpu_ratio_to_off"] == pytest.approx(r["output_tokens_per_cpu_s"] / off_cpu)
            assert 0 <= r["accepted_tokens"] <= r["proposed_tokens"]
            if r["acceptance_rate"] is not None:
                assert r["acceptance_rate"] == r["accepted_tokens"] / r["proposed_tokens"]
    assert all(0 <= c["lookup_rate"] <= 1 for c in result["cells"])
    assert result["task_models"] == {"copy": str(model), "free": str(model)}  # --model: both
    assert {c["model"] for c in result["cells"]} == {model.name}
    assert result["identical_tokens"] is False
    assert result["cells_with_other_tokens"] == ["copy/greedy/batch 1/ngram"]
    assert [r["same_tokens_as_off"] for r in records].count(False) == 1
    assert "token ids differ from off's in: copy/greedy/batch 1/ngram" in err


def test_the_demo_shape_runs_the_copy_task_on_the_copy_model_and_free_on_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.demo.checkpoint as demo

    built: list[str] = []

    def fake_build(size: str = "demo") -> Path:
        built.append(size)
        return tmp_path / f"demo-{size}"

    monkeypatch.setattr(demo, "ensure_demo_checkpoint", fake_build)
    models, _, draft = spec.resolve(spec.parse_args(["--methods", "ngram", "draft"]))
    assert models == {"copy": tmp_path / "demo-copy", "free": tmp_path / "demo-demo"}
    assert draft == tmp_path / "demo-draft"
    assert sorted(built) == ["copy", "demo", "draft"]
    model = tmp_path / "other"
    models, _, draft = spec.resolve(spec.parse_args(["--model", str(model), "--methods", "ngram"]))
    assert models == {"copy": model, "free": model} and draft is None


def test_continuous_arrival_keeps_the_batch_full_until_the_requests_run_out() -> None:
    """run_requests adds the next request as one ends: never more than the batch at once,
    and as many as that whenever enough are left."""
    from engine.protocol.messages import FinishReason, RequestOutput

    class Engine:  # each request ends after its own number of steps
        def __init__(self) -> None:
            self.left: dict[str, int] = {}
            self.widths: list[int] = []

        def add_request(self, rid: str, prompt: list[int], params: Any) -> None:
            self.left[rid] = len(prompt)

        def step(self) -> list[RequestOutput]:
            self.widths.append(len(self.left))
            outs = []
            for rid in list(self.left):
                self.left[rid] -= 1
                done = self.left[rid] == 0
                reason = FinishReason.LENGTH if done else None
                outs.append(RequestOutput(rid, 0, [7], 0, finish_reason=reason))
                if done:
                    del self.left[rid]
            return outs

    engine = Engine()
    prompts = [[0] * n for n in (3, 1, 4, 1, 5, 2, 6)]
    done = spec.run_requests(engine, prompts, [None] * len(prompts), 3, "t")
    assert [len(tokens) for tokens, _ in done] == [len(p) for p in prompts]
    assert max(engine.widths) == 3
    # Full while requests wait: the first 5 steps (7 requests, 3 at a time, the short ones
    # replaced at once).
    assert engine.widths[:5] == [3] * 5
