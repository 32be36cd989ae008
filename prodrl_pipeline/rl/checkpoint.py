"""Checkpoints: HF safetensors weights + optimizer state + the resolved config, written atomically.

A checkpoint directory appears complete or not at all: it is written to a temporary sibling and
renamed into place (a re-materialized round swaps the old directory out the same way).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PreTrainedModel

from prodrl_pipeline.folders import replacing
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
    """(model, optimizer state or None, meta)."""
    path = Path(path)
    if not (path / META_FILE).exists():
        raise FileNotFoundError(f"{path} is not a prodrl checkpoint (no {META_FILE})")
    opt = path / OPTIMIZER_FILE
    optimizer_state = torch.load(opt, weights_only=True, map_location="cpu") if opt.exists() else None
    return load_model(path), optimizer_state, json.loads((path / META_FILE).read_text())
