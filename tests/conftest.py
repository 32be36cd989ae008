"""Fixtures and helpers shared by the tests. Every float tolerance is derived from the scale of
what was computed and the precision it was computed in (`rounding_tolerance`), never read off one
machine's rounding: the rule, and how to apply it, in tests/README.md."""

import math
import os
import shutil
import tempfile

import pytest
import torch

from prodrl_pipeline.chat.render import load_tokenizer
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


def rounding_tolerance(scale: float, n_terms: int = 1, dtype: torch.dtype = torch.float32) -> float:
    """How far two computations of one float quantity may differ by rounding alone:
    4 eps(dtype) sqrt(n_terms) scale, where `scale` is the magnitude of the terms it was computed
    from (of a sum's terms, not of its result, which may cancel to ~0) and `n_terms` how many were
    summed into it (tests/README.md)."""
    return 4 * torch.finfo(dtype).eps * math.sqrt(n_terms) * float(scale)


def logprob_tolerance(logprobs, n_terms: int = TINY.hidden_size) -> float:
    """`rounding_tolerance` of float32 log-probs log p = z - logsumexp(z): the scale of those terms
    is that of the largest finite |log p| in `logprobs` (a distribution, or every value compared),
    and each logit z sums `n_terms` products (the tests' model: its hidden size)."""
    values = torch.as_tensor(logprobs).detach().double()
    finite = values[values.isfinite()]
    return rounding_tolerance(finite.abs().max() if finite.numel() else 0.0, n_terms)


SLOWEST_FIRST = (
    "tests/faults/test_round_faults.py",
    "tests/test_ui.py",
    "tests/gateway/test_serving.py",
    "tests/test_unattended.py",
    "tests/faults/test_concurrency.py",
    "tests/test_pipeline.py",
    "tests/test_bench_smoke.py",
    "tests/test_replay.py",
)
"""The files that take longest (minutes each on 2 cores), run first, longest first: `make test`'s
two workers take whole files in collection order, so a long file started last would run alone."""


def pytest_configure(config):
    """Marks of validated puzzle files (envs/puzzles.py) go to this run's folder, not the user's cache."""
    if "PRODRL_CACHE_DIR" not in os.environ:
        folder = tempfile.mkdtemp(prefix="prodrl-test-cache-")
        os.environ["PRODRL_CACHE_DIR"] = folder
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def pytest_collection_modifyitems(config, items):
    """The slowest files first (a stable sort: each file's tests keep their order). `gpu` tests
    need CUDA and the `serve` extra; without them they are skipped, not failed."""
    import importlib.util

    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
    if torch.cuda.is_available() and importlib.util.find_spec("vllm"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and vLLM (the `serve` extra)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
