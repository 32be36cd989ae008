"""The vLLM client's request bodies and recorded completions, on responses serialized as vLLM 0.33's
/v1/completions serializes them (docs/engines.md, "vLLM"), from distributions computed here by
brute force on a tiny vocabulary: the recorded head, support and log-probs must be theirs."""

import math

import pytest
import torch

from prodrl_pipeline.engine.constraints import ChoiceConstraint
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import Request
from prodrl_pipeline.engine.vllm import FILTERED, VLLMEngine, WeightVersionError, structured_outputs
from prodrl_pipeline.engine.vllm_server import agreement, golden_check, serve_command

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
        assert out.support_size[t] == len(kept)
        head = lp.topk(min(K, len(kept))).indices.tolist()
        assert out.topk_ids[t] == head
        assert out.topk_logprobs[t] == pytest.approx(lp[head].tolist())
        assert out.logprobs[t] == pytest.approx(float(lp[sampled[t]]))
        listed = K < len(kept) < V
        assert set(out.support_ids[t]) == (kept if listed else set())


def test_a_choice_constraint_goes_to_vllm_as_texts_and_its_allowed_ids_are_the_support(tokenizer):
    sequences = [[5, 6], [5, 7], [8, 9], [10, 11], [4, 3]]
    constraint = ChoiceConstraint(sequences)
    body = _engine(tokenizer=tokenizer).request_body(Request([1], SamplingParams(), constraint), None)
    assert body["structured_outputs"] == {
        "choice": [tokenizer.decode(s, skip_special_tokens=False) for s in sequences]
    }
    g = torch.Generator().manual_seed(1)
    first = _processed(torch.randn(V, generator=g), SamplingParams(), [4, 5, 8, 10])
    second = _processed(torch.randn(V, generator=g), SamplingParams(), [6, 7])
    eos = _processed(torch.randn(V, generator=g), SamplingParams(), None)  # after the choice: not recorded
    out = _engine().completion(
        Request([1], SamplingParams(), constraint), _choice([first, second, eos], [5, 7, 0])
    )
    assert out.token_ids == [5, 7]
    assert out.support_size == [4, 2]
    assert sorted(out.support_ids[0]) == [4, 5, 8, 10] and out.support_ids[1] == []  # head K >= 2 covers it
    with pytest.raises(ValueError, match="not allow|allowed"):  # vLLM produced a sequence outside the choice
        _engine().completion(
            Request([1], SamplingParams(), ChoiceConstraint(sequences)), _choice([first, second], [5, 9])
        )
    unmasked = _processed(torch.randn(V, generator=g), SamplingParams(), None)
    with pytest.raises(ValueError, match="outside the constraint"):  # log-probs without the mask
        _engine().completion(
            Request([1], SamplingParams(), ChoiceConstraint(sequences)), _choice([unmasked], [5])
        )


def test_greedy_records_a_one_token_support():
    lp = _processed(torch.randn(V, generator=torch.Generator().manual_seed(2)), SamplingParams(), None)
    tok = int(lp.argmax())
    out = _engine().completion(Request([1], SamplingParams(temperature=0)), _choice([lp], [tok]))
    assert (out.token_ids, out.logprobs, out.topk_ids, out.support_size, out.support_ids) == (
        [tok],
        [0.0],
        [[tok]],
        [1],
        [[]],
    )


def test_supports_the_head_cannot_cover_are_refused_before_sending():
    with pytest.raises(ValueError, match="top_p < 1"):
        _engine().request_body(Request([1], SamplingParams(top_p=0.9)), None)
    with pytest.raises(ValueError, match="top_k"):
        _engine().request_body(Request([1], SamplingParams(top_k=K + 2)), None)
    with pytest.raises(NotImplementedError, match="tokenizer"):
        structured_outputs(ChoiceConstraint([[1]]), None)


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


def test_golden_check_and_the_recording_command():
    new, old = [[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 9], [7, 7]]
    assert agreement(new, new) == 1.0 and agreement(old, new) == pytest.approx((2 / 4 + 0) / 2)
    assert golden_check(new, new, old)[0] and not golden_check(old, new, old)[0]
    assert golden_check(new, new, new)[0]  # identical deployments: the version tag decides
    cmd = serve_command("/exports/r1", 8001, top_logprobs=20)
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[cmd.index("--max-logprobs") + 1] == "21" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
