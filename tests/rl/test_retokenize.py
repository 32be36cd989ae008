"""The naive retokenizing pipeline: what it rebuilds from a recorded call, and where it differs."""

import copy
import json
import math

import pytest

from prodrl_pipeline.chat.render import load_tokenizer
from prodrl_pipeline.records import support
from prodrl_pipeline.rl.estimators import EstimatorConfig
from prodrl_pipeline.rl.recorded import RecordedCalls
from prodrl_pipeline.rl.retokenize import retokenize_calls
from prodrl_pipeline.rl.trainer import TrainerConfig, make_optimizer, train_round
from tests.conftest import logprob_tolerance


def _split_move(call: dict, tokenizer) -> dict:
    """The call as an engine that spelled its move in byte pieces would have recorded it."""
    free = next(t for t, s in enumerate(call["support_size"]) if s > 1)
    pieces = [
        tokenizer.convert_tokens_to_ids(ch) for ch in tokenizer.decode([call["completion_token_ids"][free]])
    ]
    assert len(pieces) > 1 and tokenizer.unk_token_id not in pieces

    def spread(column: str) -> list:
        return call[column][:free] + [call[column][free]] * len(pieces) + call[column][free + 1 :]

    out = {c: spread(c) for c in ("completion_logprobs", "topk_token_ids", "topk_logprobs", *support.COLUMNS)}
    ids = call["completion_token_ids"]
    return {
        **call,
        **out,
        "completion_token_ids": ids[:free] + pieces + ids[free + 1 :],
        "extra_token_ids": [],
    }


def test_lab_calls_differ_only_by_the_templates_trailing_newline(recorded, tokenizer):
    calls = recorded.calls
    rebuilt, report = retokenize_calls(calls, tokenizer)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    for old, new in zip(calls, rebuilt, strict=True):
        assert new["prompt_token_ids"] == old["prompt_token_ids"]
        assert new["completion_token_ids"] == old["completion_token_ids"] + newline
        n = len(old["completion_token_ids"])
        assert new["completion_logprobs"][:n] == old["completion_logprobs"]
        assert new["topk_token_ids"][:n] == old["topk_token_ids"]
        assert math.isnan(new["completion_logprobs"][n]) and new["topk_token_ids"][n] == newline
        assert new["support_size"][n] == old["vocab_size"]
    n = len(calls)
    assert report["calls"] == n and report["prompt_differs"] == 0 and report["completion_differs"] == n
    assert report["stretch: whitespace"] == n
    assert report["positions_aligned"] == report["positions"] == report["positions_retokenized"] - n


def test_a_move_spelled_in_pieces_is_merged_and_loses_its_recorded_logprobs(recorded, tokenizer):
    call = _split_move(recorded.calls[0], tokenizer)
    (new,), report = retokenize_calls([call], tokenizer)
    stretches = {k: n for k, n in report.items() if k.startswith("stretch")}
    assert stretches == {"stretch: spelling": 1, "stretch: whitespace": 1}
    original = recorded.calls[0]["completion_token_ids"]
    assert len(new["completion_token_ids"]) == len(original) + 1  # merged back, plus the newline
    free = next(t for t, s in enumerate(call["support_size"]) if s > 1)
    assert new["completion_token_ids"][free] == original[free]
    # the merged move and everything after it no longer line up with what was recorded
    assert all(math.isnan(x) for x in new["completion_logprobs"][free:])
    assert all(not math.isnan(x) for x in new["completion_logprobs"][:free])


def test_training_on_retokenized_calls_takes_unrecorded_positions_as_on_policy(
    tiny_model, recorded, tokenizer
):
    calls, _ = retokenize_calls(recorded.calls, tokenizer)
    adv = [
        {
            "trajectory_id": t["trajectory_id"],
            "minibatch": 0,
            "reward": t["reward"],
            "advantage": (i % 3) - 1.0,
        }
        for i, t in enumerate(recorded.trajectories)
    ]
    rounding = logprob_tolerance([x for c in calls for x in c["completion_logprobs"]])
    for est in ("tis_ppo", "score_centering"):
        model = copy.deepcopy(tiny_model)
        cfg = TrainerConfig(
            steps=1, batch_size=len(adv), estimator=EstimatorConfig(type=est), tokens="retokenized"
        )
        (row,) = train_round(
            model, make_optimizer(model, cfg, None), RecordedCalls.from_rows(calls), adv, cfg, pad_id=0
        )
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
        assert row["engine_mismatch"] <= rounding  # unquantized engine; the newline's mu is pi_k itself


def test_a_text_completion_call_cannot_be_rebuilt(recorded, tokenizer):
    call = {**recorded.calls[0], "messages_json": '{"prompt": "1. e4"}'}
    with pytest.raises(ValueError, match="not a chat call"):
        retokenize_calls([call], tokenizer)


def test_a_malformed_call_the_template_cannot_render_is_kept_as_served_and_counted(recorded, tokenizer):
    """Arguments that are not JSON under a template that renders them as an object (`tojson`, the
    free-text lab's as Qwen3's): the round still trains, on that call as it was served."""
    free_text = load_tokenizer("data/tokenizer_free_text")
    cut = {"id": "call_0", "type": "function", "function": {"name": "", "arguments": '{"move": "Qh5+"'}}
    messages = [
        {"role": "user", "content": "Mate in one."},
        {"role": "assistant", "content": "", "tool_calls": [cut]},
    ]
    call = {**recorded.calls[0], "messages_json": json.dumps(messages)}
    rebuilt, report = retokenize_calls([recorded.calls[1], call], free_text)
    assert rebuilt[1] is call and rebuilt[0]["prompt_token_ids"] != recorded.calls[1]["prompt_token_ids"]
    assert report["calls"] == 2 and report["not rendered"] == 1
    assert retokenize_calls([recorded.calls[1]], free_text)[1].get("not rendered") is None


def test_a_call_without_the_assistants_answer_last_cannot_be_rebuilt(recorded, tokenizer):
    for messages in ("[]", '[{"role": "user", "content": "1. e4"}]'):
        call = {**recorded.calls[0], "call_id": "c-7", "messages_json": messages}
        with pytest.raises(ValueError) as refused:
            retokenize_calls([call], tokenizer)
        assert str(refused.value) == "call c-7: messages_json does not end with the assistant's answer"


def test_extra_samples_are_kept_where_ids_agree_and_become_the_token_itself_after(recorded, tokenizer):
    from prodrl_pipeline.rl.retokenize import retokenize_call

    call = recorded.calls[0]
    extra = [
        [10_000 + t, 20_000 + t] for t in range(len(call["completion_token_ids"]))
    ]  # told apart from tokens
    whole = retokenize_call({**call, "extra_token_ids": extra}, tokenizer)
    agree = sum(
        a == b for a, b in zip(whole["completion_token_ids"], call["completion_token_ids"], strict=False)
    )
    assert 0 < agree < len(whole["completion_token_ids"])  # the template's trailing newline differs
    assert whole["extra_token_ids"][:agree] == extra[:agree]
    assert all(
        e == [tok, tok]
        for e, tok in zip(
            whole["extra_token_ids"][agree:], whole["completion_token_ids"][agree:], strict=True
        )
    )
    assert retokenize_call({**call, "extra_token_ids": None}, tokenizer)["extra_token_ids"] == []


def test_retokenizing_again_changes_nothing_and_reports_no_difference(recorded, tokenizer):
    """Ids that already are the conversation's rendering agree at every position: kept whole."""
    once, _ = retokenize_calls(recorded.calls, tokenizer)
    twice, report = retokenize_calls(once, tokenizer)
    assert [repr(c) for c in twice] == [repr(c) for c in once]  # repr: NaN equals NaN
    assert report["prompt_differs"] == report["completion_differs"] == 0
    assert not [k for k in report if k.startswith("stretch")]


def test_a_differing_prompt_is_replaced_and_counted_and_recorded_supports_kept_where_aligned(
    recorded, tokenizer
):
    calls = recorded.calls[:3]
    for call in calls[:2]:
        call["prompt_token_ids"] = call["prompt_token_ids"][1:]  # as another tokenizer would have cut it
    n = len(calls[0]["completion_token_ids"])
    top3 = support.Support(3, support.Form.IDS, [5, 6, 7])  # as if recorded under a top-k of three
    calls[0].update(support.columns([top3] * n))
    rebuilt, report = retokenize_calls(calls, tokenizer)
    assert report["prompt_differs"] == 2
    assert [len(c["prompt_token_ids"]) for c in rebuilt[:2]] == [
        len(c["prompt_token_ids"]) + 1 for c in calls[:2]
    ]
    kept = [(s.size, s.form, list(s.ids)) for s in support.of_call(rebuilt[0])]
    assert kept == [(3, support.Form.IDS, [5, 6, 7])] * n + [
        (calls[0]["vocab_size"], support.Form.VOCABULARY, [])
    ]
    assert set(k for k in report if k.startswith("stretch")) == {"stretch: whitespace"}


COLUMNS = (
    "completion_logprobs",
    "topk_token_ids",
    "topk_logprobs",
    "support_size",
    "support_form",
    "support_token_ids",
    "extra_token_ids",
)


def test_nothing_after_the_first_disagreement_is_kept_even_where_later_ids_agree_again(recorded, tokenizer):
    """The recorded move replaced by another id: the rebuilt ids differ at the move only (and the
    template's newline at the end), the ids after it line up again position by position, and still
    no recorded column is kept from the move on (a substitution is not known to be one)."""
    from prodrl_pipeline.rl.retokenize import retokenize_call

    call = recorded.calls[0]
    served = call["completion_token_ids"]
    n, vocab = len(served), call["vocab_size"]
    move = next(t for t, s in enumerate(call["support_size"]) if s > 1)
    assert move + 2 < n  # the call's closing tokens follow the move
    other = (served[move] + 1) % vocab
    recorded_ids = served[:move] + [other] + served[move + 1 :]
    given = {
        **call,
        "completion_token_ids": recorded_ids,
        **support.columns(
            [support.Support(4, support.Form.IDS, [5, 6, 7, t]) for t in range(n)]
        ),  # told apart
        "extra_token_ids": [[10_000 + t, 20_000 + t] for t in range(n)],
    }
    new = retokenize_call(given, tokenizer)
    ids = new["completion_token_ids"]
    assert ids == served + tokenizer.encode("\n", add_special_tokens=False)
    assert [a == b for a, b in zip(ids, recorded_ids, strict=False)] == [t != move for t in range(n)]
    for t, tok in enumerate(ids):
        got = [new[c][t] for c in COLUMNS]
        if t < move:
            assert got == [given[c][t] for c in COLUMNS], t
        else:
            assert math.isnan(got[0]) and math.isnan(got[2][0]) and len(got[2]) == 1, t
            assert [got[1], got[3], got[4], list(got[5]), got[6]] == [[tok], vocab, 0, [], [tok, tok]], t
