"""Checkpoints: HF safetensors weights + optimizer state + the resolved config, written atomically.

A checkpoint directory appears complete or not at all: it is written to a temporary sibling and
renamed into place (a re-materialized round swaps the old directory out the same way).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch
from transformers import PreTrainedModel

from prodrl_pipeline.model import load_model

OPTIMIZER_FILE, META_FILE = "optimizer.pt", "prodrl.json"
LINEAGE_KEYS = ("model", "source", "vocab_size")
"""Meta a trained checkpoint inherits from its parent: what the base model was built from."""


def save_checkpoint(
    path: str | Path, model: PreTrainedModel, optimizer_state: dict | None, meta: dict
) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write (disk full) leaves nothing behind
        raise
    old = path.parent / f".old-{path.name}-{uuid.uuid4().hex[:8]}"
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | Path) -> tuple[PreTrainedModel, dict | None, dict]:
    """(model, optimizer state or None, meta)."""
    path = Path(path)
    if not (path / META_FILE).exists():
        raise FileNotFoundError(f"{path} is not a prodrl checkpoint (no {META_FILE})")
    opt = path / OPTIMIZER_FILE
    optimizer_state = torch.load(opt, weights_only=True, map_location="cpu") if opt.exists() else None
    return load_model(path), optimizer_state, json.loads((path / META_FILE).read_text())
