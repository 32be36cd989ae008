"""A round's training, resumable inside the round.

Every `resume_every` optimizer steps the trainer saves its state beside the round: the model, the
Adam state, the minibatch cursor, the metrics rows so far, and a fingerprint of what the round
trains from (parent checkpoint, trainer config, a digest of its calls and advantages). A re-run with the same
fingerprint loads it and continues at the cursor, with pi_k read back from `policy_logprobs`
rather than recomputed from the half-trained model. Training holds no random state of its own (the
minibatches are fixed by the advantages table; the model has no dropout), so the continued run is
bit-identical to an uninterrupted one. The state is written to a temporary sibling and renamed into
place: a kill leaves the previous state, the new one or none, never a partial one; an unreadable
state is ignored (the round starts over).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from collections import Counter
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from prodrl_pipeline.folders import replacing
from prodrl_pipeline.records.ragged import Ragged, combined, nulls_within, offsets
from prodrl_pipeline.records.schema import LOGPROBS, POLICY_LOGPROBS
from prodrl_pipeline.rl.recorded import RecordedCalls

STATE_FILE, META_FILE = "state.pt", "resume.json"


@dataclass
class ResumeState:
    model: dict
    optimizer: dict
    cursor: int
    """Minibatches already trained."""
    rows: list[dict]
    """Their metrics rows."""


def data_digest(calls: RecordedCalls, advantages: list[dict]) -> str:
    """sha256 of what a round trains on: every column the trainer reads of its calls (in call_id
    order) and its advantages (in trajectory order); equal data, equal digest."""
    ordered = calls.take(np.argsort(np.array(calls.call_id, dtype=object), kind="stable"))
    h = hashlib.sha256()
    for name, part in _parts(ordered):
        h.update(name.encode())
        data = part.tobytes() if isinstance(part, np.ndarray) else json.dumps(part).encode()
        h.update(len(data).to_bytes(8, "little") + data)  # its length first: no part runs into the next
    for a in sorted(advantages, key=lambda a: a["trajectory_id"]):
        h.update(json.dumps([a["trajectory_id"], a["minibatch"], a["advantage"]]).encode())
    return h.hexdigest()


def _parts(value: object, name: str = "") -> list[tuple[str, object]]:
    """(name, array or JSON value) of every field of a dataclass, nested ones (a Ragged, the support
    columns) field by field."""
    if not is_dataclass(value):
        return [(name, value)]
    return [part for f in fields(value) for part in _parts(getattr(value, f.name), f"{name}.{f.name}")]


def save_state(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    cursor: int,
    rows: list[dict],
    fingerprint: dict,
) -> None:
    with replacing(folder) as tmp:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp / STATE_FILE)
        meta = {"cursor": cursor, "rows": rows, "fingerprint": fingerprint}
        (tmp / META_FILE).write_text(json.dumps(meta, default=str))


def load_state(folder: Path, fingerprint: dict) -> ResumeState | None:
    """The saved state, if there is one for exactly this fingerprint."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
        if meta["fingerprint"] != json.loads(json.dumps(fingerprint, default=str)):
            return None
        state = torch.load(folder / STATE_FILE, weights_only=True, map_location="cpu")
        return ResumeState(state["model"], state["optimizer"], meta["cursor"], meta["rows"])
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        RuntimeError,
        EOFError,
        pickle.UnpicklingError,
    ):  # none, or
        # unreadable (a state holding anything but tensors is refused unread): start over
        return None


def clear_state(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def logprobs_table(
    call_ids: list[str],
    round_start: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor] | None,
    round_: int,
    experiment: str,
) -> pa.Table:
    """The round's `policy_logprobs` rows: pi_k (and the reference, else null) of each call, as
    Arrow lists built from the tensors' float32 values (bit-exact)."""

    def lists(per_call: dict[str, torch.Tensor]) -> pa.ListArray:
        parts = [per_call[c].detach().float() for c in call_ids]
        values = torch.cat(parts).cpu().numpy() if parts else np.zeros(0, dtype=np.float32)
        ends = offsets(np.array([len(p) for p in parts], dtype=np.int64))
        array = pa.LargeListArray.from_arrays(pa.array(ends), pa.array(values, pa.float32()))
        return array.cast(LOGPROBS)  # raises, rather than wraps, past 2^31 values

    n = len(call_ids)
    return pa.Table.from_arrays(
        [
            pa.array(call_ids, pa.string()),
            pa.array(np.full(n, round_, dtype=np.int64)),
            pa.array([experiment] * n, pa.string()),
            lists(round_start),
            lists(reference) if reference is not None else pa.nulls(n, LOGPROBS),
        ],
        schema=POLICY_LOGPROBS,
    )


def stored_pi_k(
    table: pa.Table, experiment: str, calls: RecordedCalls, with_reference: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None] | None:
    """pi_k (and, `with_reference`, the reference) of every call as `policy_logprobs` rows of
    `experiment` hold them, per call_id; None unless each call has one complete row (one value per
    completion token): else they were not kept as written, and the round starts over."""
    rows = table.filter(pc.equal(table.column("experiment"), experiment))
    wanted = dict(zip(calls.call_id, calls.completion.lengths.tolist(), strict=True))
    stored = Counter(rows.column("call_id").to_pylist())
    if any(stored[c] != 1 for c in wanted):  # none, or two that may disagree: not kept as written
        return None
    found = []
    for column in ("round_start_logprobs", "reference_logprobs")[: 1 + with_reference]:
        lists = combined(rows.column(column))
        complete = rows.filter(pa.array(~nulls_within(lists, 1)))
        values = Ragged.of(combined(complete.column(column)), np.float32)
        per_call = dict(
            zip(
                complete.column("call_id").to_pylist(),
                torch.from_numpy(values.values).split(values.lengths.tolist()),
                strict=True,
            )
        )
        if any(c not in per_call or len(per_call[c]) != n for c, n in wanted.items()):
            return None
        found.append(per_call)
    return found[0], found[1] if with_reference else None
