import json

import pytest

from prodrl_pipeline.chat.render import render_ids
from prodrl_pipeline.engine.constraints import ConstraintError
from prodrl_pipeline.engine.grammar import GrammarConstraint
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Request
from prodrl_pipeline.engine.sampler import TorchEngine
from tests.conftest import logprob_tolerance

SCHEMA = {
    "type": "object",
    "properties": {"move": {"type": "string", "enum": ["e4", "Nf3", "O-O"]}, "sure": {"type": "boolean"}},
    "required": ["move", "sure"],
    "additionalProperties": False,
}


def _prompt(tokenizer, text="Answer in JSON."):
    return render_ids(tokenizer, [{"role": "user", "content": text}])


def test_json_schema_completions_match_the_schema_and_record_the_masked_mu(
    tiny_model, tokenizer, reference_mu
):
    eos = tokenizer.eos_token_id
    engine = TorchEngine(tiny_model, eos, tokenizer.pad_token_id, top_logprobs=20)
    constraint = GrammarConstraint.json(tokenizer, eos, SCHEMA)
    params = SamplingParams(temperature=1.0, top_k=40, max_tokens=256)
    requests = [Request(_prompt(tokenizer, f"Move {i}?"), params, constraint) for i in range(4)]
    outs = engine.generate(requests, seed=1)
    forced = free = 0
    for req, out in zip(requests, outs, strict=True):
        assert out.finish_reason == "stop" and out.token_ids[-1] == eos
        value = json.loads(tokenizer.decode(out.token_ids[:-1]))
        assert set(value) == {"move", "sure"} and value["move"] in {"e4", "Nf3", "O-O"}
        assert isinstance(value["sure"], bool)
        state = constraint.start()  # an independent walk of the grammar beside the engine's
        for t, tok in enumerate(out.token_ids):
            allowed = state.allowed()
            ref = reference_mu(tiny_model, req.prompt_ids + out.token_ids[:t], params, allowed)
            assert out.logprobs[t] == pytest.approx(float(ref[tok]), abs=logprob_tolerance(ref))
            assert out.supports[t].size == int(ref.isfinite().sum())
            if len(allowed) == 1:  # forced: a one-token support, log-prob 0
                forced += 1
                assert out.topk_ids[t].tolist() == [tok] and out.logprobs[t] == 0.0
            else:
                free += 1
            state.advance(tok)
    assert forced and free


def test_json_object_is_any_object_and_special_tokens_stay_out(tiny_model, tokenizer):
    eos = tokenizer.eos_token_id
    engine = TorchEngine(tiny_model, eos, tokenizer.pad_token_id)
    constraint = GrammarConstraint.json(tokenizer, eos)
    state = constraint.start()
    specials = set(tokenizer.all_special_ids) - {eos}
    assert not specials & set(state.allowed())  # `<|im_start|>` and tool markers are never JSON
    out = engine.generate([Request(_prompt(tokenizer), SamplingParams(max_tokens=1), constraint)], seed=0)[0]
    assert out.finish_reason == "length" and tokenizer.decode(out.token_ids).startswith("{")


@pytest.mark.parametrize(
    "schema,refusal",
    [
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}, "cannot be enforced"),
        ({"type": 3}, "cannot be enforced"),
        ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "admits no text"),  # no value at all
    ],
)
def test_a_schema_that_cannot_be_enforced_is_refused(tokenizer, schema, refusal):
    with pytest.raises(ValueError, match=refusal):
        GrammarConstraint.json(tokenizer, tokenizer.eos_token_id, schema)


def test_a_parser_that_gives_up_mid_reply_raises_a_short_constraint_error(tokenizer):
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}
    state = GrammarConstraint.json(tokenizer, tokenizer.eos_token_id, wide).start()
    with pytest.raises(ConstraintError, match="could not go on") as failed:
        for token in tokenizer.encode('{"p', add_special_tokens=False):
            state.advance(token)
        state.allowed()
    assert len(str(failed.value)) < 400  # llguidance's grammar dump stays out of the message


class _Broken:
    """A constraint whose matcher fails mid-completion (as llguidance does on a resource limit)."""

    recorded = None

    def __init__(self, after: int):
        self.after = after

    def start(self):
        return self

    def allow(self, row):
        if self.after == 0:
            raise ValueError("matcher failed")
        row[:] = True

    def advance(self, token):
        self.after -= 1

    def forced(self):
        return []

    finished = False


def test_a_failing_constraint_ends_its_own_row_only(tiny_model, tokenizer):
    engine = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    params = SamplingParams(max_tokens=5, seed=3)
    alone = engine.generate([Request(_prompt(tokenizer), params)])[0]
    decoder = engine.decoder(seed=0)
    decoder.admit(
        [Request(_prompt(tokenizer), params, _Broken(after=2)), Request(_prompt(tokenizer), params)]
    )
    finished = []
    while len(decoder):
        decoder.step()
        finished += decoder.release()
    (broken, b_out, b_err), (ok, ok_out, ok_err) = finished
    assert isinstance(b_err, ValueError) and len(b_out.token_ids) == 2
    assert ok_err is None and ok_out.token_ids == alone.token_ids
