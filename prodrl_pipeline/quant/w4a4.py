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
an all-zero block gets sb = 1 (Blackwell's kernel writes 0: x_hat is 0 both ways).
The arithmetic is ModelOpt's `NVFP4QTensor.quantize` then `.dequantize` with the global scale given
(the path the weights take), written out in a few tensor ops (`quantize_activations`: its packing,
unpacking and table search made serving 2-3x slower), and served from a compiled kernel of the same
arithmetic (`dequantized`: the tensor ops made serving 2.2x W4A16's time, the kernel 1.24x).
tests/quant/test_w4a4.py checks all three bit for bit.
"""

from __future__ import annotations

import ctypes

import torch

from prodrl_pipeline import native
from prodrl_pipeline.quant.modelopt_lib import BLOCK

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN = 2.0**-9  # the smallest subnormal: block scales are clamped to [E4M3_MIN, E4M3_MAX] before the cast


def _signed_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """The signed E2M1 values in ascending order (-0.0 for the negatives that round to 0) and the
    boundaries between them for `torch.bucketize(y, bounds, right=True)` (bucket i holds
    bounds[i-1] <= y < bounds[i]). Each boundary is a midpoint; where the midpoint's tie goes to
    the lower bucket (the even code lies below it) the boundary moves up by one ulp. Below -6 and
    above 6 the first and last buckets saturate; 0.0 and -0.0 fall in +0's bucket."""
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    grid = [-m for m in reversed(magnitudes)] + magnitudes  # -6 ... -0.0, 0.0 ... 6
    bounds = []
    for i in range(len(grid) - 1):
        low, high = grid[i], grid[i + 1]
        mid = torch.tensor((low + high) / 2, dtype=torch.float32)
        # the even code is the one of even index in `magnitudes`: |value| at an even position
        tie_goes_down = magnitudes.index(abs(low)) % 2 == 0 if mid != 0 else False
        bounds.append(torch.nextafter(mid, torch.tensor(float("inf"))) if tie_goes_down else mid)
    return torch.tensor(grid, dtype=torch.float32), torch.stack(bounds)


GRID, BOUNDS = _signed_grid()


def quantize_activations(
    x: torch.Tensor, input_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 of `x` [..., K] with the per-tensor scale s_x = `input_scale`: q, the signed E2M1 values
    (fp32 [..., K]; the code's sign bit is q's, so a negative x that rounds to 0 gives -0.0), the block
    scales sb (float8_e4m3fn [..., K/16]) and x_hat = q * (sb * s_x) (fp32). The rounding is one
    search of the signed grid (`_signed_grid`); q of a block holding a NaN is not NaN, its x_hat is."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)  # [..., K/16, 16]
    raw = blocks.abs().amax(-1) / (E2M1_MAX * input_scale)
    sb = torch.where(raw == 0, 1.0, raw).clamp(E4M3_MIN, E4M3_MAX).to(torch.float8_e4m3fn)
    scale = (sb.float() * input_scale).unsqueeze(-1)  # [..., K/16, 1]
    q = GRID.to(x.device)[torch.bucketize(blocks / scale, BOUNDS.to(x.device), right=True)]
    return q.reshape(x.shape), sb, (q * scale).reshape(x.shape)


ABI = 1
"""The kernel's calling convention (`prodrl_nvfp4_abi` in `_nvfp4.c`)."""
_KERNEL = native.load(
    native.built("prodrl_pipeline.quant._nvfp4"),
    "prodrl_nvfp4_abi",
    ABI,
    {"prodrl_nvfp4_dequantized": (None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p])},
    "W4A4 quantizes activations with torch",
)


def dequantized(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x_hat of `quantize_activations(x, input_scale)` (the scale taken as fp32), bit for bit:
    from the compiled kernel (`_nvfp4.c`, one pass per block: 16-19x torch's speed on a decode
    step's input or a prefill's) when it reads `x` as it is (float32 on the CPU in C order, whole
    blocks, no gradient wanted), else torch's expression."""
    input_scale = input_scale.float()
    if (
        _KERNEL is not None
        and type(x) is torch.Tensor  # not a subclass or a fake tensor: the kernel reads its memory
        and x.is_cpu
        and x.dtype is torch.float32
        and x.is_contiguous()
        and x.shape[-1] % BLOCK == 0
        and not (x.requires_grad and torch.is_grad_enabled())
    ):
        out = torch.empty_like(x)
        _KERNEL.prodrl_nvfp4_dequantized(x.data_ptr(), x.numel() // BLOCK, float(input_scale), out.data_ptr())
        return out
    return quantize_activations(x, input_scale)[2]


class SharedInput:
    """One quantization of the input of `siblings` fused linears (q/k/v, gate/up). vLLM serves
    them as one GEMM on one quantized input; here they are linears called back to back on the same
    tensor with equal scales. The first call quantizes it; the next ones, given that very tensor,
    reuse it, and the last releases both. A tensor changed in place between the siblings' calls
    would be served stale (the HF decoder layers pass each a fresh norm output, and nothing writes
    it); one engine thread serves a model."""

    def __init__(self, siblings: int) -> None:
        self.siblings = siblings
        self._x: torch.Tensor | None = None
        self._x_hat: torch.Tensor | None = None
        self._left = 0

    def quantized(self, x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
        if x is not self._x:
            self._x, self._x_hat, self._left = x, dequantized(x, input_scale), self.siblings
        x_hat = self._x_hat
        self._left -= 1
        if self._left == 0:
            self._x = self._x_hat = None
        return x_hat


class W4A4Linear(torch.nn.Linear):
    """A linear layer served as a Blackwell NVFP4 GEMM: its weight is already W_hat, its input is
    quantized to NVFP4 with the calibrated `input_scale` on every call (through `shared`, once for
    its fused siblings, if it has any). Its state dict is the linear's (the scale is a non-persistent
    buffer)."""

    def __init__(self, linear: torch.nn.Linear, input_scale: torch.Tensor, shared: SharedInput | None = None):
        if linear.in_features % BLOCK:
            raise ValueError(f"input dim {linear.in_features} is not a multiple of {BLOCK}")
        if not float(input_scale) > 0:  # NaN too
            raise ValueError(f"input_scale must be > 0, got {float(input_scale)}")
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("input_scale", input_scale.reshape(()).float(), persistent=False)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_hat = (
            self.shared.quantized(x, self.input_scale) if self.shared else dequantized(x, self.input_scale)
        )
        return super().forward(x_hat)


def serve_w4a4(
    model: torch.nn.Module, input_scales: dict[str, torch.Tensor], fused: tuple[tuple[str, ...], ...]
) -> None:
    """Replace, in place, each linear of `input_scales` (keyed `{linear}.input_scale`, as the export
    stores them) by its `W4A4Linear`. The siblings of a `fused` group under one module read the same
    input and share a `SharedInput` when their calibrated scales are equal (the export's are: they
    see the same activations; vLLM's fused layer takes their max, which is each of them)."""
    linears = {key.removesuffix(".input_scale"): scale for key, scale in input_scales.items()}
    shared: dict[str, SharedInput] = {}
    for name, scale in linears.items():
        parent, _, child = name.rpartition(".")
        group = next((g for g in fused if child in g), (child,))
        siblings = [linears.get(f"{parent}.{c}") for c in group]
        one = len(group) > 1 and all(s is not None and torch.equal(s, scale) for s in siblings)
        share = shared.setdefault(f"{parent}.{group[0]}", SharedInput(len(group))) if one else None
        module = model.get_submodule(parent)
        setattr(module, child, W4A4Linear(getattr(module, child), scale, share))
