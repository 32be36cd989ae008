"""The batching engine: one bad request fails only itself."""

from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import Request, TorchEngine
from prodrl_pipeline.gateway.batcher import BatchingEngine


def test_a_failing_request_does_not_fail_the_requests_batched_with_it(tiny_model, tokenizer):
    engine = BatchingEngine(
        TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id), wait_ms=2000, seed=3
    )
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
        assert calls >= 3  # the batch failed, then the bad request failed alone
    finally:
        engine.close()
