import pytest
import torch

from prodrl_pipeline.envs.chat import load_tokenizer
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.model import TinyQwen3Config, build_model

TINY = TinyQwen3Config(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, seed=3
)


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("data/tokenizer")


@pytest.fixture(scope="session")
def heldout():
    return list(iter_lab_puzzles("data", "heldout"))


@pytest.fixture(scope="session")
def train_puzzles():
    return list(iter_lab_puzzles("data", "train"))


def build_tiny(tokenizer):
    """The tests' tiny model, the same weights every time."""
    torch.manual_seed(0)
    return build_model(TINY, len(tokenizer), tokenizer.pad_token_id)


@pytest.fixture
def tiny_model(tokenizer):
    return build_tiny(tokenizer)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA and the `serve` extra; without them they are skipped, not failed."""
    import importlib.util

    if torch.cuda.is_available() and importlib.util.find_spec("vllm"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and vLLM (the `serve` extra)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
