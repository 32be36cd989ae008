"""A grammar-constrained call's masks, recomputed from its recorded constraint, are the masks the
engine applied: captured inside a real JSON-mode generation (the lab's 5,025 ids and the real Qwen3
vocabulary of 151,669), compared position by position; a record that cannot be replayed exactly is
refused by name."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from prodrl_pipeline.chat.render import render_ids
from prodrl_pipeline.engine.grammar import GrammarConstraint
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Request, Rows
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.model import build_model
from prodrl_pipeline.records import support
from prodrl_pipeline.records.grammar_masks import GrammarMasks
from prodrl_pipeline.records.schema import CALLS
from prodrl_pipeline.records.support import Form
from prodrl_pipeline.records.validate import call_problem
from prodrl_pipeline.rl.logprobs import _supports
from prodrl_pipeline.rl.recorded import RecordedCalls
from tests.conftest import TINY
from tests.families import family_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "move": {"type": "string", "enum": ["e4", "Nf3", "O-O"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "move", "ok"],
    "additionalProperties": False,
}


def _applied_masks(engine, requests, seed):  # noqa: ANN001, ANN202
    """Each request's completion and, per sampled position, the [V] bool mask the engine applied
    (read from `Rows.allowed_mask` as the engine calls it)."""
    applied: dict[int, dict[int, np.ndarray]] = {i: {} for i in range(len(requests))}
    original = Rows.allowed_mask

    def capture(rows):  # noqa: ANN001, ANN202
        allowed = original(rows)
        for i, request in enumerate(rows.requests):
            if allowed is not None and not rows.done[i]:
                applied[requests.index(request)][len(rows.out[i].token_ids)] = allowed[i].numpy().copy()
        return allowed

    Rows.allowed_mask = capture
    try:
        outs = engine.generate(requests, seed=seed)
    finally:
        Rows.allowed_mask = original
    return outs, applied


def _check_recomputed_equal_applied(tokenizer, model, constraint, params, n_requests):  # noqa: ANN001
    engine = TorchEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompts = [
        render_ids(tokenizer, [{"role": "user", "content": f"JSON {i}, please."}]) for i in range(n_requests)
    ]
    requests = [Request(p, params, constraint) for p in prompts]
    outs, applied = _applied_masks(engine, requests, seed=5)
    masks = GrammarMasks(tokenizer)
    vocab = engine.vocab_size
    sizes = []
    for i, out in enumerate(outs):
        packed = masks.masks(f"c{i}", constraint.recorded, out.token_ids, vocab)
        recomputed = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab].astype(bool)
        assert not np.unpackbits(packed, axis=1, bitorder="little")[:, vocab:].any()
        for t, tok in enumerate(out.token_ids):
            if t in applied[i]:  # sampled under this mask (the support: no top-k / top-p cut)
                assert np.array_equal(recomputed[t], applied[i][t]), (i, t)
                assert out.supports[t].size == applied[i][t].sum()
            else:  # forced without sampling: the engine's support is the one id
                assert np.flatnonzero(recomputed[t]).tolist() == [tok], (i, t)
            sizes.append(int(recomputed[t].sum()))
    assert min(sizes) == 1 and max(sizes) > 1  # forced and free positions both compared


def test_recomputed_masks_are_the_ones_the_engine_applied_on_the_lab_vocabulary(tiny_model, tokenizer):
    constraint = GrammarConstraint.json(tokenizer, tokenizer.eos_token_id, SCHEMA)
    _check_recomputed_equal_applied(tokenizer, tiny_model, constraint, SamplingParams(max_tokens=48), 3)


def test_recomputed_masks_are_the_ones_the_engine_applied_on_the_qwen3_vocabulary():
    tokenizer = family_tokenizer("qwen3")
    torch.manual_seed(0)
    model = build_model(TINY, len(tokenizer), tokenizer.pad_token_id)
    for schema in (None, SCHEMA):  # any object (mostly free text in strings), and a schema's forced keys
        constraint = GrammarConstraint.json(tokenizer, tokenizer.eos_token_id, schema)
        _check_recomputed_equal_applied(tokenizer, model, constraint, SamplingParams(max_tokens=24), 2)


def _served(tokenizer):  # noqa: ANN001, ANN202
    constraint = GrammarConstraint.json(tokenizer, tokenizer.eos_token_id, SCHEMA)
    ids = tokenizer.encode('{"move": "Nf3", "name": "a", "ok": true}', add_special_tokens=False)
    return constraint.recorded, [*ids, tokenizer.eos_token_id]


def test_a_record_replays_to_the_masks_of_its_ids(tokenizer):
    record, ids = _served(tokenizer)
    state = GrammarConstraint.json(tokenizer, tokenizer.eos_token_id, SCHEMA).start()
    packed = GrammarMasks(tokenizer).masks(
        "c", record, ids, len(tokenizer) + 3
    )  # a model vocabulary past the tokenizer's
    bits = np.unpackbits(packed, axis=1, bitorder="little")
    for t, tok in enumerate(ids):
        assert np.flatnonzero(bits[t]).tolist() == state.allowed()
        state.advance(tok)


@pytest.mark.parametrize(
    "change,refusal",
    [
        (lambda r, ids: ({**r, "library": "llguidance 0.0.1"}, ids), "computed by llguidance 0.0.1"),
        (lambda r, ids: ({**r, "tokenizer_sha256": "0" * 64}, ids), "another tokenizer"),
        (lambda r, ids: ({**r, "eos_id": r["eos_id"] + 1}, ids), "another tokenizer"),
        (lambda r, ids: ({**r, "grammar": "start: ("}, ids), "does not compile"),
        (lambda r, ids: ({k: v for k, v in r.items() if k != "library"}, ids), "grammar record"),
        (lambda r, ids: (r, [ids[0], ids[0], *ids[1:]]), "position 1: sampled id"),
        (lambda r, ids: (r, [*ids, ids[0]]), "after the end"),
    ],
)
def test_a_record_that_cannot_be_replayed_exactly_is_refused_by_name(tokenizer, change, refusal):
    record, ids = change(*_served(tokenizer))
    with pytest.raises(ValueError, match=f"call 'c7': .*{refusal}"):
        GrammarMasks(tokenizer).masks("c7", record, ids, len(tokenizer))


def test_without_the_served_tokenizer_a_grammar_call_is_refused(tokenizer):
    record, ids = _served(tokenizer)
    with pytest.raises(ValueError, match="call 'c7': .*needs the served tokenizer"):
        GrammarMasks(None).masks("c7", record, ids, len(tokenizer))
    with pytest.raises(ValueError, match="another tokenizer"):  # the real Qwen3 is not the lab's
        GrammarMasks(family_tokenizer("qwen3")).masks("c7", record, ids, 200_000)


def _rows(prompts, outs, vocab) -> list[dict]:  # noqa: ANN001
    """The calls as the gateway records them (gateway/serving.py `Serving.record`)."""
    return [
        {
            "call_id": f"c{i}",
            "trajectory_id": f"t{i}",
            "call_index": 0,
            "round": 1,
            "deployment_id": "d",
            "prompt_token_ids": p,
            "completion_token_ids": c.token_ids,
            "completion_logprobs": c.logprobs,
            "topk_token_ids": c.topk_ids,
            "topk_logprobs": c.topk_logprobs,
            **support.columns(c.supports),
            "extra_token_ids": c.extra_ids,
            "vocab_size": vocab,
            "grammar": c.grammar,
            "sampling": SamplingParams().recorded(0),
            "finish_reason": c.finish_reason,
            "messages_json": "[]",
        }
        for i, (p, c) in enumerate(zip(prompts, outs, strict=True))
    ]


@pytest.mark.parametrize("family", ["lab", "qwen3"])
def test_the_trainer_reads_a_grammar_call_with_the_supports_the_engine_sampled_from(
    family, tokenizer, tiny_model
):
    """Recorded once per call (GRAMMAR positions list nothing), read back through Arrow by the
    trainer's reader: every position's support is the set the engine applied, the calls pass the
    validator, and a reader without the served tokenizer refuses them by name."""
    if family == "qwen3":
        tokenizer = family_tokenizer("qwen3")
        torch.manual_seed(0)
        tiny_model = build_model(TINY, len(tokenizer), tokenizer.pad_token_id)
    engine = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    constraint = GrammarConstraint.json(tokenizer, tokenizer.eos_token_id)  # keys and strings: free text
    prompts = [render_ids(tokenizer, [{"role": "user", "content": f"JSON {i}."}]) for i in range(2)]
    requests = [Request(p, SamplingParams(max_tokens=24), constraint) for p in prompts]
    outs, applied = _applied_masks(engine, requests, seed=2)
    rows = _rows(prompts, outs, engine.vocab_size)
    forms = {int(f) for row in rows for f in row["support_form"]}
    assert Form.GRAMMAR in forms and not {Form.IDS, Form.COMPLEMENT, Form.BITMASK} & forms
    assert call_problem(rows[0]) is None and call_problem(rows[1]) is None
    calls = RecordedCalls.from_arrow(pa.Table.from_pylist(rows, schema=CALLS), tokenizer)
    supports = _supports(calls, np.repeat(np.arange(len(calls)), calls.completion.lengths))
    t = 0
    for i, out in enumerate(outs):
        for p in range(len(out.token_ids)):
            kept = supports[t]
            if p in applied[i] and applied[i][p].sum() > len(out.topk_ids[p]):
                assert np.array_equal(kept, np.flatnonzero(applied[i][p])), (i, p)
            else:  # held by the head: forced, or a mask of no more ids than the head
                assert set(kept.tolist()) == set(out.topk_ids[p].tolist()), (i, p)
            t += 1
    with pytest.raises(ValueError, match="call 'c0': it was served under a grammar: reading it needs"):
        RecordedCalls.from_arrow(pa.Table.from_pylist(rows, schema=CALLS))
    wrong = [
        {
            **rows[0],
            "completion_token_ids": [
                rows[0]["completion_token_ids"][1],
                *rows[0]["completion_token_ids"][1:],
            ],
        }
    ]
    with pytest.raises(ValueError, match="call 'c0': position 0: sampled id"):
        RecordedCalls.from_arrow(pa.Table.from_pylist(wrong, schema=CALLS), tokenizer)
