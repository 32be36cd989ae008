"""Corrupt or truncated files at each boundary that reads them back: a checkpoint folder, an NVFP4
deployment export and a Delta table's log. Each fails with an error that names the folder or table
and what is wrong with which file, never a bare low-level one, and none loads silently wrong
weights or rows. Truncation points and garbled header bytes are drawn by hypothesis. Out of reach
without a stored digest: bytes flipped inside tensor data, and a Delta commit cut exactly at a line
end (to Delta, a valid commit with fewer actions)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from prodrl_pipeline.folders import CorruptFileError
from prodrl_pipeline.model import build_model
from prodrl_pipeline.quant.nvfp4 import export_deployment, load_deployment
from prodrl_pipeline.records.store import DeltaStore, StorageError
from prodrl_pipeline.rl.checkpoint import load_checkpoint, save_checkpoint
from tests.conftest import TINY

WEIGHTS, QUANT = "model.safetensors", "hf_quant_config.json"
Edit = bytes | Callable[[bytes], bytes] | None
FEW = settings(max_examples=12, deadline=None)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    return build_model(TINY, len(tokenizer), tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "ckpt"
    save_checkpoint(path, model, {"state": {0: {"exp_avg": torch.ones(8)}}, "param_groups": []}, {"step": 1})
    return path


def _copy(folder: Path, tmp: pytest.TempPathFactory) -> Path:
    return Path(shutil.copytree(folder, tmp.mktemp("bad") / folder.name))


def _broken(folder: Path, tmp: pytest.TempPathFactory, file: str, edit: Edit) -> Path:
    """A copy of `folder` with `file` deleted (edit None), replaced by bytes, or edited by a function."""
    path = _copy(folder, tmp)
    if edit is None:
        (path / file).unlink()
    else:
        (path / file).write_bytes(edit((path / file).read_bytes()) if callable(edit) else edit)
    return path


def _header_len(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def _replacing(old: str, new: str) -> Callable[[bytes], bytes]:
    """The first `old` (in a safetensors file: in its header) replaced by `new`, of the same length."""
    return lambda data: data.replace(old.encode(), new.encode(), 1)


def _dropping(tensor: str) -> Callable[[bytes], bytes]:
    return lambda data: save({k: v for k, v in load(data).items() if k != tensor})


DOWN = "model.layers.0.mlp.down_proj"
CHECKPOINT_CASES = {  # file, edit, the error and its message
    "no-weights": (WEIGHTS, None, FileNotFoundError, r"checkpoint .*ckpt: model\.safetensors is missing"),
    "empty-weights": (WEIGHTS, b"", CorruptFileError, r"ckpt: model\.safetensors is truncated or corrupt"),
    "garbage-header": (
        WEIGHTS,
        bytes([64, 0, 0, 0, 0, 0, 0, 0]) + b"\xff" * 64,
        CorruptFileError,
        r"ckpt: model\.safetensors is truncated or corrupt \(SafetensorError: .*header",
    ),
    "int-dtype": (WEIGHTS, _replacing('"F32"', '"I32"'), CorruptFileError, r"corrupt .*non-float weights"),
    "renamed-tensor": (WEIGHTS, _replacing(DOWN, DOWN.replace("l", "n", 1)), ValueError, rf"lack \['{DOWN}"),
    "no-config": ("config.json", None, FileNotFoundError, r"checkpoint .*ckpt: config\.json is missing"),
    "cut-config": ("config.json", b'{"model_type": "qw', CorruptFileError, r"config\.json is truncated"),
    "bad-meta": ("prodrl.json", b"{", CorruptFileError, r"ckpt: prodrl\.json is truncated or corrupt"),
    "bad-optimizer": ("optimizer.pt", b"PK\x03\x04junk", CorruptFileError, r"optimizer\.pt is truncated"),
}


@pytest.mark.parametrize(
    ("file", "edit", "error", "message"), CHECKPOINT_CASES.values(), ids=CHECKPOINT_CASES
)
def test_a_broken_checkpoint_file_is_named_with_what_is_wrong(
    checkpoint, tmp_path_factory, file, edit, error, message
):
    with pytest.raises(error, match=message):
        load_checkpoint(_broken(checkpoint, tmp_path_factory, file, edit))


def test_an_empty_folder_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not a prodrl checkpoint \(no prodrl\.json\)"):
        load_checkpoint(tmp_path)


@FEW
@given(name=st.sampled_from([WEIGHTS, "optimizer.pt"]), at=st.integers(0, 2**24))
def test_a_checkpoint_file_cut_anywhere_is_reported_truncated(checkpoint, tmp_path_factory, name, at):
    whole = (checkpoint / name).read_bytes()
    path = _copy(checkpoint, tmp_path_factory)
    (path / name).write_bytes(whole[: at % len(whole)])
    with pytest.raises(CorruptFileError, match=rf"checkpoint .*ckpt: {name} is truncated or corrupt \(\w+: "):
        load_checkpoint(path)


@settings(max_examples=25, deadline=None)
@given(at=st.integers(0, 2**24), change=st.integers(1, 255))
def test_one_garbled_header_byte_is_an_error_or_changes_nothing(
    checkpoint, model, tmp_path_factory, at, change
):
    whole = (checkpoint / WEIGHTS).read_bytes()
    at %= _header_len(whole)
    path = _copy(checkpoint, tmp_path_factory)
    (path / WEIGHTS).write_bytes(whole[:at] + bytes([(whole[at] + change) % 256]) + whole[at + 1 :])
    try:
        loaded = load_checkpoint(path)[0].state_dict()
    except ValueError as e:  # CorruptFileError, or load_model's
        assert str(path) in str(e)
        assert "model.safetensors is truncated or corrupt" in str(e) or " lack [" in str(e), str(e)
    else:  # the header's padding or its `format` metadata: the weights are all there, unchanged
        for name, w in model.state_dict().items():
            assert torch.equal(loaded[name], w), name


@pytest.fixture(scope="module")
def deployment(model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "fp4"
    export_deployment(model, path, "nvfp4")
    return path


DEPLOYMENT_CASES = {
    "garbage-weights": (WEIGHTS, b"garbage!" * 16, CorruptFileError, r"fp4: model\.safetensors is trunc"),
    "no-weights": (WEIGHTS, None, FileNotFoundError, r"deployment .*fp4: model\.safetensors is missing"),
    "no-weight-scale": (
        WEIGHTS,
        _dropping(f"{DOWN}.weight_scale"),
        CorruptFileError,
        rf"fp4: model\.safetensors is .*{DOWN}\.weight holds NVFP4 codes but {DOWN}\.weight_scale is missing",
    ),
    "no-weight-scale-2": (
        WEIGHTS,
        _dropping(f"{DOWN}.weight_scale_2"),
        CorruptFileError,
        rf"but {DOWN}\.weight_scale_2 is missing",
    ),
    "no-weight": (WEIGHTS, _dropping(f"{DOWN}.weight"), ValueError, rf"fp4: missing \['{DOWN}\.weight'"),
    "quant-config-not-json": (QUANT, b"{not json", CorruptFileError, r"fp4: hf_quant_config\.json is trunc"),
    "empty-quant-config": (QUANT, b"", CorruptFileError, r"fp4: hf_quant_config\.json is truncated"),
    "no-config": ("config.json", None, FileNotFoundError, r"deployment .*fp4: config\.json is missing"),
}


@pytest.mark.parametrize(
    ("file", "edit", "error", "message"), DEPLOYMENT_CASES.values(), ids=DEPLOYMENT_CASES
)
def test_a_broken_deployment_file_is_named_with_what_is_wrong(
    deployment, tmp_path_factory, file, edit, error, message
):
    with pytest.raises(error, match=message):
        load_deployment(_broken(deployment, tmp_path_factory, file, edit))


@FEW
@given(at=st.integers(0, 2**24))
def test_a_deployment_cut_anywhere_is_reported_truncated(deployment, tmp_path_factory, at):
    whole = (deployment / WEIGHTS).read_bytes()
    path = _copy(deployment, tmp_path_factory)
    (path / WEIGHTS).write_bytes(whole[: at % len(whole)])
    with pytest.raises(
        CorruptFileError, match=r"deployment .*fp4: model\.safetensors is truncated or corrupt"
    ):
        load_deployment(path)


def _rejects(round_: int, n: int) -> list[dict]:
    now = datetime.now(UTC)
    row = {"table_name": "calls", "round": round_, "reason": "r", "record_json": "{}", "rejected_at": now}
    return [{**row, "record_id": f"{round_}-{i}"} for i in range(n)]


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("good") / "tables"
    store = DeltaStore(root)
    store.overwrite_round("rejects", _rejects(1, 3), 1)
    store.overwrite_round("rejects", _rejects(2, 4), 2)  # the latest commit: version 1
    return root


LATEST = "rejects/_delta_log/00000000000000000001.json"
CORRUPT_LOG = r"table 'rejects' \(.*\) is unreadable: its Delta log is corrupt, a commit file in _delta_log"


def _assert_reads_fail_clearly(root: Path) -> None:
    store = DeltaStore(root)
    assert store.exists("rejects")
    with pytest.raises(StorageError, match=CORRUPT_LOG):
        store.read("rejects")
    with pytest.raises(StorageError, match=CORRUPT_LOG):
        store.table("rejects")
    with pytest.raises(StorageError, match=CORRUPT_LOG):
        store.append("rejects", _rejects(3, 1))
    assert store.read("rejects", version=0).num_rows == 3  # the version before it still reads


@FEW
@given(at=st.integers(0, 2**24))
def test_a_latest_commit_cut_mid_line_makes_reads_fail_naming_the_table(tables, tmp_path_factory, at):
    root = _copy(tables, tmp_path_factory)
    whole = (root / LATEST).read_bytes()
    inside = [i for i in range(1, len(whole)) if b"\n" not in whole[i - 1 : i + 1]]  # a partial line left
    (root / LATEST).write_bytes(whole[: inside[at % len(inside)]])
    _assert_reads_fail_clearly(root)


@pytest.mark.parametrize(
    "garbage", [b"\x00\xff garbage \x13" * 8, b"not json at all\n", b"null\n", b'{"add": 5}\n']
)
def test_a_garbage_latest_commit_makes_reads_fail_naming_the_table(tables, tmp_path_factory, garbage):
    root = _copy(tables, tmp_path_factory)
    (root / LATEST).write_bytes(garbage)
    _assert_reads_fail_clearly(root)
