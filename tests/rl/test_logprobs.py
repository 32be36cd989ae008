import math

import numpy as np
import pytest
import torch

from prodrl_pipeline.engine.processing import bias_matrix
from prodrl_pipeline.records.support import kept_ids, of_call
from prodrl_pipeline.rl.estimators import EstimatorConfig, TokenInputs, objective
from prodrl_pipeline.rl.logprobs import EVERY_OUTPUT, Sequences, build_sequences, token_logprobs
from prodrl_pipeline.rl.recorded import RecordedCalls
from tests.conftest import logprob_tolerance


def _naive(model, seqs):
    """log_softmax over the full [tokens, V] logits of the whole batch (no chunking)."""
    logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
    return (logits[seqs.token_row, seqs.token_pos] / seqs.temperature[:, None]).log_softmax(-1)  # [Ntok, V]


def _over_support(logp, seqs):
    """log pi_S [Ntok, V]: each row renormalized over its recorded support, brute force."""
    out = logp.clone()
    for i, support in enumerate(seqs.support):
        if support is not None:
            keep = torch.zeros(logp.shape[1], dtype=torch.bool)
            keep[support] = True
            out[i] = logp[i].masked_fill(~keep, float("-inf")).log_softmax(0)
    return out


def test_chunked_equals_naive_log_softmax_gather(tiny_model, columns, tokenizer):
    seqs = build_sequences(columns, tokenizer.pad_token_id)
    logp = _naive(tiny_model, seqs)
    kept = _over_support(logp, seqs)
    full = logp.gather(1, seqs.token_ids[:, None]).squeeze(1)
    tail = torch.stack(
        [
            kept[i]
            .masked_fill(
                torch.isin(torch.arange(logp.shape[1]), seqs.head_ids[i][seqs.head_mask[i]]), float("-inf")
            )
            .logsumexp(0)
            for i in range(len(seqs.token_ids))
        ]
    )
    full_tol, kept_tol = logprob_tolerance(logp), logprob_tolerance(kept)  # the distributions' scales
    for chunk in (1, 7, 4096):
        got = token_logprobs(tiny_model, seqs, chunk_tokens=chunk)
        torch.testing.assert_close(got.full_logprobs, full, rtol=0, atol=full_tol)
        head = seqs.head_mask
        torch.testing.assert_close(
            got.head_logprobs[head], kept.gather(1, seqs.head_ids)[head], rtol=0, atol=kept_tol
        )
        torch.testing.assert_close(got.extra_logprobs, kept.gather(1, seqs.extra_ids), rtol=0, atol=kept_tol)
        torch.testing.assert_close(got.tail_logprobs, tail, rtol=0, atol=kept_tol)
    assert torch.isinf(tail).any() and torch.isfinite(tail).any()  # both kinds of position occur


def test_support_renormalizes_and_forced_tokens_carry_no_gradient(tiny_model, columns, tokenizer):
    seqs = build_sequences(columns, tokenizer.pad_token_id)
    got = token_logprobs(tiny_model, seqs, chunk_tokens=64)
    logp = _naive(tiny_model, seqs)
    forced = ~seqs.free
    assert forced.any() and seqs.free.any()
    for i, support in enumerate(seqs.support):
        if support is None:
            continue
        expected = logp[i, seqs.token_ids[i]] - torch.logsumexp(logp[i, support], 0)  # brute force
        rounding = logprob_tolerance(logp[i, support])
        assert got.logprobs[i].item() == pytest.approx(expected.item(), abs=rounding)
    assert torch.all(got.logprobs[forced] == 0) and torch.all(got.entropy[forced] == 0)  # constants
    assert torch.all(got.logprobs[seqs.free] > got.full_logprobs[seqs.free])  # the support's mass < 1
    grad = torch.autograd.grad(got.logprobs[forced].sum(), tiny_model.lm_head.weight, allow_unused=True)[0]
    assert grad is None or torch.count_nonzero(grad) == 0


def _brute_force_fields(model, seqs):
    """Every field of TokenLogprobs per position from the naive [Ntok, V] logits, with the recorded
    logit bias added and divided by the recorded temperature, then renormalized over each support."""
    logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
    logits = logits[seqs.token_row, seqs.token_pos]
    if seqs.bias is not None:
        logits = logits + bias_matrix(seqs.bias, logits.shape[1])
    logp = (logits / seqs.temperature[:, None]).log_softmax(-1)
    kept = _over_support(logp, seqs)
    vocab = torch.arange(logp.shape[1])
    outside_head = torch.stack(
        [~torch.isin(vocab, seqs.head_ids[i][seqs.head_mask[i]]) for i in range(len(seqs.token_ids))]
    )
    token = seqs.token_ids[:, None]
    tail = kept.masked_fill(~outside_head, -math.inf)
    has_tail = tail.isfinite().any(-1)  # a logsumexp of -inf alone has a NaN gradient: left out
    return {
        "logprobs": kept.gather(1, token).squeeze(1),
        "head_logprobs": kept.gather(1, seqs.head_ids),
        "tail_logprobs": torch.where(
            has_tail, tail.masked_fill(~has_tail[:, None], 0).logsumexp(-1), -math.inf
        ),
        "extra_logprobs": kept.gather(1, seqs.extra_ids),
        "complement_logprobs": kept.scatter(1, token, -math.inf).logsumexp(-1),
        "full_logprobs": logp.gather(1, token).squeeze(1),
        "entropy": -(kept.exp() * kept).nansum(-1),
    }


def _forced_at(seqs, rows, token=None):
    """`seqs` with the positions `rows` forced (a one-token support; head and extra samples the
    token itself), their token set to `token` if given."""
    support = list(seqs.support)
    for i in rows:
        if token is not None:
            seqs.token_ids[i] = token
        t = int(seqs.token_ids[i])
        support[i] = [t]
        seqs.head_ids[i, 0], seqs.head_mask[i, 1:], seqs.extra_ids[i] = t, False, t
    return Sequences(**{**vars(seqs), "support": support})


@pytest.mark.parametrize(
    ("batch", "chunk"),
    [("mixed", 7), ("mixed", 4096), ("forced-only", 7), ("forced-only, no gradient", 7)],
    ids=["mixed-several-chunks", "mixed-one-chunk", "forced-only", "forced-only-no-gradient"],
)
def test_every_field_and_its_gradient_equal_the_brute_force_with_forced_positions(
    batch, chunk, tiny_model, recorded, tokenizer
):
    """Only the sampled positions are projected; a forced one's fields are constants. Every field,
    at every position, and the gradient of a weighted sum of the fields that carry one equal the
    naive computation's, on calls at several temperatures, some with a logit bias (-100 on a
    forced token among them), with a forced token of id 0: on a batch mixing both kinds (in several
    chunks and in one), on one with forced positions only,
    and on that one without gradient (no projection but the diagnostic's)."""
    calls = recorded.calls
    for i, c in enumerate(calls):
        c["sampling"] = {**c["sampling"], "temperature": (0.7, 1.0, 1.3)[i % 3]}
    forced_id = calls[1]["completion_token_ids"][-1]
    calls[1]["sampling"]["logit_bias"] = [
        {"token_id": forced_id, "bias": -100.0},
        {"token_id": 7, "bias": 2.5},
    ]
    seqs = build_sequences(RecordedCalls.from_rows(calls), tokenizer.pad_token_id)
    seqs = _forced_at(seqs, [int((~seqs.free).nonzero()[0])], token=0)
    if batch != "mixed":
        seqs = _forced_at(seqs, range(len(seqs.token_ids)))
    free = seqs.free
    assert free.any() == (batch == "mixed") and not free.all() and (seqs.token_ids[~free] == 0).any()
    brute = _brute_force_fields(tiny_model, seqs)
    with torch.no_grad() if batch == "forced-only, no gradient" else torch.enable_grad():
        got = token_logprobs(tiny_model, seqs, chunk_tokens=chunk)
    head = seqs.head_mask
    support = torch.cat([brute[k].detach().flatten() for k in ("logprobs", "head_logprobs")])
    for name, value in vars(got).items():
        value, want = (value[head], brute[name][head]) if name == "head_logprobs" else (value, brute[name])
        scale = want if name == "full_logprobs" else support  # the others: log pi_S, or sums over pi_S
        atol = logprob_tolerance(scale.detach())
        torch.testing.assert_close(value.detach(), want.detach(), rtol=0, atol=atol, msg=name)
    if batch == "forced-only, no gradient":
        return
    grads = []
    for fields in (vars(got), brute):
        tiny_model.zero_grad(set_to_none=True)
        weights = torch.Generator().manual_seed(0)  # the same weights for both
        loss = sum(
            (
                torch.randn(fields[k].shape, generator=weights)
                * fields[k].masked_fill(~fields[k].isfinite(), 0)
            ).sum()
            for k in ("logprobs", "head_logprobs", "tail_logprobs", "extra_logprobs")
        )
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in tiny_model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)
    assert (grads[0].abs().sum() > 0) == (batch == "mixed")


def test_the_trainer_evaluates_pi_as_served_with_the_recorded_logit_bias(
    tiny_model, tokenizer, train_puzzles, tmp_path
):
    """On-policy identity: the trainer's pi_S at the recorded temperature and bias is mu exactly."""
    from prodrl_pipeline.engine.processing import SamplingParams
    from tests.rl.conftest import record

    bias = tuple((i, 3.0) for i in range(1024, 1324)) + ((1400, -100.0),)  # move tokens pushed up
    params = SamplingParams(temperature=0.9, logit_bias=bias)
    calls = record(tiny_model, tokenizer, train_puzzles[:4], tmp_path, params=params).calls
    assert calls[0]["sampling"]["logit_bias"][0] == {"token_id": 1024, "bias": 3.0}
    with torch.no_grad():
        served = token_logprobs(
            tiny_model, build_sequences(RecordedCalls.from_rows(calls), tokenizer.pad_token_id)
        )
        unbiased = [{**c, "sampling": {**c["sampling"], "logit_bias": []}} for c in calls]
        ignored = token_logprobs(
            tiny_model, build_sequences(RecordedCalls.from_rows(unbiased), tokenizer.pad_token_id)
        )
    seqs = build_sequences(RecordedCalls.from_rows(calls), tokenizer.pad_token_id)
    free = seqs.free
    head = seqs.head_mask
    recorded = torch.cat([seqs.deployment_logprobs[free], seqs.head_deployment_logprobs[head]])
    rounding = logprob_tolerance(recorded)  # the engine's computation and the trainer's
    torch.testing.assert_close(served.logprobs[free], seqs.deployment_logprobs[free], rtol=0, atol=rounding)
    torch.testing.assert_close(
        served.head_logprobs[head], seqs.head_deployment_logprobs[head], rtol=0, atol=rounding
    )
    gap = (ignored.logprobs[free] - seqs.deployment_logprobs[free]).abs().max()
    assert gap > 0.1  # dropping the bias would train against a distribution nobody served
    mixed = build_sequences(RecordedCalls.from_rows([*unbiased, *calls]), tokenizer.pad_token_id)
    with torch.no_grad():
        for chunk in (3, 4096):  # chunks of unbiased tokens only, and a chunk of both kinds
            got = token_logprobs(tiny_model, mixed, chunk_tokens=chunk).logprobs
            alone = torch.cat([ignored.logprobs, served.logprobs])
            torch.testing.assert_close(got, alone, rtol=0, atol=logprob_tolerance(alone))


def test_calls_with_different_numbers_of_extra_samples_are_not_batched(recorded):
    """Extra samples are one tensor column per sample: a batch must agree on how many."""
    first, second = recorded.calls[0], dict(recorded.calls[1])
    second["extra_token_ids"] = [e[:1] for e in second["extra_token_ids"]]  # one where the rest have two
    with pytest.raises(ValueError, match="^calls of one batch recorded different numbers of extra samples$"):
        build_sequences(RecordedCalls.from_rows([first, second]), pad_id=0)


@pytest.mark.parametrize(
    "cfg",
    [
        EstimatorConfig(type="reinforce"),
        EstimatorConfig(type="token_is"),
        EstimatorConfig(type="token_is", trust_region=True),
        EstimatorConfig(type="tis_ppo", kl_beta=0.1),
        EstimatorConfig(type="score_centering"),
        EstimatorConfig(type="score_centering", truncated_is=True),
        EstimatorConfig(type="score_centering", centering="samples"),
    ],
    ids=lambda c: f"{c.type}-{c.centering}-tr{c.trust_region:d}-tis{c.truncated_is:d}",
)
def test_each_estimator_reads_only_the_log_probs_it_declares(cfg, tiny_model, columns, tokenizer):
    """Computing only `cfg.reads` gives the objective and gradient of computing every field; a
    field an estimator reads but does not declare would be None here and fail."""
    seqs = build_sequences(columns, tokenizer.pad_token_id)
    assert cfg.reads <= EVERY_OUTPUT and not ({"full_logprobs", "entropy"} & cfg.reads)
    results = []
    for outputs in (EVERY_OUTPUT, cfg.reads):
        tiny_model.zero_grad(set_to_none=True)
        lp = token_logprobs(tiny_model, seqs, chunk_tokens=64, outputs=outputs)
        assert {f for f in EVERY_OUTPUT if getattr(lp, f) is not None} == outputs
        x = TokenInputs(
            logprobs=lp.logprobs,
            deployment_logprobs=seqs.deployment_logprobs,
            round_start_logprobs=seqs.deployment_logprobs + 0.01,
            advantages=torch.linspace(-1, 1, len(seqs.token_ids)),
            trajectory=seqs.token_row,
            free=seqs.free,
            head_logprobs=lp.head_logprobs,
            tail_logprobs=lp.tail_logprobs,
            head_deployment_logprobs=seqs.head_deployment_logprobs,
            extra_logprobs=lp.extra_logprobs,
            complement_logprobs=lp.complement_logprobs,
        )
        j, _ = objective(x, cfg)
        j.sum().backward()
        results.append((j.detach(), tiny_model.lm_head.weight.grad.clone()))
    (j_all, g_all), (j_read, g_read) = results
    assert torch.equal(j_all, j_read) and torch.equal(g_all, g_read)
    assert g_all.abs().sum() > 0


def test_an_unknown_log_prob_output_is_refused(tiny_model, recorded, tokenizer):
    seqs = build_sequences(RecordedCalls.from_rows(recorded.calls[:1]), tokenizer.pad_token_id)
    with pytest.raises(ValueError, match=r"^unknown log-prob outputs \['tail'\]; choose from \['complement"):
        token_logprobs(tiny_model, seqs, outputs=frozenset({"tail"}))


def _packed_token_by_token(calls, pad_id):
    """build_sequences' fields, one completion token at a time (the reference it is checked against)."""
    out = {k: [] for k in ("row", "pos", "tok", "temp", "support", "mu", "head", "head_mu", "extra", "bias")}
    width = max(len(c["prompt_token_ids"]) + len(c["completion_token_ids"]) for c in calls)
    ids = torch.full((len(calls), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(calls), width), dtype=torch.long)
    for n, c in enumerate(calls):
        seq = c["prompt_token_ids"] + c["completion_token_ids"]
        for i, t in enumerate(seq):
            ids[n, i], mask[n, i] = t, 1
        bias = c["sampling"]["logit_bias"]
        for t, tok in enumerate(c["completion_token_ids"]):
            out["row"].append(n)
            out["pos"].append(len(c["prompt_token_ids"]) + t - 1)
            out["tok"].append(tok)
            out["temp"].append(c["sampling"]["temperature"])
            # the engine records per-position arrays (engine/rows.py): compared here as lists
            head = np.asarray(c["topk_token_ids"][t]).tolist()
            kept = kept_ids(of_call(c)[t], head, c["vocab_size"])  # the kept support (docs/tables.md)
            out["support"].append(None if kept is None else kept.tolist())
            out["mu"].append(c["completion_logprobs"][t])
            out["head"].append(head)
            out["head_mu"].append(np.asarray(c["topk_logprobs"][t]).tolist())
            out["extra"].append(np.asarray(c["extra_token_ids"][t]).tolist())
            out["bias"].append(([e["token_id"] for e in bias], [e["bias"] for e in bias]) if bias else None)
    return ids, mask, out


def test_packing_equals_packing_token_by_token(recorded, tokenizer):
    calls = recorded.calls[:6]
    calls[1]["sampling"] = {**calls[1]["sampling"], "temperature": 0.7}
    calls[2]["sampling"] = {**calls[2]["sampling"], "logit_bias": [{"token_id": 5, "bias": -1.5}]}
    seqs = build_sequences(RecordedCalls.from_rows(calls), tokenizer.pad_token_id)
    ids, mask, ref = _packed_token_by_token(calls, tokenizer.pad_token_id)
    assert torch.equal(seqs.input_ids, ids) and torch.equal(seqs.attention_mask, mask)
    assert seqs.token_row.tolist() == ref["row"] and seqs.token_pos.tolist() == ref["pos"]
    assert seqs.token_ids.tolist() == ref["tok"]
    assert [None if s is None else s.tolist() for s in seqs.support] == ref["support"]
    assert torch.equal(seqs.temperature, torch.tensor(ref["temp"], dtype=torch.float32))
    assert torch.equal(seqs.deployment_logprobs, torch.tensor(ref["mu"], dtype=torch.float32))
    lengths = {len(h) for h in ref["head"]}
    assert len(lengths) > 1  # heads of different lengths are padded
    for i, (head, head_mu) in enumerate(zip(ref["head"], ref["head_mu"], strict=True)):
        k = len(head)
        assert seqs.head_ids[i, :k].tolist() == head and seqs.head_mask[i].tolist() == [True] * k + [
            False
        ] * (seqs.head_ids.shape[1] - k)
        assert torch.equal(seqs.head_deployment_logprobs[i, :k], torch.tensor(head_mu, dtype=torch.float32))
        assert torch.all(seqs.head_ids[i, k:] == 0) and torch.all(
            seqs.head_deployment_logprobs[i, k:] == -math.inf
        )
    assert seqs.extra_ids.tolist() == ref["extra"] and seqs.extra_ids.shape[1] == 2
    assert seqs.bias == ref["bias"] and any(b is not None for b in ref["bias"])


@pytest.mark.parametrize("column", ["completion_logprobs", "topk_logprobs", "support_size"])
def test_a_call_whose_positions_disagree_in_length_is_not_packed(recorded, column):
    call = recorded.calls[0]
    call[column] = call[column][:-1] if column != "topk_logprobs" else [lp[:-1] for lp in call[column]]
    with pytest.raises(ValueError, match="per-position columns disagree in length$"):
        build_sequences(RecordedCalls.from_rows([recorded.calls[1], call]), pad_id=0)
