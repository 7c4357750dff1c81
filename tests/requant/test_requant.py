"""Block-FP8 to UE8M0 requantization (shardprep.requant), against references written here, block by block."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support.checkpoints import read_state_dict
from support.fp8_fixture import QUANTIZATION_CONFIG, quantize_block_fp8, quantize_checkpoint_fp8

from shardprep.errors import RequantError
from shardprep.requant import (
    BlockFP8Info,
    ceil_pow2_exponent,
    detect_block_fp8,
    requant_ue8m0,
    scale_to_e8m0,
    scales_are_pow2,
)
from shardprep.requant import ue8m0 as ue8m0_module

FP8 = torch.float8_e4m3fn


def random_block_fp8(shape: tuple[int, ...], *, seed: int = 0, pow2_scales: bool = False):
    """A float8_e4m3fn weight of `shape` (normals, subnormals, zeros, +-448) and its per-block float32 scales,
    log-uniform over 1e-6..1e-1 with arbitrary mantissas unless `pow2_scales`."""
    gen = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    weight = (torch.randn(shape, generator=gen) * 120).clamp(-448, 448).to(FP8)
    scale_shape = (*lead, math.ceil(n / 128), math.ceil(k / 128))
    log_scale = torch.empty(scale_shape).uniform_(math.log(1e-6), math.log(1e-1), generator=gen)
    scale = log_scale.exp()
    if pow2_scales:
        scale = torch.pow(2.0, torch.round(torch.log2(scale)))
    return weight, scale.to(torch.float32)


def reference_requant(weight: torch.Tensor, scale_inv: torch.Tensor, recipe: str = "sglang"):
    """The recipe written the obvious way: a loop over 128x128 blocks, the power of two from math.frexp on
    float64 (exact for these quotients), nothing shared with shardprep.requant."""
    *lead, n, k = weight.shape
    weights = weight.reshape(-1, n, k)
    scales = scale_inv.reshape(-1, *scale_inv.shape[-2:])
    q_out = torch.empty_like(weights)
    s_out = torch.empty(scales.shape, dtype=torch.float32)
    for e in range(weights.shape[0]):
        for i in range(scales.shape[1]):
            for j in range(scales.shape[2]):
                rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
                x = weights[e, rows, cols].float() * scales[e, i, j]
                if recipe == "sglang":
                    x = x.to(torch.bfloat16).float()
                amax = max(float(x.abs().max()), 1e-4)
                mantissa, exponent = math.frexp(amax / 448.0)
                sf = 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)
                q_out[e, rows, cols] = (x / sf).to(FP8)
                s_out[e, i, j] = sf
    return q_out.view(weight.shape), s_out.view(scale_inv.shape)


def sglang_code(weight: torch.Tensor, scale_inv: torch.Tensor):
    """SGLang's vectorized 2-D recipe as it is written, torch.log2 and all (block_quant_dequant to bfloat16,
    then DeepGEMM's per_block_cast_to_fp8 with its original ceil_to_ue8m0)."""
    n, k = weight.shape
    repeated = scale_inv.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:n, :k]
    x = (weight.float() * repeated).to(torch.bfloat16)
    padded = torch.zeros(math.ceil(n / 128) * 128, math.ceil(k / 128) * 128, dtype=x.dtype)
    padded[:n, :k] = x
    view = padded.view(-1, 128, padded.shape[1] // 128, 128)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    q = (view * (1.0 / sf)).to(FP8)
    return q.view_as(padded)[:n, :k].contiguous(), sf.view(view.shape[0], view.shape[2])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape[-2:]
    repeated = scale.repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)[..., :n, :k]
    return q.float() * repeated


# --- the transform against the references ---------------------------------------------------------------

SHAPES = {
    "aligned": (256, 384),
    "tail-rows": (300, 256),
    "tail-cols": (128, 130),
    "tail-both": (200, 72),
    "smaller-than-a-block": (5, 7),
    "3d-experts-with-tails": (3, 160, 136),
}


@pytest.mark.parametrize("recipe", ["sglang", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_matches_blockwise_reference_bit_for_bit(shape, recipe):
    weight, scale = random_block_fp8(shape, seed=len(shape) + shape[-1])
    q, s = requant_ue8m0(weight, scale, recipe=recipe, name="w")
    ref_q, ref_s = reference_requant(weight, scale, recipe)
    assert q.dtype == FP8 and q.shape == weight.shape and q.device.type == "cpu"
    assert s.dtype == torch.float32 and s.shape == scale.shape
    assert same_bytes(q, ref_q)
    assert same_bytes(s, ref_s)


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1000, 129)])
def test_sglang_recipe_reproduces_sglang_code(shape):
    weight, scale = random_block_fp8(shape, seed=7)
    q, s = requant_ue8m0(weight, scale)
    sg_q, sg_s = sglang_code(weight, scale)
    assert same_bytes(q, sg_q) and same_bytes(s, sg_s)


def test_all_zero_and_tiny_blocks_get_scale_2_pow_minus_22():
    weight, scale = random_block_fp8((256, 384), seed=1)
    weight[:128, :128] = 0
    scale[1, 2] = 1e-9  # |x| <= 448e-9, far below the 1e-4 floor
    q, s = requant_ue8m0(weight, scale)
    assert s[0, 0].item() == s[1, 2].item() == 2.0**-22
    assert not q[:128, :128].float().any()
    ref_q, ref_s = reference_requant(weight, scale)
    assert same_bytes(q, ref_q) and same_bytes(s, ref_s)


def test_tail_blocks_are_scaled_by_their_real_elements_only():
    """The padded part of a tail block is zero, so a tail's scale depends on its real elements only."""
    weight = torch.zeros(130, 130, dtype=FP8)
    weight[129, 129] = 448.0  # the only element of the bottom-right tail block
    q, s = requant_ue8m0(weight, torch.full((2, 2), 1.0))
    assert s.tolist() == [[2.0**-22, 2.0**-22], [2.0**-22, 1.0]]
    assert q[129, 129].float().item() == 448.0


def test_non_power_of_two_scales_become_powers_of_two():
    weight, scale = random_block_fp8((300, 200), seed=2)
    assert not scales_are_pow2(scale)
    q, s = requant_ue8m0(weight, scale)
    assert scales_are_pow2(s)
    # The new scale is the smallest power of two that keeps the block within +-448.
    amax = dequantize(weight, scale).to(torch.bfloat16).float().abs().amax()
    assert amax <= 448 * s.max() and q.float().abs().max() <= 448


def test_3d_experts_are_requantized_one_at_a_time():
    weight, scale = random_block_fp8((4, 200, 136), seed=3)
    q, s = requant_ue8m0(weight, scale, name="mlp.experts.w")
    for e in range(4):
        q_e, s_e = requant_ue8m0(weight[e], scale[e])
        assert same_bytes(q[e], q_e) and same_bytes(s[e], s_e)


def test_several_passes_give_the_same_bytes_as_one(monkeypatch):
    weight, scale = random_block_fp8((2, 700, 300), seed=4)
    whole_q, whole_s = requant_ue8m0(weight, scale)
    monkeypatch.setattr(ue8m0_module, "_CHUNK_ELEMENTS", 128 * 128)  # one 128-row stripe per pass
    q, s = requant_ue8m0(weight, scale)
    assert same_bytes(q, whole_q) and same_bytes(s, whole_s)


def test_requantizing_its_own_output_keeps_every_value():
    """Already-UE8M0 input comes back with the same dequantized values (bytes may move: a block whose
    largest code rounded down to 224 gets half the scale and codes twice as large)."""
    weight, scale = random_block_fp8((300, 200), seed=5)
    q1, s1 = requant_ue8m0(weight, scale)
    q2, s2 = requant_ue8m0(q1, s1)
    assert scales_are_pow2(s1) and scales_are_pow2(s2)
    assert torch.equal(dequantize(q2, s2), dequantize(q1, s1))


# --- the two recipes ------------------------------------------------------------------------------------


def test_recipes_agree_when_dequantized_values_are_exact_in_bfloat16():
    # fp8 codes carry 4 significant bits and a power-of-two scale adds none, so bf16 rounding is a no-op.
    weight, scale = random_block_fp8((300, 200), seed=6, pow2_scales=True)
    q_sg, s_sg = requant_ue8m0(weight, scale, recipe="sglang")
    q_fp, s_fp = requant_ue8m0(weight, scale, recipe="fp32")
    assert same_bytes(q_sg, q_fp) and same_bytes(s_sg, s_fp)


def test_recipes_differ_only_by_the_bfloat16_rounding():
    """bf16 rounding moves a value by at most 2^-9 relative: enough to tip an fp8 rounding to the
    neighbouring code, or a block's amax across a power of two (scale halves or doubles), nothing more."""
    weight, scale = random_block_fp8((1024, 1024), seed=8)
    q_sg, s_sg = requant_ue8m0(weight, scale, recipe="sglang")
    q_fp, s_fp = requant_ue8m0(weight, scale, recipe="fp32")
    assert not same_bytes(q_sg, q_fp)
    ratio = s_sg / s_fp
    assert bool(((ratio == 0.5) | (ratio == 1) | (ratio == 2)).all())
    same_scale = (ratio == 1).repeat_interleave(128, 0).repeat_interleave(128, 1)
    codes_sg, codes_fp = q_sg.view(torch.uint8).int(), q_fp.view(torch.uint8).int()
    assert int((codes_sg - codes_fp).abs()[same_scale].max()) == 1


# --- accuracy -------------------------------------------------------------------------------------------


def test_round_trip_error_against_original_bfloat16_is_bounded():
    """bf16 weight -> DeepSeek-style block FP8 -> UE8M0 -> dequantized, compared with the bf16 weight.

    Per element: each of the two fp8 roundings costs at most half a step, 2^-4 of |x| for fp8 normals or
    2^-10 of the block scale for subnormals; the bf16 rounding in between costs 2^-9 of |x|; and the new
    scale is under twice the old (amax/448). Summed with their products that is under
    0.135 |x| + 2^-16 amax for blocks above the 1e-4 floor. The RMS error is far smaller: about 2.6% for
    the first fp8 rounding of Gaussian weights and 3.7% after both, so 6% leaves room.
    """
    gen = torch.Generator().manual_seed(9)
    original = (torch.randn(3, 300, 260, generator=gen) * 0.02).to(torch.bfloat16).float()
    original[0, :128, :128] *= 1e-2  # a block far smaller than its neighbours, still above the 1e-4 floor
    q1, s1 = quantize_block_fp8(original)
    q2, s2 = requant_ue8m0(q1, s1)
    restored = dequantize(q2, s2)
    block_amax = dequantize(torch.ones_like(q1, dtype=torch.float32), s1) * 448
    err = (restored - original).abs()
    assert bool((err <= 0.135 * original.abs() + 2.0**-16 * block_amax).all())
    assert float(err.square().mean().sqrt() / original.square().mean().sqrt()) < 0.06


# --- non-finite input -----------------------------------------------------------------------------------


def _poisoned(case: str):
    weight, scale = random_block_fp8((2, 200, 300), seed=10)
    if case == "nan-weight":
        weight.view(torch.uint8)[1, 150, 260] = 0x7F  # e4m3fn's NaN
    elif case == "inf-scale":
        scale[1, 1, 2] = float("inf")
    else:  # "overflow": finite fp8 times a finite scale, 448 * 1e36, is beyond float32
        weight[1, 128:, 256:] = 1.0
        weight[1, 150, 260] = 448.0
        scale[1, 1, 2] = 1e36
    return weight, scale


@pytest.mark.parametrize("case", ["nan-weight", "inf-scale", "overflow"])
def test_nonfinite_values_are_refused_with_the_tensor_named(case):
    weight, scale = _poisoned(case)
    with pytest.raises(RequantError, match=r"model\.layers\.3\.mlp\.experts\.w.*non-finite.*allow_nonfinite"):
        requant_ue8m0(weight, scale, name="model.layers.3.mlp.experts.w")
    with pytest.raises(RequantError, match=r"index \(1, 1, 2\)" if case == "inf-scale" else r"\(1, 150, 260\)"):
        requant_ue8m0(weight, scale, name="w")


@pytest.mark.parametrize("case", ["nan-weight", "inf-scale", "overflow"])
def test_nonfinite_values_pass_with_allow_nonfinite(case):
    weight, scale = _poisoned(case)
    q, s = requant_ue8m0(weight, scale, allow_nonfinite=True)
    ref_q, ref_s = reference_requant(weight, scale)
    assert s[1, 1, 2].item() == 2.0**127
    # Every other block is requantized as usual.
    s[1, 1, 2] = ref_s[1, 1, 2]
    assert same_bytes(s, ref_s)
    q[1, 128:, 256:], ref_q[1, 128:, 256:] = 0, 0
    assert same_bytes(q, ref_q)


# --- log2 or exponent bits ------------------------------------------------------------------------------


def _log2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The Python reference's way: torch.pow(2, torch.ceil(torch.log2(x))), as an exponent."""
    return torch.ceil(torch.log2(x)).to(torch.int32)


def test_exponent_bits_and_torch_log2_agree_on_every_bfloat16_amax():
    """The sglang recipe's amax is a bf16 value (or the 1e-4 floor): amax/448 is then either an exact power
    of two or at least ~2^-8 away from one, where log2 cannot round onto the integer."""
    bf16 = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    amax = torch.cat([bf16[bf16 >= 1e-4], torch.tensor([1e-4])])
    quotient = amax / 448.0
    assert torch.equal(ceil_pow2_exponent(quotient), _log2_ceil(quotient))


def test_torch_log2_rounds_values_just_above_a_power_of_two_down_and_we_do_not():
    """amax/448 = 2^-20 (1 + 2^-23): log2 is -20 + 1.7e-7, which float32 (spacing 1.9e-6 near 20) rounds to
    exactly -20 however carefully log2 is computed. The log2 reference then picks 2^-20, under amax/448,
    so amax / scale exceeds 448; the exponent bits pick 2^-19, as DeepGEMM's kernels do."""
    quotient = torch.tensor([2.0**-20]).nextafter(torch.tensor([1.0]))
    assert _log2_ceil(quotient).item() == -20
    assert ceil_pow2_exponent(quotient).item() == -19
    # Through the fp32 recipe: a block whose dequantized maximum is 448 * that quotient.
    weight = torch.full((1, 1), 448.0).to(FP8)
    q, s = requant_ue8m0(weight, quotient.view(1, 1), recipe="fp32")
    assert s.item() == 2.0**-19 and q.float().item() == 224.0


def test_where_torch_log2_and_exponent_bits_disagree_in_float32():
    """Only for amax a few float32 ulps above 448 * 2^k, and there log2 always picks the smaller scale.
    Reachable with the fp32 recipe (amax is any float32), never with the sglang recipe (amax is bf16)."""
    disagree = []
    for k in range(-22, 4):
        base = torch.tensor(448.0 * 2.0**k).view(torch.int32)
        amax = (base + torch.arange(0, 64, dtype=torch.int32)).view(torch.float32)
        quotient = amax / 448.0
        bits, log2 = ceil_pow2_exponent(quotient), _log2_ceil(quotient)
        assert bool((log2 <= bits).all())
        disagree += [(k, int(n)) for n in torch.nonzero(bits != log2).flatten()]
    assert disagree, "torch.log2 never rounded onto an integer; update docs/requant.md"
    assert max(n for _, n in disagree) <= 16 and min(n for _, n in disagree) >= 1


def test_division_and_reciprocal_multiplication_give_the_same_exponent():
    """CUDA computes `amax / 448.0` as amax * fl(1/448) and DeepGEMM's kernels multiply by 1/448 too; the
    quotients differ in the last bit, the powers of two never (checked for every float32 of one octave,
    which stands for all octaves: both sides scale exactly by powers of two)."""
    amax = torch.arange(0x3F800000, 0x40000000, dtype=torch.int32).view(torch.float32)  # [1, 2)
    divided = amax / torch.full_like(amax, 448.0)
    multiplied = amax * torch.tensor(1 / 448.0, dtype=torch.float32)
    assert not torch.equal(divided, multiplied)
    assert torch.equal(ceil_pow2_exponent(divided), ceil_pow2_exponent(multiplied))


# --- scales_are_pow2 and scale_to_e8m0 ------------------------------------------------------------------


@pytest.mark.parametrize(("values", "expected"), [
    ([1.0, 0.5, 2.0**-22, 2.0**127, 2.0**-127], True),
    ([], True),
    ([1.0, 0.75], False),
    ([1.0, 0.0], False),
    ([1.0, -0.5], False),
    ([1.0, float("inf")], False),
    ([1.0, float("nan")], False),
    ([2.0**-128], False),
])
def test_scales_are_pow2(values, expected):
    assert scales_are_pow2(torch.tensor(values, dtype=torch.float32)) is expected


def test_scale_to_e8m0_keeps_every_power_of_two():
    scale = torch.tensor([[2.0**-127, 2.0**-22, 1.0], [0.5, 2.0**3, 2.0**127]])
    e8m0 = scale_to_e8m0(scale)
    assert e8m0.dtype == torch.float8_e8m0fnu and e8m0.shape == scale.shape
    assert e8m0.view(torch.uint8).tolist() == [[0, 105, 127], [126, 130, 254]]
    assert torch.equal(e8m0.float(), scale)


def test_scale_to_e8m0_refuses_other_values():
    with pytest.raises(RequantError, match="layers.1.o_proj.weight_scale_inv.*powers of two"):
        scale_to_e8m0(torch.tensor([0.75]), name="layers.1.o_proj.weight_scale_inv")


# --- bad arguments --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "message"), [
    (lambda w, s: (w.float(), s), "dtype torch.float32"),
    (lambda w, s: (w, s[:, :1]), r"needs scale_inv of shape \(3, 2\)"),
    (lambda w, s: (w, s.double()), "scale_inv has dtype torch.float64"),
    (lambda w, s: (w[0], s[0]), r"shape \(200,\)"),
])
def test_bad_inputs_are_refused_with_the_tensor_named(change, message):
    weight, scale = change(*random_block_fp8((300, 200), seed=11))
    with pytest.raises(RequantError, match=rf"'q_proj.weight'.*{message}"):
        requant_ue8m0(weight, scale, name="q_proj.weight")


def test_unknown_recipe_is_refused():
    weight, scale = random_block_fp8((128, 128))
    with pytest.raises(RequantError, match="unknown recipe 'vllm'.*sglang"):
        requant_ue8m0(weight, scale, recipe="vllm")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for machines without CUDA")
def test_cuda_without_a_gpu_is_refused():
    weight, scale = random_block_fp8((128, 128))
    with pytest.raises(RequantError, match="'w'.*no CUDA device.*device='cpu'"):
        requant_ue8m0(weight, scale, name="w", device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["sglang", "fp32"])
def test_cuda_gives_the_same_bytes_as_cpu(recipe):
    weight, scale = random_block_fp8((3, 300, 200), seed=12)
    cpu = requant_ue8m0(weight, scale, recipe=recipe)
    cuda = requant_ue8m0(weight, scale, recipe=recipe, device="cuda")
    assert cuda[0].device.type == "cpu"
    assert same_bytes(cpu[0], cuda[0]) and same_bytes(cpu[1], cuda[1])


# --- detection ------------------------------------------------------------------------------------------

NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight",
         "model.layers.0.self_attn.o_proj.weight_scale_inv", "model.layers.0.mlp.experts.w13.weight",
         "model.layers.0.mlp.experts.w13.weight_scale_inv", "model.norm.weight"]


def test_detects_block_fp8_from_config_and_scale_names():
    info = detect_block_fp8({"quantization_config": dict(QUANTIZATION_CONFIG)}, NAMES)
    assert info == BlockFP8Info(block=(128, 128), scale_fmt=None, weight_names=[
        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.experts.w13.weight"])


def test_detection_reports_the_declared_ue8m0_scale_format():
    config = {"quantization_config": dict(QUANTIZATION_CONFIG, scale_fmt="ue8m0")}
    assert detect_block_fp8(config, NAMES).scale_fmt == "ue8m0"


@pytest.mark.parametrize("config", [
    {},
    {"quantization_config": None},
    {"quantization_config": {"quant_method": "awq", "bits": 4}},
    {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},  # per-tensor FP8
])
def test_no_block_fp8_config_means_none(config):
    assert detect_block_fp8(config, NAMES) is None


@pytest.mark.parametrize("block", [[64, 64], [128, 64], [1, 128]])
def test_other_block_sizes_are_refused_by_name(block):
    config = {"quantization_config": dict(QUANTIZATION_CONFIG, weight_block_size=block)}
    with pytest.raises(RequantError, match=rf"weight_block_size is \[{block[0]}, {block[1]}\]"):
        detect_block_fp8(config, NAMES)


def test_a_scale_without_its_weight_is_refused():
    config = {"quantization_config": dict(QUANTIZATION_CONFIG)}
    with pytest.raises(RequantError, match="'lm_head.weight_scale_inv' has no weight 'lm_head.weight'"):
        detect_block_fp8(config, [*NAMES, "lm_head.weight_scale_inv"])


def test_a_block_fp8_config_without_scales_is_refused():
    config = {"quantization_config": dict(QUANTIZATION_CONFIG)}
    with pytest.raises(RequantError, match="no tensor has a '\\*.weight_scale_inv'"):
        detect_block_fp8(config, ["model.layers.0.self_attn.o_proj.weight"])


def test_already_pow2_scales_are_recognised():
    weight, scale = random_block_fp8((300, 200), seed=13, pow2_scales=True)
    assert scales_are_pow2(scale)
    assert not scales_are_pow2(random_block_fp8((300, 200), seed=13)[1])


# --- the block-FP8 checkpoint fixture -------------------------------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["single-file", "sharded"])
def fp8_checkpoint(request, checkpoint_cache, tmp_path_factory):
    src = checkpoint_cache("deepseek-v3", sharded=request.param, layers=2, hidden=160)
    dst = quantize_checkpoint_fp8(src, tmp_path_factory.mktemp("fp8") / "ckpt",
                                  skip=lambda name: name.endswith("kv_b_proj.weight"))
    return src, dst


def test_fp8_fixture_writes_deepseek_style_block_fp8(fp8_checkpoint):
    src, dst = fp8_checkpoint
    original, quantized = read_state_dict(src), read_state_dict(dst)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()

    info = detect_block_fp8(config, quantized)
    assert set(quantized) == set(original) | {n + "_scale_inv" for n in info.weight_names}
    assert any("kv_a_proj_with_mqa" in n for n in info.weight_names)
    assert any(".experts.3." in n for n in info.weight_names)
    assert not any("kv_b_proj" in n or "embed" in n or "norm" in n or "mlp.gate." in n
                   for n in info.weight_names)
    for name, tensor in original.items():
        if name not in info.weight_names:
            assert torch.equal(quantized[name], tensor), name
    tails = pow2 = 0
    for name in info.weight_names:
        q, s = quantized[name], quantized[name + "_scale_inv"]
        n, k = q.shape
        assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (math.ceil(n / 128), math.ceil(k / 128))
        pow2 += scales_are_pow2(s)
        tails += n % 128 != 0 or k % 128 != 0
        x = original[name].float()
        assert bool(((dequantize(q, s) - x).abs() <= 2.0**-4 * x.abs() + s.max() * 2.0**-10).all()), name
    assert tails == len(info.weight_names)
    # amax/448 is a power of two only when a block's bf16 amax is 1.75 * 2^j, which happens now and then.
    assert pow2 < len(info.weight_names) / 4


def test_fp8_fixture_keeps_the_source_file_split(fp8_checkpoint):
    src, dst = fp8_checkpoint
    index = src / "model.safetensors.index.json"
    if not index.exists():
        assert sorted(p.name for p in dst.glob("*.safetensors")) == ["model.safetensors"]
        return
    src_map = json.loads(index.read_text())["weight_map"]
    dst_index = json.loads((dst / "model.safetensors.index.json").read_text())
    dst_map = dst_index["weight_map"]
    for name, file_name in dst_map.items():
        assert file_name == src_map[name.removesuffix("_scale_inv")]
    assert dst_index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                      for t in read_state_dict(dst).values())


def test_fp8_fixture_checkpoint_requantizes_like_the_reference(fp8_checkpoint):
    _, dst = fp8_checkpoint
    tensors = read_state_dict(dst)
    info = detect_block_fp8(json.loads((dst / "config.json").read_text()), tensors)
    for name in info.weight_names:
        q, s = requant_ue8m0(tensors[name], tensors[name + "_scale_inv"], name=name)
        ref_q, ref_s = reference_requant(tensors[name], tensors[name + "_scale_inv"])
        assert same_bytes(q, ref_q) and same_bytes(s, ref_s), name
        assert scales_are_pow2(s)


def test_fp8_fixture_quantizes_3d_experts_one_expert_at_a_time():
    experts = torch.randn(3, 200, 136, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    experts[1] *= 100
    q, s = quantize_block_fp8(experts)
    assert q.shape == experts.shape and s.shape == (3, 2, 2)
    for e in range(3):
        q_e, s_e = quantize_block_fp8(experts[e])
        assert same_bytes(q[e], q_e) and same_bytes(s[e], s_e)


@pytest.mark.parametrize("recipe", ["sglang", "fp32"])
@pytest.mark.parametrize("shape", [(300, 200), (2, 129, 257)])
def test_table_lookup_path_equals_the_elementwise_path(monkeypatch, shape, recipe):
    import shardprep.requant.ue8m0 as ue8m0

    weight, scale = random_block_fp8(shape, seed=7)
    fast = requant_ue8m0(weight, scale, recipe=recipe)
    monkeypatch.setattr(ue8m0, "_requant_by_table", lambda *args: None)
    monkeypatch.setattr(ue8m0, "requant_codes", lambda *args: None)
    slow = requant_ue8m0(weight, scale, recipe=recipe)
    assert same_bytes(fast[0], slow[0]) and same_bytes(fast[1], slow[1])


def test_numpy_roundings_match_torch_casts_on_every_fp8_midpoint_and_random_values():
    import numpy as np

    from shardprep.requant.lookup import E4M3_VALUES, encode_e4m3, round_to_bfloat16

    rng = np.random.default_rng(3)
    finite = np.sort(E4M3_VALUES[np.isfinite(E4M3_VALUES)].astype(np.float64))
    midpoints = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # every tie, both signs
    x = np.concatenate([rng.uniform(-448, 448, 200_000), rng.uniform(-2**-5, 2**-5, 200_000)]).astype(np.float32)
    x = np.concatenate([x, midpoints, finite.astype(np.float32), np.array([-0.0], np.float32)])
    expected = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(encode_e4m3(x), expected)
    y = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-30, 30, 200_000)).astype(np.float32)
    assert np.array_equal(round_to_bfloat16(y), torch.from_numpy(y).bfloat16().float().numpy())
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(E4M3_VALUES, codes, equal_nan=True)
