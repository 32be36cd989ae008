"""Trainer log-probs of recorded completion tokens, computed in chunks over tokens.

Only completion positions are projected to the vocabulary, `chunk_tokens` at a time, so the
largest fp32 tensor is [chunk_tokens, V], never [tokens, V] for the batch. From one log-softmax
per chunk (at the recorded temperature) it derives pi_S = pi renormalized over the support S the
engine sampled from (structured-output mask or top-k/top-p set; S = V when unrestricted), the
distribution every estimator compares with mu (mu is 0 outside S), and gathers, per token (pi is
the policy as served: at the recorded temperature, with the recorded logit bias added first):
- `logprobs`: log pi_S(a|h). A forced token (one-token support) gets exactly 0 and no gradient;
- `head_logprobs` [Ntok, K]: log pi_S of the recorded top-K head H of mu;
- `tail_logprobs`: log pi_S(S minus H), the mass pi_S puts outside the head, computed in log space by
  a logsumexp over S minus H (no 1 - sum cancellation); -inf where S fits in H;
- `extra_logprobs` [Ntok, M]: log pi_S of the M extra tokens the engine sampled;
- `complement_logprobs`: log(1 - pi_S(a)) as a logsumexp over S minus {a} (exact where float32
  rounds pi_S(a) to 1; no gradient; the trust region's Bernoulli-KL needs it);
- `full_logprobs`: log pi(a|h) over the whole vocabulary (a diagnostic: log pi_S - log pi = -log pi(S));
- `entropy`: entropy of pi_S.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from prodrl_pipeline.engine.processing import bias_matrix
from prodrl_pipeline.quant.qat import base_forward


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
    bias: list[tuple[list[int], list[float]] | None] | None = None  # per token: its call's logit bias

    @property
    def free(self) -> torch.Tensor:  # [Ntok] bool: sampled, not forced
        return torch.tensor([s is None or len(s) > 1 for s in self.support], device=self.token_ids.device)

    def to(self, device: torch.device | str) -> Sequences:
        """The same batch with every tensor on `device`."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return Sequences(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def build_sequences(calls: list[dict], pad_id: int) -> Sequences:
    """Pack recorded calls (rows of the `calls` table) into one padded batch."""
    width = max(len(c["prompt_token_ids"]) + len(c["completion_token_ids"]) for c in calls)
    ids = torch.full((len(calls), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(calls), width), dtype=torch.long)
    rows, pos, toks, temps, support, mu, heads, head_lps, extras, biases = ([] for _ in range(10))
    for n, c in enumerate(calls):
        prompt, completion = c["prompt_token_ids"], c["completion_token_ids"]
        seq = list(prompt) + list(completion)
        ids[n, : len(seq)] = torch.tensor(seq)
        mask[n, : len(seq)] = 1
        extra = c.get("extra_token_ids") or [[] for _ in completion]
        entries = c["sampling"].get("logit_bias")
        bias = ([e["token_id"] for e in entries], [e["bias"] for e in entries]) if entries else None
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
            biases.append(bias)
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
        biases if any(b is not None for b in biases) else None,
    )


def token_support(call: dict, t: int) -> list[int] | None:
    """The kept support of position t of a recorded call (docs/tables.md), None if unrestricted."""
    size = call["support_size"][t]
    if size >= call["vocab_size"]:
        return None
    head = call["topk_token_ids"][t]
    return list(head) if size <= len(head) else list(call["support_token_ids"][t])


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor  # [Ntok] log pi_S(a|h), pi renormalized over the recorded support S
    head_logprobs: torch.Tensor  # [Ntok, K] log pi_S of mu's recorded head H (padding: anything)
    tail_logprobs: torch.Tensor  # [Ntok] log pi_S(S minus H), -inf where S is inside H
    extra_logprobs: torch.Tensor  # [Ntok, M] log pi_S of the deployment's extra samples
    complement_logprobs: torch.Tensor  # [Ntok] log(1 - pi_S(a)), -inf for a forced token (no gradient)
    full_logprobs: torch.Tensor  # [Ntok] log pi(a|h) over the vocabulary
    entropy: torch.Tensor  # [Ntok] entropy of pi_S (no gradient)


def token_logprobs(
    model: PreTrainedModel,
    seqs: Sequences,
    chunk_tokens: int = 1024,
    w_hat: dict[str, torch.Tensor] | None = None,
) -> TokenLogprobs:
    """Gradient flows when called outside `torch.no_grad()`. `w_hat`: forward through these
    fake-quantized weights (NVFP4 QAT, straight-through gradient)."""
    hidden = base_forward(model, w_hat, input_ids=seqs.input_ids, attention_mask=seqs.attention_mask)
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
            seqs.head_mask[sl],
            seqs.extra_ids[sl],
            _support_mask(seqs.support[sl], vocab, h.device),
            bias_matrix(seqs.bias[sl], vocab).to(h.device) if seqs.bias is not None else None,
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
    head_mask: torch.Tensor,  # [c, K]
    extra_ids: torch.Tensor,  # [c, M]
    keep: torch.Tensor | None,  # [c, V] support mask, None = whole vocabulary
    bias: torch.Tensor | None,  # [c, V] logit bias, None = none
) -> tuple[torch.Tensor, ...]:
    logits = h @ weight.T
    if bias is not None:
        logits = logits + bias
    if not bool((temperature == 1).all()):  # dividing by 1 changes no bit: skip the pass
        logits = logits / temperature[:, None]
    # log pi_S: one log-softmax over the support (pi renormalized over S is the softmax of S's logits)
    kept = (logits if keep is None else logits.masked_fill(~keep, float("-inf"))).log_softmax(-1)
    # one gather for the token, the head and the extra samples: one [c, V] scatter in the backward
    picked = kept.gather(1, torch.cat([token_ids[:, None], head_ids, extra_ids], 1))
    lp, head, extra = picked[:, 0], picked[:, 1 : 1 + head_ids.shape[1]], picked[:, 1 + head_ids.shape[1] :]
    if keep is None:
        full = lp
    else:
        with torch.no_grad():
            full = logits.gather(1, token_ids[:, None]).squeeze(1) - logits.logsumexp(-1)  # [c]
    # a padded head entry (id 0) names the row's first entry instead: token 0 stays outside H
    named = torch.where(head_mask, head_ids, head_ids[:, :1])
    outside = kept.scatter(1, named, float("-inf"))  # [c, V]: log pi_S on S minus H
    has_tail = outside.amax(-1) > float("-inf")  # [c]
    if not bool(has_tail.all()):
        # rows without a tail get a finite dummy row, so logsumexp's backward stays finite (nan * 0 = nan)
        outside = outside.masked_fill(~has_tail[:, None], 0.0)
    tail = outside.logsumexp(-1)
    tail = torch.where(has_tail, tail, torch.full_like(tail, float("-inf")))
    with torch.no_grad():
        entropy = -(kept.exp() * kept).nansum(-1)  # 0 * -inf = nan outside S: dropped
        complement = kept.scatter(1, token_ids[:, None], float("-inf")).logsumexp(-1)
    return lp, head, tail, extra, complement, full, entropy


def _support_mask(support: list[list[int] | None], vocab: int, device: torch.device) -> torch.Tensor | None:
    """[c, V] True on each token's kept support, None when every support is the vocabulary."""
    if all(s is None for s in support):
        return None
    restricted = [i for i, s in enumerate(support) if s is not None]
    keep = torch.ones((len(support), vocab), dtype=torch.bool)
    keep[restricted] = False
    rows = torch.tensor([i for i in restricted for _ in support[i]], dtype=torch.long)
    keep[rows, torch.tensor([t for i in restricted for t in support[i]], dtype=torch.long)] = True
    return keep.to(device)
