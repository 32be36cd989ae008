"""The recorded head of a decode step: what `Rows.record_sampled` reads from the step's log-probs.

For log-probs `logp` [N, V] of mu and the sampled ids [N]: each row's K largest log-probs, sorted
descending, with their ids (the head of the data contract; entries past a row's kept support are
-inf and are cut by the caller), each sampled id's log-prob, and whether any entry is -inf (then the
kept supports must be counted). Values are exactly `torch.topk`'s and `gather`'s; of tied entries
the compiled kernel keeps the lower ids first, `torch.topk` in an order of its own. Returned as numpy
arrays on the CPU: the recording keeps row views of them (engine/rows.py), and every torch call on
a decode step's path costs microseconds more inside a run than alone (docs/performance.md).

On CPU the compiled kernel (`_head.c`, built at install: pyproject.toml) computes all of it in one
pass over each row; `torch.topk` over V = 5,025 took more than half of recording's time in the
engine (docs/performance.md). Elsewhere (a GPU, another dtype, a head of K > V / 64, no kernel
built) torch's operations do it.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
import torch

from prodrl_pipeline import native


class Head(NamedTuple):
    values: np.ndarray  # [N, K] the log-probs' dtype (float32 from the kernel), descending
    ids: np.ndarray  # [N, K] int64
    sampled_logp: np.ndarray  # [N]
    restricted: bool  # some row holds a -inf entry (a row holding a NaN, never recorded, aside)


ABI = 1
"""The kernel's calling convention (`prodrl_head_abi` in `_head.c`)."""


def _load_kernel(path: str | None) -> ctypes.CDLL | None:
    """The kernel built at `path` (the extension module's file for this interpreter), or None,
    logged, if there is none or it does not load as a kernel of this calling convention."""
    head = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 4
    return native.load(
        path,
        "prodrl_head_abi",
        ABI,
        {"prodrl_recorded_head": (ctypes.c_int64, head)},
        "the head uses torch.topk",
    )


_KERNEL = _load_kernel(native.built("prodrl_pipeline.engine._head"))

VOCAB_PER_K = 64
"""The kernel serves heads of K <= V / 64 (the lab's 20 of 5,025): a larger K leaves few blocks
above its bound, its insertions grow as V·K and `torch.topk` is faster ([64, 5,025] changing every
call: K = 20 0.10 against 0.48 ms, K = 78 0.50 against 0.96, K = 158 3.1 against 1.6)."""


def recorded_head(logp: torch.Tensor, k: int, sampled: torch.Tensor) -> Head:
    """The head of K entries of each row of `logp` [N, V], the log-probs of `sampled` [N] (ids in
    [0, V): IndexError, or torch's error, otherwise) and whether any entry is -inf."""
    n, v = logp.shape
    if k < 1:
        raise ValueError(f"the head needs K >= 1 entries, got {k}")
    sampled = sampled.contiguous()
    if _KERNEL is not None and _compiled_layout(logp, sampled) and k * VOCAB_PER_K <= v <= 2**31 - 1:
        # torch allocates and hands over the pointers (numpy's `.ctypes` is slower in a run)
        values = torch.empty((n, k), dtype=torch.float32)
        ids = torch.empty((n, k), dtype=torch.int64)
        sampled_logp = torch.empty(n, dtype=torch.float32)
        removed = _KERNEL.prodrl_recorded_head(
            logp.data_ptr(),
            n,
            v,
            k,
            sampled.data_ptr(),
            values.data_ptr(),
            ids.data_ptr(),
            sampled_logp.data_ptr(),
        )
        if removed == -2:
            raise IndexError(f"a sampled id is outside the vocabulary of {v}")
        if removed >= 0:
            return Head(values.numpy(), ids.numpy(), sampled_logp.numpy(), removed > 0)
    values, ids = logp.topk(min(k, v), dim=-1)
    sampled_logp = logp.gather(1, sampled[:, None]).squeeze(1)
    restricted = not bool(logp.amin() > float("-inf"))
    return Head(_numpy(values), _numpy(ids), _numpy(sampled_logp), restricted)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """`t` on the CPU as numpy holds it (bfloat16, which numpy lacks, widened exactly to float32)."""
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _compiled_layout(logp: torch.Tensor, sampled: torch.Tensor) -> bool:
    """Whether the kernel reads these tensors as they are: on CPU, float32 in C order, int64 ids."""
    return (  # the cheapest checks torch has (a decode step makes them)
        logp.is_cpu
        and sampled.is_cpu
        and logp.dtype is torch.float32
        and logp.is_contiguous()
        and sampled.dtype is torch.int64
        and sampled.shape == logp.shape[:1]
    )
