from pathlib import Path

import pytest

from prodrl_pipeline.gateway.process import GatewayProcess
from prodrl_pipeline.model import build_model
from prodrl_pipeline.quant.nvfp4 import export_deployment
from prodrl_pipeline.records.registry import register_deployment
from prodrl_pipeline.records.store import DeltaStore
from tests.conftest import TINY

SERVE_KEY, FEEDBACK_KEY = "sk-serve-test", "sk-feedback-test"


def make_root(root: Path, tokenizer) -> Path:
    """A store root with one live NVFP4 deployment of a tiny model."""
    model = build_model(TINY, len(tokenizer), tokenizer.pad_token_id)
    export_deployment(model, root / "deployments" / "base", "nvfp4")
    store = DeltaStore(root / "tables")
    register_deployment(
        store,
        deployment_id="base",
        round_=0,
        checkpoint_id="base",
        path=str(root / "deployments" / "base"),
        quant_format="nvfp4",
        sampling_json="{}",
    )
    store.set_live("base")
    return root


def Gateway(root: Path, *args: str) -> GatewayProcess:  # noqa: N802 - reads like the class it builds
    """The gateway as tests run it: API keys set, quick flushes, short default completions."""
    keys = {"PRODRL_API_KEYS": SERVE_KEY, "PRODRL_FEEDBACK_KEYS": FEEDBACK_KEY}
    return GatewayProcess(root, "--flush-seconds", "0.2", "--max-tokens", "16", *args, env=keys)


@pytest.fixture
def gateway(tmp_path, tokenizer):
    gw = Gateway(make_root(tmp_path, tokenizer)).start()
    yield gw
    gw.stop()
