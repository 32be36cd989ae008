import pytest

from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.rollout import play
from prodrl_pipeline.quant.nvfp4 import export_deployment, load_deployment


def record(model, tokenizer, puzzles, tmp_path, quant_format="none", params=None, extra_samples=0):
    """Serve `model` through a deployment export and play `puzzles`: real recorded calls."""
    export_deployment(model, tmp_path / quant_format, quant_format)
    engine = TorchEngine(
        load_deployment(tmp_path / quant_format),
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        extra_samples=extra_samples,
    )
    return play(engine, tokenizer, puzzles, params or SamplingParams(), deployment_id="d", round_=1, seed=0)


@pytest.fixture
def recorded(tiny_model, tokenizer, train_puzzles, tmp_path):
    mate_in_two = [p for p in train_puzzles if "mateIn2" in p.themes][:4]
    return record(tiny_model, tokenizer, train_puzzles[:4] + mate_in_two, tmp_path, extra_samples=2)
