"""Checkpoints: HF safetensors weights + optimizer state + the resolved config, written atomically.

A checkpoint directory appears complete or not at all: it is written to a temporary sibling and
renamed into place (a re-materialized round swaps the old directory out the same way).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_NAME

from prodrl_pipeline.folders import reading, replacing
from prodrl_pipeline.locks import folder_lock
from prodrl_pipeline.model import load_model

OPTIMIZER_FILE, META_FILE = "optimizer.pt", "prodrl.json"
LINEAGE_KEYS = ("model", "source", "vocab_size")
"""Meta a trained checkpoint inherits from its parent: what the base model was built from."""


def save_checkpoint(
    path: str | Path, model: PreTrainedModel, optimizer_state: dict | None, meta: dict
) -> None:
    with replacing(Path(path)) as tmp:  # a failed write (disk full) leaves nothing behind
        model.save_pretrained(tmp)
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))


def load_checkpoint(path: str | Path) -> tuple[PreTrainedModel, dict | None, dict]:
    """(model, optimizer state or None, meta). A file of it that is missing, truncated or corrupt
    raises an error naming the checkpoint and the file (FileNotFoundError, CorruptFileError). Read
    under the folder's shared lock: a re-materialization swapping it waits until the load is done."""
    path = Path(path)
    with folder_lock(path, shared=True):
        return _load_checkpoint(path)


def _load_checkpoint(path: Path) -> tuple[PreTrainedModel, dict | None, dict]:
    if not (path / META_FILE).exists():
        raise FileNotFoundError(f"{path} is not a prodrl checkpoint (no {META_FILE})")
    what = f"checkpoint {path}"
    with reading(path / META_FILE, what):
        meta = json.loads((path / META_FILE).read_text())
    opt = path / OPTIMIZER_FILE
    with reading(opt, what):
        optimizer_state = torch.load(opt, weights_only=True, map_location="cpu") if opt.exists() else None
    with reading(path / CONFIG_NAME, what):  # transformers calls a missing one an unrecognized model
        json.loads((path / CONFIG_NAME).read_text())
    for weights in sorted(path.glob("*.safetensors")) or [path / SAFE_WEIGHTS_NAME]:
        with reading(weights, what), safe_open(weights, "pt") as f:  # parses the header, checks the size
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (not iterable)
            if not_float := [k for k, d in dtypes.items() if not d.startswith(("F", "BF"))]:
                raise ValueError(f"non-float weights {not_float}")  # a garbled dtype would load as bits
    return load_model(path), optimizer_state, meta
