"""The columnar screen of the contract (records/screen.py) against `call_problem`, its judge: a
call the screen passes keeps every rule. Checked on every broken call of test_validate that a table
can hold, on fuzzed calls, mixed into tables of several chunks; and real recorded calls must pass
it (a screen that flagged everything would check nothing faster)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings

from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.records.schema import CALLS
from prodrl_pipeline.records.screen import sound_calls
from prodrl_pipeline.records.validate import call_problem
from tests.conftest import build_tiny
from tests.faults.test_fuzz import EDITS
from tests.records.test_validate import RULES, SOUND_EDGES, _call
from tests.rl.conftest import record


def _table(calls: list[dict]) -> pa.Table | None:
    """The calls as a stored table, each in its own chunk; None when Arrow cannot hold them."""
    try:
        return pa.concat_tables([pa.Table.from_pylist([c], schema=CALLS) for c in calls])
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None


def _judged(table: pa.Table) -> list[bool]:
    """call_problem's verdict on each stored call: True where it keeps every rule."""
    return [call_problem(c) is None for c in table.to_pylist()]


def _screen_agrees(table: pa.Table) -> None:
    sound, judged = sound_calls(table), _judged(table)
    assert not any(s and not j for s, j in zip(sound, judged, strict=True)), (sound, judged)


def test_every_broken_call_a_table_can_hold_is_flagged_among_sound_ones():
    held = 0
    for _, edit, _reason in RULES:
        table = _table(
            [_call("a"), _call("bad") | edit, _call("b"), _call("bad2") | edit]
        )  # among sound ones
        if table is None:
            continue
        judged = _judged(table)
        if judged[1]:  # stored, the edit is gone (e.g. an int the column holds as a float)
            continue
        held += 1
        assert sound_calls(table).tolist() == [True, False, True, False], edit
    assert held >= 40  # most rules are about values a table can hold


def test_sound_calls_at_every_edge_pass_the_screen_but_the_head_mass_at_its_margin():
    """Sound by call_problem's verdict, and by the screen's too, except a head whose log-mass sits
    within the screen's margin of the tolerance (flagged by design, then kept by call_problem)."""
    for name, edit in SOUND_EDGES:
        table = _table([_call("a") | edit])
        assert _judged(table) == [True]
        assert sound_calls(table).tolist() == [name != "head log-prob at the float tolerance"], name
    assert sound_calls(_table([_call("a"), _call("b")])).all()


@pytest.mark.parametrize(
    "edit",
    [
        {"sampling": {"temperature": 1.0, "top_p": float("nan")}},  # stored NaN, not null
        {"topk_token_ids": [[4, 6], [2**31 - 1]], "support_size": [3, 10]},  # far outside: no raise
        {"topk_token_ids": [[-(2**31), 6], [5]], "support_size": [10, 1]},
        {"extra_token_ids": [[4], [2**31 - 1]]},
        {"topk_token_ids": [[4, 2**31 - 1], [5]]},
        {"support_token_ids": [[4, 6, 11], []]},  # just past the vocabulary, in the last position
    ],
)
def test_values_no_rule_expects_are_flagged_without_raising(edit):
    table = _table([_call("a"), _call("bad") | edit, _call("b")])
    assert _judged(table) == [True, False, True]
    assert sound_calls(table).tolist() == [True, False, True]


@pytest.mark.parametrize(
    ("stray", "completion", "stray_first"),
    [(25, [3, 5], True), (-8, [4, 3], False)],  # V = 10: 25 keys id 3 two positions on, -8 one back
)
def test_an_id_outside_the_vocabulary_cannot_vouch_for_another_calls_id(stray, completion, stray_first):
    """Keys of (position, id) are unique only for ids inside the vocabulary: an id outside, in one
    call's support, must not count as a kept id of a neighbouring call's position (3 is outside
    both of B's supports)."""
    stray_call = _call("A", support_token_ids=[[4, 6, stray], []])
    neighbour = _call("B", completion_token_ids=completion)
    table = _table([stray_call, neighbour] if stray_first else [neighbour, stray_call])
    assert _judged(table) == [False, False]
    assert sound_calls(table).tolist() == [False, False]


@settings(max_examples=300, deadline=None)
@given(EDITS)
def test_a_fuzzed_call_the_screen_passes_keeps_every_rule(edits):
    bad = _call("fuzz")
    for name, value in edits:
        bad[name] = value
    table = _table([_call("a"), bad, _call("b")])
    if table is not None:
        _screen_agrees(table)
        assert sound_calls(table)[[0, 2]].all()  # its neighbours are not dragged down


@pytest.mark.parametrize(
    ("params", "top_logprobs"), [(SamplingParams(), 20), (SamplingParams(top_k=5, max_tokens=8), 2)]
)
def test_real_recorded_calls_pass_the_screen(tokenizer, train_puzzles, tmp_path, params, top_logprobs):
    """Constrained lab calls with a K = 20 head, and top-k calls whose support is larger than
    their K = 2 head (support lists), with extra samples."""
    calls = record(
        build_tiny(tokenizer),
        tokenizer,
        train_puzzles[:6],
        tmp_path,
        params=params,
        extra_samples=2,
        top_logprobs=top_logprobs,
    ).calls
    table = pa.Table.from_pylist(calls, schema=CALLS)
    assert all(_judged(table))
    assert sound_calls(table).all()
    restricted = np.array([s for c in calls for s in c["support_size"]]) < calls[0]["vocab_size"]
    assert restricted.any()
