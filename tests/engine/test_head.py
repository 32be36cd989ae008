"""The recorded head (engine/head.py) against a brute-force sort, through the compiled kernel and
through torch's operations."""

import math

import pytest
import torch

from prodrl_pipeline import native
from prodrl_pipeline.engine import head as head_module
from prodrl_pipeline.engine.head import recorded_head


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(head_module, "_KERNEL", None)
    else:  # every K the kernel can take, however small the vocabulary
        monkeypatch.setattr(head_module, "VOCAB_PER_K", 1)
    return request.param


def _brute_head(row: list[float], k: int) -> tuple[list[float], list[int]]:
    """The k largest entries by (value descending, id ascending), -inf entries left out."""
    order = sorted((i for i, x in enumerate(row) if x > -math.inf), key=lambda i: (-row[i], i))[:k]
    return [row[i] for i in order], order


def _check(logp: torch.Tensor, k: int, path: str) -> None:
    sampled = torch.randint(0, logp.shape[1], (logp.shape[0],))
    got = recorded_head(logp, k, sampled)
    assert got.values.shape == got.ids.shape == (logp.shape[0], k)
    assert got.sampled_logp.tolist() == logp.gather(1, sampled[:, None]).squeeze(1).tolist()
    assert got.restricted == bool((logp == -math.inf).any())
    for row, values, ids in zip(logp.tolist(), got.values.tolist(), got.ids.tolist(), strict=True):
        want_values, want_ids = _brute_head(row, k)
        kept = len(want_values)  # the caller cuts the head at the kept support
        assert values[:kept] == want_values
        assert all(v == -math.inf for v in values[kept:])
        if path == "kernel":  # ties to the lower id
            assert ids[:kept] == want_ids
        else:  # torch.topk orders ties its own way: the ids hold the values, each once
            assert [row[i] for i in ids[:kept]] == want_values and len(set(ids[:kept])) == kept


@pytest.mark.parametrize("vocab", [1, 5, 31, 32, 33, 64, 100, 5025])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_the_head_of_full_supports_is_the_sorted_top_k(vocab, k, path):
    torch.manual_seed(vocab * 100 + k)
    logp = torch.randn(7, vocab).mul(3).log_softmax(-1)
    _check(logp, min(k, vocab), path)


def test_restricted_supports_smaller_than_the_head_and_between_the_head_and_the_vocabulary(path):
    """Masks as production makes them: a one-token support, a support under K (the head cut), one
    between K and V (top-k / top-p / a grammar), and a row with nothing removed, in one batch."""
    torch.manual_seed(0)
    vocab, k = 300, 20
    logits = torch.randn(4, vocab)
    keep = torch.zeros(4, vocab, dtype=torch.bool)
    keep[0, 17] = True
    keep[1, torch.randperm(vocab)[:3]] = True
    keep[2, torch.randperm(vocab)[:150]] = True
    keep[3] = True
    logp = logits.masked_fill(~keep, -math.inf).log_softmax(-1)
    _check(logp, k, path)


def test_ties_go_to_the_lower_ids_and_equal_blocks_are_all_scanned(path):
    """Every entry equal (the head's threshold equals every block's maximum), and a row of many
    ties across blocks around the K-th value."""
    logp = torch.zeros(2, 200)
    logp[1, ::3] = 1.0
    logp[1, 150:] = 2.0
    _check(logp, 20, path)
    _check(torch.full((1, 64), -math.inf).index_fill(1, torch.tensor([5, 40]), 0.0), 20, path)
    signed = torch.full((1, 96), -1.0)  # -0.0 equals 0.0: the lower id wins, in another block
    signed[0, 0], signed[0, 32], signed[0, 64] = -0.0, 0.0, 0.0
    _check(signed, 2, path)


@pytest.mark.parametrize("tied", [1, 20, 63, 64, 65, 200])
def test_ties_at_the_head_s_last_value_placed_by_counting_and_past_it_by_insertion(tied, path):
    """`tied` entries share the K-th value, spread over the row's blocks: up to 64 candidates the
    kernel counts each one's place, past that it inserts them one by one; both keep lower ids."""
    torch.manual_seed(tied)
    logp = torch.full((2, 1000), -5.0)
    logp[:, torch.randperm(1000)[:tied]] = -1.0
    logp[0, torch.randperm(1000)[:10]] = 0.0  # ten above them: the K-th value is tied
    _check(logp, 20, path)


def test_values_adjacent_as_floats_and_spread_over_the_float_range(path):
    """The bound's histogram over a few adjacent floats (fewer keys than buckets) and over values
    from 1e-30 to 1e30 with both infinities (the keys' whole range)."""
    torch.manual_seed(2)
    base = torch.full((1, 500), -8.5)
    adjacent = torch.where(torch.rand(1, 500) < 0.5, base, torch.nextafter(base, torch.zeros(1)))
    spread = torch.randn(2, 500) * torch.tensor(10.0) ** torch.randint(-30, 30, (2, 500)).float()
    spread[0, 3], spread[1, 7], spread[1, 9] = math.inf, -math.inf, math.inf
    _check(torch.cat([adjacent, spread]), 20, path)


def test_an_ascending_row_and_a_descending_row(path):
    """The orders where a one-pass head would insert at every entry."""
    ramp = torch.arange(1000, dtype=torch.float32)
    _check(torch.stack([ramp, ramp.flip(0)]), 20, path)


def test_a_row_with_a_nan_leaves_the_other_rows_exact(path):
    """A broken row (NaN) is never recorded; the batch's other rows are still exact."""
    torch.manual_seed(1)
    logp = torch.randn(3, 100).log_softmax(-1)
    logp[1, 7] = math.nan
    sampled = torch.tensor([3, 4, 5])
    got = recorded_head(logp, 10, sampled)
    for r in (0, 2):
        assert got.values[r].tolist() == _brute_head(logp[r].tolist(), 10)[0]


def test_sampled_ids_taken_from_a_wider_draw_and_other_layouts_fall_back():
    """The sampled ids as the engine hands them (a column of its draws, not contiguous) and log-probs
    the kernel does not read as they are (float64, a transposed view) give the same head."""
    torch.manual_seed(2)
    logp = torch.randn(6, 77).log_softmax(-1)
    draws = torch.randint(0, 77, (6, 3))
    want = recorded_head(logp, 20, draws[:, 0].contiguous())
    for other in (logp, logp.double(), logp.t().contiguous().t()):
        got = recorded_head(other, 20, draws[:, 0])
        assert got.values.astype("float32").tolist() == want.values.tolist()
        assert got.sampled_logp.astype("float32").tolist() == want.sampled_logp.tolist()


def test_a_large_head_and_ids_on_another_device_go_to_torch():
    """K > V / 64 (the kernel's insertions would grow as V·K) and sampled ids the kernel cannot read
    (another device) are served by torch's operations."""
    torch.manual_seed(3)
    logp = torch.randn(2, 5025).log_softmax(-1)
    _check(logp, 200, "torch")
    assert not head_module._compiled_layout(logp, torch.zeros(2, dtype=torch.long, device="meta"))


def test_bfloat16_log_probs_and_ones_that_require_grad_give_numpy_heads():
    """torch's path hands numpy arrays back for log-probs numpy has no dtype for (bfloat16, widened
    exactly) and for ones that require grad (detached)."""
    torch.manual_seed(4)
    logp = torch.randn(3, 300).log_softmax(-1)
    sampled = torch.tensor([0, 5, 9])
    want = recorded_head(logp, 10, sampled)
    half = recorded_head(logp.bfloat16(), 10, sampled)
    assert half.values.dtype == "float32"
    assert half.values.tolist() == logp.bfloat16().float().topk(10).values.tolist()
    grad = recorded_head(logp.double().requires_grad_(), 10, sampled)
    assert grad.values.tolist() == want.values.astype("float64").tolist()


def test_a_sampled_id_outside_the_vocabulary_is_an_error(path):
    logp = torch.zeros(3, 50).log_softmax(-1)
    for bad in (50, -1):
        with pytest.raises((IndexError, RuntimeError)):
            recorded_head(logp, 5, torch.tensor([0, bad, 1]))


def test_a_kernel_file_that_does_not_load_or_is_of_another_convention_is_passed_over(tmp_path):
    """The engine then records through torch, with a warning, instead of failing to import."""
    broken = tmp_path / "_head.cpython-311-x86_64-linux-gnu.so"
    broken.write_text("not a shared library")
    assert head_module._load_kernel(str(broken)) is None
    assert head_module._load_kernel(None) is None
    assert head_module._load_kernel(native.built("prodrl_pipeline.engine._head")) is not None


def test_the_install_built_the_kernel():
    """`make install` compiles `_head.c` (pyproject.toml); without it the engine is correct but
    records through torch.topk, more than twice as slow (docs/performance.md)."""
    assert head_module._KERNEL is not None, "no compiled head kernel: install a C compiler and reinstall"
