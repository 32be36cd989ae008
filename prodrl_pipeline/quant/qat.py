"""NVFP4 quantization-aware training: the trainer's forward sees the weights the deployment serves.

Each block linear's weight W is replaced in the forward pass by W_hat = dequantize(quantize(W)),
computed by the export's own quantizer (`nvfp4.round_trip`), with a straight-through gradient:
d loss / d W := d loss / d W_hat. So the trainer's pi is the served policy up to kernel
differences (the engine mismatch from quantization vanishes), while Adam keeps updating the
full-precision master weights. Embeddings, norms and lm_head are not quantized (as in the export).
"""

from __future__ import annotations

import torch
from torch.func import functional_call
from transformers import PreTrainedModel

from prodrl_pipeline.quant.nvfp4 import QUANTIZED, round_trip


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
        return w_hat.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def served_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """W_hat of the model's quantized weights (no gradient), keyed by parameter name. Compute it
    once per optimizer step: the weights do not change between microbatches."""
    return round_trip({n: p for n, p in model.named_parameters() if QUANTIZED.match(n)})


def base_forward(
    model: PreTrainedModel, w_hat: dict[str, torch.Tensor] | None, **inputs: torch.Tensor
) -> torch.Tensor:
    """Last hidden states of the model's trunk; with `w_hat`, through the fake-quantized weights
    (straight-through to the master weights when gradients are enabled)."""
    trunk = model.base_model
    if w_hat is None:
        return trunk(**inputs).last_hidden_state
    prefix = f"{model.base_model_prefix}."
    params = dict(model.named_parameters())
    overrides = {
        name.removeprefix(prefix): _StraightThrough.apply(params[name], w) if torch.is_grad_enabled() else w
        for name, w in w_hat.items()
    }
    return functional_call(trunk, overrides, args=(), kwargs=inputs).last_hidden_state
