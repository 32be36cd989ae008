"""GPU check: the export's NVFP4 quantizer (ModelOpt's `NVFP4QTensor`, run on CPU) against
ModelOpt's own CUDA fake-quant kernel (`fp4_fake_quant_block`, what quantization-aware training
on a GPU runs), on every quantized weight of the lab-size model (under a minute on one GPU).

For each weight W, with the per-tensor scale the export uses (shared by fused siblings: q/k/v and
gate/up), it compares W_hat = dequantize(quantize(W)) from `quant/nvfp4.py` with the kernel's
output for the same global amax (6 * 448 * scale_2): the count of elements that differ and the
largest difference, then the same with each weight's own amax (ModelOpt's unfused default), and
the time of each path. Prints one JSON object. Run where CUDA and ModelOpt are installed:
`python -m bench.gpu_nvfp4_check`.
"""

from __future__ import annotations

import json
import time

import torch
from modelopt.torch.kernels.quantization.gemm import fp4_fake_quant_block

from prodrl_pipeline.chat.render import load_tokenizer
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.quant.nvfp4 import QUANTIZED, _shared_scale_2, round_trip

E2M1_MAX, E4M3_MAX = 6.0, 448.0


def _compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    diff = (ours - theirs.float().cpu()).abs()
    return {"differing": int((diff > 0).sum()), "max_abs": float(diff.max()), "elements": ours.numel()}


def main() -> None:
    tok = load_tokenizer("data/tokenizer")
    model = build_model(TinyQwen3Config(), len(tok), tok.pad_token_id)
    state = {n: p.detach().float() for n, p in model.state_dict().items()}
    names = [n for n in state if QUANTIZED.match(n)]
    t0 = time.perf_counter()
    ours = round_trip(state)
    cpu_seconds = time.perf_counter() - t0
    shared, own = {}, {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for n in names:
        w = state[n].cuda()
        amax = (_shared_scale_2(state, n) * E2M1_MAX * E4M3_MAX).cuda()
        shared[n] = fp4_fake_quant_block(w, amax)
        own[n] = fp4_fake_quant_block(w, w.abs().amax())
    torch.cuda.synchronize()
    gpu_seconds = time.perf_counter() - t0
    per_weight = {n: _compare(ours[n], shared[n]) for n in names}
    own_scale = {n: _compare(ours[n], own[n]) for n in names}
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "weights": len(names),
        "elements": sum(v["elements"] for v in per_weight.values()),
        "shared_scale": {
            "differing": sum(v["differing"] for v in per_weight.values()),
            "max_abs": max(v["max_abs"] for v in per_weight.values()),
            "worst": max(per_weight, key=lambda n: per_weight[n]["differing"]),
        },
        "own_scale": {
            "differing": sum(v["differing"] for v in own_scale.values()),
            "max_abs": max(v["max_abs"] for v in own_scale.values()),
        },
        "seconds": {"cpu_export_round_trip": cpu_seconds, "cuda_kernel_both_scales": gpu_seconds},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
