"""NVFP4 deployment export (ModelOpt's `NVFP4QTensor`, which runs on CPU) and its dequantized load.

Every linear layer of the transformer blocks is quantized; embeddings, norms and `lm_head` stay
in full precision (docs/engines.md). Per linear: `weight` uint8 [out, in/2] (two E2M1 codes a byte),
`weight_scale` FP8 E4M3 [out, in/16], `weight_scale_2` FP32 scalar; q/k/v share one
`weight_scale_2`, and so do gate/up (vLLM fuses them). The export directory mirrors ModelOpt's HF
export (`hf_quant_config.json`), and the embedded engine serves the dequantized weights W_hat, so
mu differs from the trainer's pi as a real quantized deployment does (Hopper: W4A16).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch

with warnings.catch_warnings():  # modelopt warns on every transformers it was not released with
    warnings.filterwarnings(
        "ignore", message="transformers .* is not tested with current version of modelopt"
    )
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

BLOCK = 16
QUANTIZED = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _shared_scale_2(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The per-tensor scale of `name`, shared with its fused siblings: max amax / (6 * 448)."""
    for group in FUSED_GROUPS:
        for proj in group:
            if f".{proj}.weight" in name:
                siblings = [name.replace(f".{proj}.", f".{other}.") for other in group]
                return torch.stack(
                    [NVFP4QTensor.get_weights_scaling_factor_2(state[s].float()) for s in siblings]
                ).max()
    return NVFP4QTensor.get_weights_scaling_factor_2(state[name].float())


def quantize_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An NVFP4 export state dict from a full-precision one."""
    out = {}
    for name, w in state.items():
        if not QUANTIZED.match(name):
            out[name] = w.contiguous()
            continue
        if w.shape[-1] % BLOCK:
            raise ValueError(f"{name}: input dim {w.shape[-1]} is not a multiple of {BLOCK}")
        s2 = _shared_scale_2(state, name)
        packed, scale, scale_2 = NVFP4QTensor.quantize(w.float(), BLOCK, weights_scaling_factor_2=s2)
        base = name.removesuffix(".weight")
        out[f"{base}.weight"] = packed._quantized_data.contiguous()  # uint8 [out, in/2]
        out[f"{base}.weight_scale"] = scale.contiguous()  # float8_e4m3fn [out, in/16]
        out[f"{base}.weight_scale_2"] = scale_2.reshape(()).float()  # fp32 scalar
    return out


def round_trip(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """W_hat = dequantize(quantize(W)) of every quantized weight in `weights` (which must hold their
    fused siblings), through the export's own quantizer: what an NVFP4 deployment of them serves."""
    exported = quantize_state({n: w.detach() for n, w in weights.items() if QUANTIZED.match(n)})
    return {n: w for n, w in dequantize_state(exported).items() if QUANTIZED.match(n)}


def dequantize_state(exported: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full-precision state dict with every quantized weight replaced by W_hat = q * sb * s2."""
    out = {}
    for name, t in exported.items():
        if name.endswith((".weight_scale", ".weight_scale_2")):
            continue
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{base}.weight_scale" in exported:
            shape = (t.shape[0], t.shape[1] * 2)
            qt = NVFP4QTensor(torch.Size(shape), torch.float32, t)
            out[name] = qt.dequantize(
                dtype=torch.float32,
                scale=exported[f"{base}.weight_scale"],
                double_scale=exported[f"{base}.weight_scale_2"],
                block_sizes={-1: BLOCK},
            )
        else:
            out[name] = t
    return out


def export_deployment(model: PreTrainedModel, path: str | Path, quant_format: str) -> None:
    """Write a deployable model directory: `nvfp4` (ModelOpt layout) or `none` (full precision)."""
    if quant_format not in ("nvfp4", "none"):
        raise ValueError(f"quant_format must be 'nvfp4' or 'none', got {quant_format!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if quant_format == "nvfp4":
        state = quantize_state(state)
        quant_config = {
            "producer": {"name": "prodrl", "via": "modelopt.NVFP4QTensor"},
            "quantization": {
                "quant_algo": "NVFP4",
                "group_size": BLOCK,
                "exclude_modules": ["lm_head", "model.embed_tokens"],
            },
        }
        (path / "hf_quant_config.json").write_text(json.dumps(quant_config, indent=2))
    save_file(state, str(path / "model.safetensors"))


def load_deployment(path: str | Path) -> PreTrainedModel:
    """The model a deployment serves: dequantized NVFP4 weights (or full precision), fp32 compute."""
    path = Path(path)
    config = AutoConfig.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_file(str(path / "model.safetensors"))
    if (path / "hf_quant_config.json").exists():
        state = dequantize_state(state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise ValueError(f"{path}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def weight_error(model: PreTrainedModel, path: str | Path) -> float:
    """Mean relative error sum|W_hat - W| / sum|W| over the exported linear weights (0 for `none`)."""
    served = load_deployment(path).state_dict()
    num = den = 0.0
    for name, w in model.state_dict().items():
        if QUANTIZED.match(name):
            num += float((served[name] - w).abs().sum())
            den += float(w.abs().sum())
    return num / den if den else 0.0
