"""Trainer log-probs of recorded completion tokens, computed in chunks over tokens.

Only completion positions are projected to the vocabulary, `chunk_tokens` at a time, so the
largest fp32 tensor is [chunk_tokens, V], never [tokens, V] for the batch. From one log-softmax
per chunk (at the recorded temperature) it gathers, per token:
- `full_logprobs`: log pi(a|h) over the whole vocabulary (score centering's pi);
- `logprobs`: log pi(a|h) renormalized over the support the engine sampled from (structured-output
  mask or top-k/top-p set): what IS estimators compare with mu. A forced token (one-token support)
  gets exactly 0 and no gradient;
- `head_logprobs` [Ntok, K]: full-vocabulary log pi of the recorded top-K head of mu;
- `extra_logprobs` [Ntok, M]: full-vocabulary log pi of the M extra tokens the engine sampled;
- `entropy`: entropy of pi over the support.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel


@dataclass
class Sequences:
    """A padded batch of recorded calls, with one entry per completion token."""

    input_ids: torch.Tensor  # [N, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [N, L]
    token_row: torch.Tensor  # [Ntok] which sequence each completion token is in
    token_pos: torch.Tensor  # [Ntok] position whose logits predict it (its index - 1)
    token_ids: torch.Tensor  # [Ntok] the sampled ids
    temperature: torch.Tensor  # [Ntok]
    support: list[list[int] | None]  # per token: kept ids, None = whole vocabulary
    deployment_logprobs: torch.Tensor  # [Ntok] log mu(a|h) as recorded
    head_ids: torch.Tensor  # [Ntok, K] recorded head of mu, padded with 0
    head_mask: torch.Tensor  # [Ntok, K] True where the head has an entry
    head_deployment_logprobs: torch.Tensor  # [Ntok, K] log mu of the head, -inf where padded
    extra_ids: torch.Tensor  # [Ntok, M] extra tokens sampled by the deployment (M may be 0)

    @property
    def free(self) -> torch.Tensor:  # [Ntok] bool: sampled, not forced
        return torch.tensor([s is None or len(s) > 1 for s in self.support])


def build_sequences(calls: list[dict], pad_id: int) -> Sequences:
    """Pack recorded calls (rows of the `calls` table) into one padded batch."""
    width = max(len(c["prompt_token_ids"]) + len(c["completion_token_ids"]) for c in calls)
    ids = torch.full((len(calls), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(calls), width), dtype=torch.long)
    rows, pos, toks, temps, support, mu, heads, head_lps, extras = [], [], [], [], [], [], [], [], []
    for n, c in enumerate(calls):
        prompt, completion = c["prompt_token_ids"], c["completion_token_ids"]
        seq = list(prompt) + list(completion)
        ids[n, : len(seq)] = torch.tensor(seq)
        mask[n, : len(seq)] = 1
        extra = c.get("extra_token_ids") or [[] for _ in completion]
        for t, tok in enumerate(completion):
            rows.append(n)
            pos.append(len(prompt) + t - 1)
            toks.append(tok)
            temps.append(c["sampling"]["temperature"])
            support.append(token_support(c, t))
            mu.append(c["completion_logprobs"][t])
            heads.append(c["topk_token_ids"][t])
            head_lps.append(c["topk_logprobs"][t])
            extras.append(extra[t])
    k = max(len(h) for h in heads)
    m = min(len(e) for e in extras)
    if m != max(len(e) for e in extras):
        raise ValueError("calls of one batch recorded different numbers of extra samples")
    head_ids = torch.zeros((len(heads), k), dtype=torch.long)
    head_mask = torch.zeros((len(heads), k), dtype=torch.bool)
    head_mu = torch.full((len(heads), k), float("-inf"))
    for i, (h, lp) in enumerate(zip(heads, head_lps, strict=True)):
        head_ids[i, : len(h)] = torch.tensor(h)
        head_mask[i, : len(h)] = True
        head_mu[i, : len(h)] = torch.tensor(lp)
    return Sequences(
        ids,
        mask,
        torch.tensor(rows),
        torch.tensor(pos),
        torch.tensor(toks),
        torch.tensor(temps, dtype=torch.float32),
        support,
        torch.tensor(mu, dtype=torch.float32),
        head_ids,
        head_mask,
        head_mu,
        torch.tensor(extras, dtype=torch.long).reshape(len(toks), m),
    )


def token_support(call: dict, t: int) -> list[int] | None:
    """The kept support of position t of a recorded call (DESIGN.md §3), None if unrestricted."""
    size = call["support_size"][t]
    if size >= call["vocab_size"]:
        return None
    head = call["topk_token_ids"][t]
    return list(head) if size <= len(head) else list(call["support_token_ids"][t])


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor  # [Ntok] log pi(a|h) over the recorded support
    full_logprobs: torch.Tensor  # [Ntok] log pi(a|h) over the vocabulary
    head_logprobs: torch.Tensor  # [Ntok, K] log pi of mu's recorded head (vocabulary)
    extra_logprobs: torch.Tensor  # [Ntok, M] log pi of the deployment's extra samples (vocabulary)
    entropy: torch.Tensor  # [Ntok] entropy of pi over the support (no gradient)


def token_logprobs(model: PreTrainedModel, seqs: Sequences, chunk_tokens: int = 1024) -> TokenLogprobs:
    """Gradient flows when called outside `torch.no_grad()`."""
    hidden = model.base_model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).last_hidden_state
    h = hidden[seqs.token_row, seqs.token_pos]  # [Ntok, H]
    return project_logprobs(h, model.get_output_embeddings().weight, seqs, chunk_tokens)


def project_logprobs(
    h: torch.Tensor, weight: torch.Tensor, seqs: Sequences, chunk_tokens: int
) -> TokenLogprobs:
    """From completion hidden states h [Ntok, H] and the output embedding [V, H]. With gradient,
    each chunk is recomputed in the backward pass (activation checkpointing), so the backward pass
    too holds one [chunk_tokens, V] tensor at a time instead of every chunk's log-softmax."""
    vocab = weight.shape[0]
    outs = []
    for start in range(0, h.shape[0], chunk_tokens):
        sl = slice(start, min(start + chunk_tokens, h.shape[0]))
        args = (
            h[sl],
            weight,
            seqs.temperature[sl],
            seqs.token_ids[sl],
            seqs.head_ids[sl],
            seqs.extra_ids[sl],
            _support_mask(seqs.support[sl], vocab),
        )
        if torch.is_grad_enabled():
            outs.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            outs.append(_chunk_logprobs(*args))
    return TokenLogprobs(*(torch.cat(parts) for parts in zip(*outs, strict=True)))


def _chunk_logprobs(
    h: torch.Tensor,  # [c, H]
    weight: torch.Tensor,  # [V, H]
    temperature: torch.Tensor,  # [c]
    token_ids: torch.Tensor,  # [c]
    head_ids: torch.Tensor,  # [c, K]
    extra_ids: torch.Tensor,  # [c, M]
    keep: torch.Tensor | None,  # [c, V] support mask, None = whole vocabulary
) -> tuple[torch.Tensor, ...]:
    logp = ((h @ weight.T) / temperature[:, None]).log_softmax(-1)  # [c, V]
    full = logp.gather(1, token_ids[:, None]).squeeze(1)  # [c]
    if keep is None:
        lp, kept = full, logp
    else:
        kept = logp.masked_fill(~keep, float("-inf"))
        kept = kept - kept.logsumexp(-1, keepdim=True)  # renormalize over the support
        lp = kept.gather(1, token_ids[:, None]).squeeze(1)
    with torch.no_grad():
        p = kept.exp()
        entropy = -(p * kept.masked_fill(p == 0, 0.0)).sum(-1)
    return lp, full, logp.gather(1, head_ids), logp.gather(1, extra_ids), entropy


def _support_mask(support: list[list[int] | None], vocab: int) -> torch.Tensor | None:  # [c, V]
    if all(s is None for s in support):
        return None
    keep = torch.ones((len(support), vocab), dtype=torch.bool)
    for i, s in enumerate(support):
        if s is not None:
            keep[i] = False
            keep[i, s] = True
    return keep
