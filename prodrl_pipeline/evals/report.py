"""Small report pieces for people: markdown tables and PNG curves (shown in Dagster metadata)."""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib

from prodrl_pipeline.evals.gate import PairedDifference, paired_difference
from prodrl_pipeline.records.queries import stored_results
from prodrl_pipeline.records.registry import BASE, round_id
from prodrl_pipeline.records.store import DeltaStore

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    def fmt(v: object) -> str:
        if v is None:
            return "-"
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def curves_png(
    x: Sequence[float],
    series: dict[str, Sequence[float]],
    xlabel: str,
    title: str,
    bands: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    log_y: bool = False,
) -> bytes:
    """One line per series against x, as PNG bytes; `bands[name]` = (low, high) shades a range
    around that series (e.g. min and max over seeds)."""
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=100)
    for name, ys in series.items():
        (line,) = ax.plot(list(x), list(ys), marker="o", label=name)
        if bands and name in bands:
            low, high = bands[name]
            ax.fill_between(list(x), list(low), list(high), color=line.get_color(), alpha=0.15)
    ax.set_xlabel(xlabel)
    if log_y:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds and steps are whole numbers
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def gain_over_base(store: DeltaStore, experiment: str, round_: int) -> PairedDifference:
    """Held-out solve rate of the experiment's round-`round_` deployment against the base
    deployment's, paired on the same puzzles (its `interval()` is the 95% CI of the gain)."""
    results = {}
    for deployment_id in (round_id(experiment, round_), BASE):
        rows = stored_results(store, deployment_id)
        if not rows:
            raise ValueError(f"deployment {deployment_id} has no stored held-out evaluation")
        results[deployment_id] = {r["puzzle_id"]: r["solved"] for r in rows}
    return paired_difference(results[round_id(experiment, round_)], results[BASE])
