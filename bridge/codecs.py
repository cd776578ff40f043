"""Stored quantization codecs of the release checkpoint (docs/architecture.md §9), vectorised torch.

Three layouts, one scale rule:

- dense FP8: E4M3 codes ``[out, in]`` with E8M0 scales over 32×32 blocks, ``[ceil(out/32), ceil(in/32)]``
  (ragged edge blocks included);
- routed-expert MXFP4: two E2M1 codes per I8 byte (low nibble = even column), ``[out, in/2]``, with 1×32
  E8M0 scales along the input dim, ``[out, in/32]`` (weight/scale width ratio 16; it is not NVFP4);
- Engram table FP8: E4M3 rows ``[rows, d]`` with per-row 1×32 E8M0 scales ``[rows, d/32]``.

An E8M0 byte b is the multiplier 2^(b-127); 255 is NaN and rejected, as are E4M3 NaN codes and non-finite
inputs. Encoding picks, per block, the smallest power of two s with amax <= qmax·s (qmax 448 for E4M3, 6 for
E2M1; an all-zero block gets byte 0): the §9 recipe 2^ceil(log2(amax·fp32(1/qmax))) wherever that product is
a normal fp32 number, continued exactly below it. With ``like_scale`` every block that the given scale
reproduces exactly keeps it, so re-encoding a decoded tensor returns its original bytes. docs/bridge.md states
the guarantees and why they hold.

Every function works on row chunks of about `_CHUNK_ELEMS` elements (whole 32-row block rows for dense), so
the temporaries stay bounded (≈ 12 MiB) whatever the tensor size; within a chunk everything is vectorised over
elements and blocks. 2^20 elements measured fastest on the 2-core VM (2^17: 0.22× memcpy for BF16 MXFP4 decode,
2^20: 0.35×): per-chunk dispatch overhead outweighs the L2 locality of smaller chunks.
"""

from __future__ import annotations

import torch

from dsv4flash.release.quant_plan import QuantRole

__all__ = [
    "CodecError", "BLOCK", "E4M3_MAX", "E2M1_MAX", "canonical_e8m0", "decode", "encode",
    "decode_dense_fp8", "encode_dense_fp8", "decode_mxfp4", "encode_mxfp4", "decode_engram_fp8", "encode_engram_fp8",
]

BLOCK = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
_E4M3, _E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
_CHUNK_ELEMS = 1 << 20
# Largest scale byte with qmax·2^(b-127) finite in fp32/bf16 (448 = 1.75·2^8, 6 = 1.5·2^2).
_SAFE_BYTE = {E4M3_MAX: 246, E2M1_MAX: 252}
_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_BYTE = torch.arange(256)
# One int64 per packed byte = the fp32 pair (low nibble, high nibble): gathering it unpacks and decodes at once.
_E2M1_PAIR_TABLE = torch.stack([_E2M1_VALUES[_BYTE & 15], _E2M1_VALUES[_BYTE >> 4]], -1).view(torch.int64)[:, 0]


class CodecError(ValueError):
    """A stored or to-be-stored tensor the codec cannot represent; the message names the tensor."""


# --------------------------------------------------------------------------------------- blocks, chunks
def _chunks(rows: int, cols: int, align: int):
    """Row ranges of about _CHUNK_ELEMS elements, whole multiples of `align` rows."""
    step = max(align, _CHUNK_ELEMS // max(cols, 1) // align * align)
    return [(r0, min(r0 + step, rows)) for r0 in range(0, rows, step)]


def _regions(rows: int, cols: int, block: tuple[int, int]):
    """(rows, cols, scale rows, scale cols, block rows, block cols) of the <= 4 uniformly blocked regions."""
    br, bc = block
    for r0, r1, rb in ((0, rows - rows % br, br), (rows - rows % br, rows, rows % br)):
        for c0, c1, cb in ((0, cols - cols % bc, bc), (cols - cols % bc, cols, cols % bc)):
            if r1 > r0 and c1 > c0:
                yield slice(r0, r1), slice(c0, c1), slice(r0 // br, -(-r1 // br)), slice(c0 // bc, -(-c1 // bc)), rb, cb


def _blocked(t: torch.Tensor, rs: slice, cs: slice, rb: int, cb: int) -> torch.Tensor:
    """A region of a 2-D tensor viewed as [row blocks, rb, col blocks, cb]."""
    return t[rs, cs].unflatten(0, (-1, rb)).unflatten(2, (-1, cb))


def _mul_blocks(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    """values[i, j] *= scale[i // br, j // bc], in place."""
    for rs, cs, srs, scs, rb, cb in _regions(*values.shape, block):
        _blocked(values, rs, cs, rb, cb).mul_(scale[srs, scs][:, None, :, None])


def _block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| per block of an fp32 tensor, [ceil(rows/br), ceil(cols/bc)]; NaN and inf propagate."""
    out = torch.empty(-(-x.shape[0] // block[0]), -(-x.shape[1] // block[1]), dtype=torch.float32)
    for rs, cs, srs, scs, rb, cb in _regions(*x.shape, block):
        view = _blocked(x, rs, cs, rb, cb)
        out[srs, scs] = torch.maximum(view.amax((1, 3)), -view.amin((1, 3)))
    return out


def _first(mask: torch.Tensor, offset: int = 0) -> tuple[int, ...]:
    """Index of the first True element, its row shifted by `offset` (for error messages)."""
    idx = [int(i) for i in mask.nonzero()[0]]
    return (idx[0] + offset, *idx[1:])


# ----------------------------------------------------------------------------------------------- E8M0
def canonical_e8m0(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """E8M0 bytes (uint8) of the smallest power of two s with amax <= qmax·s; 0 for amax == 0 or below range."""
    mant, exp = torch.frexp(amax.float())  # amax = mant·2^exp, mant in [0.5, 1), exact also for subnormals
    q_mant, q_exp = torch.frexp(torch.tensor(qmax, dtype=torch.float32))
    k = exp - q_exp + (mant > q_mant).to(exp.dtype)  # exactly ceil(log2(amax / qmax))
    return torch.where(amax > 0, k + 127, 0).clamp_(0, 254).to(torch.uint8)


def _scale_values(raw: torch.Tensor) -> torch.Tensor:
    """2^(b-127) as fp32, exact for every byte 0..254."""
    return raw.view(_E8M0).float()


def _inverse_scale_values(raw: torch.Tensor) -> torch.Tensor:
    """2^(127-b) as fp32, exact: the byte 254-b read as E8M0."""
    return (254 - raw.to(torch.int16)).to(torch.uint8).view(_E8M0).float()


def _scale_bytes(scale: torch.Tensor, name: str, shape: tuple[int, int]) -> torch.Tensor:
    """Check a stored E8M0 scale (dtype, shape, no NaN byte) and return its bytes as uint8."""
    if scale.dtype not in (_E8M0, torch.uint8):
        raise CodecError(f"{name}: scale must be F8_E8M0 (torch.float8_e8m0fnu), got {scale.dtype}")
    if tuple(scale.shape) != tuple(shape):
        raise CodecError(f"{name}: scale shape {tuple(scale.shape)} does not match the expected {tuple(shape)}")
    raw = scale.view(torch.uint8)
    if raw.numel() and int(raw.max()) == 255:
        raise CodecError(f"{name}: E8M0 scale byte 255 (NaN) at scale index {_first(raw == 255)}")
    return raw


def _codes(weight: torch.Tensor, dtypes: tuple[torch.dtype, ...], label: str, name: str) -> torch.Tensor:
    """Check a stored weight's dtype and rank and return its bytes as uint8."""
    if weight.dtype not in dtypes:
        raise CodecError(f"{name}: weight must be {label}, got {weight.dtype}")
    if weight.dim() != 2:
        raise CodecError(f"{name}: weight must be 2-D, got shape {tuple(weight.shape)}")
    return weight.view(torch.uint8)


def _output(out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype, name: str) -> torch.Tensor:
    """The decode destination: `out` after checking it, or a new tensor."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CodecError(f"{name}: decode dtype must be float32, bfloat16 or float16, got {dtype}")
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise CodecError(f"{name}: out must be a contiguous {dtype} tensor of shape {tuple(shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return out


# ---------------------------------------------------------------------------------------------- decode
def _fp8_chunk(raw: torch.Tensor, values: torch.Tensor, bits: torch.Tensor, name: str, row0: int) -> None:
    """E4M3 bytes -> values · 2^-8 in fp32: the 7 magnitude bits shifted into an fp16's exponent and
    mantissa (subnormals land on fp16 subnormals), the sign moved to bit 15, then a hardware fp16 -> fp32."""
    as_int8 = raw.view(torch.int8)
    if int(as_int8.max()) == 0x7F or int(raw.max()) == 0xFF:  # the only two NaN codes are extremal bytes
        raise CodecError(f"{name}: E4M3 NaN code at index {_first((raw & 0x7F) == 0x7F, row0)}")
    bits.copy_(as_int8)  # sign-extends: negative codes get bits 15 and 14 set
    bits.bitwise_left_shift_(7).bitwise_and_(~0x4000)
    values.copy_(bits.view(torch.float16))


def _decode(kind: str, raw, raw_scale, block, out, name) -> torch.Tensor:
    """Decode codes (uint8) with scale bytes into `out`, one row chunk at a time."""
    rows, cols = out.shape
    qmax, unit = (E2M1_MAX, 1.0) if kind == "mxfp4" else (E4M3_MAX, 2.0**8)  # chunk values are code / unit
    high = raw_scale.numel() > 0 and int(raw_scale.max()) > _SAFE_BYTE[qmax]
    scale = _scale_values(raw_scale)
    if not high:  # fold 1/unit into the scale; with scale bytes near the top that could overflow
        scale.mul_(unit)
    step = _chunks(rows, cols, block[0])[0][1] if rows else 0
    scratch = None if out.dtype == torch.float32 else torch.empty(step * cols, dtype=torch.float32)
    work = torch.empty(step * raw.shape[1], dtype=torch.int64 if kind == "mxfp4" else torch.int16)
    for r0, r1 in _chunks(rows, cols, block[0]):
        n = r1 - r0
        values = out[r0:r1] if scratch is None else scratch[: n * cols].view(n, cols)
        chunk_work = work[: n * raw.shape[1]].view(n, raw.shape[1])
        if kind == "mxfp4":  # gather one fp32 pair per byte: columns (2k, 2k+1) from nibbles (low, high)
            chunk_work.copy_(raw[r0:r1])
            torch.gather(_E2M1_PAIR_TABLE.expand(n, 256), 1, chunk_work, out=values.view(torch.int64))
        else:
            _fp8_chunk(raw[r0:r1], values, chunk_work, name, r0)
        if high:
            values.mul_(unit)
        _mul_blocks(values, scale[r0 // block[0]: -(-r1 // block[0])], block)
        if high and not bool(torch.isfinite(values).all()):
            raise CodecError(f"{name}: decoded value overflows fp32 at index {_first(~torch.isfinite(values), r0)}")
        if scratch is not None:
            out[r0:r1].copy_(values)  # the exact fp32 products round once here (RNE)
    return out


def decode_dense_fp8(weight, scale, *, dtype=torch.float32, out=None, name="tensor") -> torch.Tensor:
    """Dense FP8: W[i, j] = e4m3[i, j] · 2^(scale[i//32, j//32] - 127), as `dtype` [out, in]."""
    raw = _codes(weight, (_E4M3, torch.uint8), "F8_E4M3 (torch.float8_e4m3fn)", name)
    raw_scale = _scale_bytes(scale, name, _dense_scale_shape(*raw.shape))
    return _decode("fp8", raw, raw_scale, (BLOCK, BLOCK), _output(out, raw.shape, dtype, name), name)


def decode_engram_fp8(weight, scale, *, dtype=torch.float32, out=None, name="tensor") -> torch.Tensor:
    """Engram table rows: T[r, c] = e4m3[r, c] · 2^(scale[r, c//32] - 127), as `dtype` [rows, d]."""
    raw = _codes(weight, (_E4M3, torch.uint8), "F8_E4M3 (torch.float8_e4m3fn)", name)
    raw_scale = _scale_bytes(scale, name, _row_scale_shape(*raw.shape, name, "Engram row"))
    return _decode("fp8", raw, raw_scale, (1, BLOCK), _output(out, raw.shape, dtype, name), name)


def decode_mxfp4(weight, scale, *, dtype=torch.float32, out=None, name="tensor") -> torch.Tensor:
    """Routed-expert MXFP4: packed I8 [out, in/2] + E8M0 [out, in/32] -> `dtype` [out, in]."""
    raw = _codes(weight, (torch.int8, torch.uint8), "I8 (two E2M1 per byte)", name)
    raw_scale = _scale_bytes(scale, name, _mx_scale_shape(raw, scale, name))
    shape = (raw.shape[0], 2 * raw.shape[1])
    return _decode("mxfp4", raw, raw_scale, (1, BLOCK), _output(out, shape, dtype, name), name)


# ---------------------------------------------------------------------------------------------- encode
def _fp8_quantize(x: torch.Tensor, raw_scale: torch.Tensor, block) -> torch.Tensor:
    """E4M3 bytes of x / scale, round to nearest even (the scale keeps |x/s| <= 448); x (fp32) is consumed."""
    _mul_blocks(x, _inverse_scale_values(raw_scale), block)
    return x.to(_E4M3).view(torch.uint8)


def _mx_quantize(x: torch.Tensor, raw_scale: torch.Tensor, block) -> torch.Tensor:
    """Packed MXFP4 bytes of x / scale, round to nearest even on the E2M1 grid; x (fp32) is consumed."""
    _mul_blocks(x, _inverse_scale_values(raw_scale), block)
    x.clamp_(-E2M1_MAX, E2M1_MAX)
    # The grid step is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], i.e. 2^(clamp(floor(log2|x|), 0, 2) - 1):
    # built from the fp32 exponent field; round(x / step) is then round-half-even on the grid.
    biased = ((x.view(torch.int32) >> 23) & 0xFF).clamp_(127, 129)
    step = ((biased - 1) << 23).view(torch.float32)
    x.div_(step).round_().mul_(step)
    # An E2M1 value v times 2^-6 is the E4M3 byte s000_eem00 for the nibble s_eem (subnormal 0.5 included).
    e4m3 = x.mul_(2.0**-6).to(_E4M3).view(torch.uint8)
    nibble = ((e4m3 & 0x80) >> 4) | ((e4m3 >> 2) & 0x07)
    return nibble[:, 0::2] | (nibble[:, 1::2] << 4)


def _values(kind: str, codes: torch.Tensor, raw_scale: torch.Tensor, block, name: str) -> torch.Tensor:
    """fp32 decode of one chunk's codes (used to test whether a reference scale is lossless)."""
    cols = codes.shape[1] * (2 if kind == "mxfp4" else 1)
    return _decode(kind, codes, raw_scale, block, torch.empty(codes.shape[0], cols), name)


def _input_shape(w: torch.Tensor, name: str) -> tuple[int, int]:
    """Check an encode input (2-D fp32/bf16/fp16) and return its shape."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.element_size() < 2 or w.dim() != 2:
        what = f"{w.dtype} {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise CodecError(f"{name}: encode needs a 2-D fp32/bf16/fp16 tensor, got {what}")
    return w.shape[0], w.shape[1]


def _encode(kind: str, w, like_scale, block, scale_shape, name) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode a float tensor chunk by chunk -> (codes uint8, scale bytes uint8)."""
    rows, cols = w.shape
    qmax, quantize = (E2M1_MAX, _mx_quantize) if kind == "mxfp4" else (E4M3_MAX, _fp8_quantize)
    ref = None if like_scale is None else _scale_bytes(like_scale, f"{name} (like_scale)", scale_shape)
    codes = torch.empty(rows, cols // 2 if kind == "mxfp4" else cols, dtype=torch.uint8)
    raw_scale = torch.empty(scale_shape, dtype=torch.uint8)
    for r0, r1 in _chunks(rows, cols, block[0]):
        # fp32 chunk copy: the quantizers work in place, and bf16 block reductions are an order slower
        x, srows = w[r0:r1].to(torch.float32, copy=True), slice(r0 // block[0], -(-r1 // block[0]))
        amax = _block_amax(x, block)
        if not bool(torch.isfinite(amax).all()):  # amax propagates NaN and inf, so this sees every element
            raise CodecError(f"{name}: non-finite input value at index {_first(~torch.isfinite(x), r0)}")
        chosen = canonical_e8m0(amax, qmax)
        if ref is not None:  # keep the reference scale where it reproduces the block exactly
            error = _values(kind, quantize(x.clone(), ref[srows], block), ref[srows], block, name).sub_(x)
            chosen = torch.where(_block_amax(error, block) == 0, ref[srows], chosen)
        raw_scale[srows] = chosen
        codes[r0:r1] = quantize(x, chosen, block)
    return codes, raw_scale


def encode_dense_fp8(w, *, like_scale=None, name="tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Dense FP8 encode of float [out, in] -> (E4M3 [out, in], E8M0 [ceil(out/32), ceil(in/32)])."""
    codes, scale = _encode("fp8", w, like_scale, (BLOCK, BLOCK), _dense_scale_shape(*_input_shape(w, name)), name)
    return codes.view(_E4M3), scale.view(_E8M0)


def encode_engram_fp8(w, *, like_scale=None, name="tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Engram table encode of float rows [rows, d] -> (E4M3 [rows, d], E8M0 [rows, d/32])."""
    shape = _row_scale_shape(*_input_shape(w, name), name, "Engram row")
    codes, scale = _encode("fp8", w, like_scale, (1, BLOCK), shape, name)
    return codes.view(_E4M3), scale.view(_E8M0)


def encode_mxfp4(w, *, like_scale=None, name="tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 encode of float [out, in] -> (I8 [out, in/2] with low nibble = even column, E8M0 [out, in/32])."""
    shape = _row_scale_shape(*_input_shape(w, name), name, "MXFP4 input")
    codes, scale = _encode("mxfp4", w, like_scale, (1, BLOCK), shape, name)
    return codes.view(torch.int8), scale.view(_E8M0)


# ---------------------------------------------------------------------------------------------- shapes
def _dense_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """[ceil(rows/32), ceil(cols/32)]."""
    return -(-rows // BLOCK), -(-cols // BLOCK)


def _row_scale_shape(rows: int, cols: int, name: str, what: str) -> tuple[int, int]:
    """[rows, cols/32] for the 1×32 layouts; the width must be a multiple of 32."""
    if cols % BLOCK:
        raise CodecError(f"{name}: {what} width {cols} is not a multiple of {BLOCK}")
    return rows, cols // BLOCK


def _mx_scale_shape(weight: torch.Tensor, scale: torch.Tensor, name: str) -> tuple[int, int]:
    """The [out, in/32] scale shape of a packed [out, in/2] weight; names the NVFP4 misreading."""
    rows, half = weight.shape
    if half % (BLOCK // 2):
        raise CodecError(f"{name}: packed MXFP4 width {half} (= in/2) is not a multiple of {BLOCK // 2}")
    if scale.dim() == 2 and scale.shape[0] == rows and scale.shape[1] * 8 == half:
        raise CodecError(f"{name}: weight/scale width ratio is 8, the NVFP4 layout (block 16); MXFP4 has "
                         f"ratio 16 (1×32 E8M0 blocks), expected scale shape {(rows, half // 16)}")
    return rows, half // (BLOCK // 2)


# -------------------------------------------------------------------------------------------- dispatch
_DECODERS = {QuantRole.DENSE_FP8: decode_dense_fp8, QuantRole.EXPERT_MXFP4: decode_mxfp4,
             QuantRole.ENGRAM_FP8: decode_engram_fp8}
_ENCODERS = {QuantRole.DENSE_FP8: encode_dense_fp8, QuantRole.EXPERT_MXFP4: encode_mxfp4,
             QuantRole.ENGRAM_FP8: encode_engram_fp8}


def decode(role: QuantRole, weight, scale, *, dtype=torch.float32, out=None, name="tensor") -> torch.Tensor:
    """Decode a stored (weight, scale) pair of a quantized role."""
    if role not in _DECODERS:
        raise CodecError(f"{name}: role {role.value} is not a quantized layout")
    return _DECODERS[role](weight, scale, dtype=dtype, out=out, name=name)


def encode(role: QuantRole, w, *, like_scale=None, name="tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Encode a float tensor into the stored (weight, scale) pair of a quantized role."""
    if role not in _ENCODERS:
        raise CodecError(f"{name}: role {role.value} is not a quantized layout")
    return _ENCODERS[role](w, like_scale=like_scale, name=name)
