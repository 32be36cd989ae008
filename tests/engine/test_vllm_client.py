"""The vLLM client's request bodies and recorded completions, on responses serialized as vLLM 0.33's
/v1/completions serializes them (docs/engines.md, "vLLM"), from distributions computed here by
brute force on a tiny vocabulary: the recorded head, support and log-probs must be theirs."""

import json
import math

import llguidance
import numpy as np
import pytest
import torch

from prodrl_pipeline.engine.constraints import ChoiceConstraint
from prodrl_pipeline.engine.grammar import GrammarConstraint, ll_tokenizer
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Request
from prodrl_pipeline.engine.vllm import FILTERED, VLLMEngine, WeightVersionError, structured_outputs
from prodrl_pipeline.engine.vllm_server import (
    distance,
    golden_check,
    model_logprobs,
    serve_command,
    weight_label,
)
from prodrl_pipeline.envs.tool_choice import tool_choice_constraint
from prodrl_pipeline.records import support
from tests.conftest import logprob_tolerance

V, K = 12, 3


def _processed(logits: torch.Tensor, p: SamplingParams, allowed: list[int] | None) -> torch.Tensor:
    """log mu over the vocabulary by definition: mask, temperature, top-k, then top-p."""
    x = logits / p.temperature
    if allowed is not None:
        x = torch.full_like(x, -math.inf).index_put_((torch.tensor(allowed),), x[allowed])
    if 0 < p.top_k < V:
        x[x < x.topk(p.top_k).values[-1]] = -math.inf
    lp = x.log_softmax(-1)
    if p.top_p < 1:
        order = lp.argsort(descending=True)
        before = lp[order].exp().cumsum(0) - lp[order].exp()
        x[order[before >= p.top_p]] = -math.inf
        lp = x.log_softmax(-1)
    return lp


def _choice(steps: list[torch.Tensor], sampled: list[int], version: str | None = "v1") -> dict:
    """A response choice as vLLM writes it: the sampled token first, then the top K + 1, -inf as
    -9999, ids as 'token_id:N'."""
    top = []
    for lp, tok in zip(steps, sampled, strict=True):
        entries = {f"token_id:{tok}": float(lp[tok])}
        for i in lp.topk(K + 1).indices.tolist():
            entries.setdefault(f"token_id:{i}", max(float(lp[i]), FILTERED))
        top.append({k: (FILTERED if v == -math.inf else v) for k, v in entries.items()})
    choice = {
        "token_ids": sampled,
        "finish_reason": "length",
        "logprobs": {
            "token_logprobs": [float(lp[t]) for lp, t in zip(steps, sampled, strict=True)],
            "top_logprobs": top,
        },
    }
    if version is not None:
        choice["weight_versions"] = [{"version": version, "start": 0, "end": len(sampled)}]
    return choice


def _engine(**kw) -> VLLMEngine:
    return VLLMEngine("http://127.0.0.1:1", "prodrl", V, top_logprobs=K, **kw)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=K + 1),
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.6, top_k=K + 1),
    ],
)
def test_recorded_head_and_support_are_the_processed_distributions(params):
    g = torch.Generator().manual_seed(0)
    steps = [_processed(torch.randn(V, generator=g) * 2, params, None) for _ in range(4)]
    sampled = [int(lp.argmax()) for lp in steps]
    req = Request([1, 2], params)
    assert _engine().request_body(req, seed=0)["logprobs"] == K + 1
    out = _engine().completion(req, _choice(steps, sampled))
    for t, lp in enumerate(steps):
        kept = {i for i in range(V) if lp[i] > -math.inf}
        assert out.supports[t].size == len(kept)
        head = lp.topk(min(K, len(kept))).indices.tolist()
        assert out.topk_ids[t].tolist() == head
        assert out.topk_logprobs[t].tolist() == pytest.approx(lp[head].tolist())
        assert out.logprobs[t] == pytest.approx(float(lp[sampled[t]]))
        decoded = support.kept_ids(out.supports[t], out.topk_ids[t], V)
        assert (decoded is None) if len(kept) == V else set(decoded.tolist()) == kept
        assert out.supports[t].form == support.form_for(len(kept), len(head), V)


def _walk(matcher: llguidance.LLMatcher, n_vocab: int, ids: list[int]) -> list[set[int]]:
    """The ids llguidance allows before each of `ids`, consuming them."""
    allowed = []
    for t in ids:
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed.append(set(np.flatnonzero(bits[:n_vocab]).tolist()))
        assert matcher.consume_token(t), matcher.get_error()
    return allowed


def test_constraints_reach_vllm_as_the_same_token_level_rules(tokenizer):
    """What vLLM's guidance backend builds from the request's structured_outputs (llguidance's
    grammar_from, as vLLM calls it) allows exactly the ids the gateway's constraint allows, along
    the lab's move-tool calls (special tokens included)."""
    eos = tokenizer.eos_token_id
    constraint = tool_choice_constraint(tokenizer, "move", "move", ["e2e4", "g1f3", "e7e8q"])
    form = structured_outputs(constraint)
    ll = ll_tokenizer(tokenizer, eos)[0]
    for seq in constraint.sequences:
        matcher = llguidance.LLMatcher(ll, llguidance.grammar_from("grammar", form["grammar"]), log_level=0)
        state = constraint.start()
        for t, vllm_allowed in zip(seq, _walk(matcher, len(tokenizer), list(seq)), strict=True):
            assert vllm_allowed == set(state.allowed()), t
            state.advance(t)
    schema = {"type": "object", "properties": {"move": {"type": "string"}}, "required": ["move"]}
    json_form = structured_outputs(GrammarConstraint.json(tokenizer, eos, schema))
    assert json_form == {"json": schema}
    assert llguidance.grammar_from("json", json.dumps(json_form["json"])) == (
        llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema, sort_keys=True))
    )  # vLLM compiles the schema into the grammar the gateway's constraint compiled


def test_a_choice_constraint_records_its_allowed_ids_as_the_support():
    sequences = [[5, 6], [5, 7], [8, 9], [10, 11], [4, 3]]
    constraint = ChoiceConstraint(sequences)
    g = torch.Generator().manual_seed(1)
    first = _processed(torch.randn(V, generator=g), SamplingParams(), [4, 5, 8, 10])
    second = _processed(torch.randn(V, generator=g), SamplingParams(), [6, 7])
    eos = _processed(torch.randn(V, generator=g), SamplingParams(), None)  # after the choice: not recorded
    out = _engine().completion(
        Request([1], SamplingParams(), constraint), _choice([first, second, eos], [5, 7, 0])
    )
    assert out.token_ids == [5, 7]
    assert [s.size for s in out.supports] == [4, 2]
    assert support.kept_ids(out.supports[0], out.topk_ids[0], V).tolist() == [4, 5, 8, 10]
    assert out.supports[1].form == support.Form.HEAD  # the head (K >= 2) holds the support
    fresh = lambda: Request([1], SamplingParams(), ChoiceConstraint(sequences))  # noqa: E731
    other = _processed(torch.randn(V, generator=g), SamplingParams(), [9])  # vLLM's rule forced 9
    with pytest.raises(ValueError, match="outside the constraint"):  # vLLM produced a sequence outside it
        _engine().completion(fresh(), _choice([first, other], [5, 9]))
    unmasked = _processed(torch.randn(V, generator=g), SamplingParams(), None)
    with pytest.raises(ValueError, match="outside the constraint"):  # log-probs without the mask
        _engine().completion(fresh(), _choice([unmasked], [5]))
    narrower = _processed(torch.randn(V, generator=g), SamplingParams(), [5, 8])  # vLLM also dropped 4, 10
    with pytest.raises(ValueError, match="filtered an id|not the constraint"):
        _engine().completion(fresh(), _choice([narrower], [5]))
    bad = _choice([first], [5])
    bad["logprobs"]["token_logprobs"][0] = FILTERED
    with pytest.raises(ValueError, match="outside"):
        _engine().completion(fresh(), bad)


def test_greedy_records_a_one_token_support():
    lp = _processed(torch.randn(V, generator=torch.Generator().manual_seed(2)), SamplingParams(), None)
    tok = int(lp.argmax())
    out = _engine().completion(Request([1], SamplingParams(temperature=0)), _choice([lp], [tok]))
    heads = [h.tolist() for h in out.topk_ids]
    assert (out.token_ids, out.logprobs, heads, out.supports) == (
        [tok],
        [0.0],
        [[tok]],
        [support.Support(1, support.Form.HEAD)],
    )


def test_supports_the_head_cannot_cover_are_refused_before_sending(tokenizer):
    with pytest.raises(ValueError, match="top_p < 1"):
        _engine().request_body(Request([1], SamplingParams(top_p=0.9)), None)
    with pytest.raises(ValueError, match="top_k"):
        _engine().request_body(Request([1], SamplingParams(top_k=K + 2)), None)
    with pytest.raises(NotImplementedError, match="no vLLM form"):
        structured_outputs(GrammarConstraint(tokenizer, 'start: "a"', tokenizer.eos_token_id))


def test_a_completion_from_other_weights_is_refused():
    lp = _processed(torch.randn(V, generator=torch.Generator().manual_seed(3)), SamplingParams(), None)
    req = Request([1], SamplingParams())
    assert _engine(weight_version="v1").completion(req, _choice([lp], [0], "v1")).token_ids == [0]
    for version in ("v0", None):
        with pytest.raises(WeightVersionError, match="expected v1"):
            _engine(weight_version="v1").completion(req, _choice([lp], [0], version))
    mixed = _choice([lp, lp], [0, 0], "v1")
    mixed["weight_versions"] = [
        {"version": "v0", "start": 0, "end": 1},
        {"version": "v1", "start": 1, "end": 2},
    ]
    with pytest.raises(WeightVersionError):  # a reload in the middle of the completion
        _engine(weight_version="v1").completion(req, mixed)


def test_golden_check_scores_log_probs_and_the_recording_command(tiny_model):
    golden = [([1, 5, 9], [13, 2, 7]), ([3, 4], [4, 8])]
    new = model_logprobs(tiny_model, golden)
    full = tiny_model(input_ids=torch.tensor([[1, 5, 9, 13, 2, 7]])).logits[0].log_softmax(-1)
    want = [float(full[2, 13]), float(full[3, 2]), float(full[4, 7])]
    assert new[0] == pytest.approx(want, abs=logprob_tolerance(full))
    old = [[x + 0.3 for x in xs] for xs in new]  # another export scores them 0.3 nats apart
    served_new = [[x + 0.01 for x in xs] for xs in new]  # bf16 noise around the new weights
    served_old = [[x - 0.01 for x in xs] for xs in old]
    assert golden_check(served_new, new, old)[0] and not golden_check(served_old, new, old)[0]
    assert golden_check(served_new, new, new)[0]  # exports that score alike cannot be told apart
    assert distance(served_new, new) == pytest.approx(0.01)
    a = weight_label({"deployment_id": "main-r000001", "path": "s3://b/deployments/main/r000001/v1"})
    b = weight_label({"deployment_id": "main-r000001", "path": "s3://b/deployments/main/r000001/v2"})
    assert a.startswith("main-r000001@") and a != b  # a re-run's export gets its own label
    cmd = serve_command("/exports/r1", "data/tokenizer", 8001, top_logprobs=20)
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[cmd.index("--max-logprobs") + 1] == "21" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--tokenizer") + 1] == "data/tokenizer"


def test_stop_ids_go_to_vllm_as_stop_token_ids():
    assert "stop_token_ids" not in _engine().request_body(Request([1]), None)
    body = _engine().request_body(Request([1], stop_ids=frozenset({200012, 200002})), None)
    assert body["stop_token_ids"] == [200002, 200012]
