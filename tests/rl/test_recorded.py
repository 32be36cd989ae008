"""A round's calls as the trainer reads them (rl/recorded.py) and pi_k as it stores them
(rl/resume.py): refusals that name the call, columns of any chunking, and the stored log-probs
read back bit-exactly or not at all."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from prodrl_pipeline.records.ragged import combined
from prodrl_pipeline.records.schema import CALLS
from prodrl_pipeline.rl.recorded import RecordedCalls
from prodrl_pipeline.rl.resume import logprobs_table, stored_pi_k
from tests.records.test_validate import _call


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ({"completion_token_ids": [4, None]}, "it has a null in completion_token_ids"),
        ({"completion_logprobs": [-0.5, None]}, "it has a null in completion_logprobs"),
        ({"support_size": [3, None]}, "it has a null in support_size"),
        ({"topk_token_ids": [[4, 6], None]}, "it has a null in topk_token_ids"),
        ({"topk_logprobs": None}, "it has a null in topk_logprobs"),
        ({"extra_token_ids": [[4], [None]]}, "it has a null in extra_token_ids"),
        ({"sampling": {"temperature": 1.0, "logit_bias": [None]}}, "it has a null logit_bias entry"),
        (
            {"sampling": {"temperature": 1.0, "logit_bias": [{"token_id": 3}]}},
            "it has a null logit_bias entry",
        ),
        ({"sampling": {"top_p": 1.0}}, "it has no temperature"),
        ({"call_index": None}, "it has no call_index"),
        ({"support_size": [3]}, "its per-position columns disagree in length"),
        ({"topk_logprobs": [[-0.5], [0.0]]}, "its per-position columns disagree in length"),
    ],
)
def test_a_call_the_trainer_cannot_read_is_refused_by_its_id(edit, reason):
    with pytest.raises(ValueError, match=f"^call 'bad-0': {reason}$"):
        RecordedCalls.from_rows([_call("a"), _call("bad") | edit])


def test_columns_of_many_chunks_read_as_one():
    """A Delta read gives a chunk per file; the calls read the same in one chunk or many, and a
    list column past 2^31 values in all is combined with 64-bit offsets (nulls: no memory)."""
    calls = [_call("a"), _call("b", extra_token_ids=[[4], [5]]), _call("c")]
    one = RecordedCalls.from_rows(calls)
    chunks = RecordedCalls.from_arrow(
        pa.concat_tables([pa.Table.from_pylist([c], schema=CALLS) for c in calls])
    )
    for name in ("completion_logprobs", "call_index", "temperature"):
        assert np.array_equal(getattr(one, name), getattr(chunks, name))
    assert np.array_equal(one.support.size, chunks.support.size)
    assert np.array_equal(one.extra_ids.offsets, chunks.extra_ids.offsets)
    assert one.extra_ids.lengths.tolist() == [0, 0, 1, 1, 0, 0]  # none where a call recorded none
    n = 2**30 + 2**29
    half = pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), pa.nulls(n))
    assert combined(pa.chunked_array([half, half])).offsets[-1].as_py() == 2 * n


def test_pi_k_is_read_back_bit_exactly_or_not_at_all():
    calls = RecordedCalls.from_rows([_call("a"), _call("b")])
    pi_k = {"a-0": torch.tensor([-0.5, -0.0]), "b-0": torch.tensor([-1e-45, -math.inf])}
    ref = {"a-0": torch.tensor([-0.25, -1.0]), "b-0": torch.tensor([-2.0, -3.0])}
    table = pa.concat_tables(
        [
            logprobs_table(["a-0", "b-0"], pi_k, ref, 1, "exp"),
            logprobs_table(["a-0", "b-0"], ref, None, 1, "other"),  # another experiment's rows
        ]
    )
    got_pi_k, got_ref = stored_pi_k(table, "exp", calls, with_reference=True)
    for want, got in ((pi_k, got_pi_k), (ref, got_ref)):
        for c in want:
            assert got[c].dtype == torch.float32 and got[c].numpy().tobytes() == want[c].numpy().tobytes()
    assert stored_pi_k(table, "other", calls, with_reference=False)[1] is None
    assert stored_pi_k(table, "other", calls, with_reference=True) is None  # its reference is null
    assert stored_pi_k(table, "nobody", calls, with_reference=False) is None
    short = logprobs_table(["a-0", "b-0"], {**pi_k, "b-0": pi_k["b-0"][:1]}, None, 1, "exp")
    assert stored_pi_k(short, "exp", calls, with_reference=False) is None  # one value too few
    assert stored_pi_k(table.slice(0, 1), "exp", calls, with_reference=False) is None  # a call missing
    twice = pa.concat_tables([table, logprobs_table(["a-0"], pi_k, ref, 1, "exp")])
    assert stored_pi_k(twice, "exp", calls, with_reference=False) is None  # two rows for a call
