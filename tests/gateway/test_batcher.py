"""The batching engine: requests join a running batch and leave it when done; one bad request
fails only itself."""

from concurrent.futures import Future

from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Request
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.gateway.batcher import BatchingEngine


def _engine(tiny_model, tokenizer, **kw) -> BatchingEngine:
    return BatchingEngine(TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id), **kw)


def test_a_request_arriving_mid_decode_joins_and_returns_before_the_long_one(tiny_model, tokenizer):
    engine = _engine(tiny_model, tokenizer)
    plain = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    seed = next(  # a draw that runs all 60 tokens
        s
        for s in range(200)
        if plain.generate([Request([5, 6, 7], SamplingParams(max_tokens=60, seed=s))])[0].finish_reason
        == "length"
    )
    late: list[Future] = []
    seen: list[tuple[int, bool]] = []

    def watch(ids: list[int]) -> bool:  # on the engine thread, after each of the long call's tokens
        if len(ids) == 5:
            late.append(engine.submit(Request([8, 9], SamplingParams(max_tokens=3, seed=1))))
        seen.append((len(ids), bool(late) and late[0].done()))
        return False

    try:
        long = engine.submit(Request([5, 6, 7], SamplingParams(max_tokens=60, seed=seed), on_token=watch))
        out, _ = long.result(timeout=120)
        assert len(out.token_ids) == 60
        short, recorded_seed = late[0].result(timeout=10)
        assert len(short.token_ids) == 3 or short.finish_reason == "stop"
        assert recorded_seed == 1
        first_done = min(n for n, done in seen if done)
        assert first_done < 20  # answered within a few steps of arriving, long before the 60th token
    finally:
        engine.close()


def test_a_failing_request_does_not_fail_the_requests_batched_with_it(tiny_model, tokenizer):
    engine = _engine(tiny_model, tokenizer, wait_ms=2000)
    try:
        calls = 0

        def fail_on_second_token(ids: list[int]) -> bool:  # a request whose processing raises
            nonlocal calls
            calls += 1
            if len(ids) == 2:
                raise RuntimeError("bad request")
            return False

        good = engine.submit(Request([5, 6, 7], SamplingParams(max_tokens=4, seed=1)))
        bad = engine.submit(Request([5, 6, 7], SamplingParams(max_tokens=4), on_token=fail_on_second_token))
        completion, seed = good.result(timeout=60)
        assert len(completion.token_ids) == 4 or completion.finish_reason == "stop"
        assert seed == 1  # the request's own seed is the one recorded
        assert isinstance(bad.exception(timeout=60), RuntimeError)
        assert calls == 2  # its row ended at the error
        bad_prompt = engine.submit(Request([5, 10**9], SamplingParams(max_tokens=2)))  # cannot be prefilled
        assert bad_prompt.exception(timeout=60) is not None
        assert engine.submit(Request([5], SamplingParams(max_tokens=2))).result(timeout=60)[0].token_ids
    finally:
        engine.close()


def test_a_request_whose_distribution_is_not_finite_fails_alone(tiny_model, tokenizer):
    engine = _engine(tiny_model, tokenizer, wait_ms=2000)
    try:
        overflow = engine.submit(
            Request([5, 6, 7], SamplingParams(temperature=1e-45, max_tokens=4))
        )  # logits/T: inf
        good = engine.submit(Request([5, 6, 7], SamplingParams(max_tokens=4, seed=2)))
        assert "not finite" in str(overflow.exception(timeout=60))
        assert good.result(timeout=60)[0].token_ids
    finally:
        engine.close()
