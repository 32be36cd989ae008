"""Trainer log-probs of recorded completion tokens, computed in chunks over tokens.

Only sampled completion positions are projected to the vocabulary (a forced one's fields are
constants), `chunk_tokens` at a time, so the largest fp32 tensor is [chunk_tokens, V], never
[tokens, V] for the batch. From one log-softmax
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
Every field but `logprobs` is computed only when asked for (`outputs`; None otherwise): the round's
pi_k pass needs none of them, and each estimator reads its own (`EstimatorConfig.reads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from prodrl_pipeline.engine.processing import bias_matrix
from prodrl_pipeline.quant.qat import base_forward
from prodrl_pipeline.rl.recorded import RecordedCalls


@dataclass
class Sequences:
    """A padded batch of recorded calls, with one entry per completion token."""

    input_ids: torch.Tensor  # [N, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [N, L]
    token_row: torch.Tensor  # [Ntok] which sequence each completion token is in
    token_pos: torch.Tensor  # [Ntok] position whose logits predict it (its index - 1)
    token_ids: torch.Tensor  # [Ntok] the sampled ids
    temperature: torch.Tensor  # [Ntok]
    support: list[Sequence[int] | np.ndarray | None]  # per token: kept ids, None = whole vocabulary
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


def build_sequences(calls: RecordedCalls, pad_id: int) -> Sequences:
    """Pack recorded calls into one padded batch: one tensor per column, filled from each column's
    flat values by masks (no per-call or per-token tensors)."""
    n = len(calls)
    prompt_len, comp_len = calls.prompt.lengths, calls.completion.lengths
    width = int((prompt_len + comp_len).max(initial=0))
    cols = np.arange(width)
    ids = np.full((n, width), pad_id, dtype=np.int64)
    ids[cols < prompt_len[:, None]] = calls.prompt.values
    ids[(cols >= prompt_len[:, None]) & (cols < (prompt_len + comp_len)[:, None])] = calls.completion.values
    mask = (cols < (prompt_len + comp_len)[:, None]).astype(np.int64)
    rows = np.repeat(np.arange(n), comp_len)  # [Ntok]
    pos = np.arange(len(rows)) - calls.completion.offsets[:-1][rows] + prompt_len[rows] - 1
    head_ids, head_mask = calls.head_ids.padded(0)
    head_mu, _ = calls.head_logprobs.padded(float("-inf"))
    extra_ids, extra_mask = calls.extra_ids.padded(0)
    if not extra_mask.all():
        raise ValueError("calls of one batch recorded different numbers of extra samples")
    biases = [calls.bias[r] for r in rows]  # per token: its call's bias (None: no token has one)
    return Sequences(
        torch.from_numpy(ids),
        torch.from_numpy(mask),
        torch.from_numpy(rows),
        torch.from_numpy(pos),
        torch.from_numpy(calls.completion.values),
        torch.from_numpy(calls.temperature[rows]),
        _supports(calls, rows),
        torch.from_numpy(calls.completion_logprobs),
        torch.from_numpy(head_ids),
        torch.from_numpy(head_mask),
        torch.from_numpy(head_mu),
        torch.from_numpy(extra_ids),
        biases if any(b is not None for b in biases) else None,
    )


def _supports(calls: RecordedCalls, rows: np.ndarray) -> list[np.ndarray | None]:
    """Each position's kept ids (records/support.py), None if unrestricted."""
    vocab = calls.vocab_size[rows]
    return [calls.support.kept_ids(t, calls.head_ids, int(vocab[t])) for t in range(len(rows))]


@dataclass
class TokenLogprobs:
    """Per completion token; every field but `logprobs` is None unless asked for."""

    logprobs: torch.Tensor  # [Ntok] log pi_S(a|h), pi renormalized over the recorded support S
    head_logprobs: torch.Tensor | None  # [Ntok, K] log pi_S of mu's recorded head H (padding: anything)
    tail_logprobs: torch.Tensor | None  # [Ntok] log pi_S(S minus H), -inf where S is inside H
    extra_logprobs: torch.Tensor | None  # [Ntok, M] log pi_S of the deployment's extra samples
    complement_logprobs: torch.Tensor | None  # [Ntok] log(1 - pi_S(a)), -inf if forced (no gradient)
    full_logprobs: torch.Tensor | None  # [Ntok] log pi(a|h) over the vocabulary
    entropy: torch.Tensor | None  # [Ntok] entropy of pi_S (no gradient)


EVERY_OUTPUT = frozenset(f.name for f in fields(TokenLogprobs)) - {"logprobs"}
"""The optional fields of TokenLogprobs (each costs at least one more pass over [chunk, V])."""


def token_logprobs(
    model: PreTrainedModel,
    seqs: Sequences,
    chunk_tokens: int = 1024,
    w_hat: dict[str, torch.Tensor] | None = None,
    outputs: frozenset[str] = EVERY_OUTPUT,
) -> TokenLogprobs:
    """Gradient flows when called outside `torch.no_grad()`. `w_hat`: forward through these
    fake-quantized weights (NVFP4 QAT, straight-through gradient). `outputs`: the optional fields
    to compute (the others are None)."""
    hidden = base_forward(model, w_hat, input_ids=seqs.input_ids, attention_mask=seqs.attention_mask)
    h = hidden[seqs.token_row, seqs.token_pos]  # [Ntok, H]
    return project_logprobs(h, model.get_output_embeddings().weight, seqs, chunk_tokens, outputs)


def project_logprobs(
    h: torch.Tensor,
    weight: torch.Tensor,
    seqs: Sequences,
    chunk_tokens: int,
    outputs: frozenset[str] = EVERY_OUTPUT,
) -> TokenLogprobs:
    """From completion hidden states h [Ntok, H] and the output embedding [V, H]. Only the sampled
    positions are projected: a forced token (one-token support S = {a}) has log pi_S(a) = 0 with a
    zero gradient, whatever the weights, so its fields are constants (`_forced`); only its
    `full_logprobs`, a diagnostic, takes a projection without gradient. With gradient, a batch with
    no sampled position projects one forced position, so that the loss stays attached to the graph
    (a backward pass needs one; data parallel ranks run theirs in lockstep). With gradient, each
    chunk is recomputed in the backward pass (activation checkpointing), so the backward pass too
    holds one [chunk_tokens, V] tensor at a time instead of every chunk's log-softmax."""
    if unknown := outputs - EVERY_OUTPUT:
        raise ValueError(f"unknown log-prob outputs {sorted(unknown)}; choose from {sorted(EVERY_OUTPUT)}")
    free = seqs.free
    if bool(free.all()):
        return _projected(h, weight, seqs, None, chunk_tokens, outputs)
    projected = free.clone()
    if torch.is_grad_enabled() and not bool(free.any()):
        projected[0] = True
    rows, forced = projected.nonzero().squeeze(1), (~projected).nonzero().squeeze(1)
    const = _forced(seqs, forced, outputs, h.dtype)
    if "full_logprobs" in outputs:
        with torch.no_grad():
            unrestricted = Sequences(**{**vars(seqs), "support": [None] * len(seqs.support)})
            full = _projected(h, weight, unrestricted, forced, chunk_tokens, frozenset({"full_logprobs"}))
        const = TokenLogprobs(**{**vars(const), "full_logprobs": full.full_logprobs})
    if not len(rows):  # every position forced, no gradient: the constants are all there is
        return const
    got = _projected(h, weight, seqs, rows, chunk_tokens, outputs)
    return TokenLogprobs(
        *(
            None if part is None else _interleaved(len(free), (rows, part), (forced, fill))
            for part, fill in zip(vars(got).values(), vars(const).values(), strict=True)
        )
    )


def _projected(
    h: torch.Tensor,
    weight: torch.Tensor,
    seqs: Sequences,
    rows: torch.Tensor | None,
    chunk_tokens: int,
    outputs: frozenset[str],
) -> TokenLogprobs:
    """The fields of the positions `rows` (None: all, in order), `chunk_tokens` at a time."""
    vocab = weight.shape[0]
    n = h.shape[0] if rows is None else len(rows)
    outs = []
    for start in range(0, n, chunk_tokens):
        at = (
            slice(start, min(start + chunk_tokens, n)) if rows is None else rows[start : start + chunk_tokens]
        )
        picked = at if rows is None else at.tolist()
        support = _entries(seqs.support, picked)
        bias = None if seqs.bias is None else _entries(seqs.bias, picked)
        args = (
            h[at],
            weight,
            seqs.temperature[at],
            seqs.token_ids[at],
            seqs.head_ids[at],
            seqs.head_mask[at],
            seqs.extra_ids[at],
            _outside_support(support, vocab, h.device),
            _on(bias_matrix(bias, vocab) if bias is not None else None, h.device),
            outputs,
        )
        if torch.is_grad_enabled():
            outs.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            outs.append(_chunk_logprobs(*args))
    return TokenLogprobs(
        *(None if parts[0] is None else torch.cat(parts) for parts in zip(*outs, strict=True))
    )


def _entries(values: list, at: slice | list[int]) -> list:
    """A per-token list's entries at a slice or at listed positions."""
    return values[at] if isinstance(at, slice) else [values[i] for i in at]


def _forced(
    seqs: Sequences, rows: torch.Tensor, outputs: frozenset[str], dtype: torch.dtype
) -> TokenLogprobs:
    """The fields at forced positions `rows`, S = {a}: log pi_S is 0 at a and -inf elsewhere, so
    the head and the extra samples (the token itself) are 0, nothing lies outside the head or
    outside a, and the entropy is 0. `full_logprobs` is not a constant: None here."""
    token = seqs.token_ids[rows]

    def at_token(ids: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros(ids.shape, dtype=dtype, device=ids.device)
        return zero.masked_fill_(ids != token[:, None], float("-inf"))

    zeros = torch.zeros(len(rows), dtype=dtype, device=token.device)
    none = torch.full_like(zeros, float("-inf"))
    return TokenLogprobs(
        zeros,
        at_token(seqs.head_ids[rows]) if "head_logprobs" in outputs else None,
        none if "tail_logprobs" in outputs else None,
        at_token(seqs.extra_ids[rows]) if "extra_logprobs" in outputs else None,
        none if "complement_logprobs" in outputs else None,
        None,
        zeros if "entropy" in outputs else None,
    )


def _interleaved(n: int, *parts: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One [n, ...] tensor from (rows, values) pairs that cover 0..n-1 once (differentiable)."""
    first = parts[0][1]
    out = first.new_zeros((n, *first.shape[1:]))
    for rows, values in parts:
        out = out.index_put((rows,), values.to(out.dtype))
    return out


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return t.to(device) if t is not None else None


def _chunk_logprobs(
    h: torch.Tensor,  # [c, H]
    weight: torch.Tensor,  # [V, H]
    temperature: torch.Tensor,  # [c]
    token_ids: torch.Tensor,  # [c]
    head_ids: torch.Tensor,  # [c, K]
    head_mask: torch.Tensor,  # [c, K]
    extra_ids: torch.Tensor,  # [c, M]
    drop: torch.Tensor | None,  # [c, V] True outside the kept support, None = whole vocabulary
    bias: torch.Tensor | None,  # [c, V] logit bias, None = none
    outputs: frozenset[str],  # the optional fields wanted
) -> tuple[torch.Tensor | None, ...]:
    """The fields of TokenLogprobs, in order, for one chunk (None where not in `outputs`)."""
    logits = h @ weight.T
    if bias is not None:
        logits = logits + bias
    if not bool((temperature == 1).all()):  # dividing by 1 changes no bit: skip the pass
        logits = logits / temperature[:, None]
    full = None
    if "full_logprobs" in outputs and drop is not None:
        with torch.no_grad():
            full = logits.gather(1, token_ids[:, None]).squeeze(1) - logits.logsumexp(-1)  # [c]
    if drop is not None:  # in place: the product's backward does not read it
        logits = logits.masked_fill_(drop, float("-inf"))
    # log pi_S: one log-softmax over the support (pi renormalized over S is the softmax of S's logits)
    kept = logits.log_softmax(-1)
    # one gather for the token, the head and the extra samples: one [c, V] scatter in the backward
    k = head_ids.shape[1] if "head_logprobs" in outputs else 0
    m = extra_ids.shape[1] if "extra_logprobs" in outputs else 0
    picked = kept.gather(1, torch.cat([token_ids[:, None], head_ids[:, :k], extra_ids[:, :m]], 1))
    lp = picked[:, 0]
    head = picked[:, 1 : 1 + k] if "head_logprobs" in outputs else None
    extra = picked[:, 1 + k :] if "extra_logprobs" in outputs else None
    if "full_logprobs" in outputs and drop is None:
        full = lp
    tail = entropy = complement = None
    if "tail_logprobs" in outputs:
        tail = _tail(kept, head_ids, head_mask)
    with torch.no_grad():
        if "entropy" in outputs:
            entropy = -kept.exp().mul_(kept).nansum(-1)  # 0 * -inf = nan outside S: dropped
        if "complement_logprobs" in outputs:
            complement = kept.scatter(1, token_ids[:, None], float("-inf")).logsumexp(-1)
    return lp, head, tail, extra, complement, full, entropy


def _tail(kept: torch.Tensor, head_ids: torch.Tensor, head_mask: torch.Tensor) -> torch.Tensor:
    """log pi_S(S minus H) [c] from log pi_S [c, V]: -inf where S fits in the head H."""
    # a padded head entry (id 0) names the row's first entry instead: token 0 stays outside H
    named = torch.where(head_mask, head_ids, head_ids[:, :1])
    outside = kept.scatter(1, named, float("-inf"))  # [c, V]: log pi_S on S minus H
    has_tail = outside.amax(-1) > float("-inf")  # [c]
    if not bool(has_tail.all()):
        # rows without a tail get a finite dummy row, so logsumexp's backward stays finite (nan * 0 = nan)
        outside = outside.masked_fill_(~has_tail[:, None], 0.0)
    tail = outside.logsumexp(-1)
    return torch.where(has_tail, tail, torch.full_like(tail, float("-inf")))


def _outside_support(
    support: list[Sequence[int] | np.ndarray | None], vocab: int, device: torch.device
) -> torch.Tensor | None:
    """[c, V] True outside each token's kept support, None when every support is the vocabulary."""
    if all(s is None for s in support):
        return None
    restricted = [i for i, s in enumerate(support) if s is not None]
    drop = torch.zeros((len(support), vocab), dtype=torch.bool)
    drop[restricted] = True
    rows = np.repeat(restricted, [len(support[i]) for i in restricted])
    ids = np.concatenate([np.asarray(support[i], dtype=np.int64) for i in restricted])
    drop[torch.from_numpy(rows), torch.from_numpy(ids)] = False
    return drop.to(device)
