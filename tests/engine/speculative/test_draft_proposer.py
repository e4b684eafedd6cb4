"""The draft-model proposer: its proposals are the draft checkpoint's greedy continuation, as
Hugging Face transformers computes it, however the requests grow between calls; its pages come
back when a request finishes; a draft with another vocabulary is refused at load; a full pool
proposes nothing rather than failing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.execution.model_shard import DRAFT_KV_SHARE
from engine.kv_cache.page_pool import PagePool
from engine.models.base import KVLayout
from engine.models.hf_config import load_model_config
from engine.parallel.tensor_parallel import TensorParallel
from engine.protocol.config import EngineConfig
from engine.scheduling.request import Request
from engine.speculative.draft import DraftProposer, draft_proposer
from engine.speculative.draft_model import DraftModel, draft_config, load_draft
from tests.support.scheduler_builders import make_request
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, make_tokenizer

PAGE = 4
CPU = torch.device("cpu")
# The draft: half the target's width, one layer, the same tokenizer (make_checkpoint's).
DRAFT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=0)


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=1, **DRAFT)


@pytest.fixture(scope="module")
def hf_draft(draft: Path) -> Any:
    return load_hf_model(draft)


def config(target: Path, draft: Path, **overrides: Any) -> EngineConfig:
    return EngineConfig(
        model=str(target),
        device="cpu",
        dtype="float32",
        page_size=PAGE,
        speculative_method="draft",
        speculative_draft_model=str(draft),
        **overrides,
    )


def make_proposer(
    target: Path, draft: Path, kv_bytes: int = 1 << 30, max_seqs: int = 8, max_tokens: int = 64
) -> DraftProposer:
    """A proposer whose pool is what `kv_bytes` of target KV allow (draft_model.py's rule)."""
    return DraftProposer(load(config(target, draft), kv_bytes), max_seqs, max_tokens)


def load(engine_config: EngineConfig, kv_bytes: int) -> DraftModel:
    """The draft of `engine_config`, one rank, beside `kv_bytes` of target KV."""
    target = Path(engine_config.model)
    cfg = draft_config(engine_config, target, load_model_config(target))
    return load_draft(engine_config, cfg, TensorParallel(), CPU, torch.float32, kv_bytes)


def requests(lengths: list[int]) -> list[Request]:
    gen = torch.Generator().manual_seed(7)
    return [
        make_request(
            f"r{i}", n, tokens=[0, *torch.randint(2, 300, (n - 1,), generator=gen).tolist()]
        )
        for i, n in enumerate(lengths)
    ]


def test_proposals_are_the_drafts_greedy_continuation_as_requests_grow(
    target: Path, draft: Path, hf_draft: Any
) -> None:
    # Five requests of different lengths, more than a pass's sequences (4) and tokens (32): the
    # first call's catch-up is chunked over several passes.
    proposer = make_proposer(target, draft, max_seqs=4, max_tokens=32)
    check_growing_requests(proposer, hf_draft, requests([3, 9, 17, 26, 40]), [4, 1, 3, 5, 2])


def test_a_draft_with_sliding_window_layers_proposes_its_greedy_continuation(
    target: Path, tmp_path: Path
) -> None:
    # Gemma 2: sliding (window 8) and full layers, two KV groups: a page id in each per page.
    gemma = make_checkpoint(tmp_path / "gemma", "gemma2", seed=2)
    proposer = make_proposer(target, gemma, max_seqs=4, max_tokens=32)
    assert proposer.passes.num_groups == 2
    reqs = requests([5, 14, 30])
    check_growing_requests(proposer, load_hf_model(gemma), reqs, [3, 5, 4])
    for req in reqs:
        proposer.finished(req)
    assert proposer.pool.num_free == proposer.pool.num_pages


def check_growing_requests(
    proposer: DraftProposer, hf_draft: Any, reqs: list[Request], limits: list[int]
) -> None:
    """Proposals equal transformers' greedy continuation of the draft, call after call, as
    each request takes some of them and then tokens of its own."""
    # Per round and request: how many proposals the target accepts, then how many tokens of
    # its own follow them, the first differing from the next proposal (1: the verifying
    # step's; more: steps that decoded without speculating came before the next call).
    rounds = [
        ([2, 0, 3, 5, 1], [1, 1, 1, 1, 1]),
        ([4, 1, 0, 2, 2], [1, 3, 2, 1, 4]),
        ([0, 0, 1, 3, 0], [2, 1, 1, 3, 1]),
    ]
    for round in [*rounds, None]:
        proposals = proposer.propose(reqs, limits)
        for req, limit, got in zip(reqs, limits, proposals, strict=True):
            expected, _ = hf_greedy(hf_draft, req.token_ids, limit)
            assert got == expected, f"{req.request_id} at {len(req.token_ids)} tokens"
        if round is None:
            break
        for req, got, accepted, emitted in zip(reqs, proposals, *round, strict=False):
            own = [got[accepted] + 1 if accepted < len(got) else 5] + [7] * (emitted - 1)
            req.token_ids += got[:accepted] + [token % 300 for token in own]


def test_a_request_that_did_not_advance_gets_the_same_proposals(target: Path, draft: Path) -> None:
    proposer = make_proposer(target, draft)
    reqs = requests([11, 6])
    first = proposer.propose(reqs, [4, 4])
    assert proposer.propose(reqs, [4, 4]) == first
    assert proposer.propose(reqs, [2, 3]) == [first[0][:2], first[1][:3]]


def test_finished_frees_the_requests_pages(target: Path, draft: Path) -> None:
    proposer = make_proposer(target, draft)
    pool = proposer.pool
    reqs = requests([10, 23])
    proposer.propose(reqs, [4, 4])
    # Pages for every position fed: the tokens and the proposals but the last.
    assert pool.num_free == pool.num_pages - pool.pages_for(10 + 3) - pool.pages_for(23 + 3)
    proposer.finished(reqs[0])
    assert pool.num_free == pool.num_pages - pool.pages_for(23 + 3)
    proposer.finished(reqs[1])
    assert pool.num_free == pool.num_pages
    assert all(count == 0 for count in pool.ref_counts)
    proposer.finished(reqs[1])  # once more: nothing held, nothing done


def test_a_full_pool_proposes_nothing_for_the_requests_it_cannot_hold(
    target: Path, draft: Path, hf_draft: Any
) -> None:
    per_page = PagePool.bytes_per_page(PAGE, 1, 1, 16, torch.float32)  # the draft's layout
    # 6 pages: room for the first request's 5 (17 tokens + 3 proposals fed), not the second's.
    proposer = make_proposer(target, draft, kv_bytes=6 * per_page * DRAFT_KV_SHARE)
    assert proposer.pool.num_pages == 6
    first, second = requests([17, 12])
    expected, _ = hf_greedy(hf_draft, first.token_ids, 4)
    assert proposer.propose([first, second], [4, 4]) == [expected, []]
    # Outside this call, the first request's KV is evicted to make room for the second.
    expected, _ = hf_greedy(hf_draft, second.token_ids, 4)
    assert proposer.propose([second], [4]) == [expected]
    assert first.key not in proposer.seqs


def test_proposals_stop_at_the_drafts_context(target: Path, draft: Path, hf_draft: Any) -> None:
    proposer = make_proposer(target, draft)
    long = requests([proposer.draft.max_model_len - 1])[0]
    expected, _ = hf_greedy(hf_draft, long.token_ids, 2)
    # Its last position fed is the draft's last: 2 proposals, not 4.
    assert proposer.propose([long], [4]) == [expected]


def test_a_draft_of_another_vocab_size_is_refused_by_name(
    target: Path, draft: Path, tmp_path: Path
) -> None:
    other = copy_checkpoint(draft, tmp_path / "other")
    raw = json.loads((other / "config.json").read_text())
    raw["vocab_size"] += 64
    (other / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"^speculative_draft_model: vocab_size 384 differs"):
        make_proposer(target, other)


def test_a_draft_whose_tokenizer_maps_other_tokens_is_refused_by_name(
    target: Path, draft: Path, tmp_path: Path
) -> None:
    other = copy_checkpoint(draft, tmp_path / "other")
    # Trained on other text: the same number of ids, meaning other tokens.
    tokenizer = make_tokenizer(corpus=["other text entirely, with merges of its own " * 40])
    tokenizer.save(str(other / "tokenizer.json"))
    raw = json.loads((other / "config.json").read_text())
    raw["vocab_size"] = json.loads((target / "config.json").read_text())["vocab_size"]
    (other / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"^speculative_draft_model: .*tokenizer.json maps"):
        make_proposer(target, other)


def test_a_draft_that_is_no_checkpoint_is_refused_by_name(target: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^speculative_draft_model: .* no config.json"):
        make_proposer(target, tmp_path / "nothing")


def test_the_pool_takes_a_bounded_share_of_the_targets_kv(target: Path, draft: Path) -> None:
    target_pool = PagePool(1024, PAGE, 2, 2, 16, torch.float32, CPU)
    shared = config(target, draft)
    proposer = draft_proposer(shared, load(shared, target_pool.num_bytes))
    assert (
        proposer.pool.num_bytes
        <= target_pool.num_bytes // DRAFT_KV_SHARE
        + PagePool.bytes_per_page(PAGE, 1, 1, 16, torch.float32)
    )  # + its scratch page
    # A roomy target: the draft holds speculative_max_batch sequences at full length.
    roomy = PagePool(1 << 16, PAGE, 2, 2, 16, torch.float32, CPU)
    proposer = draft_proposer(shared, load(shared, roomy.num_bytes))
    per_seq = proposer.pool.pages_for(proposer.draft.max_model_len)
    assert proposer.pool.num_pages == 8 * per_seq  # speculative_max_batch's default


def copy_checkpoint(source: Path, destination: Path) -> Path:
    destination.mkdir()
    for file in source.iterdir():
        (destination / file.name).write_bytes(file.read_bytes())
    return destination


def test_the_kv_of_accepted_proposals_is_kept_and_only_new_tokens_are_fed(
    target: Path, draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proposer = make_proposer(target, draft)
    fed: list[int] = []
    run = proposer.passes.run
    monkeypatch.setattr(proposer.passes, "run", lambda s, n: fed.append(sum(n)) or run(s, n))
    (req,) = requests([10])
    (got,) = proposer.propose([req], [4])
    assert fed == [10, 1, 1, 1]  # the prompt, then each proposal but the last
    fed.clear()
    req.token_ids += [*got, 5]  # all 4 accepted, then the target's bonus token
    proposer.propose([req], [4])
    # The first three proposals' KV stays: the fourth and the bonus are fed, then 3 decodes.
    assert fed == [2, 1, 1, 1]


def test_a_byte_budget_holds_both_pools(target: Path, draft: Path) -> None:
    from engine.execution.model_shard import kv_pages

    cfg = load_model_config(target)
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    per_page = PagePool.bytes_per_page(PAGE, *shape, torch.float32)
    budget = {"kv_cache_memory": 1 << 20}
    layout = KVLayout(*shape)
    alone_config = EngineConfig(model=str(target), page_size=PAGE, **budget)
    alone = kv_pages(alone_config, cfg, layout, torch.float32, CPU)
    shared = config(target, draft, **budget)
    pages = kv_pages(shared, cfg, layout, torch.float32, CPU)
    assert pages == ((1 << 20) - (1 << 20) // DRAFT_KV_SHARE) // per_page < alone
    target_pool = PagePool(pages, PAGE, *shape, torch.float32, CPU)
    proposer = draft_proposer(shared, load(shared, target_pool.num_bytes))
    used = target_pool.num_bytes + proposer.pool.num_bytes
    assert used <= (1 << 20) + 2 * per_page  # + each pool's scratch page


def test_a_draft_the_tensor_parallel_size_does_not_divide_is_refused_before_any_worker(
    target: Path, draft: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.core import model_parts
    from engine.core.llm_engine import LLMEngine

    def no_workers(*args: object) -> None:
        raise AssertionError("workers started before the draft was checked")

    monkeypatch.setattr(model_parts, "WorkerGroup", no_workers)

    three = copy_checkpoint(draft, tmp_path / "three-heads")
    raw = json.loads((three / "config.json").read_text())
    raw |= {"num_attention_heads": 4, "num_key_value_heads": 3, "head_dim": 8}
    (three / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"^speculative_draft_model: .*num_key_value_heads"):
        LLMEngine(config(target, three, tensor_parallel_size=2))
