"""The detection benchmark's target (``bench/report_detection.py``): a drift of the kill-to-FAILED bound is seen.

Kill records shaped as :func:`bench.detection_case.one_kill` writes them; times in seconds.
"""

from __future__ import annotations

from typing import Any

from bench.report_detection import DETECTION_LIMIT_S, checks, section, summary


def kill(seconds: float | None, path: str = "watch", reason: str = "PEER_LOST") -> dict[str, Any]:
    return {"seconds": seconds, "engine_seconds": seconds, "path": path, "reason": reason,
            "bytes_received": 1 << 27, "bytes_expected": 1 << 30, "polls": 1}  # fmt: skip


def results(staged: list[dict[str, Any]], streaming: list[dict[str, Any]], recovered: bool = True) -> dict[str, Any]:
    return {
        "model": "1gb", "kills": len(staged), "poll_seconds": 0.01, "reattach_seconds": 0.5,
        "gone_poll_seconds": 0.25, "kill_at": [0.0, 0.25, 0.5], "min_watch_kills": 3,
        "runs": {"staged": staged, "streaming": streaming},
        "recovery": {m: {"ok": recovered, "seconds": 0.7} for m in ("staged", "streaming")},
    }  # fmt: skip


def passed(d: dict[str, Any]) -> list[bool]:
    return [ok for _, _, ok in checks(d)]


def test_kills_within_the_window_pass_and_one_past_the_limit_fails_its_mode() -> None:
    good = [kill(0.55), kill(0.05, "group"), kill(0.56), kill(0.55)]
    assert passed(results(good, good)) == [True, True, True]
    late = [*good, kill(DETECTION_LIMIT_S + 0.2)]
    assert passed(results(late, good)) == [False, True, True]
    s = summary(late)
    assert s["first"] == 0.55 and s["max"] == DETECTION_LIMIT_S + 0.2 and s["by_watch"] == 4 and s["by_group"] == 1
    assert summary(good)["median"] == 0.555, "the first kill and the group path are left out of the window's figures"


def test_the_bound_must_be_exercised_and_every_kill_noticed_as_peer_lost() -> None:
    watch = [kill(0.55)] * 3
    only_group = [kill(0.05, "group")] * 4
    assert passed(results(only_group, watch)) == [False, True, True], "no kill measured the Watch window"
    unseen = [*watch, kill(None, "")]
    assert passed(results(watch, unseen)) == [True, False, True]
    other = [*watch, kill(0.3, "other", "RECEIVE_TIMEOUT")]
    assert passed(results(other, watch)) == [False, True, True]
    assert passed(results(watch, watch, recovered=False)) == [True, True, False]


def test_the_section_names_what_the_bound_is_made_of() -> None:
    text = section(results([kill(0.55)] * 3, [kill(0.55)] * 3))
    assert "`REATTACH_S + GONE_POLL_S` = 0.75 s" in text
    assert "| staged | 3 (3 / 0) |" in text
