"""Dagster metadata helpers: plots and tables as markdown, lineage, locations.

The UI draws a markdown value in place only when it is shorter than 1,000 characters (longer ones sit
behind a "[Show Markdown]" link): `sparkline` stays under that, a PNG plot never does."""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Sequence
from html import escape

from dagster import MetadataValue

from prodrl_pipeline.evals.report import curves_png, markdown_table
from prodrl_pipeline.records.lineage import absolute_uri, versions
from prodrl_pipeline.records.store import DeltaStore


def image(png: bytes, title: str) -> MetadataValue:
    """A PNG shown inline (a data URI inside markdown)."""
    return MetadataValue.md(f"![{title}](data:image/png;base64,{base64.b64encode(png).decode()})")


def plot(x: Sequence[float], series: dict[str, Sequence[float]], xlabel: str, title: str) -> MetadataValue:
    return image(curves_png(x, series, xlabel, title), title)


def table(rows: Sequence[dict], columns: Sequence[str]) -> MetadataValue:
    return MetadataValue.md(markdown_table(rows, columns))


def lineage(tables: DeltaStore) -> dict[str, MetadataValue]:
    """The Delta versions this step read and committed, per table (`records.lineage.versions`)."""
    seen = versions(tables)
    return {
        "delta_read": MetadataValue.json(seen["read"]),
        "delta_written": MetadataValue.json(seen["written"]),
    }


def location(uri: str) -> MetadataValue:
    """A checkpoint's or export's location, absolute (a local path or an object-store URI)."""
    return MetadataValue.path(absolute_uri(uri))


INLINE_LIMIT = 1000
"""Markdown shorter than this is drawn in place in the UI's metadata tables."""
SPARK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c")


def sparkline(x: Sequence[float], series: dict[str, Sequence[float]], title: str) -> MetadataValue:
    """Up to three curves, on one axis from 0 to their largest value, as an SVG small enough to be
    drawn in place (thinned to the last rounds until it fits), each named in its own color; the
    alt text names the series and their last values."""
    last = ", ".join(f"{name} {_last(ys)}" for name, ys in series.items())
    if not x:
        return MetadataValue.md(f"{title}: {last}")
    for keep in (len(x), 40, 20, 10):
        md = _spark_md(list(x)[-keep:], {n: list(ys)[-keep:] for n, ys in series.items()}, f"{title}: {last}")
        if len(md) < INLINE_LIMIT:
            return MetadataValue.md(md)
    return MetadataValue.md(f"{title}: {last}")


def _finite(ys: Sequence[float | None]) -> list[float]:
    return [y for y in ys if y is not None and math.isfinite(y)]


def _last(ys: Sequence[float]) -> str:
    finite = _finite(ys)
    return f"{finite[-1]:.3f}" if finite else "-"


def _spark_md(x: list[float], series: dict[str, list[float]], alt: str) -> str:
    w, h, top = 240, 60, 14  # the curves below a line of labels
    span = (max(x) - min(x)) or 1
    high = max((y for ys in series.values() for y in _finite(ys)), default=0) or 1
    parts = [f"<text x='0' y='10' font-size='9'>max {high:.3g}</text>"]
    for i, (color, (name, ys)) in enumerate(zip(SPARK_COLORS, series.items(), strict=False)):
        points = " ".join(
            f"{(xi - min(x)) / span * w:.0f},{top + (1 - max(y, 0) / high) * (h - top - 1):.0f}"
            for xi, y in zip(x, ys, strict=True)
            if y is not None and math.isfinite(y)
        )
        parts.append(f"<text x='{56 + 100 * i}' y='10' font-size='9' fill='{color}'>{escape(name)}</text>")
        parts.append(f"<polyline points='{points}' fill='none' stroke='{color}' stroke-width='2'/>")
    svg = f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}'>{''.join(parts)}</svg>"
    alt = re.sub(r"[\[\]\n]", " ", alt)  # plain text inside the markdown image's brackets
    return f"![{alt}](data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode()})"
