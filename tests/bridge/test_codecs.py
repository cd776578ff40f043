"""Codec tests: exact decode against the per-element reference, round trips, rounding, rejections."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4flash.release.quant_plan import QuantRole
from dsv4flash_bridge import codecs as C
from dsv4flash_bridge import naive_codecs as N

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
VALID_E4M3 = [b for b in range(256) if b & 0x7F != 0x7F]


def u8(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor."""
    return t.view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (so -0.0 differs from +0.0 and dtypes must agree)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def scales(rows_cols, byte_range=(100, 140), seed=0) -> torch.Tensor:
    """Random E8M0 scale tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(*byte_range, rows_cols, generator=g, dtype=torch.uint8).view(E8M0)


def random_e4m3(shape, seed=0) -> torch.Tensor:
    """Random valid E4M3 codes (every byte except the two NaN codes)."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.tensor(VALID_E4M3, dtype=torch.uint8)
    return valid[torch.randint(len(VALID_E4M3), shape, generator=g)].view(E4M3)


def random_packed(shape, seed=0) -> torch.Tensor:
    """Random packed MXFP4 bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)


def dense_oracle(q, s):
    """Independent whole-tensor decode: expand the scale with repeat_interleave."""
    rows, cols = q.shape
    full = s.float().repeat_interleave(32, 0)[:rows].repeat_interleave(32, 1)[:, :cols]
    return q.float() * full


# ------------------------------------------------------------------------------------ exact decode
@pytest.mark.parametrize("scale_byte", [0, 1, 2, 3, 60, 127, 128, 200, 246])
def test_every_e4m3_code_decodes_exactly(scale_byte):
    codes = torch.tensor(VALID_E4M3 + [0, 0], dtype=torch.uint8).view(1, 256)
    s = torch.full((1, 8), scale_byte, dtype=torch.uint8)
    want = torch.tensor(N.decode_engram_fp8(codes.tolist(), s.tolist()), dtype=torch.float32)
    got = C.decode_engram_fp8(codes.view(E4M3), s.view(E8M0))
    assert same(got, want)
    dense = C.decode_dense_fp8(codes.view(E4M3).reshape(8, 32), torch.full((1, 1), scale_byte, dtype=torch.uint8).view(E8M0))
    assert same(dense.reshape(1, 256), want)


@pytest.mark.parametrize("scale_byte", [0, 1, 64, 127, 200, 252])
def test_every_mxfp4_byte_decodes_exactly(scale_byte):
    packed = torch.arange(256, dtype=torch.uint8).view(torch.int8).view(8, 32)  # every nibble pair
    s = torch.full((8, 2), scale_byte, dtype=torch.uint8)
    want = torch.tensor(N.decode_mxfp4(packed.tolist(), s.tolist()), dtype=torch.float32)
    assert same(C.decode_mxfp4(packed, s.view(E8M0)), want)


def test_low_nibble_is_even_column():
    packed = torch.tensor([[0x21, 0x7F, 0x8A, 0xF0] * 4], dtype=torch.uint8).view(torch.int8)
    s = torch.full((1, 1), 127, dtype=torch.uint8).view(E8M0)
    got = C.decode_mxfp4(packed, s)[0, :8].tolist()
    # 0x21: low 1 -> 0.5, high 2 -> 1.0; 0x7F: 6 -> -6 ... high 7 -> 6; 0x8A: low A -> -1, high 8 -> -0
    assert got == [0.5, 1.0, -6.0, 6.0, -1.0, -0.0, 0.0, -6.0]
    assert math.copysign(1, got[5]) < 0 and math.copysign(1, got[6]) > 0
    q, _ = C.encode_mxfp4(torch.tensor([[0.5, 1.0] + [0.0] * 29 + [6.0]]))
    assert int(u8(q)[0, 0]) == 0x21


@pytest.mark.parametrize("shape", [(1, 1), (1, 40), (31, 33), (33, 31), (32, 32), (70, 100), (64, 96)])
def test_dense_ragged_shapes_match_reference(shape):
    rows, cols = shape
    q = random_e4m3(shape, seed=rows * cols)
    s = scales((-(-rows // 32), -(-cols // 32)), seed=rows)
    want = torch.tensor(N.decode_dense_fp8(u8(q).tolist(), u8(s).tolist()), dtype=torch.float32)
    assert same(C.decode_dense_fp8(q, s), want)


@pytest.mark.parametrize("shape", [(300, 1024), (97, 5120), (40, 4100)])
def test_dense_across_chunks_matches_oracle(shape, monkeypatch):
    monkeypatch.setattr(C, "_CHUNK_ELEMS", 1 << 14)  # several chunks whatever the production chunk size
    rows, cols = shape
    q = random_e4m3(shape, seed=1)
    s = scales((-(-rows // 32), -(-cols // 32)), seed=2)
    assert same(C.decode_dense_fp8(q, s), dense_oracle(q, s))
    assert same(C.decode_dense_fp8(q, s, dtype=torch.bfloat16), dense_oracle(q, s).bfloat16())


def test_row_layouts_across_chunks_match_oracle(monkeypatch):
    monkeypatch.setattr(C, "_CHUNK_ELEMS", 1 << 14)
    q = random_e4m3((5000, 256), seed=3)
    s = scales((5000, 8), seed=4)
    want = q.float() * s.float().repeat_interleave(32, 1)
    assert same(C.decode_engram_fp8(q, s), want)
    packed = random_packed((700, 1024), seed=5)
    s = scales((700, 64), seed=6)
    b = u8(packed).long()
    table = torch.tensor(N.E2M1_TABLE)
    values = torch.stack([table[b & 15], table[b >> 4]], -1).flatten(1)
    assert same(C.decode_mxfp4(packed, s), values * s.float().repeat_interleave(32, 1))


def test_bf16_decode_is_exact_in_release_scale_range():
    q = random_e4m3((64, 64), seed=7)
    s = scales((2, 2), byte_range=(3, 247))
    assert same(C.decode_dense_fp8(q, s, dtype=torch.bfloat16).float(), C.decode_dense_fp8(q, s))
    packed = random_packed((8, 64))
    s = scales((8, 4), byte_range=(0, 253))
    assert same(C.decode_mxfp4(packed, s, dtype=torch.bfloat16).float(), C.decode_mxfp4(packed, s))


def test_decode_into_given_buffer():
    q, s = random_e4m3((40, 70)), scales((2, 3))
    out = torch.full((40, 70), 7.0)
    assert C.decode_dense_fp8(q, s, out=out) is out and same(out, dense_oracle(q, s))
    with pytest.raises(C.CodecError, match="w.q: out must be"):
        C.decode_dense_fp8(q, s, out=torch.empty(40, 71), name="w.q")


# ------------------------------------------------------------------------- round-trip properties
def all_e4m3_tensor(scale_bytes):
    """Rows of every valid E4M3 code at each scale byte: [len, 256] codes, [len, 8] scales."""
    codes = torch.tensor(VALID_E4M3 + [0, 0x80], dtype=torch.uint8).repeat(len(scale_bytes), 1)
    s = torch.tensor(scale_bytes, dtype=torch.uint8)[:, None].repeat(1, 8)
    return codes, s


def test_fp8_round_trips_for_every_code_and_scale_byte():
    # Every valid code at every non-overflowing scale byte, shuffled so blocks differ in their largest code
    # (many blocks are therefore not canonical).
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    codes = torch.tensor(VALID_E4M3 + [0, 0x80], dtype=torch.uint8)[perm].repeat(247, 1)  # [247, 256]
    q, s = codes.view(E4M3), torch.arange(247, dtype=torch.uint8)[:, None].repeat(1, 8).view(E8M0)
    d = C.decode_engram_fp8(q, s)
    q2, s2 = C.encode_engram_fp8(d, like_scale=s)
    assert same(q2, q) and same(s2, s)  # encode(decode(x), like x) == x, bytes and scales
    assert same(C.decode_engram_fp8(*C.encode_engram_fp8(d)), d)  # decode∘encode∘decode == decode
    # Dense 32×32 blocks (ragged edges included) at every scale byte.
    dq = random_e4m3((32 * 123 + 7, 45), seed=9)
    ds = torch.arange(248, dtype=torch.uint8).clamp(max=246).reshape(124, 2).view(E8M0)
    dd = C.decode_dense_fp8(dq, ds)
    q2, s2 = C.encode_dense_fp8(dd, like_scale=ds)
    assert same(q2, dq) and same(s2, ds)
    assert same(C.decode_dense_fp8(*C.encode_dense_fp8(dd)), dd)


def test_mxfp4_round_trips_for_every_byte_and_scale_byte():
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(1))
    packed = torch.arange(256, dtype=torch.uint8)[perm].repeat(253, 1).view(torch.int8)  # [253, 256]: in = 512
    s = torch.arange(0, 253, dtype=torch.uint8)[:, None].repeat(1, 16).view(E8M0)
    d = C.decode_mxfp4(packed, s)
    q2, s2 = C.encode_mxfp4(d, like_scale=s)
    assert same(q2, packed) and same(s2, s)
    assert same(C.decode_mxfp4(*C.encode_mxfp4(d)), d)
    bf = C.decode_mxfp4(packed, s, dtype=torch.bfloat16)
    assert same(C.decode_mxfp4(*C.encode_mxfp4(bf), dtype=torch.bfloat16), bf)


@pytest.mark.parametrize("layout", ["dense", "mxfp4", "engram"])
def test_reencode_without_reference_is_exact_on_exactly_the_canonical_blocks(layout):
    enc, dec, qmax, block = {
        "dense": (C.encode_dense_fp8, C.decode_dense_fp8, C.E4M3_MAX, (32, 32)),
        "mxfp4": (C.encode_mxfp4, C.decode_mxfp4, C.E2M1_MAX, (1, 32)),
        "engram": (C.encode_engram_fp8, C.decode_engram_fp8, C.E4M3_MAX, (1, 32)),
    }[layout]
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(2))
    q, s = enc(w)
    d = dec(q, s)
    amax = d.abs().unflatten(0, (-1, block[0])).unflatten(2, (-1, block[1])).amax((1, 3))
    canonical = C.canonical_e8m0(amax, qmax) == u8(s)
    assert 0 < int(canonical.sum()) <= canonical.numel()
    if layout != "dense":  # 1×32 blocks of Gaussian data round their largest value down to a lower binade often
        assert int(canonical.sum()) < canonical.numel()
    q2, s2 = enc(d)
    assert same(dec(q2, s2), d)
    assert torch.equal(u8(s2) == u8(s), canonical)  # the scale moves exactly where the block is not canonical
    rows = canonical.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    if layout == "mxfp4":
        rows = rows[:, 0::2]
    assert torch.equal(u8(q2)[rows], u8(q)[rows])


def test_noncanonical_block_keeps_values_and_reference_bytes():
    # One 1×32 block whose largest code is 2.0 at scale 2^0: canonical scale would be 2^-1 (2.0 <= 6·0.5).
    packed = torch.tensor([[0x44] + [0x12] * 15], dtype=torch.uint8).view(torch.int8)  # 2.0, 2.0, 1.0, 0.5
    s = torch.tensor([[127]], dtype=torch.uint8).view(E8M0)
    d = C.decode_mxfp4(packed, s)
    q_can, s_can = C.encode_mxfp4(d)
    assert int(u8(s_can)) == 126 and not same(q_can, packed)
    assert same(C.decode_mxfp4(q_can, s_can), d)
    q_ref, s_ref = C.encode_mxfp4(d, like_scale=s)
    assert same(q_ref, packed) and same(s_ref, s)


def test_like_scale_falls_back_to_canonical_where_the_block_changed():
    g = torch.Generator().manual_seed(3)
    q, s = C.encode_dense_fp8(torch.randn(64, 64, generator=g))
    d = C.decode_dense_fp8(q, s)
    d[40, 40] = 1024.0  # block (1, 1) no longer fits its scale
    d[0, 0] += 1e-3  # block (0, 0) is no longer on its grid
    q2, s2 = C.encode_dense_fp8(d, like_scale=s)
    assert torch.equal(u8(s2)[0, 1], u8(s)[0, 1]) and torch.equal(u8(s2)[1, 0], u8(s)[1, 0])
    assert torch.equal(u8(q2)[:32, 32:], u8(q)[:32, 32:]) and torch.equal(u8(q2)[32:, :32], u8(q)[32:, :32])
    assert int(u8(s2)[1, 1]) == int(C.canonical_e8m0(torch.tensor(1024.0), C.E4M3_MAX))
    assert float(C.decode_dense_fp8(q2, s2)[40, 40]) == 1024.0
    assert torch.equal(u8(s2)[0, 0], C.canonical_e8m0(d[:32, :32].abs().max(), C.E4M3_MAX))


# ------------------------------------------------------------------------------------- scale rule
def recipe_bytes(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The §9 recipe vectorised: exponent field of amax·fp32(1/qmax), +1 when its mantissa is non-zero."""
    bits = (amax * torch.tensor(1.0 / qmax, dtype=torch.float32)).view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()


@pytest.mark.parametrize("qmax", [C.E4M3_MAX, C.E2M1_MAX])
@pytest.mark.parametrize("exponent", [-100, -1, 0, 30, 120])
def test_canonical_scale_equals_the_recipe_for_every_mantissa(qmax, exponent):
    mant = torch.arange(1 << 23, dtype=torch.int32)
    amax = (((exponent + 127) << 23) | mant).view(torch.float32)
    assert torch.equal(C.canonical_e8m0(amax, qmax).int(), recipe_bytes(amax, qmax))


@pytest.mark.parametrize("qmax", [C.E4M3_MAX, C.E2M1_MAX])
def test_canonical_scale_is_minimal_everywhere(qmax):
    g = torch.Generator().manual_seed(4)
    bits = torch.randint(1, 0x7F800000, (200_000,), generator=g, dtype=torch.int32)
    amax = bits.view(torch.float32).double()
    b = C.canonical_e8m0(amax.float(), qmax).double()
    fits = amax <= qmax * torch.exp2(b - 127)
    smaller_fits = amax <= qmax * torch.exp2(b - 128)
    assert bool(fits.all()) and not bool((smaller_fits & (b > 0)).any())
    assert int(C.canonical_e8m0(torch.tensor([0.0]), qmax)) == 0  # the all-zero block
    # Where amax·fp32(1/qmax) is a normal fp32 number the literal per-element recipe agrees.
    for a in amax[:200].tolist():
        if a / qmax >= 2.0**-126:
            assert N.recipe_e8m0(a, qmax) == int(C.canonical_e8m0(torch.tensor([a], dtype=torch.float32), qmax))


def test_boundaries_of_the_scale_rule():
    for qmax, k in ((448.0, 0), (448.0, -50), (6.0, 3), (6.0, -120)):
        exact = torch.tensor([qmax * 2.0**k], dtype=torch.float32)
        assert int(C.canonical_e8m0(exact, qmax)) == 127 + k
        assert int(C.canonical_e8m0(torch.nextafter(exact, torch.tensor(math.inf)), qmax)) == 128 + k
    assert int(C.canonical_e8m0(torch.tensor([3.4e38]), 448.0)) <= 254


# ------------------------------------------------------------------------------------ rounding
def test_fp8_encode_rounds_like_the_reference():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 64, generator=g) * torch.logspace(-4, 4, 64)[:, None]
    w[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 448.0, -448.0, 3.0, -2.5])
    q, s = C.encode_dense_fp8(w)
    sf = s.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    scaled = (w / sf).tolist()
    want = [[N.e4m3_round_byte(x) for x in row] for row in scaled]
    assert u8(q).tolist() == want


def test_fp8_ties_go_to_even_codes():
    mags = [v for v, _ in N._E4M3_MAGNITUDES]
    mids = [(a + b) / 2 for a, b in zip(mags, mags[1:])]
    low, high = mids[:31], mids[-31:]  # 31 midpoints per row plus the block max 448
    w = torch.tensor([low + [448.0], high + [448.0]], dtype=torch.float32)
    q, s = C.encode_engram_fp8(w)
    assert u8(s).tolist() == [[127], [127]]
    assert u8(q)[:, :31].tolist() == [[N.e4m3_round_byte(x) for x in low], [N.e4m3_round_byte(x) for x in high]]
    assert all(b & 1 == 0 for b in u8(q)[:, :31].flatten().tolist())


def test_mxfp4_ties_and_rounding():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -4.0]
    g = torch.Generator().manual_seed(6)
    rest = (torch.rand(21, generator=g) * 12 - 6).tolist()
    w = torch.tensor([ties + rest + [6.0]], dtype=torch.float32)
    q, s = C.encode_mxfp4(w)
    assert int(u8(s)) == 127
    d = C.decode_mxfp4(q, s)[0]
    assert d[:10].tolist() == want and all(math.copysign(1, x) < 0 for x in d[7:10].tolist())
    b = u8(q)[0]
    nibbles = torch.stack([b & 15, b >> 4], -1).flatten().tolist()
    assert nibbles[10:31] == [N.e2m1_round_nibble(x) for x in rest]


def test_negative_zero_subnormals_and_zero_blocks():
    w = torch.zeros(32, 64)
    w[0, 0], w[0, 1] = -0.0, 448.0
    w[0, 2] = 2.0**-9  # smallest E4M3 subnormal at scale 2^0
    w[0, 3] = -3 * 2.0**-9
    q, s = C.encode_dense_fp8(w)
    assert u8(q)[0, :4].tolist() == [0x80, 0x7E, 0x01, 0x83]
    assert u8(s).tolist() == [[127, 0]]  # the all-zero block gets byte 0 (the smallest scale)
    assert same(C.decode_dense_fp8(q, s), w)
    mx = torch.zeros(2, 32)
    mx[0, 0], mx[0, 1] = -0.0, 0.5
    q, s = C.encode_mxfp4(mx)
    assert u8(q)[0, 0] == 0x68 and u8(s)[:, 0].tolist() == [124, 0]  # 0.5 <= 6·2^-3: code 4.0
    assert same(C.decode_mxfp4(q, s), mx)


def test_tiny_blocks_at_scale_byte_zero_stay_exact():
    # Scale 2^-127 with subnormal codes: the recipe's fp32 product is subnormal there; canonical stays exact.
    codes = torch.tensor([[1, 0x81, 3, 0x7E] + [0] * 28], dtype=torch.uint8)
    s = torch.zeros(1, 1, dtype=torch.uint8)
    d = C.decode_engram_fp8(codes.view(E4M3), s.view(E8M0))
    assert same(C.decode_engram_fp8(*C.encode_engram_fp8(d)), d)
    codes[0, 3] = 2  # max code now tiny too
    d = C.decode_engram_fp8(codes.view(E4M3), s.view(E8M0))
    q, s2 = C.encode_engram_fp8(d)
    assert int(u8(s2)) == 0 and same(q.view(torch.uint8), codes)


# ------------------------------------------------------------------------------------ rejections
def test_nan_scale_byte_is_rejected_naming_the_tensor():
    s = torch.full((2, 2), 127, dtype=torch.uint8)
    s[1, 0] = 255
    with pytest.raises(C.CodecError, match=r"layers\.3\.attn\.wkv\.weight: E8M0 scale byte 255 \(NaN\) at scale index \(1, 0\)"):
        C.decode_dense_fp8(random_e4m3((64, 64)), s.view(E8M0), name="layers.3.attn.wkv.weight")
    with pytest.raises(C.CodecError, match="experts.0.w1.weight: E8M0 scale byte 255"):
        C.decode_mxfp4(random_packed((2, 32)), s.view(E8M0), name="experts.0.w1.weight")
    with pytest.raises(C.CodecError, match="engram.*E8M0 scale byte 255"):
        C.decode_engram_fp8(random_e4m3((2, 64)), s.view(E8M0), name="layers.1.engram.embed.weight")
    with pytest.raises(C.CodecError, match=r"w \(like_scale\): E8M0 scale byte 255"):
        C.encode_dense_fp8(torch.ones(64, 64), like_scale=s.view(E8M0), name="w")


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_e4m3_nan_codes_are_rejected(code):
    q = random_e4m3((40, 64))
    u8(q)[37, 5] = code
    with pytest.raises(C.CodecError, match=r"wq_b.weight: E4M3 NaN code at index \(37, 5\)"):
        C.decode_dense_fp8(q, scales((2, 2)), name="wq_b.weight")
    with pytest.raises(C.CodecError, match="E4M3 NaN code"):
        C.decode_engram_fp8(q, scales((40, 2)), name="embed")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("encode", [C.encode_dense_fp8, C.encode_mxfp4, C.encode_engram_fp8])
def test_non_finite_inputs_are_rejected(bad, encode):
    w = torch.ones(40, 64, dtype=torch.bfloat16)
    w[35, 9] = bad
    with pytest.raises(C.CodecError, match=r"my.weight: non-finite input value at index \(35, 9\)"):
        encode(w, name="my.weight")


def test_overflowing_decode_is_rejected():
    q = torch.full((1, 32), 0x7E, dtype=torch.uint8).view(E4M3)  # 448
    with pytest.raises(C.CodecError, match="t: decoded value overflows"):
        C.decode_engram_fp8(q, torch.full((1, 1), 247, dtype=torch.uint8).view(E8M0), name="t")
    ones = torch.full((1, 32), 0x38, dtype=torch.uint8).view(E4M3)  # 1.0 at 2^127 is fine
    assert float(C.decode_engram_fp8(ones, torch.full((1, 1), 254, dtype=torch.uint8).view(E8M0))[0, 0]) == 2.0**127


def test_shape_and_dtype_errors():
    with pytest.raises(C.CodecError, match=r"x: scale shape \(2, 2\) does not match the expected \(3, 4\)"):
        C.decode_dense_fp8(random_e4m3((70, 100)), scales((2, 2)), name="x")
    with pytest.raises(C.CodecError, match="x: weight must be F8_E4M3"):
        C.decode_dense_fp8(torch.zeros(4, 4, dtype=torch.bfloat16), scales((1, 1)), name="x")
    with pytest.raises(C.CodecError, match="x: scale must be F8_E8M0"):
        C.decode_dense_fp8(random_e4m3((4, 4)), torch.ones(1, 1), name="x")
    with pytest.raises(C.CodecError, match="NVFP4"):
        C.decode_mxfp4(random_packed((4, 32)), scales((4, 4)), name="x")  # ratio 8: block 16
    with pytest.raises(C.CodecError, match="not a multiple of 32"):
        C.encode_mxfp4(torch.ones(4, 48), name="x")
    with pytest.raises(C.CodecError, match="2-D fp32/bf16/fp16"):
        C.encode_dense_fp8(torch.ones(4), name="x")
    with pytest.raises(C.CodecError, match="not a quantized layout"):
        C.decode(QuantRole.BF16, random_e4m3((4, 4)), scales((1, 1)))


def test_role_dispatch_matches_the_plan():
    w = torch.randn(64, 64)
    for role, enc, dec in ((QuantRole.DENSE_FP8, C.encode_dense_fp8, C.decode_dense_fp8),
                           (QuantRole.EXPERT_MXFP4, C.encode_mxfp4, C.decode_mxfp4),
                           (QuantRole.ENGRAM_FP8, C.encode_engram_fp8, C.decode_engram_fp8)):
        q, s = C.encode(role, w)
        assert all(same(a, b) for a, b in zip((q, s), enc(w)))
        assert same(C.decode(role, q, s, dtype=torch.bfloat16), dec(q, s, dtype=torch.bfloat16))
