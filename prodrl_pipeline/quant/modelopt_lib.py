"""ModelOpt, imported on first use, and the NVFP4 block size its quantizers are called with."""

from __future__ import annotations

import warnings
from functools import cache
from types import SimpleNamespace

BLOCK = 16
"""NVFP4 block: 16 consecutive elements along the reduction (input, last) dimension."""


@cache
def modelopt() -> SimpleNamespace:
    """ModelOpt's quantization API, HF export and NVFP4 tensor, imported on first use: its import is
    slow and warns, and only the export, QAT and NVFP4 deployment loads need it (a trainer without
    QAT on a GPU machine does not)."""
    with warnings.catch_warnings():  # modelopt warns on every transformers it was not released with
        warnings.filterwarnings(
            "ignore", message="transformers .* is not tested with current version of modelopt"
        )
        import modelopt.torch.quantization as mtq  # noqa: PLC0415
        from modelopt.torch.export import export_hf_checkpoint  # noqa: PLC0415
        from modelopt.torch.quantization.qtensor import NVFP4QTensor  # noqa: PLC0415
    return SimpleNamespace(mtq=mtq, export_hf_checkpoint=export_hf_checkpoint, NVFP4QTensor=NVFP4QTensor)
