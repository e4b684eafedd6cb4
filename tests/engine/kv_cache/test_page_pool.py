"""PagePool: pages handed out referenced once, reference counts kept per page, a page freed
only when unreferenced, and the scratch page never handed out."""

from __future__ import annotations

import pytest

from tests.support.scheduler_builders import make_pool


def test_a_taken_page_is_referenced_once_and_freed_only_after_its_last_release() -> None:
    pool = make_pool(pages=4)
    page = pool.take_free()
    assert pool.ref_counts[page] == 1 and pool.num_free == 3 and page not in pool.free
    pool.retain(page)
    assert pool.release(page) is False  # one holder left
    assert pool.release(page) is True  # unreferenced: the caller frees or caches it
    pool.put_free(page)
    assert pool.num_free == 4 and pool.ref_counts[page] == 0


def test_releasing_an_unreferenced_page_is_refused() -> None:
    pool = make_pool(pages=2)
    with pytest.raises(AssertionError, match="released more often than retained"):
        pool.release(0)


def test_freeing_a_referenced_page_is_refused() -> None:
    pool = make_pool(pages=2)
    page = pool.take_free()
    with pytest.raises(AssertionError, match="freed while referenced"):
        pool.put_free(page)


def test_every_page_but_the_scratch_page_is_handed_out() -> None:
    pool = make_pool(pages=5)
    taken = [pool.take_free() for _ in range(5)]
    assert sorted(taken) == [0, 1, 2, 3, 4] and pool.num_free == 0
    assert pool.scratch_page == 5 and pool.k.shape[1] == pool.v.shape[1] == 6
    assert pool.scratch_slot == 5 * pool.page_size


@pytest.mark.parametrize(("tokens", "pages"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_pages_for_rounds_up_to_whole_pages(tokens: int, pages: int) -> None:
    assert make_pool(page_size=4).pages_for(tokens) == pages


def test_a_copied_page_holds_the_sources_k_and_v_in_every_layer() -> None:
    pool = make_pool(pages=3)
    pool.k[:, 0].fill_(1.5)
    pool.v[:, 0].fill_(-2.0)
    pool.copy_log = []
    pool.copy_page(0, 2)
    assert bool((pool.k[:, 2] == 1.5).all()) and bool((pool.v[:, 2] == -2.0).all())
    assert pool.copy_log == [(0, 2)]  # what rank 0 tells the other ranks to copy
