"""NVFP4 deployment export (ModelOpt's HF export, which runs on CPU) and its dequantized load.

Every linear layer of the transformer blocks is quantized; embeddings, norms and `lm_head` stay
in full precision (docs/engines.md). Per linear: `weight` uint8 [out, in/2] (two E2M1 codes a byte),
`weight_scale` FP8 E4M3 [out, in/16], `weight_scale_2` FP32 scalar and the activation
`input_scale`; q/k/v share one `weight_scale_2`, and so do gate/up (vLLM fuses them).
`quantize_state` computes the same codes and scales directly with ModelOpt's `NVFP4QTensor`
(for QAT's W_hat). The embedded engine serves the dequantized weights W_hat, so mu differs from
the trainer's pi as a real quantized deployment does (Hopper: W4A16).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import warnings
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from prodrl_pipeline.folders import CorruptFileError, reading
from prodrl_pipeline.locks import folder_lock

BLOCK = 16
QUANTIZED = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
TIED_HEAD = "lm_head.weight"  # absent from an export of a model whose head is its embedding


@cache
def _modelopt() -> SimpleNamespace:
    """ModelOpt, imported on first use: its import is slow and warns, and only the export, QAT
    and NVFP4 deployment loads need it (a trainer without QAT on a GPU machine does not)."""
    with warnings.catch_warnings():  # modelopt warns on every transformers it was not released with
        warnings.filterwarnings(
            "ignore", message="transformers .* is not tested with current version of modelopt"
        )
        import modelopt.torch.quantization as mtq  # noqa: PLC0415
        from modelopt.torch.export import export_hf_checkpoint  # noqa: PLC0415
        from modelopt.torch.quantization.qtensor import NVFP4QTensor  # noqa: PLC0415
    return SimpleNamespace(mtq=mtq, export_hf_checkpoint=export_hf_checkpoint, NVFP4QTensor=NVFP4QTensor)


def _shared_scale_2(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The per-tensor scale of `name`, shared with its fused siblings: max amax / (6 * 448)."""
    for group in FUSED_GROUPS:
        for proj in group:
            if f".{proj}.weight" in name:
                siblings = [name.replace(f".{proj}.", f".{other}.") for other in group]
                return torch.stack(
                    [
                        _modelopt().NVFP4QTensor.get_weights_scaling_factor_2(state[s].float())
                        for s in siblings
                    ]
                ).max()
    return _modelopt().NVFP4QTensor.get_weights_scaling_factor_2(state[name].float())


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
        packed, scale, scale_2 = _modelopt().NVFP4QTensor.quantize(
            w.float(), BLOCK, weights_scaling_factor_2=s2
        )
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
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        base = name.removesuffix(".weight")
        scales = (f"{base}.weight_scale", f"{base}.weight_scale_2")
        if name.endswith(".weight") and (t.dtype == torch.uint8 or any(s in exported for s in scales)):
            if t.dtype != torch.uint8:
                raise ValueError(f"{name} has NVFP4 scales but is {t.dtype}, not two E2M1 codes a byte")
            if missing := [s for s in scales if s not in exported]:
                raise ValueError(f"{name} holds NVFP4 codes but {' and '.join(missing)} is missing")
            shape = (t.shape[0], t.shape[1] * 2)
            qt = _modelopt().NVFP4QTensor(torch.Size(shape), torch.float32, t)
            out[name] = qt.dequantize(
                dtype=torch.float32,
                scale=exported[f"{base}.weight_scale"],
                double_scale=exported[f"{base}.weight_scale_2"],
                block_sizes={-1: BLOCK},
            )
        else:
            out[name] = t
    return out


def export_deployment(
    model: PreTrainedModel,
    path: str | Path,
    quant_format: str,
    calibration: Sequence[Sequence[int]] = (),
) -> None:
    """Write a deployable model directory: `nvfp4` or `none` (full precision, safetensors).

    `nvfp4` is ModelOpt's own HF export: `mtq.quantize` with `NVFP4_DEFAULT_CFG` (max calibration)
    on a copy of the model, then `export_hf_checkpoint`, the artifact vLLM loads (`hf_quant_config.json`,
    `quantization_config` in config.json). Its weight codes and scales are `quantize_state`'s
    (tests/quant/test_nvfp4.py). The forward passes over `calibration` (token-id sequences, e.g.
    recorded calls) set only the activation `input_scale`s, which W4A4 kernels use and W4A16
    serving (the embedded engine, Hopper) ignores; without them a fixed random batch stands in.
    """
    if quant_format not in ("nvfp4", "none"):
        raise ValueError(f"quant_format must be 'nvfp4' or 'none', got {quant_format!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if quant_format == "none":
        model.config.save_pretrained(path)
        tied = getattr(
            model.config, "tie_word_embeddings", False
        )  # then lm_head is the embedding, saved once
        state = {
            k: v.detach().clone() for k, v in model.state_dict().items() if not (tied and k == TIED_HEAD)
        }
        save_file(state, str(path / "model.safetensors"))
        return
    quantized = copy.deepcopy(model).float().eval()
    quantized.config.architectures = quantized.config.architectures or [type(model).__name__]
    batches = [torch.tensor([list(ids)]) for ids in calibration if len(ids)] or [
        torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    ]

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for ids in batches:
                m(ids)

    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():  # ModelOpt prints
        warnings.simplefilter("ignore")  # per module and warns on torch_dtype
        modelopt = _modelopt()
        modelopt.mtq.quantize(quantized, modelopt.mtq.NVFP4_DEFAULT_CFG, forward_loop)
        modelopt.export_hf_checkpoint(quantized, dtype=torch.float32, export_dir=path)


def load_deployment(path: str | Path) -> PreTrainedModel:
    """The model a deployment serves: dequantized NVFP4 weights (or full precision), fp32 compute.
    A file of it that is missing, truncated or corrupt raises an error naming the deployment and the
    file (FileNotFoundError, CorruptFileError). Read under the folder's shared lock (a swap waits)."""
    path = Path(path)
    with folder_lock(path, shared=True):
        return _load_deployment(path)


def _load_deployment(path: Path) -> PreTrainedModel:
    what = f"deployment {path}"
    weights, quant_config = path / "model.safetensors", path / "hf_quant_config.json"
    with reading(path / "config.json", what):  # transformers calls a missing one an unrecognized model
        json.loads((path / "config.json").read_text())
    config = AutoConfig.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with reading(weights, what):
        state = load_file(str(weights))
    if quant_config.exists():
        with reading(quant_config, what):
            json.loads(quant_config.read_text())  # vLLM parses it too
        try:
            state = dequantize_state(state)
        except ValueError as e:  # a scale it lacks, or codes of another format
            raise CorruptFileError(f"{what}: {weights.name} is corrupt ({e})") from e
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [
        m for m in missing if not (getattr(config, "tie_word_embeddings", False) and m == TIED_HEAD)
    ]:
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
