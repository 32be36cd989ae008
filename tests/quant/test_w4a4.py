"""W4A4 serving (quant/w4a4.py) against an NVFP4 quantizer written here from the format's
definition, independently of the code under test and of ModelOpt:
  per block of 16 along the last dim: sb = e4m3(clamp(max|x| / (6 s), 2^-9, 448)) (1 for an all-zero
  block), q = the E2M1 magnitude nearest |x| / (sb s) (ties to the even code, saturating at 6) with
  x's sign bit, x_hat = q * sb * s."""

import itertools

import pytest
import torch
from safetensors.torch import load_file, save_file

from prodrl_pipeline.quant import w4a4
from prodrl_pipeline.quant.modelopt_lib import modelopt
from prodrl_pipeline.quant.nvfp4 import QUANTIZED, export_deployment, load_deployment
from prodrl_pipeline.quant.w4a4 import W4A4Linear, dequantized, quantize_activations
from tests.conftest import rounding_tolerance

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
# Every finite non-negative E4M3 (fn) value, indexed by its code: 0 and the subnormals m/8 * 2^-6, then
# (1 + m/8) * 2^(e-7); e = 15, m = 7 is NaN, so the largest is 448. An even code has an even mantissa.
E4M3 = torch.tensor(
    [m / 8 * 2.0**-6 for m in range(8)]
    + [
        (1 + m / 8) * 2.0 ** (e - 7)
        for e, m in itertools.product(range(1, 16), range(8))
        if (e, m) != (15, 7)
    ],
    dtype=torch.float64,
)


def _nearest(values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the grid value nearest each of `values` (>= 0), ties to the even index; saturating."""
    dist = (values[..., None] - grid).abs()
    best = dist == dist.min(-1, keepdim=True).values
    even = best & (torch.arange(len(grid)) % 2 == 0)
    return torch.where(best.sum(-1) > 1, even.int().argmax(-1), best.int().argmax(-1))


def reference(x: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [..., K] with the sign in bit 3, block scales float64 [..., K/16], x_hat float64)."""
    blocks = x.double().reshape(*x.shape[:-1], -1, 16)
    raw = blocks.abs().amax(-1) / (6 * s)
    sb = E4M3[_nearest(torch.where(raw == 0, 1.0, raw).clamp(2**-9, 448), E4M3)]
    magnitude = _nearest(blocks.abs() / (sb[..., None] * s), E2M1)
    codes = (magnitude + 8 * (blocks < 0)).to(torch.uint8)
    x_hat = torch.where(blocks < 0, -1.0, 1.0) * E2M1[magnitude] * sb[..., None] * s
    return codes.reshape(x.shape), sb, x_hat.reshape(x.shape)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """Two codes a byte, low nibble first."""
    return torch.stack([packed & 0x0F, packed >> 4], -1).reshape(*packed.shape[:-1], -1)


def _codes(q: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of signed E2M1 values: sign bit 3 (set for -0.0 too), magnitude index."""
    return ((q.abs()[..., None] == E2M1).int().argmax(-1) + 8 * q.signbit()).to(torch.uint8)


def _check(x: torch.Tensor, s: float) -> None:
    q, scale, x_hat = quantize_activations(x, torch.tensor(s))
    codes, sb, want = reference(x, s)
    assert scale.dtype == torch.float8_e4m3fn and x_hat.dtype == torch.float32
    assert torch.isin(q.abs(), E2M1.float()).all() and torch.equal(_codes(q), codes)
    assert torch.equal(scale.double(), sb)
    # q * sb * s in fp32: two roundings of the exact product, each within eps/2 of it
    assert ((x_hat.double() - want).abs() <= torch.finfo(torch.float32).eps * want.abs()).all()
    # and bit for bit what ModelOpt's NVFP4QTensor gives with this global scale (its weight path)
    nvfp4 = modelopt().NVFP4QTensor
    packed, mo_scale, _ = nvfp4.quantize(x, 16, weights_scaling_factor_2=torch.tensor(s))
    mo_hat = packed.dequantize(
        dtype=torch.float32, scale=mo_scale, double_scale=torch.tensor(s), block_sizes={-1: 16}
    )
    assert torch.equal(_unpack(packed._quantized_data), codes) and torch.equal(mo_scale, scale)
    assert torch.equal(x_hat, mo_hat)
    _same_bits(dequantized(x, torch.tensor(s)), x_hat)  # the compiled kernel, as served


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values bit for bit (signed zeros too), NaN where NaN (of any payload)."""
    nan = want.isnan()
    assert got.dtype == want.dtype and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


S = 2.0**-8  # the hand-made blocks' tensor scale: a block of amax 6 gets sb = 256, so sb * s = 1


def test_hand_made_blocks():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    blocks = {
        "ties at every E2M1 midpoint": ties + [-t for t in ties],
        "all zero": [0.0] * 16,
        "beyond the calibrated range": [100.0, -100.0, 10.5, -10.5, 1.75] + [0.0] * 11,
        "the largest unsaturated block": [10.5, -10.5, 5.25, 2.625] + [0.0] * 12,
        "subnormal scale 3 * 2^-9": [18 * 2.0**-17, 9 * 2.0**-17, -(2.0**-17)] + [0.0] * 13,
        "subnormal scale tie 2.5 * 2^-9": [15 * 2.0**-17, -15 * 2.0**-18] + [0.0] * 14,
        "scale below 2^-9": [6 * 2.0**-19, 2.0**-30] + [0.0] * 14,
        "normal scale tie 17/16": [17 / 16 * 6 * S, -(17 / 16) * S] + [0.0] * 14,
        "signed tiny values": [-1e-9, 1e-9, -0.0, 6.0] + [0.0] * 12,
    }
    x = torch.tensor(list(blocks.values()), dtype=torch.float32)
    _check(x, S)
    _, scale, x_hat = quantize_activations(x, torch.tensor(S))  # s a power of 2: x_hat exact
    got = dict(zip(blocks, zip(scale.float()[:, 0].tolist(), x_hat.tolist(), strict=True), strict=True))
    # by hand: each midpoint goes to its even neighbour
    assert got["ties at every E2M1 midpoint"] == (
        256,
        [0, 1, 1, 2, 2, 4, 4, 6, 0, -1, -1, -2, -2, -4, -4, -6],
    )
    assert got["all zero"] == (1.0, [0.0] * 16)
    # sb clamps at 448 (sb * s = 1.75) and the codes saturate at 6
    assert got["beyond the calibrated range"] == (448, [10.5, -10.5, 10.5, -10.5, 1.75] + [0.0] * 11)
    assert got["the largest unsaturated block"] == (448, [10.5, -10.5, 5.25, 2.625] + [0.0] * 12)
    assert got["subnormal scale 3 * 2^-9"][0] == 3 * 2.0**-9
    assert got["subnormal scale tie 2.5 * 2^-9"][0] == 2 * 2.0**-9  # to the even subnormal
    assert got["scale below 2^-9"][0] == 2.0**-9
    assert got["normal scale tie 17/16"][0] == 1.0
    assert got["signed tiny values"][1][:3] == [0.0, 0.0, 0.0]


def test_every_block_scale_tie():
    """Blocks whose raw scale max|x| / (6 s) is exactly each midpoint of two E4M3 values in
    [2^-9, 448] (subnormal and normal, the carry into the next exponent), and one ulp either side."""
    values = E4M3[E4M3 >= 2.0**-9]
    mids = ((values[:-1] + values[1:]) / 2 * 6 * S).float()  # exact: 5 significant bits times 6 s
    amax = torch.cat([mids, torch.nextafter(mids, mids * 2), torch.nextafter(mids, mids / 2)])
    x = amax[:, None] * torch.linspace(-1, 1, 16)  # the first element is -amax, the last +amax
    _check(x, S)
    raw = (mids / (6 * S)).double()
    assert torch.equal(raw, (values[:-1] + values[1:]) / 2)  # they are the ties


@pytest.mark.parametrize("relative_scale", [1.0, 0.25, 4.0])  # dynamic, saturating, coarse
def test_random_tensors(relative_scale):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 64, generator=g) * torch.logspace(-3, 1, 7)[:, None]  # rows of every magnitude
    s = float(x.abs().max() / (6 * 448)) * relative_scale
    _check(x, s)
    if relative_scale < 1:
        _, scale, _ = quantize_activations(x, torch.tensor(s))
        assert (scale.float() == 448).any()  # the saturating path is exercised


@pytest.fixture(scope="module")
def w4a4_export(tmp_path_factory, request):
    from tests.conftest import build_tiny  # noqa: PLC0415

    tokenizer = request.getfixturevalue("tokenizer")
    model = build_tiny(tokenizer)
    path = tmp_path_factory.mktemp("w4a4") / "d"
    export_deployment(model, path, "nvfp4_w4a4", calibration=[[1, 5, 9, 13, 2, 7, 7, 30]])
    return model, path


def _w_hat(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The reference W_hat of weight `name`, its per-tensor scale shared with its fused siblings."""
    group = next((g for g in ("q_proj k_proj v_proj", "gate_proj up_proj") if name.split(".")[-2] in g), "")
    siblings = [name.replace(name.split(".")[-2], p) for p in group.split()] or [name]
    s2 = float(max(state[n].abs().max() for n in siblings)) / (6 * 448)
    return reference(state[name], s2)[2]


def test_w4a4_layer_is_the_reference_gemm(w4a4_export):
    """Each quantized linear of a W4A4 deployment computes reference dequant(W) @ dequant(q(x))
    with the export's calibrated input scale, within fp32 summation rounding."""
    model, path = w4a4_export
    served = load_deployment(path, "nvfp4_w4a4")
    scales = {
        k: v for k, v in load_file(str(path / "model.safetensors")).items() if k.endswith(".input_scale")
    }
    state = model.state_dict()
    g = torch.Generator().manual_seed(1)
    for name in [n for n in state if QUANTIZED.match(n)]:
        layer = served.get_submodule(name.removesuffix(".weight"))
        assert isinstance(layer, W4A4Linear)
        s = float(scales[name.replace(".weight", ".input_scale")])
        assert float(layer.input_scale) == s
        x = torch.randn(3, 5, layer.in_features, generator=g) * 6 * 448 * s / 3  # amax near the calibrated
        w_hat, x_hat = _w_hat(state, name), reference(x, s)[2]
        want = x_hat @ w_hat.T  # float64
        with torch.no_grad():
            got = layer(x)
        tol = rounding_tolerance((x_hat.abs().amax() * w_hat.abs().amax()).item(), layer.in_features)
        assert (got.double() - want).abs().max() <= tol, name
        # not the W4A16 product: the activation quantization is there
        assert (x.double() @ w_hat.T - want).abs().max() > 100 * tol, name


def test_w4a4_and_w4a16_serve_one_export(w4a4_export, tmp_path):
    model, path = w4a4_export
    w4a16, w4a4 = load_deployment(path, "nvfp4"), load_deployment(path, "nvfp4_w4a4")
    assert not any(isinstance(m, W4A4Linear) for m in w4a16.modules())
    assert sum(isinstance(m, W4A4Linear) for m in w4a4.modules()) == sum(
        bool(QUANTIZED.match(n)) for n in model.state_dict()
    )
    a, b = w4a16.state_dict(), w4a4.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same weights, same names
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        assert not torch.allclose(w4a16(ids).logits, w4a4(ids).logits)
    # what cannot be served W4A4 is refused, saying why
    export_deployment(model, tmp_path / "none", "none")
    with pytest.raises(ValueError, match="cannot be served W4A4: it has no NVFP4 weights$"):
        load_deployment(tmp_path / "none", "nvfp4_w4a4")
    export_deployment(model, tmp_path / "fp4", "nvfp4")
    state = load_file(str(tmp_path / "fp4" / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.input_scale"]
    save_file(state, str(tmp_path / "fp4" / "model.safetensors"))
    with pytest.raises(ValueError, match="it has no input_scale for model.layers.1.mlp.down_proj$"):
        load_deployment(tmp_path / "fp4", "nvfp4_w4a4")
    load_deployment(tmp_path / "fp4", "nvfp4")  # W4A16 does not need it
    with pytest.raises(ValueError, match="^quant_format must be one of nvfp4, nvfp4_w4a4, none, got 'w4a4'$"):
        load_deployment(path, "w4a4")


def test_w4a4_linear_refuses_what_it_cannot_quantize():
    with pytest.raises(ValueError, match="^input dim 24 is not a multiple of 16$"):
        W4A4Linear(torch.nn.Linear(24, 4), torch.tensor(1.0))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="^input_scale must be > 0"):
            W4A4Linear(torch.nn.Linear(32, 4), torch.tensor(bad))


def test_fused_siblings_quantize_their_input_once(w4a4_export, monkeypatch):
    """q/k/v and gate/up share their input's NVFP4 (`SharedInput`, as vLLM's fused GEMMs): 4
    quantizations a layer instead of 7, and the logits bit for bit those of linears that each
    quantize their own input."""
    _, path = w4a4_export
    shared, alone = load_deployment(path, "nvfp4_w4a4"), load_deployment(path, "nvfp4_w4a4")
    for layer in alone.modules():
        if isinstance(layer, W4A4Linear):
            layer.shared = None
    calls = []
    quantize = w4a4.dequantized
    monkeypatch.setattr(w4a4, "dequantized", lambda x, s: calls.append(x) or quantize(x, s))
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.inference_mode():  # as the engine serves
        want = alone(ids).logits
        n_alone = len(calls)
        got = shared(ids).logits
        again = shared(ids).logits  # a new forward quantizes its own inputs
    layers = shared.config.num_hidden_layers
    assert (n_alone, len(calls) - n_alone) == (7 * layers, 8 * layers)
    assert torch.equal(got, want) and torch.equal(again, want)
    attention = shared.model.layers[0].self_attn
    assert attention.q_proj.shared is attention.v_proj.shared and attention.o_proj.shared is None
    assert attention.q_proj.shared._x is None  # released by the last sibling
    # a tensor changed in place once its group has read it is quantized again, shared or not
    x = torch.randn(1, 2, attention.q_proj.in_features)
    for group in ((attention.q_proj, attention.k_proj, attention.v_proj), (attention.o_proj,)):
        first = [layer(x) for layer in group][0]
        x.mul_(2)
        layer = group[0]
        again = layer(x)
        assert torch.equal(again, torch.nn.functional.linear(quantize(x, layer.input_scale), layer.weight))
        assert not torch.equal(again, first)
        [sibling(x) for sibling in group[1:]]


def test_siblings_with_unequal_scales_quantize_alone(w4a4_export, tmp_path):
    _, path = w4a4_export
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.0.self_attn.k_proj.input_scale"] = (
        state["model.layers.0.self_attn.k_proj.input_scale"] * 2
    )
    folder = tmp_path / "d"
    folder.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    save_file(state, str(folder / "model.safetensors"))
    layer = load_deployment(folder, "nvfp4_w4a4").model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    assert attention.q_proj.shared is attention.k_proj.shared is attention.v_proj.shared is None
    assert mlp.gate_proj.shared is mlp.up_proj.shared is not None  # its scales are still equal


def test_the_kernel_is_torchs_expression_on_what_torch_alone_defines():
    """NaN blocks, infinities, -0.0, a non-contiguous input (torch's path), an empty one."""
    x = torch.tensor(
        [[float("nan")] + [1.0] * 15, [float("inf"), -float("inf"), -0.0, 3.0] + [0.0] * 12, [-0.0] * 16]
    )
    s = torch.tensor(2.0**-8)
    want = quantize_activations(x, s)[2]
    _same_bits(dequantized(x, s), want)
    assert want[0].isnan().all() and want[1, :2].tolist() == [1.75 * 6, -1.75 * 6]
    wide = torch.randn(4, 64)
    _same_bits(dequantized(wide[:, ::2], s), quantize_activations(wide[:, ::2], s)[2])
    assert dequantized(torch.empty(0, 32), s).shape == (0, 32)


def test_the_install_built_the_kernel():
    """`make install` compiles `_nvfp4.c` (pyproject.toml); without it W4A4 is served correctly
    through torch's expression, at ~2x the serving time of W4A16 (docs/lab.md)."""
    assert w4a4._KERNEL is not None, "no compiled NVFP4 kernel: install a C compiler and reinstall"


def test_the_kernel_is_torchs_expression_on_many_blocks():
    """20,000 blocks spanning 2^-40 to 2^40, a fifth of the elements at E2M1 midpoints of their
    block's amax / 6, each row under its own tensor scale (saturating ones too)."""
    g = torch.Generator().manual_seed(3)
    rows = 50
    x = torch.randn(rows, 400, 16, generator=g) * torch.exp2(
        torch.randint(-40, 40, (rows, 400, 1), generator=g)
    )
    tie = torch.rand(x.shape, generator=g) < 0.2
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])[
        torch.randint(0, 7, x.shape, generator=g)
    ]
    x = torch.where(tie, midpoints * x.abs().amax(-1, keepdim=True) / 6 * x.sign(), x)
    for row, scale in zip(
        x, x.abs().amax((1, 2)) / (6 * 448) * torch.rand(rows, generator=g) * 2, strict=True
    ):
        _same_bits(dequantized(row, scale), quantize_activations(row, scale)[2])
