"""Metadata the UI draws in place: the run's curves fit under its 1,000-character limit at any
length, with every series named."""

import base64
import re

import pytest

from assets.metadata import INLINE_LIMIT, sparkline


@pytest.mark.parametrize("rounds", [1, 2, 10, 41, 500])
def test_the_curves_fit_in_place_whatever_the_run_length(rounds):
    series = {
        "held-out solve rate": [0.2 + 0.001 * k for k in range(rounds)],
        "train reward": [float("nan")] + [0.1] * (rounds - 1),
    }
    md = sparkline(list(range(rounds)), series, "per round").value
    assert len(md) < INLINE_LIMIT
    alt, payload = re.fullmatch(r"!\[(.*)\]\(data:image/svg\+xml;base64,(.*)\)", md).groups()
    svg = base64.b64decode(payload).decode()
    assert alt == f"per round: held-out solve rate {0.2 + 0.001 * (rounds - 1):.3f}, train reward " + (
        "0.100" if rounds > 1 else "-"
    )
    assert all(f">{name}</text>" in svg for name in series)
    assert svg.count("<polyline") == 2
    if rounds > 1:  # the newest round is always drawn, at the right edge
        assert re.search(r"points='[^']*\b240,\d+'", svg)
