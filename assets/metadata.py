"""Dagster metadata helpers: plots inline in the UI, tables as markdown."""

from __future__ import annotations

import base64
from collections.abc import Sequence

from dagster import MetadataValue

from prodrl_pipeline.evals.report import curves_png, markdown_table


def plot(x: Sequence[float], series: dict[str, Sequence[float]], xlabel: str, title: str) -> MetadataValue:
    png = base64.b64encode(curves_png(x, series, xlabel, title)).decode()
    return MetadataValue.md(f"![{title}](data:image/png;base64,{png})")


def table(rows: Sequence[dict], columns: Sequence[str]) -> MetadataValue:
    return MetadataValue.md(markdown_table(rows, columns))
