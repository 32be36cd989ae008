import torch

from prodrl_pipeline.quant.nvfp4 import dequantize_state, export_deployment, load_deployment, quantize_state

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
    assert 0.02 < rel < 0.2  # ~0.09 on Gaussian weights (ENGINES.md)
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
