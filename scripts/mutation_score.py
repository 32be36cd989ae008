"""The mutation score per module from a finished `mutmut run` (its `mutants/*.meta` files).

score = killed / (mutants - equivalent), where killed counts a failing test, a timeout or a crash,
and every other outcome (survived, no test ran) counts against the score. Equivalent mutants (the
same behaviour as the original, so no test can tell them apart) are listed with the reason in
`scripts/mutation_equivalent.txt`, one `<mutant name>  # why` a line.

Usage: python scripts/mutation_score.py [--json PATH] [--survivors]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

KILLED = {1, 3, 36, 24, -24, 152, 255, -11, -9}  # a failing test, pytest's internal error, a timeout, a crash
EQUIVALENT = Path(__file__).with_name("mutation_equivalent.txt")


def equivalent_mutants(path: Path = EQUIVALENT) -> dict[str, str]:
    """Mutant name -> why it behaves as the original."""
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        name, _, why = line.partition("#")
        if name.strip():
            out[name.strip()] = why.strip()
    return out


def outcomes(root: Path) -> dict[str, dict[str, int | None]]:
    """Module file -> mutant name -> mutmut's exit code (None: not run)."""
    found = {}
    for meta in sorted(root.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        found[str(meta.relative_to(root))[: -len(".meta")]] = codes
    return found


def score_table(found: dict, equivalent: dict[str, str]) -> list[dict]:
    rows = []
    for module, codes in found.items():
        n = Counter()
        for name, code in codes.items():
            if name in equivalent:
                n["equivalent"] += 1
            elif code is None:
                n["not run"] += 1
            elif code in KILLED:
                n["killed"] += 1
            else:
                n["survived" if code == 0 else "no test"] += 1
        judged = n["killed"] + n["survived"] + n["no test"]
        rows.append(
            {
                "module": module,
                "mutants": len(codes),
                **{k: n[k] for k in ("killed", "survived", "no test", "equivalent", "not run")},
                "score": n["killed"] / judged if judged else None,
            }
        )
    return rows


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
    equivalent = equivalent_mutants()
    rows = score_table(found, equivalent)
    total = {
        k: sum(r[k] for r in rows)
        for k in ("mutants", "killed", "survived", "no test", "equivalent", "not run")
    }
    judged = total["killed"] + total["survived"] + total["no test"]
    rows.append({"module": "all", **total, "score": total["killed"] / judged if judged else None})
    print(
        f"{'module':45} {'mutants':>7} {'killed':>6} {'surv.':>5} {'no test':>7} {'equiv.':>6} {'score':>6}"
    )
    for r in rows:
        score = "-" if r["score"] is None else f"{r['score']:.1%}"
        print(
            f"{r['module']:45} {r['mutants']:7} {r['killed']:6} {r['survived']:5} {r['no test']:7} "
            f"{r['equivalent']:6} {score:>6}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.survivors:
        for codes in found.values():
            for name, code in codes.items():
                if name not in equivalent and code is not None and code not in KILLED:
                    print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
