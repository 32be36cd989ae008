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
from dataclasses import dataclass
from pathlib import Path

import torch

from prodrl_pipeline.folders import replacing

STATE_FILE, META_FILE = "state.pt", "resume.json"


@dataclass
class ResumeState:
    model: dict
    optimizer: dict
    cursor: int
    """Minibatches already trained."""
    rows: list[dict]
    """Their metrics rows."""


def data_digest(calls: list[dict], advantages: list[dict]) -> str:
    """A digest of what a round trains on: its calls (ids, tokens, log mu, sampling) and advantages."""
    h = hashlib.sha256()
    for c in sorted(calls, key=lambda c: c["call_id"]):
        ids = [c["call_id"], c["trajectory_id"], list(c["prompt_token_ids"]), list(c["completion_token_ids"])]
        h.update(json.dumps([*ids, list(c["completion_logprobs"]), c["sampling"]]).encode())
    for a in sorted(advantages, key=lambda a: a["trajectory_id"]):
        h.update(json.dumps([a["trajectory_id"], a["minibatch"], a["advantage"]]).encode())
    return h.hexdigest()


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
