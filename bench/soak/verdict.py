"""The soak's verdict: canaries judged against running alone, the JSON result, what fails it."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from bench.common import machine
from bench.soak.checks import DUPLICATES
from bench.soak.driver import CANARIES, Driver, Served


def judge_canaries(
    canaries: list[dict[str, Any]],
    expected: dict[str, list[list[int]]],
    served: list[Served],
    busy: list[tuple[float, float]],
) -> dict[str, Any]:
    """Compare each canary that ran to its length with running alone.

    With no update overlapping it, a canary must show the version and weights applied last
    before it began, whatever happened in between (an engine restart included). Overlapping
    an update, it is compared with the weights of the one version its chunks report, the
    latest applied under that version number; a mix of versions is counted, not compared.
    """
    counts: Counter[str] = Counter()
    examples: list[dict[str, Any]] = []
    for canary in canaries:
        if set(canary["reasons"].values()) != {"LENGTH"}:
            counts["not_to_length"] += 1  # cancelled, aborted, failed: nothing to compare
            continue
        t0, t1 = canary["t0"], canary["t1"]
        versions = {v for chunk_versions in canary["versions"].values() for v in chunk_versions}
        quiet = not any(begin < t1 and t0 < end for begin, end in busy)
        if quiet:
            current = [s for s in served if s.end <= t0][-1]
            weights = current.weights
            if versions != {current.version}:
                counts["wrong_version"] += 1
                _example(examples, "wrong_version", canary, want=current.version)
        elif len(versions) != 1:
            counts["mixed_versions"] += 1
            continue
        else:
            (version,) = versions
            candidates = [s for s in served if s.version == version and s.begin <= t1]
            if not candidates:
                counts["unknown_version"] += 1
                _example(examples, "unknown_version", canary)
                continue
            weights = candidates[-1].weights
        counts["compared_quiet" if quiet else "compared_during_update"] += 1
        want = expected[weights][canary["canary"]]
        if all(ids == want for ids in canary["token_ids"].values()):
            counts["matched"] += 1
        else:
            counts["mismatches"] += 1
            _example(examples, "mismatch", canary, weights=weights)
    return {"total": len(canaries), **counts, "examples": examples}


def _example(
    examples: list[dict[str, Any]], kind: str, canary: dict[str, Any], **more: Any
) -> None:
    if len(examples) < 8:
        versions = {i: sorted(set(v)) for i, v in canary["versions"].items()}
        examples.append({"kind": kind, "canary": canary["canary"], "versions": versions, **more})


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "minutes": args.minutes,
        "clients": args.clients,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "update_every_s": args.update_every,
        "kill_every_s": args.kill_every,
        "engine_threads": args.threads,
    }


def report(
    args: argparse.Namespace,
    driver: Driver,
    summaries: list[dict[str, Any]],
    expected: dict[str, list[list[int]]],
    differing: int,
    pages: dict[str, Any] | None,
    final: dict[str, Any] | None,
) -> dict[str, Any]:
    errors = [s for s in summaries if "error" in s]
    outcomes, by_kind, violations, cancels = (Counter[str]() for _ in range(4))
    examples: list[dict[str, Any]] = []
    canaries: list[dict[str, Any]] = []
    for s in summaries:
        if "error" in s:
            continue
        outcomes.update(s["outcomes"])
        by_kind.update(s["by_kind"])
        violations.update(s["violations"])
        cancels.update(s["cancels"])
        examples += s["examples"]
        canaries += s["canaries"]
    duplicated = sum(n for kind, n in violations.items() if kind in DUPLICATES)
    out_of_order = sum(violations.values()) - duplicated
    judged = judge_canaries(canaries, expected, driver.served, driver.busy)
    growth, warm = server_rss_growth(driver.rss)
    engine_growth = engine_rss_growth(driver.rss)
    result: dict[str, Any] = {
        "benchmark": "soak",
        "model": str(args.model) if args.model else "soak tiny llama (random, float32)",
        "settings": settings(args),
        "requests": sum(outcomes.values()),
        "by_outcome": dict(outcomes.most_common()),
        "by_kind": dict(sorted(by_kind.items())),
        "lost": outcomes.get("lost", 0),
        "missing_finished": outcomes.get("missing_finished", 0),
        "duplicated": duplicated,
        "out_of_order": out_of_order,
        "violations": dict(violations),
        "violation_examples": examples[:10],
        "cancels": dict(cancels),
        "canaries": {**judged, "prompts_telling_a_from_b": f"{differing}/{len(CANARIES)}"},
        "final_canaries": final,
        "updates": driver.updates,
        "kills": driver.kills,
        "version_regressions": driver.regressions,
        "versions_during_restart": driver.transient_versions,
        "states_seen": dict(driver.states),
        "rss": {
            "samples": driver.rss,
            "server_growth_mb": growth,
            "warm_up_samples": warm,
            "engine_growth_mb": engine_growth,
        },
        "kv_cache_end": pages,
        "pages_in_use_end": None if pages is None else pages["pages_in_use"],
        "load_generator_errors": errors,
        "machine": machine(),
    }
    return result


def server_rss_growth(samples: list[dict[str, Any]]) -> tuple[float | None, int]:
    """(the server's last RSS sample minus its first after warm-up, the warm-up samples): the
    first quarter of the run is warm-up; None with too few samples."""
    server_rss = [s["server_mb"] for s in samples if s["server_mb"] is not None]
    warm = len(server_rss) // 4
    if len(server_rss) > warm + 1:
        return round(server_rss[-1] - server_rss[warm], 1), warm
    return None, warm


def engine_rss_growth(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Per engine process (a kill starts a new one): its last RSS sample minus its first."""
    by_pid: dict[int, list[float]] = {}
    for sample in samples:
        if sample["engine_pid"] is not None and sample["engine_mb"] is not None:
            by_pid.setdefault(sample["engine_pid"], []).append(sample["engine_mb"])
    return {str(pid): round(mb[-1] - mb[0], 1) for pid, mb in by_pid.items() if len(mb) > 1}


def failures(result: dict[str, Any], max_growth: float) -> list[str]:
    """What makes the soak fail (exit 1), in words; empty when it passed."""
    checks = [
        (result["lost"], "lost calls"),
        (result["missing_finished"], "calls ended without a finished per index"),
        (result["duplicated"], "duplicated events"),
        (result["out_of_order"], "events out of order"),
        (result["canaries"].get("mismatches", 0), "canary mismatches"),
        (result["canaries"].get("wrong_version", 0), "canaries under an unexpected version"),
        (result["canaries"].get("unknown_version", 0), "canaries under a version never applied"),
        (len(result["version_regressions"]), "policy version went backwards while SERVING"),
        (len(result["load_generator_errors"]), "load generators failed"),
    ]
    found = [f"{n} {what}" for n, what in checks if n]
    canaries = result["canaries"]
    if not canaries.get("matched", 0) + canaries.get("mismatches", 0):
        found.append("no canary was compared")
    if canaries["prompts_telling_a_from_b"].startswith("0/"):
        found.append("the canaries cannot tell weights A from B")
    final = result["final_canaries"]
    if final is None:
        found.append("the server was not SERVING after the traffic")
    elif (
        "error" in final
        or final["mismatches"]
        or final["reasons"] != ["LENGTH"]
        or final["versions"] != [final["expected_version"]]
    ):
        found.append(f"final canaries alone: {final}")
    if result["pages_in_use_end"]:
        found.append(f"{result['pages_in_use_end']} KV pages in use once idle")
    growth = result["rss"]["server_growth_mb"]
    if growth is not None and growth > max_growth:
        found.append(f"server RSS grew {growth:.1f} MiB")
    return found


def table_rows(result: dict[str, Any]) -> list[list[Any]]:
    """The short table printed beside the JSON."""
    canaries = result["canaries"]
    return [
        ["requests", result["requests"]],
        ["lost", result["lost"]],
        ["missing finished", result["missing_finished"]],
        ["duplicated", result["duplicated"]],
        ["out of order", result["out_of_order"]],
        ["canaries compared", canaries.get("matched", 0) + canaries.get("mismatches", 0)],
        ["canary mismatches", canaries.get("mismatches", 0)],
        ["version regressions", len(result["version_regressions"])],
        ["updates applied", sum(u["outcome"] == "applied" for u in result["updates"])],
        ["kills", len(result["kills"])],
        ["server RSS growth MiB", result["rss"]["server_growth_mb"]],
        ["pages in use at end", result["pages_in_use_end"]],
    ]
