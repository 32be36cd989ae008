"""Trainer log-probs of recorded completion tokens, computed in chunks over tokens.

Only completion positions are projected to the vocabulary, `chunk_tokens` at a time, so the
largest fp32 tensor is [chunk_tokens, V], never [tokens, V] for the batch. Each token is scored
under the support the engine sampled from (its structured-output mask or top-k/top-p set) at the
recorded temperature: pi(a|h) = softmax(z/T) renormalized over that support. A forced token
(one-token support) therefore gets log-prob exactly 0 and no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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


def build_sequences(calls: list[dict], pad_id: int) -> Sequences:
    """Pack recorded calls (rows of the `calls` table) into one padded batch."""
    width = max(len(c["prompt_token_ids"]) + len(c["completion_token_ids"]) for c in calls)
    ids = torch.full((len(calls), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(calls), width), dtype=torch.long)
    rows, pos, toks, temps, support = [], [], [], [], []
    for n, c in enumerate(calls):
        prompt, completion = c["prompt_token_ids"], c["completion_token_ids"]
        seq = list(prompt) + list(completion)
        ids[n, : len(seq)] = torch.tensor(seq)
        mask[n, : len(seq)] = 1
        for t, tok in enumerate(completion):
            rows.append(n)
            pos.append(len(prompt) + t - 1)
            toks.append(tok)
            temps.append(c["sampling"]["temperature"])
            support.append(token_support(c, t))
    return Sequences(
        ids,
        mask,
        torch.tensor(rows),
        torch.tensor(pos),
        torch.tensor(toks),
        torch.tensor(temps, dtype=torch.float32),
        support,
    )


def token_support(call: dict, t: int) -> list[int] | None:
    """The kept support of position t of a recorded call (DESIGN.md §3), None if unrestricted."""
    size = call["support_size"][t]
    if size >= call["vocab_size"]:
        return None
    head = call["topk_token_ids"][t]
    return list(head) if size <= len(head) else list(call["support_token_ids"][t])


def token_logprobs(
    model: PreTrainedModel, seqs: Sequences, chunk_tokens: int = 1024, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(a|h) of every completion token ([Ntok]), and optionally the entropy of pi over the
    support ([Ntok]). Gradient flows when called outside `torch.no_grad()`."""
    hidden = model.base_model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).last_hidden_state
    h = hidden[seqs.token_row, seqs.token_pos]  # [Ntok, H]
    weight = model.get_output_embeddings().weight  # [V, H]
    vocab = weight.shape[0]
    logps, ents = [], []
    for start in range(0, h.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, h.shape[0])
        logits = (h[start:end] @ weight.T) / seqs.temperature[start:end, None]  # [c, V]
        keep = _support_mask(seqs.support[start:end], vocab)
        if keep is not None:
            logits = logits.masked_fill(~keep, float("-inf"))
        logp = logits.log_softmax(-1)  # [c, V]
        logps.append(logp.gather(1, seqs.token_ids[start:end, None]).squeeze(1))
        if with_entropy:
            p = logp.exp()
            ents.append(-(p * logp.masked_fill(p == 0, 0.0)).sum(-1))
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def _support_mask(support: list[list[int] | None], vocab: int) -> torch.Tensor | None:  # [c, V]
    if all(s is None for s in support):
        return None
    keep = torch.ones((len(support), vocab), dtype=torch.bool)
    for i, s in enumerate(support):
        if s is not None:
            keep[i] = False
            keep[i, s] = True
    return keep
