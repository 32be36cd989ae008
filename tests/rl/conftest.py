import copy
import math

import pytest
import torch

from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.rollout import play
from prodrl_pipeline.quant.nvfp4 import export_deployment, load_deployment
from prodrl_pipeline.rl.estimators import TokenInputs
from prodrl_pipeline.rl.logprobs import Sequences, project_logprobs
from prodrl_pipeline.rl.recorded import RecordedCalls
from tests.conftest import build_tiny


def record(
    model, tokenizer, puzzles, tmp_path, quant_format="none", params=None, extra_samples=0, top_logprobs=20
):
    """Serve `model` through a deployment export and play `puzzles`: real recorded calls."""
    export_deployment(model, tmp_path / quant_format, quant_format)
    engine = TorchEngine(
        load_deployment(tmp_path / quant_format),
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        top_logprobs=top_logprobs,
        extra_samples=extra_samples,
    )
    return play(engine, tokenizer, puzzles, params or SamplingParams(), deployment_id="d", round_=1, seed=0)


@pytest.fixture(scope="session")
def _recorded_once(tokenizer, train_puzzles, tmp_path_factory):
    model = build_tiny(tokenizer)  # the weights of `tiny_model`
    mate_in_two = [p for p in train_puzzles if "mateIn2" in p.themes][:4]
    return record(
        model, tokenizer, train_puzzles[:4] + mate_in_two, tmp_path_factory.mktemp("rec"), extra_samples=2
    )


@pytest.fixture
def recorded(_recorded_once):
    """Calls `tiny_model` recorded playing 8 puzzles (with 2 extra samples a position): recorded
    once a session, a fresh copy a test."""
    return copy.deepcopy(_recorded_once)


def token_inputs(theta, tokens, log_mu, support=None, head=None, log_pik=None, adv=1.0, pad=0, extra=None):
    """TokenInputs for sampled `tokens` at one position whose logits are `theta` [V], computed by
    the trainer's own log-prob code (identity output embedding). mu is recorded as `log_mu` [V]
    (-inf outside the kept support `support`, None = the whole vocabulary) with head `head` (default:
    the whole support, by decreasing mu), padded with `pad` entries (id 0, log mu = -inf) as a
    microbatch mixing head lengths pads it. `adv`: a float or one advantage per token."""
    vocab = theta.shape[0]
    tokens = torch.as_tensor(tokens)
    n = len(tokens)
    if head is None:
        kept = torch.arange(vocab) if support is None else torch.as_tensor(support)
        head = kept[log_mu[kept].argsort(descending=True)]
    head = torch.as_tensor(head)
    head_mu = log_mu[head].detach()
    head_ids = torch.cat([head, torch.zeros(pad, dtype=torch.long)])
    head_mu = torch.cat([head_mu, torch.full((pad,), -math.inf)])
    extra = torch.zeros((n, 0), dtype=torch.long) if extra is None else torch.as_tensor(extra)
    seqs = Sequences(
        input_ids=torch.zeros((n, 1), dtype=torch.long),
        attention_mask=torch.ones((n, 1), dtype=torch.long),
        token_row=torch.arange(n),
        token_pos=torch.zeros(n, dtype=torch.long),
        token_ids=tokens,
        temperature=torch.ones(n),
        support=[None if support is None else list(support)] * n,
        deployment_logprobs=log_mu[tokens].detach(),
        head_ids=head_ids.expand(n, -1),
        head_mask=torch.isfinite(head_mu).expand(n, -1),
        head_deployment_logprobs=head_mu.expand(n, -1),
        extra_ids=extra,
    )
    lp = project_logprobs(theta.expand(n, vocab), torch.eye(vocab, dtype=theta.dtype), seqs, chunk_tokens=5)
    return TokenInputs(
        logprobs=lp.logprobs,
        deployment_logprobs=seqs.deployment_logprobs,
        round_start_logprobs=lp.logprobs.detach() if log_pik is None else log_pik[tokens],
        advantages=torch.as_tensor(adv, dtype=theta.dtype).expand(n).clone(),
        trajectory=torch.zeros(n, dtype=torch.long),
        free=torch.full((n,), support is None or len(support) > 1),
        head_logprobs=lp.head_logprobs,
        tail_logprobs=lp.tail_logprobs,
        head_deployment_logprobs=seqs.head_deployment_logprobs,
        extra_logprobs=lp.extra_logprobs,
        complement_logprobs=lp.complement_logprobs,
    )


@pytest.fixture
def columns(recorded):
    """`recorded`'s calls as the trainer reads them (rl/recorded.py)."""
    return RecordedCalls.from_rows(recorded.calls)
