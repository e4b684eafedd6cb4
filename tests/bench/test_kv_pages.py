"""bench/step/kv_pages.py: a long request on a gpt-oss-like layer pattern holds a window's worth
of pages in its sliding group with reclamation, every page without it (a count, not a timing)."""

from __future__ import annotations

from bench.step.kv_pages import SHAPES, run


def test_reclamation_keeps_the_sliding_group_to_its_window() -> None:
    windows = SHAPES["gpt-oss-like"]
    on = run(windows, total=512, prompt=64, size=16, reclaim=True)
    off = run(windows, total=512, prompt=64, size=16, reclaim=False)
    assert on["windows"] == off["windows"] == [None, 128]
    assert on["held"] == [512 // 16, 128 // 16 + 1]  # the window and the page being filled
    assert off["held"] == [512 // 16, 512 // 16]
    assert on["layer_pages"] < off["layer_pages"]
