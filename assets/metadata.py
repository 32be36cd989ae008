"""Dagster metadata helpers: plots inline in the UI, tables as markdown."""

from __future__ import annotations

import base64
from collections.abc import Sequence

from dagster import MetadataValue

from prodrl_pipeline.evals.report import curves_png, markdown_table


def image(png: bytes, title: str) -> MetadataValue:
    """A PNG shown inline (a data URI inside markdown)."""
    return MetadataValue.md(f"![{title}](data:image/png;base64,{base64.b64encode(png).decode()})")


def plot(x: Sequence[float], series: dict[str, Sequence[float]], xlabel: str, title: str) -> MetadataValue:
    return image(curves_png(x, series, xlabel, title), title)


def table(rows: Sequence[dict], columns: Sequence[str]) -> MetadataValue:
    return MetadataValue.md(markdown_table(rows, columns))
