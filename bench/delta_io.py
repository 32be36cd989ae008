"""A round's Delta writes and reads against raw parquet of the same Arrow table, side by side: figures.

A round of lab calls with every recorded column: the calls of B trajectories played by the lab
model, repeated under fresh ids up to `--rows` rows (a lab round is S·B = 1,024 trajectories of a
few calls each). Written as round 1 of the `calls` table (`DeltaStore.overwrite_round`: deltalake's
writer, a predicate overwrite and its commit) and as one parquet file (`pyarrow.parquet.write_table`),
each from the same input: an Arrow table, or Python dicts (the pipeline's calls arrive as dicts;
parquet then needs `pa.Table.from_pylist` first, as the store does). Read back as the round
(`DeltaStore.read`: DataFusion) and as the file (`pyarrow.parquet.read_table`). Each repeat times
each in turn; a ratio is parquet's time ÷ Delta's (Delta's speed relative to parquet), median and
range over the repeats, and the milliseconds of each. No goal: what a user waits for is the round,
and `bench.round` holds the goal on the share of a round's wall time its tables take.
Run: `make bench`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from bench.ratios import Ratio, alternate, report, speedup
from prodrl_pipeline.chat.render import load_tokenizer
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.envs.rollout import play
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.records.schema import TABLES
from prodrl_pipeline.records.store import DeltaStore


def _round_of_calls(batch: int, rows: int) -> list[dict]:
    torch.manual_seed(0)
    tok = load_tokenizer("data/tokenizer")
    model = build_model(TinyQwen3Config(), len(tok), tok.pad_token_id)
    puzzles = list(iter_lab_puzzles("data", "train"))[:batch]
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id)
    played = play(engine, tok, puzzles, SamplingParams(), deployment_id="d", round_=1, seed=0).calls
    return [
        {**c, "call_id": f"{c['call_id']}-{i}", "trajectory_id": f"{c['trajectory_id']}-{i}"}
        for i in range(-(-rows // len(played)))
        for c in played
    ][:rows]


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256, help="trajectories played")
    parser.add_argument("--rows", type=int, default=3000, help="calls in the round")
    parser.add_argument("--repeats", type=int, default=15)
    return parser


SMOKE = ["--batch", "4", "--rows", "40", "--repeats", "1"]


def measure(args: argparse.Namespace) -> list[Ratio]:
    calls = _round_of_calls(args.batch, args.rows)
    schema = TABLES["calls"]
    table = pa.Table.from_pylist(calls, schema=schema)
    with tempfile.TemporaryDirectory() as tmp:
        # one table per Delta write line: each of its writes commits the next version, and so
        # pays the log checkpoint of every tenth commit as a round's writes do
        store, dict_store = DeltaStore(Path(tmp) / "tables"), DeltaStore(Path(tmp) / "from_dicts")
        for each in (store, dict_store):  # the table exists, as after a first round; the second
            for _ in range(2):  # write leaves the store holding its snapshot, as later writes find it
                each.overwrite_round("calls", table, 1)
        file = Path(tmp) / "calls.parquet"
        pq.write_table(table, file)
        times = alternate(
            {
                "delta write": lambda: store.overwrite_round("calls", table, 1),
                "delta write (dicts)": lambda: dict_store.overwrite_round("calls", calls, 1),
                "parquet write": lambda: pq.write_table(table, file),
                "parquet write (dicts)": lambda: pq.write_table(
                    pa.Table.from_pylist(calls, schema=schema), file
                ),
                "delta read": lambda: store.read("calls", 1),
                "parquet read": lambda: pq.read_table(file),
            },
            args.repeats,
        )
        assert store.read("calls", 1).num_rows == table.num_rows == pq.read_table(file).num_rows
        assert dict_store.read("calls", 1).num_rows == table.num_rows
        assert store.table("calls").version() == dict_store.table("calls").version() == 1 + args.repeats
    medians = ", ".join(f"{name} {statistics.median(ts) * 1000:.0f} ms" for name, ts in times.items())
    detail = (
        f"a round's calls, {table.num_rows} rows, {table.nbytes / 1e6:.1f} MB in Arrow, "
        f"{args.repeats} repeats; {medians}"
    )
    return [
        Ratio(
            "Delta write / parquet write (speed)",
            speedup(times, "delta write", "parquet write"),
            None,
            detail=detail,
        ),
        Ratio(
            "Delta write / parquet write, from dicts (speed)",
            speedup(times, "delta write (dicts)", "parquet write (dicts)"),
            None,
        ),
        Ratio("Delta read / parquet read (speed)", speedup(times, "delta read", "parquet read"), None),
    ]


def main() -> None:
    report(measure(arguments().parse_args()))


if __name__ == "__main__":
    main()
