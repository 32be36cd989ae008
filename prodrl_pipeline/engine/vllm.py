"""vLLM as the deployment engine (GPU): a client of a vLLM OpenAI server started for recording.

Start the server on the deployment export (`engine/vllm_server.py` builds the command):

    vllm serve EXPORT_DIR --logprobs-mode processed_logprobs --max-logprobs 21 --generation-config vllm

Each request goes to /v1/completions with the token-id prompt (exact tokens in), explicit
sampling parameters, `logprobs: K + 1`, `return_token_ids`, `return_tokens_as_token_ids` and
`return_weight_versions`. vLLM lists the sampled token first, then the top tokens, so the K + 1
entries are deduplicated, sorted and cut to K. Filtered tokens come back as -inf (serialized
-9999). The recorded support is, in this order of preference:
- the constraint's allowed ids, when a constraint is the only restriction (the client steps its
  own copy of the constraint through the returned ids, so it knows them exactly);
- the finite entries, when top-k <= K + 1 guarantees they are all of it;
- the whole vocabulary, when nothing restricts sampling.
A top-p support that may be larger than the K + 1 entries cannot be recorded: such requests are
refused before they are sent. vLLM 0.33 returns the kept support itself (`sampling_mask`) only on
its token-in/token-out endpoint (/inference/v1/generate), which this client does not use yet.

Structured outputs go to vLLM as the constraint's own `structured_outputs` form: a choice as a Lark
grammar of token-id references, a JSON schema as `json` (the server runs the `guidance` backend,
llguidance, the library the gateway's constraints use). The client steps its own copy of the
constraint through the returned ids and checks each step's log-probs against it: the sampled id
must be allowed, every finite entry must be allowed, no allowed id may be listed as filtered, and
an allowed set that fits in the K + 1 entries must be exactly the finite ones. A completion vLLM
tokenized or masked differently is refused, never recorded.

`weight_version`, when set, is the version the server must report for every generated token
(`weight_versions` in the response, token ranges; set by `vllm_server.reload`): a completion
served, even partly, by other weights is refused.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from prodrl_pipeline.engine.constraints import Constraint
from prodrl_pipeline.engine.rows import Completion, Request, ids_array
from prodrl_pipeline.records import support

FILTERED = -9999.0  # vLLM's serialization of -inf


class WeightVersionError(ValueError):
    """The server generated with weights other than the deployment's: the call is not recorded."""


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ValueError(f"expected 'token_id:N' tokens (return_tokens_as_token_ids), got {token!r}")
    return int(token.removeprefix("token_id:"))


def structured_outputs(constraint: Constraint) -> dict:
    """The `structured_outputs` request field that makes vLLM enforce `constraint`."""
    form = getattr(constraint, "structured_outputs", None)
    if form is None:
        raise NotImplementedError(f"this {type(constraint).__name__} has no vLLM form")
    return form


def _versions_cover(spans: list[dict], version: str, n: int) -> bool:
    """Whether `spans` (vLLM's weight_versions: version, start, end) give every one of the n
    generated tokens the version `version`."""
    covered = [False] * n
    for span in spans:
        if span["version"] != version:
            return False
        for i in range(max(0, span["start"]), min(n, span["end"])):
            covered[i] = True
    return all(covered)


def _check_mask(allowed: list[int], entries: dict[int, float], finite: list, k: int, whole: bool) -> None:
    """vLLM's listed log-probs agree with the constraint's allowed ids (ValueError otherwise);
    `whole`: nothing but the constraint restricts sampling, so every allowed id is kept."""
    allowed_set, listed = set(allowed), {i for _, i in finite}
    if not listed <= allowed_set:
        raise ValueError("vLLM's log-probs put mass outside the constraint: not recorded")
    if whole and any(entries[i] <= FILTERED for i in entries if i in allowed_set):
        raise ValueError("vLLM filtered an id the constraint allows (another mask): not recorded")
    if whole and len(allowed_set) <= k + 1 and listed != allowed_set:
        raise ValueError("vLLM's kept ids are not the constraint's allowed ids: not recorded")


class VLLMEngine:
    honours = frozenset({"tool_choice", "response_format"})
    """Per-token callbacks (stop strings, token streaming) and logit_bias are not wired through
    vLLM yet: the gateway refuses stop and logit_bias, and streams a finished completion."""

    def __init__(  # noqa: PLR0913
        self,
        base_url: str,
        model: str,
        vocab_size: int,
        top_logprobs: int = 20,
        api_key: str | None = None,
        timeout: float = 300.0,
        max_workers: int = 64,
        weight_version: str | None = None,
    ):
        self.url, self.model, self.vocab_size, self.top_logprobs = (
            base_url.rstrip("/"),
            model,
            vocab_size,
            top_logprobs,
        )
        self.weight_version = weight_version
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            timeout=timeout, headers=headers, limits=httpx.Limits(max_connections=max_workers)
        )
        self.pool = ThreadPoolExecutor(max_workers)
        self.extra_samples = 0

    def generate(self, requests: list[Request], seed: int | None = None) -> list[Completion]:
        return list(self.pool.map(lambda r: self._one(r, seed), requests))

    def _one(self, req: Request, seed: int | None) -> Completion:
        r = self.client.post(f"{self.url}/v1/completions", json=self.request_body(req, seed))
        r.raise_for_status()
        return self.completion(req, r.json()["choices"][0])

    def request_body(self, req: Request, seed: int | None) -> dict:
        """The /v1/completions body for `req` (ValueError if its support could not be recorded)."""
        if req.on_token is not None or req.params.logit_bias:
            raise NotImplementedError("per-token callbacks and logit_bias through vLLM are not wired yet")
        p, k = req.params, self.top_logprobs
        if p.temperature > 0 and p.top_p < 1 and not 0 < p.top_k <= k + 1:
            raise ValueError(
                f"with vLLM, top_p < 1 leaves a support the recorded head may not cover; set top_k <= {k + 1}"
            )
        if p.temperature > 0 and self._topk_restricts(p.top_k) and p.top_k > k + 1:
            raise ValueError(f"with vLLM, top_k > {k + 1} leaves a support the recorded head cannot cover")
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
            "return_weight_versions": True,
        }
        if req.stop_ids:
            body["stop_token_ids"] = sorted(req.stop_ids)
        if req.constraint is not None:
            body["structured_outputs"] = structured_outputs(req.constraint)
        return body

    def _topk_restricts(self, top_k: int) -> bool:
        return 0 < top_k < self.vocab_size

    def completion(self, req: Request, choice: dict) -> Completion:
        """The recorded completion from one response choice, checked against the request."""
        spans = choice.get("weight_versions") or []
        if self.weight_version is not None and not _versions_cover(
            spans, self.weight_version, len(choice["token_ids"])
        ):
            versions = sorted({v["version"] for v in spans}) or "unreported"
            raise WeightVersionError(
                f"vLLM generated with weight version(s) {versions}, expected {self.weight_version} "
                "for every token: the call is not recorded"
            )
        p, k = req.params, self.top_logprobs
        greedy = p.temperature == 0
        sampling_restricted = p.top_p < 1 or self._topk_restricts(p.top_k)
        state = req.constraint.start() if req.constraint is not None else None
        out = Completion(finish_reason="stop" if choice.get("finish_reason") == "stop" else "length")
        for t, tok in enumerate(choice["token_ids"]):
            entries = {_token_id(s): lp for s, lp in (choice["logprobs"]["top_logprobs"][t] or {}).items()}
            finite = sorted(((lp, i) for i, lp in entries.items() if lp > FILTERED), reverse=True)
            if not greedy and not FILTERED < choice["logprobs"]["token_logprobs"][t] <= 0:
                raise ValueError(
                    f"vLLM gave the sampled token a log-prob outside (-inf, 0] at {t}: not recorded"
                )
            allowed = None
            if state is not None:
                if state.finished:
                    break  # the end-of-turn id vLLM appends after a finished constraint
                allowed = state.allowed()
                _check_mask(allowed, entries, finite, k, whole=not sampling_restricted)
                state.advance(tok)  # ValueError: vLLM produced ids the constraint does not allow
            if greedy:
                head, logprob, kept = [(0.0, tok)], 0.0, [tok]
            else:
                head, logprob = finite[:k], choice["logprobs"]["token_logprobs"][t]
                if allowed is not None and not sampling_restricted:
                    kept = allowed  # T > 0 over the allowed ids alone
                elif sampling_restricted or allowed is not None:
                    kept = [i for _, i in finite]  # top-k <= K + 1: all of it is listed
                else:
                    kept = None  # the whole vocabulary
            out.token_ids.append(tok)
            out.logprobs.append(logprob)
            out.topk_ids.append(ids_array([i for _, i in head]))
            out.topk_logprobs.append(np.array([lp for lp, _ in head], dtype=np.float32))
            out.supports.append(support.from_ids(kept, len(head), self.vocab_size))
            out.extra_ids.append(ids_array([]))
        return out
