"""The mutation score per module from a finished `mutmut run` (its `mutants/*.py.meta` files).

score = killed / judged, judged = every mutant that ran and is not equivalent. Killed: a failing
test, pytest's internal error, a timeout, a crash (any signal) or the type checker. Against the
score: survived, no test covers it, suspicious. Not judged: not run (or interrupted) and mutants
listed as equivalent (the same behaviour as the original, so no test can tell them apart) in
`scripts/mutation_equivalent.txt`, one `<mutant name> | <its mutated code> | why` a line. The
mutated code is checked against the mutant's source under `mutants/`: mutmut numbers mutants per
function, so an edit renumbers them, and a stale entry is reported and not counted.

Usage: python scripts/mutation_score.py [--root mutants] [--json PATH] [--survivors]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

KILLED = {1, 3, 24, 36, 37, 152, 255}  # failed, internal error, timeouts, type check (and signals < 0)
NOT_RUN = {None, 2, 34}  # not checked, interrupted, skipped
EQUIVALENT = Path(__file__).with_name("mutation_equivalent.txt")
NEXT_DEFINITION = re.compile(r"\n\s*def \w*__mutmut_\d+\(|\n[A-Za-z_@]")  # the next mutant, or top-level code


def outcome(code: int | None) -> str:
    if code in NOT_RUN:
        return "not run"
    if code in KILLED or code < 0:
        return "killed"
    return {0: "survived", 5: "no test", 33: "no test"}.get(code, "suspicious")


def mutant_source(root: Path, name: str) -> str:
    """The source of mutant `name` (module.function__mutmut_N) in mutmut's mutated module."""
    module, _, function = name.rpartition(".")
    path = root / (module.replace(".", "/") + ".py")
    text = path.read_text() if path.exists() else ""
    start = text.find(f"def {function}(")
    if start < 0:
        return ""
    end = NEXT_DEFINITION.search(text, start + 1)
    return text[start : end.start() if end else len(text)]


def equivalent_mutants(root: Path, path: Path = EQUIVALENT) -> dict[str, str]:
    """Mutant name -> why it behaves as the original, for entries whose mutated code still matches."""
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        if not line.strip() or line.startswith("#"):
            continue
        name, code, why = (part.strip() for part in line.split("|", 2))
        if code not in mutant_source(root, name):
            print(
                f"stale equivalent entry (not counted): {name} no longer mutates to `{code}`", file=sys.stderr
            )
            continue
        out[name] = why
    return out


def outcomes(root: Path) -> dict[str, dict[str, int | None]]:
    """Module file -> mutant name -> mutmut's exit code (None: not run)."""
    return {
        str(meta.relative_to(root))[: -len(".meta")]: json.loads(meta.read_text())["exit_code_by_key"]
        for meta in sorted(root.rglob("*.py.meta"))
    }


COLUMNS = ("killed", "survived", "no test", "suspicious", "equivalent", "not run")


def score_row(module: str, codes: dict[str, int | None], equivalent: dict[str, str]) -> dict:
    n = Counter("equivalent" if name in equivalent else outcome(code) for name, code in codes.items())
    judged = n["killed"] + n["survived"] + n["no test"] + n["suspicious"]
    return {
        "module": module,
        "mutants": len(codes),
        **{k: n[k] for k in COLUMNS},
        "score": n["killed"] / judged if judged else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("mutants"))
    parser.add_argument("--json", type=Path, help="also write the table here")
    parser.add_argument("--survivors", action="store_true", help="list the mutants no test killed")
    args = parser.parse_args()
    found = outcomes(args.root)
    if not found:
        print(f"no mutmut results under {args.root}/: run `make mutation` first", file=sys.stderr)
        return 1
    equivalent = equivalent_mutants(args.root)
    rows = [score_row(module, codes, equivalent) for module, codes in found.items()]
    rows.append(score_row("all", {k: v for codes in found.values() for k, v in codes.items()}, equivalent))
    print(
        f"{'module':40} {'mutants':>7} {'killed':>6} {'surv.':>5} {'no test':>7} {'susp.':>5} "
        f"{'equiv.':>6} {'not run':>7} {'score':>6}"
    )
    for r in rows:
        score = "-" if r["score"] is None else f"{r['score']:.1%}"
        counts = " ".join(f"{r[k]:{w}}" for k, w in zip(COLUMNS, (6, 5, 7, 5, 6, 7), strict=True))
        print(f"{r['module']:40} {r['mutants']:7} {counts} {score:>6}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.survivors:
        for codes in found.values():
            for name, code in codes.items():
                if name not in equivalent and outcome(code) in ("survived", "no test", "suspicious"):
                    print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
