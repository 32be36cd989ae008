"""A kept support's record (records/support.py) against brute force: every subset of a tiny
vocabulary, in every exact form, read back as the same set by every reader (a dict record, Arrow
columns through Delta, the validator and the screen); the smallest form chosen; tables written
before forms existed read as they were meant; a real engine's top-k and top-p supports re-read
from Delta exactly."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pytest
from deltalake import write_deltalake

from prodrl_pipeline.chat.render import render_ids
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Request
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.chess_env import ChessEpisode
from prodrl_pipeline.records import support
from prodrl_pipeline.records.schema import CALLS
from prodrl_pipeline.records.screen import sound_calls
from prodrl_pipeline.records.store import PARTITION, TABLE_PROPERTIES, DeltaStore
from prodrl_pipeline.records.support import Form
from prodrl_pipeline.records.validate import call_problem
from prodrl_pipeline.rl.recorded import RecordedCalls

NOW = datetime(2026, 11, 30, tzinfo=UTC)
V = 10
K = 2


def _call(i: int, kept: list[int], records: list[support.Support], vocab: int = V) -> dict:
    """A call whose every position samples from the support `kept` (ascending), recorded as
    `records` (one position each), with the head its first min(K, |S|) ids."""
    head = kept[:K]
    n = len(records)
    return {
        "call_id": f"c{i}",
        "trajectory_id": f"t{i}",
        "call_index": 0,
        "round": 1,
        "deployment_id": "d",
        "prompt_token_ids": [1],
        "completion_token_ids": [kept[-1]] * n,
        "completion_logprobs": [-1.0] * n,
        "topk_token_ids": [head] * n,
        "topk_logprobs": [[-1.0] * len(head)] * n,
        **support.columns(records),
        "extra_token_ids": [[kept[0]]] * n,
        "vocab_size": vocab,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 8, "seed": 0},
        "finish_reason": "stop",
        "messages_json": "[]",
        "created_at": NOW,
    }


def _exact_forms(size: int, vocab: int) -> list[Form]:
    """Every form that can hold a support of `size` ids beside a head of min(K, size)."""
    forms = [Form.IDS, Form.COMPLEMENT, Form.BITMASK]
    return forms + [Form.VOCABULARY] * (size == vocab) + [Form.HEAD] * (size <= K)


def _decoded(calls: RecordedCalls) -> list[list[int]]:
    positions = range(len(calls.completion.values))
    vocab = np.repeat(calls.vocab_size, calls.completion.lengths).tolist()
    return [_as_list(calls.support.kept_ids(t, calls.head_ids, vocab[t]), vocab[t]) for t in positions]


def _as_list(ids: np.ndarray | None, vocab: int) -> list[int]:
    """Kept ids as a sorted list (None: the whole vocabulary)."""
    return list(range(vocab)) if ids is None else sorted(ids.tolist())


def test_every_subset_of_a_tiny_vocabulary_round_trips_in_every_form_and_the_smallest_is_chosen(tmp_path):
    calls, want = [], []
    for i, bits in enumerate(itertools.product([False, True], repeat=V)):
        kept = np.array(bits)
        if not kept.any():  # a support holds at least the sampled id
            continue
        ids = np.flatnonzero(kept).tolist()
        head = min(K, len(ids))
        records = [support.encode(kept, head, form) for form in _exact_forms(len(ids), V)]
        chosen = support.encode(kept, head)
        assert support.payload_bytes(chosen.form, len(ids), V) == min(
            support.payload_bytes(r.form, len(ids), V) for r in records
        )
        records.append(chosen)
        calls.append(_call(i, ids, records))
        want += [ids] * len(records)
        for r in records:
            assert r.size == len(ids) and support.problem(r, ids[:head], V) is None
            assert _as_list(support.kept_ids(r, ids[:head], V), V) == ids
            assert support.contains(r, np.arange(-1, V + 1), ids[:head], V).tolist() == [
                False,
                *bits,
                False,
            ]
    # every form but GRAMMAR, which tests/records/test_grammar_masks.py records
    assert {f for c in calls for f in c["support_form"]} == set(Form) - {Form.GRAMMAR}
    assert [call_problem(c) for c in calls] == [None] * len(calls)
    store = DeltaStore(tmp_path)
    store.overwrite_round("calls", calls, 1)
    table = store.read("calls", 1)
    assert sound_calls(table).all()
    assert _decoded(RecordedCalls.from_arrow(table)) == want
    assert [call_problem(c) for c in table.to_pylist()] == [None] * len(calls)  # stored dicts too


@pytest.mark.parametrize("vocab", [5_025, 151_669])
def test_at_real_vocabularies_the_record_is_the_smallest_form_and_never_past_v_over_8(vocab):
    rng = np.random.default_rng(0)
    worst = 0
    edges = [1, K + 1, vocab // 32, vocab // 32 + 1, vocab // 2, vocab - vocab // 32, vocab - 1, vocab]
    for size in sorted({*edges, *rng.integers(1, vocab, 20).tolist()}):
        kept = np.zeros(vocab, dtype=bool)
        kept[rng.choice(vocab, size, replace=False)] = True
        head = np.flatnonzero(kept)[:K].tolist()
        record = support.encode(kept, len(head))
        exact = [support.payload_bytes(f, size, vocab) for f in _exact_forms(size, vocab)]
        assert support.payload_bytes(record.form, size, vocab) == min(exact)
        stored = len(record.ids) * support.ID_BYTES + len(record.mask)
        assert stored == min(exact) <= (vocab + 7) // 8
        worst = max(worst, stored)
        assert support.problem(record, head, vocab) is None
        decoded = support.kept_ids(record, head, vocab)
        assert (decoded is None) if size == vocab else np.array_equal(decoded, np.flatnonzero(kept))
    assert worst == (vocab + 7) // 8  # reached at the middle sizes: the bound is tight


OLD_CALLS = pa.schema([f for f in CALLS if f.name not in ("support_form", "support_mask")])
"""The calls schema before support forms (prodrl before issue 41)."""


def test_a_table_written_before_support_forms_reads_as_it_was_meant_beside_newer_rows(tmp_path):
    """Older rows listed a support's ids (in any order) only when larger than the head and smaller
    than the vocabulary: read back, each position is the same set; rows appended in the new form
    land beside them (the table's schema grows) and both read exactly."""
    old = _call(0, [4, 6, 7], [])
    old.update(
        completion_token_ids=[4, 7, 5],
        completion_logprobs=[-1.0, -1.0, 0.0],
        topk_token_ids=[[4, 6], [4, 6], [5]],
        topk_logprobs=[[-1.0, -1.5], [-1.0, -1.5], [0.0]],
        support_size=[3, V, 1],
        support_token_ids=[[7, 4, 6], [], []],  # unsorted, as the vLLM client listed them
        extra_token_ids=[],
    )
    for name in ("support_form", "support_mask"):
        del old[name]
    uri = str(tmp_path / "calls")
    write_deltalake(
        uri,
        pa.Table.from_pylist([old], schema=OLD_CALLS),
        partition_by=[PARTITION],
        configuration=TABLE_PROPERTIES,
    )
    store = DeltaStore(tmp_path)
    table = store.read("calls")
    assert table.column("support_form").null_count == 1
    want = [[4, 6, 7], list(range(V)), [5]]
    assert _decoded(RecordedCalls.from_arrow(table)) == want
    assert sound_calls(table).tolist() == [True] and call_problem(table.to_pylist()[0]) is None
    newer = _call(1, [4, 6, 7], [support.from_ids([4, 6, 7], K, V)], vocab=V)
    newer["round"] = 2
    store.overwrite_round("calls", [newer], 2)
    both = store.read("calls")
    both = both.take(pa.compute.sort_indices(both, [("call_id", "ascending")]))
    assert _decoded(RecordedCalls.from_arrow(both)) == [*want, [4, 6, 7]]
    assert sound_calls(both).tolist() == [True, True]
    assert both.column("support_form").to_pylist() == [None, [Form.BITMASK]]


def test_a_real_engine_s_top_k_and_top_p_supports_are_re_read_from_delta_exactly(
    tiny_model, tokenizer, heldout, tmp_path
):
    """Top-k beyond the head (ids), top-p on a high-entropy model (a bitmask) and top-k all but ten
    ids (the complement): the engine's records, stored and read back, are the supports it kept
    (tests/engine/test_sampler.py checks those against the processed distribution recomputed)."""
    engine = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id, top_logprobs=20)
    vocab = engine.vocab_size
    prompts = [render_ids(tokenizer, ChessEpisode(p).messages) for p in heldout[:2]]
    params = [
        SamplingParams(temperature=1.0, top_k=40, max_tokens=4),
        SamplingParams(temperature=1.5, top_p=0.9, max_tokens=4),
        SamplingParams(temperature=1.0, top_k=vocab - 10, max_tokens=4),
    ]
    requests = [Request(p, sp) for sp in params for p in prompts]
    outs = engine.generate(requests, seed=0)
    calls = []
    for i, (req, out) in enumerate(zip(requests, outs, strict=True)):
        calls.append(
            {
                **_call(i, [0], []),
                "prompt_token_ids": req.prompt_ids,
                "completion_token_ids": out.token_ids,
                "completion_logprobs": out.logprobs,
                "topk_token_ids": out.topk_ids,
                "topk_logprobs": out.topk_logprobs,
                **support.columns(out.supports),
                "extra_token_ids": [],
                "vocab_size": vocab,
                "sampling": req.params.recorded(0),
            }
        )
    forms = {f for c in calls for f in c["support_form"]}
    assert {Form.IDS, Form.BITMASK, Form.COMPLEMENT} <= forms, forms
    engine_sets = [
        _as_list(support.kept_ids(s, out.topk_ids[t], vocab), vocab)
        for out in outs
        for t, s in enumerate(out.supports)
    ]
    store = DeltaStore(tmp_path)
    store.overwrite_round("calls", calls, 1)
    table = store.read("calls", 1)
    table = table.take(pa.compute.sort_indices(table, [("call_id", "ascending")]))  # c0 ... c5: as made
    assert _decoded(RecordedCalls.from_arrow(table)) == engine_sets
    assert sound_calls(table).all()
