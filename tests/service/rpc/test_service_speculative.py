"""Speculative decoding outside the engine: a request's opt-out (GenerateRequest.speculative)
reaches the engine's SamplingParams, a sample's Usage carries the proposed and accepted counts
of its final RequestMetrics, the Prometheus counters add up the engine's cumulative counts under
the configured method's label, and ServerInfo reports the method and the proposal length.

The fake engine (tests/support/fake_engine.py) proposes and accepts for every request that did
not opt out, with its own bookkeeping; the tests compare what the service reports with what the
engine sent."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry
from sluice_client import AsyncClient, build_request

from engine.protocol.messages import EngineStats, RequestMetrics, RequestOutput
from service.ops.metrics import Metrics
from service.rpc.admission import sampling_params
from tests.support.service_harness import make_fake_model, running_server

PROMPT = [0, 5, 6, 7]  # the fake engine echoes 5, 6, 7 in a cycle: no EOS


def spec_counts(registry: CollectorRegistry, method: str) -> tuple[float | None, float | None]:
    labels = {"method": method}
    return (
        registry.get_sample_value("sluice_spec_proposed_tokens_total", labels),
        registry.get_sample_value("sluice_spec_accepted_tokens_total", labels),
    )


async def test_usage_and_counters_report_the_engines_counts_and_an_opt_out_proposes_nothing(
    tmp_path: Path,
) -> None:
    model = make_fake_model(tmp_path, spec_accept=2)
    engine = {"speculative_method": "ngram", "num_speculative_tokens": 3}
    async with running_server(model, engine=engine) as (server, target):
        final: dict[str, RequestMetrics] = {}
        request_ended = server.metrics.request_ended

        def record(output: RequestOutput) -> None:  # what the engine sent with each end
            assert output.metrics is not None
            final[output.request_id] = output.metrics
            request_ended(output)

        server.metrics.request_ended = record  # type: ignore[method-assign]
        registry = server.metrics.registry
        before = spec_counts(registry, "ngram")
        async with AsyncClient(target) as client:
            info = await client.info()
            options = {"max_tokens": 9, "ignore_eos": True}
            speculated = await client.complete(PROMPT, request_id="on", **options)
            opted_out = await client.complete(
                PROMPT, request_id="off", speculative=False, **options
            )
            explicit = await client.complete(PROMPT, request_id="on2", speculative=True, **options)
        after = spec_counts(registry, "ngram")

    assert (info.speculative_method, info.num_speculative_tokens) == ("ngram", 3)
    usages = {c.request_id: c.finished.usage for c in (speculated, opted_out, explicit)}
    for rid, usage in usages.items():
        assert usage.completion_tokens == 9
        assert (usage.proposed_tokens, usage.accepted_tokens) == (
            final[rid].proposed_tokens,
            final[rid].accepted_tokens,
        )
    assert speculated.token_ids == opted_out.token_ids == explicit.token_ids
    assert 0 < usages["on"].accepted_tokens <= usages["on"].proposed_tokens
    assert usages["on2"] == usages["on"]
    assert (usages["off"].proposed_tokens, usages["off"].accepted_tokens) == (0, 0)
    # The counters come from EngineStats, not from the usages: the two must agree.
    assert before == (0, 0)
    assert after == (
        sum(u.proposed_tokens for u in usages.values()),
        sum(u.accepted_tokens for u in usages.values()),
    )


async def test_a_server_that_does_not_speculate_reports_off_and_zeros(tmp_path: Path) -> None:
    model = make_fake_model(tmp_path)
    async with running_server(model, engine={"num_speculative_tokens": 5}) as (server, target):
        async with AsyncClient(target) as client:
            info = await client.info()
            completion = await client.complete(PROMPT, max_tokens=4, ignore_eos=True)
        counts = spec_counts(server.metrics.registry, "off")
    assert (info.speculative_method, info.num_speculative_tokens) == ("off", 0)
    usage = completion.finished.usage
    assert (usage.completion_tokens, usage.proposed_tokens, usage.accepted_tokens) == (4, 0, 0)
    assert counts == (0, 0)  # the series exist from the start, under "off"


def test_the_counters_add_the_engines_deltas_and_a_new_engine_counts_from_zero() -> None:
    metrics = Metrics("suffix")
    assert spec_counts(metrics.registry, "suffix") == (0, 0)
    for proposed, accepted in ((4, 1), (10, 6), (10, 6)):
        metrics.engine_stats(
            EngineStats(spec_proposed_tokens=proposed, spec_accepted_tokens=accepted)
        )
    assert spec_counts(metrics.registry, "suffix") == (10, 6)
    metrics.engine_started()  # a replacement engine: its cumulative counts start again at 0
    metrics.engine_stats(EngineStats(spec_proposed_tokens=3, spec_accepted_tokens=2))
    assert spec_counts(metrics.registry, "suffix") == (13, 8)
    assert spec_counts(metrics.registry, "off") == (None, None)  # one label: the method's


def test_the_opt_out_maps_to_the_engines_sampling_params() -> None:
    unset = build_request(PROMPT)
    assert not unset.HasField("speculative")
    assert sampling_params(unset).speculative is True  # the default speculates
    assert sampling_params(build_request(PROMPT, speculative=True)).speculative is True
    opted_out = build_request(PROMPT, speculative=False)
    assert opted_out.HasField("speculative")
    assert sampling_params(opted_out).speculative is False
