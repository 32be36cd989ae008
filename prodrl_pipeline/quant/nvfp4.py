"""NVFP4 deployment export (ModelOpt's HF export, which runs on CPU) and its dequantized load.

Every linear layer of the transformer blocks is quantized; embeddings, norms and `lm_head` stay
in full precision (docs/engines.md). Per linear: `weight` uint8 [out, in/2] (two E2M1 codes a byte),
`weight_scale` FP8 E4M3 [out, in/16], `weight_scale_2` FP32 scalar and the activation
`input_scale`; q/k/v share one `weight_scale_2`, and so do gate/up (vLLM fuses them).
`quantize_state` computes the same codes and scales directly with ModelOpt's `NVFP4QTensor`
(for QAT's W_hat). The embedded engine serves the dequantized weights W_hat, so mu differs from
the trainer's pi as a real quantized deployment does: with fp32 activations (`nvfp4`, Hopper's
W4A16) or with NVFP4 activations too (`nvfp4_w4a4`, Blackwell's W4A4: `quant/w4a4.py`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from prodrl_pipeline.folders import CorruptFileError, reading
from prodrl_pipeline.locks import folder_lock
from prodrl_pipeline.quant.modelopt_lib import BLOCK, modelopt
from prodrl_pipeline.quant.w4a4 import serve_w4a4

QUANTIZED = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
QuantFormat = Literal["nvfp4", "nvfp4_w4a4", "none"]
"""How a deployment is exported and served: NVFP4 weights with full-precision activations (W4A16,
as Hopper serves NVFP4), NVFP4 weights and activations (W4A4, as Blackwell does), or full precision.
Both NVFP4 formats export the same ModelOpt checkpoint (with calibrated activation scales); they
differ in how the engine serves it."""
QUANT_FORMATS: tuple[str, ...] = get_args(QuantFormat)
TIED_HEAD = "lm_head.weight"  # absent from an export of a model whose head is its embedding


def _shared_scale_2(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The per-tensor scale of `name`, shared with its fused siblings: max amax / (6 * 448)."""
    for group in FUSED_GROUPS:
        for proj in group:
            if f".{proj}.weight" in name:
                siblings = [name.replace(f".{proj}.", f".{other}.") for other in group]
                return torch.stack(
                    [modelopt().NVFP4QTensor.get_weights_scaling_factor_2(state[s].float()) for s in siblings]
                ).max()
    return modelopt().NVFP4QTensor.get_weights_scaling_factor_2(state[name].float())


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
        packed, scale, scale_2 = modelopt().NVFP4QTensor.quantize(
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
            qt = modelopt().NVFP4QTensor(torch.Size(shape), torch.float32, t)
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
    quant_format: QuantFormat,
    calibration: Sequence[Sequence[int]] = (),
) -> None:
    """Write a deployable model directory: NVFP4 (`nvfp4`, `nvfp4_w4a4`: the same export) or
    `none` (full precision, safetensors).

    NVFP4 is ModelOpt's own HF export: `mtq.quantize` with `NVFP4_DEFAULT_CFG` (max calibration)
    on a copy of the model, then `export_hf_checkpoint`, the artifact vLLM loads (`hf_quant_config.json`,
    `quantization_config` in config.json). Its weight codes and scales are `quantize_state`'s
    (tests/quant/test_nvfp4.py). The forward passes over `calibration` (token-id sequences, e.g.
    recorded calls) set only the activation `input_scale`s, which W4A4 serving uses and W4A16
    serving ignores; without them a fixed random batch stands in.
    """
    if quant_format not in QUANT_FORMATS:
        raise ValueError(f"quant_format must be one of {', '.join(QUANT_FORMATS)}, got {quant_format!r}")
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
        lib = modelopt()
        lib.mtq.quantize(quantized, lib.mtq.NVFP4_DEFAULT_CFG, forward_loop)
        lib.export_hf_checkpoint(quantized, dtype=torch.float32, export_dir=path)


def load_deployment(path: str | Path, quant_format: QuantFormat | None = None) -> PreTrainedModel:
    """The model a deployment serves: dequantized NVFP4 weights (or full precision), fp32 compute;
    with `quant_format` "nvfp4_w4a4" (its registry row's) the activations entering each quantized
    linear are NVFP4 too, with the export's `input_scale`s (`quant/w4a4.py`). Otherwise the export's
    weights with fp32 activations, whatever it is. A file of it that is missing, truncated or
    corrupt raises an error naming the deployment and the file (FileNotFoundError,
    CorruptFileError). Read under the folder's shared lock (a swap waits)."""
    if quant_format is not None and quant_format not in QUANT_FORMATS:
        raise ValueError(f"quant_format must be one of {', '.join(QUANT_FORMATS)}, got {quant_format!r}")
    path = Path(path)
    with folder_lock(path, shared=True):
        return _load_deployment(path, quant_format == "nvfp4_w4a4")


def _load_deployment(path: Path, w4a4: bool) -> PreTrainedModel:
    what = f"deployment {path}"
    weights, quant_config = path / "model.safetensors", path / "hf_quant_config.json"
    with reading(path / "config.json", what):  # transformers calls a missing one an unrecognized model
        json.loads((path / "config.json").read_text())
    config = AutoConfig.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with reading(weights, what):
        state = load_file(str(weights))
    input_scales = {n: t for n, t in state.items() if n.endswith(".input_scale")}
    if quant_config.exists():
        with reading(quant_config, what):
            json.loads(quant_config.read_text())  # vLLM parses it too
        try:
            state = dequantize_state(state)
        except ValueError as e:  # a scale it lacks, or codes of another format
            raise CorruptFileError(f"{what}: {weights.name} is corrupt ({e})") from e
    if w4a4:
        linears = {n.removesuffix(".weight") for n in state if QUANTIZED.match(n)}
        if not quant_config.exists() or (
            missing := sorted(linears - {n.rsplit(".", 1)[0] for n in input_scales})
        ):
            lacks = "NVFP4 weights" if not quant_config.exists() else f"input_scale for {', '.join(missing)}"
            raise ValueError(f"{what} cannot be served W4A4: it has no {lacks}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [
        m for m in missing if not (getattr(config, "tie_word_embeddings", False) and m == TIED_HEAD)
    ]:
        raise ValueError(f"{path}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if w4a4:
        serve_w4a4(model, input_scales, FUSED_GROUPS)
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
