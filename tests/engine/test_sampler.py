import pytest
import torch

from prodrl_pipeline.chat.render import render_ids
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Request
from prodrl_pipeline.engine.sampler import PREFILL_ROWS, TorchEngine, draw
from prodrl_pipeline.envs.chess_env import ChessEpisode
from prodrl_pipeline.envs.tool_choice import tool_choice_constraint
from prodrl_pipeline.records import support
from tests.conftest import logprob_tolerance

# move tokens (ids from 1024) pushed up or banned, ordinary ones pushed up: a bias that matters
BIAS = tuple((i, 4.0) for i in range(1024, 1224)) + ((1300, -100.0), (200, 6.0), (201, 50.0))


@pytest.mark.parametrize(
    "params,constrained",
    [
        (SamplingParams(temperature=1.0, max_tokens=6), False),
        (SamplingParams(temperature=0.8, top_k=30, max_tokens=6), False),
        (SamplingParams(temperature=1.2, top_p=0.6, max_tokens=6), False),
        (SamplingParams(temperature=1.0, max_tokens=64), True),
        (SamplingParams(temperature=0.9, top_k=50, max_tokens=64, logit_bias=BIAS), True),
        (SamplingParams(temperature=1.0, max_tokens=6, logit_bias=BIAS), False),
    ],
)
def test_recorded_logprobs_are_the_processed_distribution(
    tiny_model, tokenizer, heldout, params, constrained, reference_mu
):
    engine = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id, top_logprobs=20)
    episodes = [ChessEpisode(p) for p in heldout[:3]]
    requests = [
        Request(
            render_ids(tokenizer, e.messages),
            params,
            tool_choice_constraint(tokenizer, "move", "move", e.allowed_moves()) if constrained else None,
        )
        for e in episodes
    ]
    outs = engine.generate(requests, seed=0)
    checked_free = 0
    for req, out in zip(requests, outs, strict=True):
        state = req.constraint.start() if req.constraint else None
        for t, tok in enumerate(out.token_ids):
            allowed = state.allowed() if state is not None else None
            ref = reference_mu(tiny_model, req.prompt_ids + out.token_ids[:t], params, allowed)
            kept = torch.isfinite(ref).nonzero().squeeze(1)
            recorded = out.supports[t]
            assert recorded.size == len(kept)
            assert support.problem(recorded, out.topk_ids[t], engine.vocab_size) is None
            head = ref.topk(min(20, len(kept)))
            # engine (KV cache) vs a full forward pass, fp32, at the scale of the values compared (not
            # of a token a -100 bias pushed to ~-100, which the head and the draw never hold)
            rounding = logprob_tolerance(torch.cat([head.values, ref[tok : tok + 1]]))
            assert out.logprobs[t] == pytest.approx(float(ref[tok]), abs=rounding)
            assert out.topk_logprobs[t].tolist() == pytest.approx(head.values.tolist(), abs=rounding)
            assert set(out.topk_ids[t].tolist()) == set(head.indices.tolist())  # the K largest
            decoded = support.kept_ids(recorded, out.topk_ids[t], engine.vocab_size)
            if len(kept) == engine.vocab_size:
                assert decoded is None
            else:
                assert sorted(decoded.tolist()) == kept.tolist()
            assert recorded.form == support.form_for(len(kept), min(20, len(kept)), engine.vocab_size)
            if len(kept) == 1:
                assert out.logprobs[t] == 0.0 and out.topk_ids[t].tolist() == [tok]  # forced token
            else:
                checked_free += 1
            if state is not None:
                state.advance(tok)
        if constrained:
            assert out.finish_reason == "stop" and out.token_ids[-1] == tokenizer.eos_token_id
    assert checked_free >= 3


def test_seeded_generation_is_reproducible(tiny_model, tokenizer, heldout):
    engine = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    reqs = [
        Request(render_ids(tokenizer, ChessEpisode(p).messages), SamplingParams(max_tokens=4))
        for p in heldout[:4]
    ]
    a = engine.generate(reqs, seed=5)
    b = engine.generate(reqs, seed=5)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_a_request_seed_gives_the_same_draws_alone_or_in_any_batch(tiny_model, tokenizer, heldout):
    engine = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompts = [render_ids(tokenizer, ChessEpisode(p).messages) for p in heldout[:3]]
    seeded = Request(prompts[0], SamplingParams(max_tokens=12, seed=1234))
    alone = engine.generate([seeded], seed=1)[0]
    others = [Request(p, SamplingParams(max_tokens=12)) for p in prompts[1:]]
    batched = engine.generate([*others, seeded], seed=99)[-1]  # other batch seed, other neighbours
    assert batched.token_ids == alone.token_ids
    unseeded = [
        engine.generate([Request(prompts[0], SamplingParams(max_tokens=12))], seed=s)[0] for s in (1, 2)
    ]
    assert unseeded[0].token_ids != unseeded[1].token_ids  # the draws do depend on the seed


def test_prompts_prefilled_in_length_groups_each_decode_as_alone(tiny_model, tokenizer, heldout):
    """More prompts than one prefill group, of many lengths and given unsorted: every row keeps its
    request's place, tokens and log-probs (each request seeded, so its draws are its own)."""
    engine = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id, top_logprobs=3)
    full = render_ids(tokenizer, ChessEpisode(heldout[0]).messages)
    lengths = [(7 * i) % 60 + 5 for i in range(PREFILL_ROWS + 9)]  # two groups, lengths shuffled
    requests = [Request(full[-n:], SamplingParams(max_tokens=4, seed=i)) for i, n in enumerate(lengths)]
    together = engine.generate(requests, seed=0)
    for request, out in zip(requests, together, strict=True):
        alone = engine.generate([request], seed=1)[0]
        assert out.token_ids == alone.token_ids
        assert out.logprobs == pytest.approx(alone.logprobs, abs=logprob_tolerance(alone.logprobs))
        assert [h.tolist() for h in out.topk_ids] == [h.tolist() for h in alone.topk_ids]


def test_on_token_is_called_after_every_token_and_can_end_the_completion(tiny_model, tokenizer, heldout):
    engine = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompt = render_ids(tokenizer, ChessEpisode(heldout[0]).messages)
    free = engine.generate([Request(prompt, SamplingParams(max_tokens=8, seed=7))])[0]
    seen = []

    def stop(ids: list[int]) -> bool:
        seen.append(list(ids))
        return len(ids) == 3

    out = engine.generate([Request(prompt, SamplingParams(max_tokens=8, seed=7), on_token=stop)])[0]
    assert out.token_ids == free.token_ids[:3] and out.finish_reason == "stop"
    assert seen == [free.token_ids[:n] for n in (1, 2, 3)]


def test_a_stop_id_ends_the_completion_as_its_last_token(tiny_model, tokenizer, heldout):
    """`Request.stop_ids` (harmony's <|call|>): the completion ends at such a token, kept."""
    engine = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompt = render_ids(tokenizer, ChessEpisode(heldout[0]).messages)
    free = engine.generate([Request(prompt, SamplingParams(max_tokens=8, seed=7))])[0]
    third = free.token_ids[2]
    first = free.token_ids.index(third)
    stopped = Request(prompt, SamplingParams(max_tokens=8, seed=7), stop_ids=frozenset({third}))
    out = engine.generate([stopped])[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"


def test_a_request_seed_is_batch_independent_beside_a_constrained_neighbour(tiny_model, tokenizer, heldout):
    """A neighbour's forced chain can be longer or shorter than this row's: the seeded row's own
    generator is used only where it has a choice, so its draws do not depend on the neighbour."""
    engine = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    episodes = [ChessEpisode(p) for p in heldout[:2]]
    constrained = [
        Request(
            render_ids(tokenizer, e.messages),
            SamplingParams(max_tokens=64, seed=11),
            tool_choice_constraint(tokenizer, "move", "move", e.allowed_moves()),
        )
        for e in episodes
    ]
    alone = engine.generate([constrained[0]], seed=0)[0]
    free = Request(render_ids(tokenizer, episodes[1].messages), SamplingParams(max_tokens=64))
    for neighbour in (free, constrained[1]):
        assert engine.generate([neighbour, constrained[0]], seed=5)[1].token_ids == alone.token_ids


def _long_seed(engine, prompt, n):
    """A request seed whose draw runs all n tokens (no end token)."""
    return next(
        s
        for s in range(200)
        if engine.generate([Request(prompt, SamplingParams(max_tokens=n, seed=s))])[0].finish_reason
        == "length"
    )


def test_requests_admitted_between_steps_decode_as_they_would_alone(tiny_model, tokenizer, heldout):
    """Continuous batching: rows joining a running batch (with a longer and a shorter prompt than
    its cache), rows leaving it (their cache freed, its left edge cut): every row's tokens and
    recorded log-probs are those of the request decoded alone."""
    engine = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id, top_logprobs=5)
    long_prompt = render_ids(tokenizer, ChessEpisode(heldout[0]).messages)
    short_prompt = long_prompt[-12:]
    a = Request(short_prompt, SamplingParams(max_tokens=30, seed=_long_seed(engine, short_prompt, 30)))
    b = Request(long_prompt, SamplingParams(max_tokens=6, seed=5))  # joins with a longer prompt
    c = Request(short_prompt[:5], SamplingParams(max_tokens=20, seed=6))  # joins after b left
    alone = {id(r): engine.generate([r])[0] for r in (a, b, c)}
    decoder = engine.decoder(seed=0)
    decoder.admit([a])
    finished, steps = {}, 0
    while len(decoder):
        if steps == 3:
            decoder.admit([b])
        if steps == 12:
            decoder.admit([c])
        decoder.step()
        steps += 1
        for r, out, error in decoder.release():
            assert error is None
            finished[id(r)] = (out, steps)
    assert finished[id(b)][1] < finished[id(a)][1]  # b left while a was still decoding
    for r in (a, b, c):
        out = finished[id(r)][0]
        assert out.token_ids == alone[id(r)].token_ids
        assert out.logprobs == pytest.approx(
            alone[id(r)].logprobs, abs=logprob_tolerance(alone[id(r)].logprobs)
        )


def test_draw_inverts_each_rows_cdf_exactly():
    """On an even grid of n uniforms each token is drawn n * p(token) times (up to one), a
    zero-probability token never, whatever the row's scale."""
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    n = 1000
    grid = ((torch.arange(n, dtype=torch.float64) + 0.5) / n).expand(2, n)
    counts = torch.stack([torch.bincount(row, minlength=6) for row in draw(probs, grid)])
    expected = n * probs / probs.sum(-1, keepdim=True)
    assert (counts - expected).abs().max() <= 1
    assert draw(probs, torch.zeros((2, 1), dtype=torch.float64)).flatten().tolist() == [1, 0]
    assert draw(probs, torch.full((2, 1), 1 - 2**-53, dtype=torch.float64)).flatten().tolist() == [4, 5]
