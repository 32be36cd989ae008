from pathlib import Path

import pytest

from prodrl_pipeline.gateway.process import GatewayProcess, live_root
from prodrl_pipeline.model import build_model
from tests.conftest import TINY

SERVE_KEY, FEEDBACK_KEY = "sk-serve-test", "sk-feedback-test"


def make_root(root: Path, tokenizer) -> Path:
    """A store root with one live NVFP4 deployment of a tiny model."""
    return live_root(root, build_model(TINY, len(tokenizer), tokenizer.pad_token_id))


def Gateway(root: Path, *args: str) -> GatewayProcess:  # noqa: N802 - reads like the class it builds
    """The gateway as tests run it: API keys set, quick flushes, short default completions."""
    keys = {"PRODRL_API_KEYS": SERVE_KEY, "PRODRL_FEEDBACK_KEYS": FEEDBACK_KEY}
    return GatewayProcess(root, "--flush-seconds", "0.2", "--max-tokens", "16", *args, env=keys)


@pytest.fixture
def gateway(tmp_path, tokenizer):
    gw = Gateway(make_root(tmp_path, tokenizer)).start()
    yield gw
    gw.stop()
