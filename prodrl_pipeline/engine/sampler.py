"""The embedded deployment engine: batched sampling with a KV cache, recording like vLLM.

For every position of every completion it records what the data contract (docs/tables.md) asks:
the sampled id, its log-prob under the processed distribution mu (after the structured-output
mask, temperature, top-k, top-p), the top-K head of mu (forced tokens: one entry, log-prob 0),
the kept support when sampling was restricted (`support_size` tokens were kept; if that is more
than the head holds and less than the vocabulary, `support_ids` lists them all), and optionally
M extra tokens drawn from the same mu in the same multinomial call (score centering's samples form).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from prodrl_pipeline.engine.constraints import ChoiceConstraint
from prodrl_pipeline.engine.processing import SamplingParams, processed_logprobs


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    """`params.seed` set: this request samples from its own generator (batch-independent)."""
    constraint: ChoiceConstraint | None = None
    on_token: Callable[[list[int]], bool] | None = None
    """Called on the engine thread with the completion's ids after each token (streaming, stop
    strings, a client that left); True ends the completion (finish_reason "stop")."""


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    support_size: list[int] = field(default_factory=list)
    support_ids: list[list[int]] = field(default_factory=list)
    extra_ids: list[list[int]] = field(default_factory=list)
    finish_reason: str = "length"


class TorchEngine:
    """Serves a causal LM (already holding the deployed weights) on CPU or GPU."""

    honours = frozenset({"on_token", "tool_choice"})
    """Request features beyond sampling parameters: per-token callbacks, constraints."""

    def __init__(
        self, model: PreTrainedModel, eos_id: int, pad_id: int, top_logprobs: int = 20, extra_samples: int = 0
    ):
        if top_logprobs < 1:
            raise ValueError(f"top_logprobs must be >= 1, got {top_logprobs}")
        if extra_samples < 0:
            raise ValueError(f"extra_samples must be >= 0, got {extra_samples}")
        self.model = model.eval()
        self.eos_id, self.pad_id, self.top_logprobs = eos_id, pad_id, top_logprobs
        self.extra_samples = extra_samples
        self.vocab_size = model.config.vocab_size

    @torch.inference_mode()
    def generate(self, requests: list[Request], seed: int | None = None) -> list[Completion]:
        """Complete every request in one batch. `seed` seeds the batch's sampling RNG; a request
        with its own `params.seed` draws from its own generator instead.

        Tokens forced by a constraint are fed in one forward pass (jump-forward decoding) and
        recorded as what they are: log-prob 0 under a one-token support.
        """
        if not requests:
            return []
        n = len(requests)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        own = [
            torch.Generator().manual_seed(r.params.seed) if r.params.seed is not None else None
            for r in requests
        ]
        temperature = torch.tensor([r.params.temperature for r in requests])
        top_k = torch.tensor([r.params.top_k for r in requests])
        top_p = torch.tensor([r.params.top_p for r in requests])
        b = _Batch(requests, self.vocab_size, self.eos_id, self.pad_id, self.top_logprobs, self.extra_samples)
        forced = b.force_common()
        prompts = [r.prompt_ids + f for r, f in zip(requests, forced, strict=True)]
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        while not all(b.done):
            result = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = result.cache
            logp = processed_logprobs(  # [N, V]
                result.logits[:, -1, :], temperature, top_k, top_p, b.allowed_mask()
            )
            # the sampled token and M extra samples of the same mu, in one draw
            probs = logp.exp()
            draws = torch.multinomial(probs, 1 + self.extra_samples, replacement=True, generator=gen)
            for i, g in enumerate(own):  # a one-token support is forced, not drawn: no draw used
                if g is not None and not b.done[i] and int((probs[i] > 0).sum()) > 1:
                    draws[i] = torch.multinomial(
                        probs[i], 1 + self.extra_samples, replacement=True, generator=g
                    )
            sampled = draws[:, 0]  # [N]
            was_done = list(b.done)
            b.record_sampled(logp, sampled, draws[:, 1:])
            forced = b.force_common()
            new = [[int(sampled[i]), *forced[i]] for i in range(n)]
            width = len(new[0])
            ids = torch.tensor(
                [row if not d else [self.pad_id] * width for row, d in zip(new, was_done, strict=True)]
            )
            live = torch.tensor([[0 if d else 1] * width for d in was_done])
            mask = torch.cat([mask, live], dim=1)
            positions = positions[:, -1:] + torch.arange(1, width + 1)[None, :]
        return b.out


class _Batch:
    """Per-request decoding state of one `generate` call: constraint states, outputs, done flags."""

    def __init__(
        self,
        requests: list[Request],
        vocab_size: int,
        eos_id: int,
        pad_id: int,
        top_logprobs: int,
        extra_samples: int,
    ):
        self.requests, self.vocab_size = requests, vocab_size
        self.eos_id, self.pad_id, self.top_logprobs = eos_id, pad_id, top_logprobs
        self.extra_samples = extra_samples
        self.states = [r.constraint.root if r.constraint else None for r in requests]
        self.out = [Completion() for _ in requests]
        self.done = [False] * len(requests)

    def allowed_mask(self) -> torch.Tensor | None:  # [N, V] bool
        if all(s is None for s in self.states):
            return None
        allowed = torch.ones((len(self.states), self.vocab_size), dtype=torch.bool)
        for i, s in enumerate(self.states):
            if s is not None and not self.done[i]:
                allowed[i] = False
                allowed[i, list(s)] = True
        return allowed

    def record_sampled(self, logp: torch.Tensor, sampled: torch.Tensor, extra: torch.Tensor) -> None:
        k = min(self.top_logprobs, self.vocab_size)
        head_lp, head_ids = logp.topk(k, dim=-1)  # [N, K]
        kept = torch.isfinite(logp).sum(-1)  # [N]
        for i in range(len(self.out)):
            if self.done[i]:
                continue
            tok, size = int(sampled[i]), int(kept[i])
            n_head = min(k, size)
            stored = n_head < size < self.vocab_size
            support = torch.isfinite(logp[i]).nonzero().squeeze(1).tolist() if stored else []
            self.append(
                i,
                tok,
                float(logp[i, tok]),
                head_ids[i, :n_head].tolist(),
                head_lp[i, :n_head].tolist(),
                size,
                support,
                extra[i].tolist(),
            )

    def force_common(self) -> list[list[int]]:
        """Append to every unfinished row the same number m of forced tokens (m = the shortest
        forced chain among them, so the next forward pass stays rectangular)."""
        chains = []
        for i, s in enumerate(self.states):
            if self.done[i]:
                continue
            room = self.requests[i].params.max_tokens - len(self.out[i].token_ids)
            chains.append(ChoiceConstraint.forced(s)[:room] if s is not None else [])
        m = min((len(c) for c in chains), default=0)
        out, it = [], iter(chains)
        for i in range(len(self.states)):
            if self.done[i]:
                out.append([self.pad_id] * m)
                continue
            chain = []
            for tok in next(it)[:m]:
                if self.done[i]:  # its on_token callback ended the row inside the chain
                    break
                self.append(i, tok, 0.0, [tok], [0.0], 1, [], [tok] * self.extra_samples)
                chain.append(tok)
            out.append(chain + [self.pad_id] * (m - len(chain)))
        return out

    def append(
        self,
        i: int,
        tok: int,
        logprob: float,
        head_ids: list[int],
        head_lp: list[float],
        support_size: int,
        support_ids: list[int],
        extra_ids: list[int],
    ) -> None:
        c = self.out[i]
        c.token_ids.append(tok)
        c.logprobs.append(logprob)
        c.topk_ids.append(head_ids)
        c.topk_logprobs.append(head_lp)
        c.support_size.append(support_size)
        c.support_ids.append(support_ids)
        c.extra_ids.append(extra_ids)
        if self.states[i] is not None:
            self.states[i] = ChoiceConstraint.advance(self.states[i], tok)
        on_token = self.requests[i].on_token
        if (
            tok == self.eos_id
            or (self.states[i] is not None and not self.states[i])
            or (on_token and on_token(c.token_ids))
        ):
            self.done[i], c.finish_reason = True, "stop"
        elif len(c.token_ids) >= self.requests[i].params.max_tokens:
            self.done[i] = True
