"""The soak benchmark's own judgement: what counts as duplicated, refused, lost or mismatched.

bench/soak/run.py gates on these counts, so they are specified here on hand-made events, without a
server.
"""

from __future__ import annotations

import math

from sluice_client import pb

from bench.soak.checks import Record, RequestCheck
from bench.soak.driver import Served
from bench.soak.verdict import judge_canaries


def started(rid: str = "r") -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=rid, started=pb.Started(prompt_tokens=3))


def tokens(ids: list[int], version: int = 1, index: int = 0) -> pb.GenerateResponse:
    chunk = pb.TokenChunk(token_ids=ids, policy_version=version)
    return pb.GenerateResponse(request_id="r", index=index, tokens=chunk)


def finished(
    reason: pb.FinishReason.ValueType, index: int = 0, message: str = "", rid: str = "r"
) -> pb.GenerateResponse:
    done = pb.Finished(reason=reason, message=message)
    return pb.GenerateResponse(request_id=rid, index=index, finished=done)


def check_of(*events: pb.GenerateResponse, n: int = 1) -> RequestCheck:
    check = RequestCheck("r", n)
    for event in events:
        check.add(event)
    return check


def test_a_well_formed_request_of_two_samples_is_done_without_violations():
    check = check_of(
        started(),
        tokens([5, 6], index=0),
        tokens([7], index=1),
        finished(pb.FINISH_REASON_LENGTH, index=1),
        finished(pb.FINISH_REASON_STOP_STRING, index=0),
        n=2,
    )
    assert check.done and not check.violations
    assert check.reasons == {0: "STOP_STRING", 1: "LENGTH"}


def test_a_second_finished_and_events_after_finished_are_duplicates():
    check = check_of(
        started(),
        finished(pb.FINISH_REASON_LENGTH),
        tokens([1]),
        finished(pb.FINISH_REASON_ERROR),
        started(),
    )
    assert check.violations == {
        "event_after_finished": 1,
        "duplicate_finished": 1,
        "duplicate_started": 1,
    }
    assert check.reasons == {0: "LENGTH"}  # the first finished counts


def test_tokens_before_started_and_an_unexplained_finished_are_out_of_order():
    assert check_of(tokens([1]), started()).violations == {
        "tokens_before_started": 1,
        "started_late": 1,
    }
    failed = check_of(finished(pb.FINISH_REASON_ERROR, message="the engine failed: gone"))
    assert failed.violations == {"finished_before_started": 1}


def refused(code: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="r", refused=pb.Refused(code=code, message="no"))


def test_a_refused_stream_start_answers_every_sample_with_one_refused_event():
    check = check_of(refused(14), n=2)  # 14: UNAVAILABLE
    assert check.done and not check.violations
    assert Record("r", "stream", check).outcome == "refused.UNAVAILABLE"


def test_a_refusal_after_other_events_of_the_request_is_a_violation():
    check = check_of(started(), refused(6), n=1)
    assert check.violations == {"refused_after_events": 1}
    old_style = check_of(finished(pb.FINISH_REASON_ERROR, message="UNAVAILABLE: restarting"))
    assert old_style.violations == {"finished_before_started": 1}


def test_a_call_that_never_ended_is_lost_and_one_that_ended_early_is_missing_a_finished():
    record = Record("r", "generate", check_of(started(), tokens([1])))
    assert record.outcome == "lost"
    record.end("OK")
    assert record.outcome == "missing_finished"
    failed = Record("r", "generate", check_of(started()))
    failed.end("UNAVAILABLE")
    assert failed.outcome == "status.UNAVAILABLE"


EXPECTED = {"A": [[1, 2, 3]], "B": [[7, 8, 9]]}
# A served from the start as version 0, B applied as version 1 by an update during [10, 11].
SERVED = [Served(0, "A", -math.inf, -math.inf), Served(1, "B", 10.0, 11.0)]
BUSY = [(10.0, 11.0)]


def canary(t0: float, t1: float, ids: list[int], versions: list[int]) -> dict[str, object]:
    return {
        "canary": 0,
        "t0": t0,
        "t1": t1,
        "reasons": {0: "LENGTH"},
        "token_ids": {0: ids},
        "versions": {0: versions},
    }


def test_a_canary_after_an_update_must_show_the_applied_weights_and_version():
    judged = judge_canaries(
        [canary(12, 13, [7, 8, 9], [1]), canary(12, 13, [1, 2, 3], [0])], EXPECTED, SERVED, BUSY
    )
    # The second one is what a restart that rolled the weights back serves.
    assert (judged["matched"], judged["mismatches"], judged["wrong_version"]) == (1, 1, 1)


def test_a_canary_overlapping_an_update_is_judged_by_its_one_version_or_not_at_all():
    judged = judge_canaries(
        [canary(9, 10.5, [1, 2, 3], [0]), canary(9, 12, [1, 2, 9], [0, 1])],
        EXPECTED,
        SERVED,
        BUSY,
    )
    assert judged["matched"] == 1 and judged["mixed_versions"] == 1
    assert "mismatches" not in judged
