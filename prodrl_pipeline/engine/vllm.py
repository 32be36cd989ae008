"""vLLM as the deployment engine (GPU): a client of a vLLM OpenAI server started for recording.

Start the server on the deployment export (docs/engines.md):

    vllm serve EXPORT_DIR --logprobs-mode processed_logprobs --max-logprobs 21 --generation-config vllm

Each request goes to /v1/completions with the token-id prompt (exact tokens in), explicit
sampling parameters, `logprobs: K + 1`, `return_token_ids` and `return_tokens_as_token_ids`.
vLLM lists the sampled token first, then the top tokens, so the K + 1 entries are deduplicated,
sorted and cut to K. Filtered tokens come back as -inf (serialized -9999): when the kept support
fits in the K + 1 entries it is exactly their finite part; a top-p/top-k support larger than that
cannot be recorded, so such requests are refused (the trainer needs the support).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from prodrl_pipeline.engine.sampler import Completion, Request

FILTERED = -9999.0  # vLLM's serialization of -inf


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ValueError(f"expected 'token_id:N' tokens (return_tokens_as_token_ids), got {token!r}")
    return int(token.removeprefix("token_id:"))


class VLLMEngine:
    honours = frozenset()
    """Per-token callbacks (stop strings, token streaming) and tool-call constraints are not wired
    through vLLM yet: the gateway refuses stop and tool_choice, and streams a finished completion."""

    def __init__(
        self,
        base_url: str,
        model: str,
        vocab_size: int,
        top_logprobs: int = 20,
        api_key: str | None = None,
        timeout: float = 300.0,
        max_workers: int = 64,
    ):
        self.url, self.model, self.vocab_size, self.top_logprobs = (
            base_url.rstrip("/"),
            model,
            vocab_size,
            top_logprobs,
        )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            timeout=timeout, headers=headers, limits=httpx.Limits(max_connections=max_workers)
        )
        self.pool = ThreadPoolExecutor(max_workers)
        self.extra_samples = 0

    def generate(self, requests: list[Request], seed: int | None = None) -> list[Completion]:
        return list(self.pool.map(lambda r: self._one(r, seed), requests))

    def _one(self, req: Request, seed: int | None) -> Completion:
        if req.constraint is not None or req.on_token is not None or req.params.logit_bias:
            raise NotImplementedError(
                "constraints, per-token callbacks and logit_bias through vLLM are not wired yet"
            )
        p, k = req.params, self.top_logprobs
        greedy = p.temperature == 0
        restricted = greedy or p.top_p < 1 or 0 < p.top_k < self.vocab_size
        if restricted and not greedy and not 0 < p.top_k <= k + 1:
            raise ValueError(
                f"with vLLM, top_p < 1 or top_k > {k + 1} leaves a support the recorded head cannot "
                f"cover; set top_k <= {k + 1}"
            )
        body = {
            "model": self.model,
            "prompt": req.prompt_ids,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k if p.top_k > 0 else -1,
            "seed": p.seed if p.seed is not None else seed,
            "logprobs": k + 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        r = self.client.post(f"{self.url}/v1/completions", json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        out = Completion(finish_reason="stop" if choice.get("finish_reason") == "stop" else "length")
        for t, tok in enumerate(choice["token_ids"]):
            entries = {_token_id(s): lp for s, lp in (choice["logprobs"]["top_logprobs"][t] or {}).items()}
            finite = sorted(((lp, i) for i, lp in entries.items() if lp > FILTERED), reverse=True)
            if greedy:
                head, size, logprob = [(0.0, tok)], 1, 0.0
            else:
                head, logprob = finite[:k], choice["logprobs"]["token_logprobs"][t]
                size = len(finite) if restricted else self.vocab_size
            out.token_ids.append(tok)
            out.logprobs.append(logprob)
            out.topk_ids.append([i for _, i in head])
            out.topk_logprobs.append([lp for lp, _ in head])
            out.support_size.append(size)
            out.support_ids.append([i for _, i in finite] if len(head) < size < self.vocab_size else [])
            out.extra_ids.append([])
        return out
