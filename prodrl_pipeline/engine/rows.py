"""The embedded engine's rows: what a request asks (`Request`), what is recorded for it
(`Completion`, the data contract's per-position fields, docs/tables.md) and each row's decoding state
while its batch runs (`Rows`): the constraint's state, the recording, when the row is done.

`Rows.record_sampled` records a sampled position: the id, its log-prob under the processed
distribution mu, the top-K head of mu, the kept support (records/support.py: its size and, when
the head does not hold it and it is not the vocabulary, its ids, its complement's or a bitmask,
whichever is smallest; GRAMMAR, nothing listed, where it is the whole mask of a constraint recorded
once per call) and the M extra samples. A forced token is recorded as what it is: log-prob
0 under a one-token support.

A position's head, support and extra samples are 1-D numpy arrays (ids int64, log-probs as mu's
dtype, float32 on the lab engine): a step's [N, K] head becomes N row views in one call, where
Python lists would cost an object an entry (2,560 a step for the lab's batch) and the collector's
passes over them; Arrow takes the arrays as they are (records/schema.py), a JSON answer turns the
few it shows into lists. Positions that record the same thing share one read-only array: `NO_IDS`,
and a forced id's head.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from prodrl_pipeline.engine.constraints import Constraint
from prodrl_pipeline.engine.head import recorded_head
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.records import support
from prodrl_pipeline.records.support import Support


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    """`params.seed` set: this request samples from its own generator (batch-independent)."""
    constraint: Constraint | None = None
    on_token: Callable[[list[int]], bool] | None = None
    """Called on the engine thread with the completion's ids after each token (streaming, stop
    strings, a client that left); True ends the completion (finish_reason "stop")."""
    stop_ids: frozenset[int] = frozenset()
    """Tokens that end the completion besides the engine's eos, kept as its last id (finish_reason
    "stop"): harmony's <|call|> for gpt-oss (vLLM's stop_token_ids)."""


NO_IDS = support.NO_IDS
"""The ids of a position that records none (no extra samples): one shared array."""


def ids_array(ids: list[int]) -> np.ndarray:
    """A position's ids as the engine records them (int64)."""
    return np.array(ids, dtype=np.int64) if ids else NO_IDS


@dataclass
class Completion:
    """What the engine recorded for a request: per position, the sampled id and its log-prob (lists:
    streaming and constraints read them as they grow), the head and extra samples (1-D numpy
    arrays, the module docstring) and the kept support's record."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[np.ndarray] = field(default_factory=list)
    topk_logprobs: list[np.ndarray] = field(default_factory=list)
    supports: list[Support] = field(default_factory=list)
    extra_ids: list[np.ndarray] = field(default_factory=list)
    finish_reason: str = "length"
    grammar: dict | None = None
    """The constraint recorded once for the call (`Constraint.recorded`), None without one."""


def check_recording(top_logprobs: int, extra_samples: int) -> None:
    """ValueError unless the recorded head has K >= 1 entries and extra samples are >= 0."""
    if not top_logprobs >= 1:
        raise ValueError(f"top_logprobs must be >= 1, got {top_logprobs}")
    if not extra_samples >= 0:
        raise ValueError(f"extra_samples must be >= 0, got {extra_samples}")


class Rows:
    """Per-request decoding state of a running batch, one row a request: constraint states, the
    completions recorded so far, done flags and errors."""

    def __init__(
        self,
        requests: list[Request],
        vocab_size: int,
        eos_id: int,
        pad_id: int,
        top_logprobs: int,
        extra_samples: int,
    ):
        self.requests, self.vocab_size = list(requests), vocab_size
        self.eos_id, self.pad_id, self.top_logprobs = eos_id, pad_id, top_logprobs
        self.extra_samples = extra_samples
        self.states = [r.constraint.start() if r.constraint else None for r in requests]
        self.out = [Completion(grammar=r.constraint.recorded if r.constraint else None) for r in requests]
        self.mask_sizes: np.ndarray | None = None  # [N] ids each row's constraint allowed this step
        self.done = [False] * len(requests)
        self.errors: list[Exception | None] = [None] * len(requests)

    def config(self) -> tuple[int, int, int, int, int]:
        return self.vocab_size, self.eos_id, self.pad_id, self.top_logprobs, self.extra_samples

    def extend(self, other: Rows) -> None:
        self.requests += other.requests
        self.states += other.states
        self.out += other.out
        self.done += other.done
        self.errors += other.errors

    def select(self, rows: list[int]) -> None:
        self.requests = [self.requests[i] for i in rows]
        self.states = [self.states[i] for i in rows]
        self.out = [self.out[i] for i in rows]
        self.done = [self.done[i] for i in rows]
        self.errors = [self.errors[i] for i in rows]

    def allowed_mask(self) -> torch.Tensor | None:  # [N, V] bool
        self.mask_sizes = None
        if all(s is None for s in self.states):
            return None
        allowed = torch.ones((len(self.states), self.vocab_size), dtype=torch.bool)
        for i, s in enumerate(self.states):
            if s is not None and not self.done[i]:
                allowed[i] = False
                try:
                    s.allow(allowed[i])
                except Exception as e:  # noqa: BLE001 - a constraint that fails ends its own row
                    self.fail(i, e)
        if any(c.grammar is not None for c in self.out):
            self.mask_sizes = allowed.sum(-1).numpy()
        return allowed

    def record_sampled(self, logp: torch.Tensor, sampled: torch.Tensor, extra: torch.Tensor) -> list[int]:
        """Append each live row's sampled token with its record; the sampled ids as a list. The
        batch's tensors become lists and row views in a few calls (not a few per row): a busy
        gateway's engine thread re-takes the GIL after every torch call."""
        k = min(self.top_logprobs, self.vocab_size)
        head = recorded_head(logp, k, sampled)
        toks, lps = sampled.tolist(), head.sampled_logp.tolist()
        heads, head_lps = list(head.ids), list(head.values)
        extras = list(extra.cpu().numpy()) if self.extra_samples else [NO_IDS] * len(toks)
        if not head.restricted:  # nothing removed anywhere: every support is the vocabulary
            whole = support.unrestricted(self.vocab_size)
            for i, tok in enumerate(toks):
                if not self.done[i]:
                    self.append(i, tok, lps[i], heads[i], head_lps[i], whole, extras[i])
            return toks
        # the kept supports (a broken row's NaNs are never recorded)
        kept = (logp > float("-inf")).cpu().numpy()
        live = [i for i in range(len(toks)) if not self.done[i]]
        sizes = np.count_nonzero(kept[live], axis=1).tolist()
        n_heads = np.minimum(k, sizes).tolist()  # the head's -inf entries cut
        masked = self._whole_masks(live, sizes, n_heads)
        listed = [j for j, m in enumerate(masked) if not m]
        encoded = iter(support.encode_rows(kept[[live[j] for j in listed]], [n_heads[j] for j in listed]))
        for j, i in enumerate(live):
            kept_i = Support(sizes[j], support.Form.GRAMMAR) if masked[j] else next(encoded)
            self.append(
                i, toks[i], lps[i], heads[i][: n_heads[j]], head_lps[i][: n_heads[j]], kept_i, extras[i]
            )
        return toks

    def _whole_masks(self, live: list[int], sizes: list[int], n_heads: list[int]) -> list[bool]:
        """Per live row: its kept support is the whole mask its call's recorded constraint allowed
        this step (a kept support lies inside that mask: equal sizes are equal sets), larger than
        the head and smaller than the vocabulary, so a reader recomputes it (GRAMMAR)."""
        if self.mask_sizes is None:
            return [False] * len(live)
        return [
            self.out[i].grammar is not None and n_heads[j] < sizes[j] == self.mask_sizes[i] < self.vocab_size
            for j, i in enumerate(live)
        ]

    def force_common(self) -> list[list[int]]:
        """Append to every unfinished row the same number m of forced tokens (m = the shortest
        forced chain among them, so the next forward pass stays rectangular)."""
        chains: dict[int, list[int]] = {}
        for i, s in enumerate(self.states):
            if self.done[i] or s is None:
                chains[i] = []
                continue
            room = self.requests[i].params.max_tokens - len(self.out[i].token_ids)
            try:
                chains[i] = s.forced()[:room]
            except Exception as e:  # noqa: BLE001 - a constraint that fails ends its own row
                self.fail(i, e)
        m = min((len(c) for i, c in chains.items() if not self.done[i]), default=0)
        out = []
        for i in range(len(self.states)):
            chain = []
            for tok in chains.get(i, [])[:m]:
                if self.done[i]:  # ended (its on_token callback) inside the chain
                    break
                self.append(i, tok, 0.0, *_forced_record(tok, self.extra_samples))
                chain.append(tok)
            out.append(chain + [self.pad_id] * (m - len(chain)))
        return out

    def append(
        self,
        i: int,
        tok: int,
        logprob: float,
        head_ids: np.ndarray,
        head_lp: np.ndarray,
        kept: Support,
        extra_ids: np.ndarray,
    ) -> None:
        c = self.out[i]
        c.token_ids.append(tok)
        c.logprobs.append(logprob)
        c.topk_ids.append(head_ids)
        c.topk_logprobs.append(head_lp)
        c.supports.append(kept)
        c.extra_ids.append(extra_ids)
        state = self.states[i]
        if state is not None:
            try:
                state.advance(tok)
            except Exception as e:  # noqa: BLE001
                self.fail(i, e)
                return
        if (
            tok == self.eos_id
            or tok in self.requests[i].stop_ids
            or (state is not None and state.finished)
            or self._on_token(i)
        ):
            self.done[i], c.finish_reason = True, "stop"
        elif len(c.token_ids) >= self.requests[i].params.max_tokens:
            self.done[i] = True

    def fail(self, i: int, error: Exception) -> None:
        """End row i with `error` (reported to its request alone)."""
        self.done[i], self.errors[i] = True, error

    def _on_token(self, i: int) -> bool:
        """The row's callback; one that raises ends only its own row (the error is kept)."""
        on_token = self.requests[i].on_token
        if on_token is None:
            return False
        try:
            return bool(on_token(self.out[i].token_ids))
        except Exception as e:  # noqa: BLE001 - reported to that request alone
            self.errors[i] = e
            return True


def _forced_record(tok: int, extra_samples: int) -> tuple[np.ndarray, np.ndarray, Support, np.ndarray]:
    """A forced token's head, head log-prob, support and extra samples: itself alone."""
    extra = _alone(tok) if extra_samples == 1 else ids_array([tok] * extra_samples)
    return _alone(tok), _CERTAIN, _ONE, extra


@functools.cache  # one array an id the constraints force (most of a tool call's tokens)
def _alone(tok: int) -> np.ndarray:
    ids = ids_array([tok])
    ids.flags.writeable = False
    return ids


_ONE = Support(1, support.Form.HEAD)
"""A forced token's support: the one-id head."""
_CERTAIN = np.zeros(1, dtype=np.float32)
_CERTAIN.flags.writeable = False
"""A forced token's head log-prob: 0."""
