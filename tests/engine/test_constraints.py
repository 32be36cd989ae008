"""The choice constraint behind tool calls over an enum, step by step on hand-written and random sequences."""

import random

import numpy as np
import pytest
import torch

from prodrl_pipeline.engine.constraints import AfterReasoning, ChoiceConstraint
from tests.engine.conftest import advanced, completions

IDS = (8, 7, 6)


def test_after_reasoning_allows_everything_until_the_end_marker_then_the_choice():
    s = AfterReasoning(ChoiceConstraint([[5, 1], [7]]), end_id=3).start()
    for token in (5, 7, 0):  # reasoning: any id, ids of the choice included, changes nothing
        row = torch.zeros(9, dtype=torch.bool)
        s.allow(row)
        assert row.all() and s.forced() == [] and not s.finished
        s.advance(token)
    s.advance(3)  # the end of the reasoning
    row = torch.zeros(9, dtype=torch.bool)
    s.allow(row)
    assert row.nonzero().squeeze(1).tolist() == [5, 7]
    s.advance(5)
    assert s.forced() == [1] and not s.finished
    s.advance(1)
    assert s.finished
    with pytest.raises(ValueError, match="per position"):
        AfterReasoning(type("Recorded", (), {"recorded": {"grammar": "x"}})(), end_id=3)


def test_a_choice_walks_its_sequences_forcing_single_continuations():
    c = ChoiceConstraint([[5, 1, 2], [5, 1, 3, 4], [7]])
    s = c.start()
    assert s.allowed() == [5, 7] and s.forced() == [] and not s.finished
    row = torch.zeros(9, dtype=torch.bool)
    s.allow(row)
    assert row.nonzero().squeeze(1).tolist() == [5, 7]
    s.advance(5)
    assert s.forced() == [1] and s.allowed() == [1]  # forced() looks ahead without consuming
    s.advance(1)
    assert s.allowed() == [2, 3] and s.forced() == []
    s.advance(3)
    assert s.forced() == [4] and not s.finished
    s.advance(4)
    assert s.finished and s.allowed() == [] and s.forced() == []
    with pytest.raises(ValueError, match="^token 2 is not allowed here$"):
        s.advance(2)
    s2 = c.start()  # every completion starts at the root, whatever another did
    assert s2.allowed() == [5, 7]
    s2.advance(7)
    assert s2.finished
    # a chain of single children is forced to its end
    assert ChoiceConstraint([[1, 2, 3]]).start().forced() == [1, 2, 3]


def test_the_choice_for_vllm_is_the_same_sequences_as_a_grammar():
    c = ChoiceConstraint([(5, 1), [7]])
    assert c.sequences == ((5, 1), (7,))
    assert c.structured_outputs == {"grammar": "start: <[5]> <[1]> | <[7]>"}


@pytest.mark.parametrize(
    ("sequences", "message"),
    [
        ([], "^a choice constraint needs at least one allowed sequence$"),
        ([[1], []], "^allowed sequences must be non-empty$"),
        ([[1, 2], [1, 2, 3]], r"^allowed sequence \[1, 2\] is a prefix of another$"),
        ([[1, 2, 3], [1, 2]], r"^allowed sequence \[1, 2\] is a prefix of another$"),
    ],
)
def test_a_choice_refuses_sequences_it_cannot_tell_apart(sequences, message):
    with pytest.raises(ValueError, match=message):
        ChoiceConstraint(sequences)


def test_walking_a_choice_reaches_exactly_its_sequences_and_its_prefix_check_compares_every_pair():
    rng = random.Random(0)
    for _ in range(500):  # ids a small set of ints iterates out of order (8 wraps to its first slot)
        seqs = [[rng.choice(IDS) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(1, 6))]
        unique = {tuple(s) for s in seqs}
        prefix = any(a != b and b[: len(a)] == a for a in unique for b in unique)
        try:
            choice = ChoiceConstraint([torch.tensor(s, dtype=torch.long) for s in seqs])
            refused = False
        except ValueError:
            refused = True
        assert refused == prefix, seqs
        if not refused:  # every walk ends on one of the sequences, and each is reached
            assert set(completions(choice)) == unique, seqs
            for consumed in {s[:n] for s in unique for n in range(len(s) + 1)}:
                _check_state(choice, consumed)


def _check_state(choice: ChoiceConstraint, consumed: tuple) -> None:
    """At every place a completion can reach: `allowed` holds plain ints in order, `allow` marks
    them, any other id is refused, `forced` is the chain of single choices ahead, and a finished
    state allows nothing."""
    state = advanced(choice, consumed)
    allowed = state.allowed()
    assert all(type(t) is int for t in allowed) and allowed == sorted(set(allowed))
    row = torch.zeros(max(IDS) + 1, dtype=torch.bool)
    state.allow(row)
    assert row.nonzero().squeeze(1).tolist() == allowed
    for t in sorted(set(range(max(IDS) + 2)) - set(allowed)):
        with pytest.raises(ValueError, match=f"^token {t} is not allowed here$"):
            advanced(choice, consumed).advance(t)
    chain, ahead = [], advanced(choice, consumed)
    while len(ahead.allowed()) == 1:
        chain.append(ahead.allowed()[0])
        ahead.advance(chain[-1])
    assert state.forced() == chain
    assert state.finished == (allowed == [])


def test_ids_of_any_type_are_read_as_plain_ints_and_only_ints_advance():
    choice = ChoiceConstraint([(np.int64(5), 1), (True, 2), [torch.tensor(7)]])
    assert choice.sequences == ((5, 1), (1, 2), (7,))
    assert all(type(t) is int for s in choice.sequences for t in s)
    assert choice.structured_outputs == {"grammar": "start: <[5]> <[1]> | <[1]> <[2]> | <[7]>"}
    state = choice.start()
    assert state.allowed() == [1, 5, 7] and all(type(t) is int for t in state.allowed())
    for token in (5.0, True, np.int64(5), torch.tensor(5), None, "5"):
        with pytest.raises(ValueError, match="is not allowed here$"):
            choice.start().advance(token)
    state.advance(5)
    assert state.forced() == [1] and type(state.forced()[0]) is int
