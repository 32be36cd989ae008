import math

import pytest
import torch

from prodrl_pipeline.engine.processing import SamplingParams, processed_logprobs
from tests.conftest import logprob_tolerance


def brute_force(logits: list[float], temperature: float, top_k: int, top_p: float, allowed: set[int] | None):
    """vLLM's order, one token at a time: mask -> temperature -> top-k -> top-p -> renormalize."""
    v = len(logits)
    ids = [i for i in range(v) if allowed is None or i in allowed]
    if temperature == 0:
        best = max(ids, key=lambda i: logits[i])
        return {best: 0.0}
    z = {i: logits[i] / temperature for i in ids}
    order = sorted(ids, key=lambda i: -z[i])
    if 0 < top_k < v:
        order = order[:top_k]
    norm = math.log(sum(math.exp(z[i]) for i in order))
    kept, mass = [], 0.0
    for i in order:
        if top_p < 1 and mass >= top_p:  # top_p = 1: no cut (vLLM skips it)
            break
        kept.append(i)
        mass += math.exp(z[i] - norm)
    norm = math.log(sum(math.exp(z[i]) for i in kept))
    return {i: z[i] - norm for i in kept}


@pytest.mark.parametrize(
    "temperature,top_k,top_p,mask",
    [
        (1.0, 0, 1.0, False),
        (0.7, 5, 1.0, False),
        (1.3, 0, 0.8, False),
        (0.9, 6, 0.7, True),
        (1.0, 0, 1.0, True),
        (0.0, 0, 1.0, True),
        (2.0, 3, 0.5, False),
    ],
)
def test_matches_brute_force_on_tiny_vocab(temperature, top_k, top_p, mask):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 16, generator=g) * 2
    allowed = torch.rand(4, 16, generator=g) < 0.6 if mask else None
    if allowed is not None:
        allowed[:, 0] = True
    out = processed_logprobs(
        logits, torch.full((4,), temperature), torch.full((4,), top_k), torch.full((4,), top_p), allowed
    )
    for row in range(4):
        keep = set(allowed[row].nonzero().squeeze(1).tolist()) if allowed is not None else None
        expected = brute_force(logits[row].tolist(), temperature, top_k, top_p, keep)
        got = {i: float(out[row, i]) for i in range(16) if math.isfinite(out[row, i])}
        assert got.keys() == expected.keys()
        rounding = logprob_tolerance(list(expected.values()), n_terms=16)  # fp32 logsumexp of 16 logits
        for i in got:
            assert got[i] == pytest.approx(expected[i], abs=rounding)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (0, 0.9), (5, 1.0)])
def test_logit_bias_comes_first_and_top_p_1_keeps_a_near_certain_row_whole(top_k, top_p):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 16, generator=g)
    bias = torch.zeros(2, 16)
    bias[0, 3], bias[0, 5], bias[1, 7] = 60.0, -100.0, 2.5  # row 0: token 3 is near certain in fp32
    out = processed_logprobs(
        logits, torch.full((2,), 0.8), torch.full((2,), top_k), torch.full((2,), top_p), bias=bias
    )
    for row in range(2):
        expected = brute_force((logits[row] + bias[row]).tolist(), 0.8, top_k, top_p, None)
        got = {i: float(out[row, i]) for i in range(16) if math.isfinite(out[row, i])}
        assert got.keys() == expected.keys()
        rounding = logprob_tolerance(list(expected.values()), n_terms=16)
        assert all(got[i] == pytest.approx(expected[i], abs=rounding) for i in got)
    if (top_k, top_p) == (0, 1.0):
        assert torch.isfinite(out[0]).all()  # p(3) rounds to 1 in fp32, yet nothing is cut


def test_bad_sampling_params_are_refused():
    for bad in (
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"max_tokens": 0},
        {"logit_bias": ((3, 101.0),)},
        {"logit_bias": ((-1, 1.0),)},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_each_row_keeps_its_own_sampling_parameters_in_one_batch():
    """Rows with different temperature, top-k (0, k < V, k = V, k > V), top-p and greedy, processed
    together, each equal their own brute force (nothing of one row leaks into another)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 12, generator=g) * 2
    rows = [
        (1.0, 0, 1.0),
        (0.5, 4, 1.0),
        (1.5, 12, 1.0),
        (1.0, 40, 1.0),
        (0.8, 0, 0.6),
        (0.0, 5, 0.5),
        (1.2, 1, 0.9),
    ]
    temperature, top_k, top_p = (torch.tensor(c) for c in zip(*rows, strict=True))
    out = processed_logprobs(logits, temperature.float(), top_k, top_p.float())
    for row, (t, k, p) in enumerate(rows):
        expected = brute_force(logits[row].tolist(), t, k, p, None)
        got = {i: float(out[row, i]) for i in range(12) if math.isfinite(out[row, i])}
        assert got.keys() == expected.keys(), row
        rounding = logprob_tolerance(list(expected.values()), n_terms=12)
        assert all(got[i] == pytest.approx(expected[i], abs=rounding) for i in got), row


def test_a_masked_row_under_top_k_never_keeps_a_masked_token():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    allowed = torch.tensor([[False, True, False, True, True]])
    out = processed_logprobs(logits, torch.ones(1), torch.tensor([4]), torch.ones(1), allowed)
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, True]  # k = 4 > 3 allowed
    assert float(out[0].exp().sum()) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"temperature": -1}, "temperature must be >= 0, got -1"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -2}, r"top_k must be >= 0 \(0 disables it\), got -2"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        (
            {"logit_bias": ((3, 100.5),)},
            r"logit_bias takes token ids >= 0 and biases in \[-100, 100\], got 3: 100.5",
        ),
        ({"logit_bias": ((3, -100.5),)}, r"got 3: -100.5"),
        ({"logit_bias": ((-1, 1.0),)}, r"got -1: 1.0"),
    ],
)
def test_bad_sampling_params_are_refused_with_their_reason(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_sampling_params_at_their_edges_are_accepted_and_recorded_whole():
    edge = SamplingParams(
        temperature=0.0, top_p=1.0, top_k=0, max_tokens=1, logit_bias=((0, -100.0), (9, 100.0))
    )
    assert edge.recorded(seed=7) == {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "max_tokens": 1,
        "seed": 7,
        "logit_bias": [{"token_id": 0, "bias": -100.0}, {"token_id": 9, "bias": 100.0}],
    }
    assert SamplingParams(top_p=1e-6).top_p == 1e-6
    assert SamplingParams() == SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=64, seed=None)


def test_the_bias_matrix_is_dense_per_row_and_absent_without_biases():
    from prodrl_pipeline.engine.processing import bias_matrix

    assert bias_matrix([None, None], 5) is None
    dense = bias_matrix([None, ([0, 4], [1.5, -2.0]), ([2], [100.0])], 5)
    assert dense.tolist() == [[0, 0, 0, 0, 0], [1.5, 0, 0, 0, -2.0], [0, 0, 100.0, 0, 0]]
    assert dense.dtype == torch.float32


def test_top_p_keeps_a_token_only_while_the_mass_before_it_is_below_top_p():
    """Four equal logits: exactly 0.25 each, so the mass before the third token is exactly 0.5."""
    out = processed_logprobs(
        torch.zeros(1, 4), torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.5])
    )
    assert int(torch.isfinite(out).sum()) == 2
