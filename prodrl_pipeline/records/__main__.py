"""`python -m prodrl_pipeline.records`: each table's latest Delta version and its rows, read through
the store (what a round's `delta_read` and `delta_written` versions are measured against).

    python -m prodrl_pipeline.records --root .prodrl calls trajectories

Without table names, every table that exists. Object-store options for s3:// tables come from
PRODRL_STORAGE_OPTIONS (a JSON object). Exit status 1 when a named table does not exist or a table
cannot be read, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prodrl_pipeline.artifacts import storage_options_from_environment
from prodrl_pipeline.records.schema import TABLES
from prodrl_pipeline.records.store import DeltaStore, StorageError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tables", nargs="*", metavar="TABLE", help=f"of {', '.join(TABLES)}")
    p.add_argument("--root", default=".prodrl", help="store root: the tables are <root>/tables")
    p.add_argument("--tables-uri", default="", help="the tables' folder or s3:// URI, if not <root>/tables")
    args = p.parse_args(argv)
    if unknown := [t for t in args.tables if t not in TABLES]:
        p.error(f"unknown tables {unknown}; known: {', '.join(TABLES)}")
    try:
        options = storage_options_from_environment(os.environ)
    except ValueError as e:
        p.error(str(e))
    store = DeltaStore(args.tables_uri or Path(args.root) / "tables", storage_options=options)
    status = 0
    print(f"{'table':<16} {'version':>8} {'rows':>10}")
    for table in args.tables or TABLES:
        try:
            if not store.exists(table):
                if args.tables:
                    print(f"{table:<16} {'absent':>8}")
                    status = 1
                continue
            version = store.table(table).version()
            rows = store.read(table, version=version).num_rows
        except StorageError as e:
            print(e, file=sys.stderr)
            status = 1
            continue
        print(f"{table:<16} {version:>8} {rows:>10}")
    return status


if __name__ == "__main__":
    sys.exit(main())
