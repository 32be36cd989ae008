"""The lab study's report as an asset: docs/results.md rewritten from the study's tables, and the
same findings and curves shown in the Dagster UI (`make study` materializes it after the runs)."""

import json
from pathlib import Path

from dagster import Config, MaterializeResult, MetadataValue, asset

from assets import metadata
from prodrl_pipeline.evals.fidelity_report import figures, recommendation, section
from prodrl_pipeline.evals.study_report import build_report

FINDING_COLUMNS = [
    "finding",
    "A",
    "B",
    "round",
    "rate_A",
    "rate_B",
    "A − B (95% CI)",
    "seeds",
    "mde",
    "verdict",
]


class StudyReportConfig(Config):
    root: str = ".prodrl/study"
    """The study's root (`python -m assets.study run --root`)."""
    seeds: list[int] = [0, 1, 2]  # noqa: RUF012 (pydantic copies field defaults)
    out: str = "docs/results.md"
    """Where the markdown goes; its PNGs go to `results/` beside it."""


@asset(group_name="study", kinds={"delta"})
def study_report(config: StudyReportConfig) -> MaterializeResult:
    """Every finished study configuration compared per finding (verdict with a 95% interval over
    seeds), the curves of each comparison group, the final round of every run."""
    out = Path(config.out).resolve()
    fidelity = out.parent / "results" / "fidelity.json"  # python -m prodrl_pipeline.evals.fidelity_study
    found = json.loads(fidelity.read_text()) if fidelity.exists() else None
    report = build_report(
        Path(config.root),
        config.seeds,
        section([found]) if found else "",
        recommendation(found["rows"], found["steps"]) if found else "",
    )
    report.figures |= figures(found) if found else {}
    report.save(out)
    curves = {name.removesuffix(".png"): metadata.image(png, name) for name, png in report.figures.items()}
    return MaterializeResult(
        metadata={
            "report": MetadataValue.path(str(out)),
            "seeds": MetadataValue.text(",".join(map(str, config.seeds))),
            "reproduced": sum(f["verdict"] == "reproduced" for f in report.findings),
            "findings": metadata.table(report.findings, FINDING_COLUMNS),
            **curves,
        }
    )
