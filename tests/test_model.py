import torch
from dagster import instance_for_test, materialize

from assets.base_model import base_model
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.records.registry import live_deployment, lookup
from resources.lab import LabResource
from resources.store import StoreResource
from tests.conftest import TINY


def test_base_model_is_deterministic(tokenizer):
    a = build_model(TINY, len(tokenizer), tokenizer.pad_token_id).state_dict()
    b = build_model(TINY, len(tokenizer), tokenizer.pad_token_id).state_dict()
    c = build_model(TinyQwen3Config(**{**TINY.__dict__, "seed": 4}), len(tokenizer), 0).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_bad_architecture_is_refused():
    try:
        TinyQwen3Config(hidden_size=100, num_heads=3)
    except ValueError as e:
        assert "divide" in str(e)
    else:
        raise AssertionError("hidden_size 100 with 3 heads must be refused")


def test_base_model_from_an_hf_checkpoint(tiny_model, tokenizer, tmp_path):
    """The production path: base_model loads an existing HF checkpoint (weights + tokenizer)."""
    hf = tmp_path / "hf"
    tiny_model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    resources = {
        "store": StoreResource(root=str(tmp_path / "root")),
        "lab": LabResource(base_checkpoint=str(hf), eval_puzzles=4),
    }
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
    tables = resources["store"].tables()
    assert live_deployment(tables)["deployment_id"] == "base"
    assert lookup(tables, "checkpoints", "checkpoint_id", "base")["parent_id"] is None
    assert tables.read("eval_results", 0).num_rows == 4
    served = (tmp_path / "root" / "checkpoints" / "base" / "model.safetensors").exists()
    assert served
