"""The embedded deployment engine: batched sampling with a KV cache, recording like vLLM.

`TorchEngine.generate` completes a batch of requests; a `Decoder` is a running batch that admits
requests between its steps (the gateway's continuous batching). Each step processes the logits into
mu (logit bias, structured-output mask, temperature, top-k, top-p: `engine/processing.py`), draws
from it, and hands the draws to the rows, which record them as the data contract asks
(`engine/rows.py`, docs/tables.md)."""

from __future__ import annotations

import torch
from transformers import Cache, PreTrainedModel

from prodrl_pipeline.engine.kv_cache import growing_cache, left_pad, stacked
from prodrl_pipeline.engine.processing import SamplingParams, bias_matrix, processed_logprobs
from prodrl_pipeline.engine.rows import Completion, Request, Rows, check_recording

PREFILL_ROWS = 32
"""Prompts prefilled per forward pass when many are admitted at once: sorted by length and grouped,
each group padded to its own longest prompt (one group padded to the longest of all computes
~20% padding on the lab's turns), then stacked."""


class TorchEngine:
    """Serves a causal LM (already holding the deployed weights) on CPU or GPU."""

    honours = frozenset({"on_token", "tool_choice", "response_format", "logit_bias"})
    """Request features beyond sampling parameters: per-token callbacks, constraints."""

    def __init__(
        self, model: PreTrainedModel, eos_id: int, pad_id: int, top_logprobs: int = 20, extra_samples: int = 0
    ):
        check_recording(top_logprobs, extra_samples)
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
        decoder = Decoder(self, seed)
        decoder.admit(requests)
        while not all(decoder.rows.done):
            decoder.step()
        if error := next((e for e in decoder.rows.errors if e is not None), None):
            raise error
        return decoder.rows.out

    def decoder(self, seed: int | None = None) -> Decoder:
        """A running batch that admits requests between steps (continuous batching)."""
        return Decoder(self, seed)


class Decoder:
    """A running batch: each `step` samples one token for every live row (plus the tokens a
    constraint forces); `admit` prefills new requests between steps and joins them to the batch;
    `release` removes finished rows. Rows stay right-aligned in the KV cache (left padding,
    masked), each with its own positions, so a row decodes as it would alone."""

    def __init__(self, engine: TorchEngine, seed: int | None):
        self.engine = engine
        self.gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self.rows = Rows(
            [], engine.vocab_size, engine.eos_id, engine.pad_id, engine.top_logprobs, engine.extra_samples
        )
        self.own: list[torch.Generator | None] = []
        self.temperature, self.top_p = torch.zeros(0), torch.zeros(0)  # per row
        self.top_k = torch.zeros(0, dtype=torch.long)
        self.bias: list[tuple[tuple[int, ...], tuple[float, ...]] | None] = []  # per row: (ids, biases)
        self.cache: Cache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)  # [N, cache length]
        self.pending = torch.zeros((0, 0), dtype=torch.long)  # [N, w]: ids not yet in the cache
        self.fed = torch.zeros((0, 0), dtype=torch.long)  # [N, w]: 1 where a pending id is a real token
        self.logits: torch.Tensor | None = None  # [N, V] for the next token, when known

    def __len__(self) -> int:
        return len(self.rows.out)

    @torch.inference_mode()
    def admit(self, requests: list[Request]) -> None:
        """Prefill `requests` (their prompts and any forced prefix) and add them as rows. Between
        steps only: the live rows' pending ids are fed first, so every row is at "logits ready"."""
        if not requests:
            return
        biases = [_bias(r.params, self.engine.vocab_size) for r in requests]  # checked before any change
        if len(self):
            self._forward()
        new = Rows(requests, *self.rows.config())
        forced = new.force_common()
        prompts = [r.prompt_ids + f for r, f in zip(requests, forced, strict=True)]
        # prefill in groups of similar length (each padded to its own longest), rows back in order
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        groups = [order[i : i + PREFILL_ROWS] for i in range(0, len(order), PREFILL_ROWS)]
        parts = [self._prefill([prompts[i] for i in group]) for group in groups]
        back = torch.tensor(order).argsort()
        width = max(len(p) for p in prompts)
        cache = stacked([c for c, _, _ in parts], width, back)
        mask = torch.cat([left_pad(m, width) for _, m, _ in parts])[back]
        logits = torch.cat([x for _, _, x in parts])[back]
        self._join(new, cache, mask, logits, requests, biases)

    def _prefill(self, prompts: list[list[int]]) -> tuple[Cache, torch.Tensor, torch.Tensor]:
        """One forward over left-padded `prompts`: their cache, mask and next-token logits."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.engine.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        result = self.engine.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            cache=growing_cache(),
            use_cache=True,
            logits_to_keep=1,
        )
        return result.cache, mask, result.logits[:, -1, :]

    def _join(
        self, new: Rows, cache: Cache, mask: torch.Tensor, logits: torch.Tensor, requests, biases
    ) -> None:  # noqa: ANN001
        if self.cache is None or not len(self):
            self.cache, self.mask, self.logits = cache, mask, logits
        else:  # pad the shorter cache on the left, then stack the rows
            length = max(self.mask.shape[1], mask.shape[1])
            self.mask = torch.cat([left_pad(self.mask, length), left_pad(mask, length)])
            for old, add in zip(self.cache.layers, cache.layers, strict=True):
                old.stack_below(add, length)
            self.logits = torch.cat([self.logits, logits])
        self.rows.extend(new)
        self.own += [
            torch.Generator().manual_seed(r.params.seed) if r.params.seed is not None else None
            for r in requests
        ]
        self.temperature = torch.cat(
            [self.temperature, torch.tensor([r.params.temperature for r in requests])]
        )
        self.top_k = torch.cat([self.top_k, torch.tensor([r.params.top_k for r in requests])])
        self.top_p = torch.cat([self.top_p, torch.tensor([r.params.top_p for r in requests])])
        self.bias += biases
        self.pending = torch.zeros((len(self), 0), dtype=torch.long)
        self.fed = torch.zeros((len(self), 0), dtype=torch.long)

    def _forward(self) -> None:
        """Feed every row's pending ids; the logits of each row's next token."""
        if self.logits is not None:
            return
        width = self.pending.shape[1]
        positions = self.mask.sum(-1, keepdim=True) + torch.arange(width)[None, :]  # after the real tokens
        self.mask = torch.cat([self.mask, self.fed], dim=1)
        result = self.engine.model(
            input_ids=self.pending,
            attention_mask=self.mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache, self.logits = result.cache, result.logits[:, -1, :]

    @torch.inference_mode()
    def step(self) -> None:
        """Sample (and record) one token for every live row, then the tokens forced after it."""
        self._forward()
        b, extra = self.rows, self.engine.extra_samples
        logp = processed_logprobs(  # [N, V]
            self.logits,
            self.temperature,
            self.top_k,
            self.top_p,
            b.allowed_mask(),
            bias_matrix(self.bias, self.engine.vocab_size),
        )
        # the sampled token and M extra samples of the same mu, in one draw
        probs = logp.exp()
        # a NaN anywhere or no finite entry (e.g. an fp16 overflow); amax propagates NaN, one pass
        broken = ~(logp.amax(-1) > float("-inf"))
        for i in broken.nonzero().flatten().tolist():  # fails that request alone
            if not b.done[i]:
                b.done[i], b.errors[i] = True, ValueError("the model's next-token distribution is not finite")
            probs[i] = 0.0
            probs[i, self.engine.pad_id] = 1.0  # a placeholder draw, never recorded
        uniform = torch.rand((len(self), 1 + extra), generator=self.gen, dtype=torch.float64)
        for i, g in enumerate(self.own):  # a one-token support is forced, not drawn: no draw used
            if g is not None and not b.done[i] and int((probs[i] > 0).sum()) > 1:
                uniform[i] = torch.rand(1 + extra, generator=g, dtype=torch.float64)
        draws = draw(probs, uniform)
        sampled = draws[:, 0]  # [N]
        was_done = list(b.done)
        toks = b.record_sampled(logp, sampled, draws[:, 1:])
        forced = b.force_common()
        new = [[toks[i], *forced[i]] for i in range(len(self))]
        width = len(new[0])
        pad = self.engine.pad_id
        self.pending = torch.tensor(
            [row if not d else [pad] * width for row, d in zip(new, was_done, strict=True)]
        )
        self.fed = torch.tensor([[0 if d else 1] * width for d in was_done], dtype=torch.long)
        self.logits = None

    def release(self) -> list[tuple[Request, Completion, Exception | None]]:
        """Remove the finished rows (freeing their cache): their requests, completions and the
        error that ended a row whose `on_token` raised (None otherwise)."""
        done = [i for i, d in enumerate(self.rows.done) if d]
        if not done:
            return []
        out = [(self.rows.requests[i], self.rows.out[i], self.rows.errors[i]) for i in done]
        keep = [i for i, d in enumerate(self.rows.done) if not d]
        index = torch.tensor(keep, dtype=torch.long)
        self.rows.select(keep)
        self.own = [self.own[i] for i in keep]
        self.bias = [self.bias[i] for i in keep]
        self.temperature, self.top_k, self.top_p = (
            self.temperature[index],
            self.top_k[index],
            self.top_p[index],
        )
        self.pending, self.fed, self.mask = self.pending[index], self.fed[index], self.mask[index]
        self.cache.batch_select_indices(index)
        if self.logits is not None:
            self.logits = self.logits[index]
        start = int((self.mask.sum(0) == 0).long().cumprod(0).sum()) if keep else self.mask.shape[1]
        if start:  # columns no remaining row attends to: cut from the cache's left
            self.mask = self.mask[:, start:]
            for layer in self.cache.layers:
                layer.cut_left(start)
        return out


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Samples of each row of `probs` [N, V] (unnormalized, >= 0) by inverting its CDF at the
    `uniform` [N, S] draws in [0, 1): token j is drawn with probability probs[j] / sum(probs),
    a zero-probability token never. One uniform per sample instead of one random number per
    vocabulary entry (as torch.multinomial draws)."""
    cdf = probs.double().cumsum(-1)  # [N, V]
    return torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1)


def _bias(params: SamplingParams, vocab_size: int) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    if not params.logit_bias:
        return None
    ids, biases = zip(*params.logit_bias, strict=True)
    if max(ids) >= vocab_size:
        raise ValueError(f"logit_bias names token {max(ids)}, outside the vocabulary of {vocab_size}")
    return ids, biases
