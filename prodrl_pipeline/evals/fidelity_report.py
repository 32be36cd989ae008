"""The gradient-fidelity study's report (docs/results.md, "Gradient fidelity" and "Which estimator
to run"): markdown tables, figures and the recommendation, from the rows
`python -m prodrl_pipeline.evals.fidelity_study` writes. No torch here.
"""

from __future__ import annotations

from prodrl_pipeline.evals.report import curves_png

KL_BETA = 0.1  # the study's `sc_async_kl` penalty
SCHEDULES = {"sync": 0, "async1": 1}
"""Rounds of S steps between the deployment's theta and the trainer's round start pi_k."""


CELL = (
    "cos {cosine:.3f} [{cosine_lo:.3f}, {cosine_hi:.3f}]; bias {relative_bias:.3f} "
    "[{relative_bias_lo:.3f}, {relative_bias_hi:.3f}]; var {relative_variance:.2f}"
)


def markdown(rows: list[dict], steps: int) -> str:
    """Per schedule, one table per engine x support: estimators by staleness; each cell the cosine,
    the relative bias and the relative minibatch variance, the first two with their 95% bootstrap
    intervals."""
    out = []
    for schedule in dict.fromkeys(r.get("schedule", "sync") for r in rows):
        mine = [r for r in rows if r.get("schedule", "sync") == schedule]
        stale = sorted({r["staleness_steps"] for r in mine})
        drift = {r["staleness_steps"]: r["mean_abs_logprob_drift"] for r in mine}
        behind = mine[0].get("round_start_drift", 0.0)
        out += [
            f"Schedule {schedule}: pi_k is {SCHEDULES[schedule] * steps} steps from the deployment's theta "
            f"({behind:.3f} nats, mean |log pi_k - log pi_theta_dep|); staleness, mean over states and "
            "legal moves of |log pi - log pi_k|: "
            + ", ".join(f"{drift[s]:.3f} nats after {s} steps" for s in stale)
            + ".",
            "",
        ]
        for engine in dict.fromkeys(r["engine"] for r in mine):
            for support in dict.fromkeys(r["support"] for r in mine):
                cells = {
                    (r["estimator"], r["staleness_steps"]): r
                    for r in mine
                    if r["engine"] == engine and r["support"] == support
                }
                out += [f"#### {schedule}, {engine}, {support}", ""]
                out.append(
                    "| estimator | " + " | ".join(f"{s} steps ({s / steps:g} S)" for s in stale) + " |"
                )
                out.append("|---|" + "---|" * len(stale))
                for name in dict.fromkeys(e for e, _ in cells):
                    out.append(
                        f"| {name} | " + " | ".join(CELL.format(**cells[name, s]) for s in stale) + " |"
                    )
                out.append("")
    return "\n".join(out)


VARIANCE_BUDGET = 4.0
"""The recommendation's variance rule: an estimator qualifies if, within one round of staleness,
its relative minibatch variance stays within this multiple of its on-policy (0-step sync) one."""


def recommendation(rows: list[dict], steps: int) -> str:
    """docs/results.md's first section, from the fidelity rows only. Over every cell within one round
        of staleness (0..S steps; each schedule, engine and support present), per estimator without KL:
        the worst and median cosine with the exact gradient and the worst variance over its on-policy
        variance. Recommended: the highest worst cosine among the estimators within VARIANCE_BUDGET (a
    tie: the lower worst variance)."""
    cells = [r for r in rows if r["staleness_steps"] <= steps and "+kl" not in r["estimator"]]
    table = []
    for name in dict.fromkeys(r["estimator"] for r in cells):
        mine = [r for r in cells if r["estimator"] == name]
        on_policy = [
            r["relative_variance"]
            for r in mine
            if r["staleness_steps"] == 0 and r.get("schedule", "sync") == "sync"
        ]
        base = sum(on_policy) / len(on_policy)
        cosines = sorted(r["cosine"] for r in mine)
        table.append(
            {
                "estimator": name,
                "worst cos": cosines[0],
                "median cos": cosines[len(cosines) // 2],
                "worst var": max(r["relative_variance"] for r in mine),
                "worst var / on-policy var": max(r["relative_variance"] for r in mine) / base,
            }
        )
    within = [t for t in table if t["worst var / on-policy var"] <= VARIANCE_BUDGET]
    best = max(within or table, key=lambda t: (round(t["worst cos"], 3), -t["worst var"]))
    axes = ", ".join(
        f"{key}: {' / '.join(dict.fromkeys(str(r.get(key, 'sync')) for r in cells))}"
        for key in ("schedule", "engine", "support")
    )
    lines = [
        "## Which estimator to run",
        "",
        f"**{best['estimator']}.** Within one round of staleness (0 to S = {steps} optimizer steps; "
        f"{axes}; {len(cells) // len(table)} cells each), its expected update keeps a cosine of at "
        f"least {best['worst cos']:.2f} with the exact policy gradient (median {best['median cos']:.2f}), "
        f"while its minibatch variance stays within {best['worst var / on-policy var']:.1f}x its on-policy "
        f"variance. The rule: the highest worst-case cosine among the estimators whose variance stays "
        f"within {VARIANCE_BUDGET:g}x on-policy (a tie: the lower variance). var: the variance of a "
        "B = 64 minibatch's update over ||grad J||^2. The cosines' 95% intervals over states are in the "
        "tables below: a gap of a few hundredths between two estimators is within them.",
        "",
        "| estimator | worst cos | median cos | worst var | worst var / on-policy var | |",
        "|---|---|---|---|---|---|",
    ]
    for t in sorted(table, key=lambda t: (-round(t["worst cos"], 3), t["worst var"])):
        said = (
            "recommended"
            if t is best
            else f"variance beyond {VARIANCE_BUDGET:g}x"
            if t not in within
            else "lower worst cosine"
            if round(t["worst cos"], 3) < round(best["worst cos"], 3)
            else "same cosine, more variance"
        )
        lines.append(
            f"| {t['estimator']} | {t['worst cos']:.2f} | {t['median cos']:.2f} | {t['worst var']:.1f} | "
            f"{t['worst var / on-policy var']:.1f} | {said} |"
        )
    lines += [
        "",
        "From the gradient-fidelity measurement below only: exact expected updates on the lab's",
        "mate-in-1 decisions, for one model. It says how well each estimator's update points where",
        "the policy gradient does, and how noisy it is, under the mismatch a production round has; the",
        "end-to-end runs (Findings) have not resolved a difference between estimators yet (each",
        "finding states the smallest difference its seeds could detect).",
        "",
    ]
    return "\n".join(lines)


PLOTTED = ("nvfp4_w4a4", "full")
"""The engine and support the figures show (the lab's production-like deployment)."""


def figures(result: dict) -> dict[str, bytes]:
    """Per schedule, PNGs of each estimator's (without KL) cosine with grad J and its relative
    variance against staleness, on the PLOTTED cells; cosines with their 95% bootstrap band."""
    rows = [
        r for r in result["rows"] if (r["engine"], r["support"]) == PLOTTED and "+kl" not in r["estimator"]
    ]
    out = {}
    for schedule in dict.fromkeys(r.get("schedule", "sync") for r in rows):
        mine = [r for r in rows if r.get("schedule", "sync") == schedule]
        steps = sorted({r["staleness_steps"] for r in mine})
        by = {(r["estimator"], r["staleness_steps"]): r for r in mine}
        names = list(dict.fromkeys(r["estimator"] for r in mine))
        where = f"{schedule}, {PLOTTED[0]}, {PLOTTED[1]}"
        for metric, label in (
            ("cosine", "cos(E[g], grad J), 95% band"),
            ("relative_variance", "var / |grad J|^2"),
        ):
            cosine = metric == "cosine"
            series = {n: [by[n, t][metric] for t in steps] for n in names}
            bands = {
                n: ([by[n, t]["cosine_lo"] for t in steps], [by[n, t]["cosine_hi"] for t in steps])
                for n in names
            }
            out[f"fidelity_{schedule}_{metric}.png"] = curves_png(
                steps,
                series,
                "optimizer steps since pi_k",
                f"{where}: {label}",
                bands if cosine else None,
                not cosine,
            )
    return out


def section(results: list[dict], figures_in: str = "results") -> str:
    """The "Gradient fidelity" section of docs/results.md from the JSON of one or more runs of the
    command (e.g. an engine run on its own), its `figures` linked from the folder `figures_in`."""
    runs = []
    for result in results:
        rows = result["rows"]
        engines = ", ".join(dict.fromkeys(r["engine"] for r in rows))
        runs += [
            f"### {engines}: {rows[0]['n_states']} states",
            "",
            f"`{result['command']}`: {len(rows)} cells, {result['seconds'] / 60:.0f} min wall time on 2",
            "CPU cores shared with other work.",
            "",
            *(f"![{name.removesuffix('.png')}]({figures_in}/{name})\n" for name in figures(result)),
            markdown(rows, result["steps"]),
        ]
    return "\n".join(
        [
            "## Gradient fidelity (exact, by enumeration)",
            "",
            "States: the first turns of the lab's mate-in-1 train puzzles, each one decision over the",
            "legal moves M with known rewards. Exact, by enumeration: the gradient",
            "grad J = (1/n) sum_s sum_a pi_S(a) R(a) grad log pi_S(a) (S the deployment's kept support)",
            "and each estimator's expected update E_{a~mu}[g] through the trainer's own objective",
            "(rl/estimators.py), with A = R - b and b the expected batch mean (1/n) sum_s E_mu[R] (a",
            "constant: the B -> infinity limit of the batch-mean baseline). cos: cosine(E[g], grad J);",
            "bias: ||E[g] - grad J|| / ||grad J||; var: the trace variance of the mean of B = 64 iid",
            "(state, token) draws over ||grad J||^2, also exact. Sampled: only the 95% intervals",
            "[lo, hi] (a 1,000-resample bootstrap over the states). Schedules: sync, the trainer's",
            "round start pi_k is the deployment's theta; async1, pi_k is S Adam steps further, as when",
            "a round trains from the checkpoint of a round whose deployment is not live yet.",
            "",
            "Caveats: few states (n below), so the intervals are wide where states disagree; theta_k is",
            "the lab's warm-started base model (the `base_model` asset's defaults); staleness is theta",
            "after Adam steps (the trainer's lr, betas and clip, a fresh optimizer state, so larger",
            "first steps than a carried one) on the exact objective of the same states: a controlled",
            "drift, not minibatch training; mu is recomputed by a full forward of the served model, not",
            "read from recorded calls; the trainer's 1/T_i token weighting is left out of both sides;",
            "score centering's samples form has M = 1 extra sample (its var is M = 1's); the head",
            "form's head is mu's top 20 (the lab's top_logprobs), so with more kept moves its tail",
            f"model applies; +kl adds beta = {KL_BETA} times the KL estimator, whose expected update",
            "-beta grad KL(pi || pi_k) is no part of grad J (0 at 0 steps).",
            "",
            *runs,
        ]
    )
