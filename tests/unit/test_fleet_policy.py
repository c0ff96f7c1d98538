"""The fleet policy's minimum: a count, a fraction of the members rounded up, or both (the larger holds)."""

from __future__ import annotations

import pytest

from wsync_grpc.trainer import FleetPolicy


def test_the_default_policy_fails_and_excludes_nobody() -> None:
    policy = FleetPolicy()
    assert policy.on_failure == "fail" and not policy.excludes


@pytest.mark.parametrize(
    ("policy", "members", "required"),
    [
        (FleetPolicy.exclude(), 3, 1),
        (FleetPolicy.exclude(min_engines=2), 3, 2),
        (FleetPolicy.exclude(min_fraction=0.5), 3, 2),  # 1.5 rounded up
        (FleetPolicy.exclude(min_fraction=0.5), 4, 2),
        (FleetPolicy.exclude(min_fraction=0.75), 32, 24),
        (FleetPolicy.exclude(min_engines=5, min_fraction=0.1), 32, 5),
        (FleetPolicy.exclude(min_engines=2, min_fraction=1.0), 3, 3),
    ],
)
def test_the_minimum_is_the_larger_of_the_count_and_the_fraction(
    policy: FleetPolicy, members: int, required: int
) -> None:
    assert policy.excludes
    assert policy.required(members) == required


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"on_failure": "skip"}, "unknown fleet policy"),
        ({"on_failure": "exclude", "min_engines": 0}, "min_engines"),
        ({"on_failure": "exclude", "min_fraction": 1.5}, "min_fraction"),
        ({"on_failure": "exclude", "min_fraction": -0.1}, "min_fraction"),
    ],
)
def test_a_bad_policy_is_refused_when_built(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FleetPolicy(**kwargs)  # type: ignore[arg-type]
