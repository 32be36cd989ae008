import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from prodrl_pipeline.quant.nvfp4 import (
    QUANTIZED,
    dequantize_state,
    export_deployment,
    load_deployment,
    quantize_state,
    round_trip,
)

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def test_nvfp4_layout_and_grid(tiny_model):
    state = {k: v for k, v in tiny_model.state_dict().items() if k != "lm_head.weight"}
    exported = quantize_state(state)
    q = "model.layers.0.self_attn.q_proj.weight"
    w = state[q]
    assert exported[q].dtype == torch.uint8 and exported[q].shape == (w.shape[0], w.shape[1] // 2)
    scale = exported[q.replace("weight", "weight_scale")]
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0], w.shape[1] // 16)
    # q/k/v share one per-tensor scale, gate/up share one: s2 = max amax / (6 * 448)
    s2 = {p: exported[f"model.layers.0.self_attn.{p}_proj.weight_scale_2"] for p in "qkv"}
    amax = max(state[f"model.layers.0.self_attn.{p}_proj.weight"].abs().max() for p in "qkv")
    assert s2["q"] == s2["k"] == s2["v"]
    assert torch.allclose(s2["q"], amax / (6 * 448))
    assert (
        exported["model.layers.0.mlp.gate_proj.weight_scale_2"]
        == exported["model.layers.0.mlp.up_proj.weight_scale_2"]
    )
    # every dequantized element is an E2M1 value times its block scale times s2
    w_hat = dequantize_state(exported)[q]
    block = scale.float().repeat_interleave(16, dim=1) * s2["q"]
    codes = (w_hat / block).abs()
    assert torch.isclose(codes[..., None], E2M1, atol=1e-5).any(-1).all()
    rel = float((w_hat - w).abs().mean() / w.abs().mean())
    assert 0.02 < rel < 0.2  # ~0.09 on Gaussian weights (docs/lab.md)
    # embeddings and norms are kept in full precision
    assert torch.equal(exported["model.embed_tokens.weight"], state["model.embed_tokens.weight"])


def test_deployment_round_trip(tiny_model, tmp_path):
    export_deployment(tiny_model, tmp_path / "none", "none")
    served = load_deployment(tmp_path / "none")
    for name, w in tiny_model.state_dict().items():
        assert torch.equal(served.state_dict()[name], w), name
    export_deployment(tiny_model, tmp_path / "fp4", "nvfp4")
    served = load_deployment(tmp_path / "fp4")
    assert (tmp_path / "fp4" / "hf_quant_config.json").exists()
    assert torch.equal(served.lm_head.weight, tiny_model.lm_head.weight)
    assert not torch.equal(
        served.model.layers[0].mlp.down_proj.weight, tiny_model.model.layers[0].mlp.down_proj.weight
    )


def _reference_w_hat(w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """NVFP4 from the format's definition, written independently of the exporter: per-tensor
    s2 = amax / (6 * 448), per-block sb = fp8_e4m3(clamp(blockmax / (6 * s2), 2^-9, 448)) (1 for
    an all-zero block), each element the nearest E2M1 magnitude of |w| / (sb * s2) (ties to the
    even code, saturating at 6) with w's sign, times sb * s2."""
    s2 = amax.float() / (6 * 448)
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for b in range(0, w.shape[1], 16):
            block = w[r, b : b + 16]
            sb = block.abs().max() / (6 * s2)
            sb = torch.tensor(1.0) if sb == 0 else sb
            sb = sb.clamp(2**-9, 448).to(torch.float8_e4m3fn).float()
            for i, x in enumerate(block / (sb * s2)):
                dist = (x.abs() - E2M1).abs()
                best = [j for j in range(8) if dist[j] == dist.min()]
                code = best[0] if len(best) == 1 else next(j for j in best if j % 2 == 0)
                out[r, b + i] = torch.copysign(E2M1[code], x) * (sb * s2)
    return out


def test_nvfp4_round_trip_matches_an_independent_reference():
    """Random weights, exact ties at every E2M1 midpoint, saturation, an all-zero block, tiny values."""
    g = torch.Generator().manual_seed(0)
    ties = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.75, -3.5, -5.0, 1e-9, 0.1, 5.9]
    )
    weights = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 32, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(8, 32, generator=g) * 3,
        "model.layers.0.self_attn.v_proj.weight": torch.randn(8, 32, generator=g) * 0.01,
        "model.layers.0.mlp.down_proj.weight": torch.cat(
            [ties.repeat(2, 1), torch.zeros(2, 16), torch.randn(2, 16, generator=g) * 1e-3]
        ).reshape(3, 32),  # amax 6: the tie block's scale sb * s2 is 448 * 6 / (6 * 448) = 1
    }
    got = round_trip(weights)
    qkv_amax = torch.stack(
        [weights[f"model.layers.0.self_attn.{p}_proj.weight"].abs().max() for p in "qkv"]
    ).max()
    for name, w in weights.items():
        amax = qkv_amax if "self_attn" in name else w.abs().max()
        assert torch.equal(got[name], _reference_w_hat(w, amax)), name
    # the tie row, by hand: each midpoint goes to its even neighbour (0, 1, 1, 2, 2, 4, 4, 6, ...)
    expected = torch.tensor([0, 1, 1, 2, 2, 4, 4, 6, -0.0, -1, -2, -4, -4, 0, 0, 6], dtype=torch.float32)
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"][0, :16], expected)


def test_modelopt_export_is_the_deployed_artifact(tiny_model, tmp_path):
    """The nvfp4 export is ModelOpt's HF export (what vLLM loads), its weight codes and scales are
    exactly `quantize_state`'s, and it dequantizes to the W_hat the embedded engine and QAT use."""
    calls = [[1, 5, 9, 13, 2], [3, 4, 4, 7]]
    export_deployment(tiny_model, tmp_path / "fp4", "nvfp4", calibration=calls)
    files = {p.name for p in (tmp_path / "fp4").iterdir()}
    assert {"hf_quant_config.json", "config.json", "model.safetensors"} <= files
    quant = json.loads((tmp_path / "fp4" / "hf_quant_config.json").read_text())
    assert quant["producer"]["name"] == "modelopt"
    assert quant["quantization"]["quant_algo"] == "NVFP4" and quant["quantization"]["group_size"] == 16
    config = json.loads((tmp_path / "fp4" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    exported = load_file(str(tmp_path / "fp4" / "model.safetensors"))
    state = {k: v for k, v in tiny_model.state_dict().items() if k != "lm_head.weight"}
    ours = quantize_state(state)
    assert set(exported) == set(ours) | {
        n.replace(".weight", ".input_scale") for n in state if QUANTIZED.match(n)
    }
    for name, t in ours.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    assert all(float(exported[n]) > 0 for n in exported if n.endswith(".input_scale"))
    served = load_deployment(tmp_path / "fp4").state_dict()
    w_hat = round_trip({n: w for n, w in state.items() if QUANTIZED.match(n)})
    for name, w in w_hat.items():
        assert torch.equal(served[name], w), name
    assert type(tiny_model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # caller's model untouched


def test_weight_error_is_the_relative_error_of_what_the_export_serves(tiny_model, tmp_path):
    from prodrl_pipeline.quant.nvfp4 import weight_error

    export_deployment(tiny_model, tmp_path / "none", "none")
    assert weight_error(tiny_model, tmp_path / "none") == 0.0
    export_deployment(tiny_model, tmp_path / "fp4", "nvfp4")
    weights = {n: w for n, w in tiny_model.state_dict().items() if QUANTIZED.match(n)}
    w_hat = round_trip(weights)
    num = sum(float((w_hat[n] - w).abs().sum()) for n, w in weights.items())
    den = sum(float(w.abs().sum()) for w in weights.values())
    assert weight_error(tiny_model, tmp_path / "fp4") == pytest.approx(num / den, rel=1e-6)
    assert 0.02 < num / den < 0.2
    assert weight_error(torch.nn.Linear(2, 2), tmp_path / "none") == 0.0  # nothing quantized: no error


def test_exports_refuse_what_they_cannot_write(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="^quant_format must be one of nvfp4, nvfp4_w4a4, none, got 'int4'$"):
        export_deployment(tiny_model, tmp_path / "x", "int4")
    assert not (tmp_path / "x").exists()
    odd = {"model.layers.0.mlp.down_proj.weight": torch.ones(4, 24)}
    with pytest.raises(
        ValueError, match="^model.layers.0.mlp.down_proj.weight: input dim 24 is not a multiple of 16$"
    ):
        quantize_state(odd)
    # an export whose weights do not fit the model's config is refused, naming what is off
    export_deployment(tiny_model, tmp_path / "none", "none")
    state = load_file(str(tmp_path / "none" / "model.safetensors"))
    state["model.extra.weight"] = torch.zeros(1)
    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "none" / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"none: missing \['model.norm.weight', 'lm_head.weight'\], "
        r"unexpected \['model.extra.weight'\]$",
    ):
        load_deployment(tmp_path / "none")


def test_an_untied_head_is_exported_and_served(tokenizer, tmp_path):
    from prodrl_pipeline.model import build_model
    from tests.conftest import TINY

    model = build_model(TINY, len(tokenizer), tokenizer.pad_token_id)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    export_deployment(model, tmp_path / "none", "none")
    served = load_deployment(tmp_path / "none")
    assert torch.equal(served.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(served.lm_head.weight, served.model.embed_tokens.weight)
    state = load_file(str(tmp_path / "none" / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "none" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):  # not a random head
        load_deployment(tmp_path / "none")


def test_codes_of_another_format_under_nvfp4_scales_are_refused(tiny_model):
    state = quantize_state({k: v for k, v in tiny_model.state_dict().items() if QUANTIZED.match(k)})
    q = "model.layers.0.self_attn.q_proj.weight"
    state[q] = state[q].view(torch.float8_e4m3fn)  # FP8 codes where NVFP4 codes belong
    with pytest.raises(ValueError, match=f"^{q} has NVFP4 scales but is torch.float8_e4m3fn, not two E2M1"):
        dequantize_state(state)


def test_the_export_is_quiet_reproducible_and_calibrated_on_what_it_is_given(tiny_model, tmp_path, capsys):
    export_deployment(tiny_model, tmp_path / "a" / "nested", "nvfp4")  # parents are made
    export_deployment(tiny_model, tmp_path / "a" / "nested", "nvfp4")  # and a folder is re-exported into
    export_deployment(tiny_model, tmp_path / "b", "nvfp4")
    assert capsys.readouterr().out == ""  # ModelOpt's per-module prints are swallowed
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["architectures"] == [type(tiny_model).__name__]
    again = (tmp_path / "a" / "nested" / "model.safetensors").read_bytes()
    assert again == (tmp_path / "b" / "model.safetensors").read_bytes()  # the stand-in batch is seeded
    scale = "model.layers.0.self_attn.q_proj.input_scale"
    export_deployment(tiny_model, tmp_path / "c", "nvfp4", calibration=[[1, 2, 3]])
    export_deployment(tiny_model, tmp_path / "d", "nvfp4", calibration=[[4, 5, 6, 7, 8, 9]])
    c, d = (load_file(str(tmp_path / x / "model.safetensors"))[scale] for x in "cd")
    assert not torch.equal(c, d)  # the activation scales come from the calibration calls
