"""W4A4 NVFP4 serving, emulated on CPU: the activations entering each quantized linear are NVFP4 too.

Blackwell's NVFP4 GEMMs (vLLM's `modelopt_fp4` W4A4 path, TensorRT-LLM) quantize a linear's input
x [..., K] before multiplying it with the FP4 weights, with the export's calibrated `input_scale`
s_x = amax_x / (6 * 448) as its static per-tensor FP32 scale (ModelOpt's max calibration):
  per block of 16 consecutive elements along K:  sb = e4m3(clamp(max|x_block| / (6 s_x), 2^-9, 448))
  q = round_e2m1(x / (sb s_x))   (nearest of {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to even, saturating)
  x_hat = q * sb * s_x
  y = x_hat @ W_hat^T (+ b)   in fp32, W_hat the dequantized NVFP4 weights (`nvfp4.py`).
The kernel multiplies the FP4 codes exactly and accumulates in fp32, so this is its result up to
summation order. Inputs beyond the calibrated amax saturate (sb at 448, q at ±6), as in the kernel;
an all-zero block gets sb = 1 (the kernel writes 0: x_hat is 0 both ways).
The arithmetic is ModelOpt's `NVFP4QTensor.quantize` then `.dequantize` with the global scale given
(the path the weights take), written out in a few tensor ops: its packing, unpacking and table
search made serving 2-3x slower. tests/quant/test_w4a4.py checks both bit for bit.
"""

from __future__ import annotations

import torch

from prodrl_pipeline.quant.modelopt_lib import BLOCK

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN = 2.0**-9  # the smallest subnormal: block scales are clamped to [E4M3_MIN, E4M3_MAX] before the cast


def quantize_activations(
    x: torch.Tensor, input_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 of `x` [..., K] with the per-tensor scale s_x = `input_scale`: q, the signed E2M1 values
    (fp32 [..., K]; the code's sign bit is q's, so a negative x that rounds to 0 gives -0.0), the block
    scales sb (float8_e4m3fn [..., K/16]) and x_hat = q * (sb * s_x) (fp32)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)  # [..., K/16, 16]
    raw = blocks.abs().amax(-1) / (E2M1_MAX * input_scale)
    sb = torch.where(raw == 0, 1.0, raw).clamp(E4M3_MIN, E4M3_MAX).to(torch.float8_e4m3fn)
    scale = (sb.float() * input_scale).unsqueeze(-1)  # [..., K/16, 1]
    y = blocks / scale
    magnitude = y.abs().clamp(max=E2M1_MAX)
    # the E2M1 grid steps by 0.5 below 2, by 1 below 4 and by 2 up to 6; round() takes a tie to the
    # even multiple of the step, which is the even code
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    rounded = torch.round(magnitude / step) * step
    q = torch.where(y < 0, -rounded, rounded)  # the sign bit of x < 0 (a -0.0 input is +0, as ModelOpt)
    return q.reshape(x.shape), sb, (q * scale).reshape(x.shape)


class W4A4Linear(torch.nn.Linear):
    """A linear layer served as a Blackwell NVFP4 GEMM: its weight is already W_hat, its input is
    quantized to NVFP4 with the calibrated `input_scale` on every call. Its state dict is the
    linear's (the scale is a non-persistent buffer)."""

    def __init__(self, linear: torch.nn.Linear, input_scale: torch.Tensor):
        if linear.in_features % BLOCK:
            raise ValueError(f"input dim {linear.in_features} is not a multiple of {BLOCK}")
        if not float(input_scale) > 0:  # NaN too
            raise ValueError(f"input_scale must be > 0, got {float(input_scale)}")
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("input_scale", input_scale.reshape(()).float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(quantize_activations(x, self.input_scale)[2])


def serve_w4a4(model: torch.nn.Module, input_scales: dict[str, torch.Tensor]) -> None:
    """Replace, in place, each linear of `input_scales` (keyed `{linear}.input_scale`, as the export
    stores them) by its `W4A4Linear`. q/k/v (and gate/up) read the same input, so their calibrated
    scales are equal; vLLM's fused layer takes their max, which is each of them."""
    for key, scale in input_scales.items():
        parent, _, child = key.removesuffix(".input_scale").rpartition(".")
        module = model.get_submodule(parent)
        setattr(module, child, W4A4Linear(getattr(module, child), scale))
