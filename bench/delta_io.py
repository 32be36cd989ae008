"""A round's Delta writes and reads against raw parquet of the same Arrow table, side by side.

A round of lab calls with every recorded column: the calls of B trajectories played by the lab
model, repeated under fresh ids up to `--rows` rows (a lab round is S·B = 1,024 trajectories of a
few calls each). Written as round 1 of the `calls` table (`DeltaStore.overwrite_round`: a round
overwrite and its commit) and as one parquet file (`pyarrow.parquet.write_table`), each from the
same input: an Arrow table, or Python dicts (the pipeline's calls arrive as dicts; parquet then
needs `pa.Table.from_pylist` first, as the store does). Read back as the round (`DeltaStore.read`) and as
the file (`pyarrow.parquet.read_table`). Each repeat times each in turn; a ratio is parquet's time ÷
Delta's (Delta's speed relative to parquet), median and range over the repeats. Goal: >= 0.8.
Also shown: what a write spends committing, timed inside the store's writes: the store's own
commit file (`delta_log.commit`), deltalake's commit when another writer took the version
(`DeltaTable.create_write_transaction`), bringing deltalake's snapshot up to date
(`update_incremental`) and the log checkpoint every tenth commit (`create_checkpoint`; each Delta
line writes its own table, so one write in ten of each pays one, as a round's writes do). The median
over the repeats of parquet ÷ (parquet + the commit calls that write made) is about the most the
write ratio (a median too: of writes without a checkpoint) can be with these commits; the
checkpoints' cost averaged over the writes is printed beside it. About: the Delta file lacks the
`round` column, and each repeat pairs one parquet sample with one Delta write's.
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
from deltalake import DeltaTable

from bench.ratios import Ratio, alternate, report, seconds_in, speedup
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.chat import load_tokenizer
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.envs.rollout import play
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.records import delta_log
from prodrl_pipeline.records.schema import TABLES
from prodrl_pipeline.records.store import CHECKPOINT_INTERVAL, DeltaStore

DELTALAKE_CALLS = ("create_write_transaction", "update_incremental", "create_checkpoint")
"""deltalake's calls inside a store's write; the store's own commit is `delta_log.commit`."""


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
        # pays the log checkpoint of every tenth commit as a round's writes do (one shared table
        # would give every checkpoint to whichever line writes the even versions)
        store, dict_store = DeltaStore(Path(tmp) / "tables"), DeltaStore(Path(tmp) / "from_dicts")
        for each in (store, dict_store):  # the table exists, as after a first round; the second
            for _ in range(2):  # write leaves the store holding its snapshot, as later writes find it
                each.overwrite_round("calls", table, 1)
        file = Path(tmp) / "calls.parquet"
        pq.write_table(table, file)
        inside: list[dict[str, float]] = []

        def delta_write() -> None:
            with seconds_in(DeltaTable, *DELTALAKE_CALLS) as spent, seconds_in(delta_log, "commit") as own:
                store.overwrite_round("calls", table, 1)
            inside.append({**spent, **own})

        times = alternate(
            {
                "delta write": delta_write,
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
    own = statistics.median(s["commit"] for s in inside)
    theirs = sum(1 for s in inside if s["create_write_transaction"])  # a version another writer took
    commit = statistics.median(s["create_write_transaction"] for s in inside)
    catch_up = statistics.median(s["update_incremental"] for s in inside)
    made = [s["create_checkpoint"] for s in inside if s["create_checkpoint"]]  # one write in ten
    checkpoints = (
        f"{len(made)} log checkpoint(s) of {statistics.mean(made) * 1000:.1f} ms, "
        f"{statistics.mean(made) / CHECKPOINT_INTERVAL * 1000:.1f} ms a write on average"
        if made
        else f"no log checkpoint in {len(inside)} writes"
    )
    bound = statistics.median(  # each write with what it paid: the median write holds no checkpoint
        p / (p + sum(s.values())) for p, s in zip(times["parquet write"], inside, strict=True)
    )
    detail = (
        f"a round's calls, {table.num_rows} rows, {table.nbytes / 1e6:.1f} MB in Arrow, "
        f"{args.repeats} repeats; {medians}; inside a Delta write, the store's own commit "
        f"{own * 1000:.1f} ms, deltalake's commit {commit * 1000:.1f} ms ({theirs} of "
        f"{len(inside)} writes), deltalake's snapshot catch-up {catch_up * 1000:.1f} ms, "
        f"{checkpoints}: parquet / (parquet + these calls) = {bound:.2f}, about the most the write "
        "ratio can be with these commits"
    )
    return [
        Ratio(
            "Delta write / parquet write (speed)",
            speedup(times, "delta write", "parquet write"),
            0.8,
            detail=detail,
        ),
        Ratio(
            "Delta write / parquet write, from dicts (speed)",
            speedup(times, "delta write (dicts)", "parquet write (dicts)"),
            0.8,
        ),
        Ratio("Delta read / parquet read (speed)", speedup(times, "delta read", "parquet read"), 0.8),
    ]


def main() -> None:
    report(measure(arguments().parse_args()))


if __name__ == "__main__":
    main()
