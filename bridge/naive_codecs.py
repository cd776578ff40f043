"""Per-element reference decoders written straight from the format definitions (docs/architecture.md §9).

Pure Python, one element at a time, no torch float8 conversion: the independent oracle the vectorised
codecs in `codecs.py` are tested against, and the "naive decode" baseline of `python -m dsv4flash.bench
codecs`. Never used for conversion.
"""

from __future__ import annotations

import math

E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e4m3_value(byte: int) -> float:
    """The E4M3 (fn: no infinities, 0x7F/0xFF NaN) byte as a Python float."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * math.ldexp(mantissa, -9)  # subnormal: m/8 · 2^(1-7)
    return sign * math.ldexp(8 + mantissa, exponent - 7 - 3)


def e8m0_value(byte: int) -> float:
    """The E8M0 byte as a Python float: 2^(b-127), NaN for 255."""
    return math.nan if byte == 255 else math.ldexp(1.0, byte - 127)


def decode_dense_fp8(codes: list[list[int]], scale: list[list[int]]) -> list[list[float]]:
    """W[i][j] = e4m3(codes[i][j]) · e8m0(scale[i//32][j//32])."""
    return [[e4m3_value(c) * e8m0_value(scale[i // 32][j // 32]) for j, c in enumerate(row)]
            for i, row in enumerate(codes)]


def decode_engram_fp8(codes: list[list[int]], scale: list[list[int]]) -> list[list[float]]:
    """T[r][c] = e4m3(codes[r][c]) · e8m0(scale[r][c//32])."""
    return [[e4m3_value(c) * e8m0_value(scale[r][j // 32]) for j, c in enumerate(row)]
            for r, row in enumerate(codes)]


def decode_mxfp4(packed: list[list[int]], scale: list[list[int]]) -> list[list[float]]:
    """Byte [r][k] holds column 2k in its low nibble and 2k+1 in its high nibble; times e8m0(scale[r][c//32])."""
    out = []
    for r, row in enumerate(packed):
        values = []
        for k, byte in enumerate(row):
            byte &= 0xFF
            for c, nibble in ((2 * k, byte & 0xF), (2 * k + 1, byte >> 4)):
                values.append(E2M1_TABLE[nibble] * e8m0_value(scale[r][c // 32]))
        out.append(values)
    return out


# ------------------------------------------------------------------------------- encode references
_E4M3_MAGNITUDES = [(e4m3_value(b), b) for b in range(0x7F)]  # every finite non-negative code, ascending


def e4m3_round_byte(x: float) -> int:
    """The E4M3 byte nearest to x (|x| <= 448), ties to the even code; the sign (also of zero) is kept."""
    mag = abs(x)
    best = min(_E4M3_MAGNITUDES, key=lambda vb: (abs(vb[0] - mag), vb[1] & 1))
    return best[1] | (0x80 if math.copysign(1.0, x) < 0 else 0)


def e2m1_round_nibble(x: float) -> int:
    """The E2M1 nibble nearest to x (|x| <= 6), ties to the even code; the sign (also of zero) is kept."""
    mag = abs(x)
    code = min(range(8), key=lambda c: (abs(E2M1_TABLE[c] - mag), c & 1))
    return code | (8 if math.copysign(1.0, x) < 0 else 0)


def recipe_e8m0(amax: float, qmax: float) -> int:
    """The §9 recipe literally: fp32 bits of amax · fp32(1/qmax), exponent field + (mantissa != 0)."""
    import numpy as np

    p = np.float32(amax) * np.float32(1.0 / qmax)
    bits = int(np.array(p, dtype=np.float32).view(np.uint32))
    return ((bits >> 23) & 0xFF) + (1 if bits & 0x7FFFFF else 0)
