"""Independent, slow, exact reference ("oracle") for OCP MX v1.0 quantisation.

Written from the rules in the test brief only, never from the library under
test, so that a shared misunderstanding cannot hide a bug.  Every rounding
decision is made with Python integers (or ``fractions.Fraction``); numpy is
used only to read / write float32 bit patterns and to shape arrays.

Internally a finite float32 is handled as a *dyadic* ``(neg, m, e)`` meaning
``(-1)**neg * m * 2**e`` with integer ``m >= 0``.  This keeps the oracle fast
enough for thousands of elements while staying exact.

Public API (see the docstrings):
``FORMATS``, ``decode``, ``round_fraction_to_f32``, ``f32_add``,
``quantize_block``, ``quantize``, ``dequantize``, ``matmul``,
``element_neighbours``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

__all__ = [
    "FMT_NAMES",
    "FORMATS",
    "ROUNDINGS",
    "SCALE_MODES",
    "Fmt",
    "decode",
    "dequantize",
    "element_neighbours",
    "f32_add",
    "matmul",
    "quantize",
    "quantize_block",
    "round_fraction_to_f32",
]

SCALE_MODES = ("floor", "ceil", "even", "rceil")
ROUNDINGS = ("rne", "rna")

F32_NAN_BITS = 0x7FC00000
F32_INF_BITS = 0x7F800000
F32_SIGN = 0x80000000
SCALE_NAN = 0xFF


@dataclass(frozen=True)
class Fmt:
    """Static description of one MX element format.

    ``max_k * 2**max_j`` is the largest finite magnitude; ``lsb`` is the
    exponent of the smallest step (min subnormal for the float formats,
    2^-6 for MXINT8) so that every element value is ``k * 2**lsb``.
    ``round_mbits`` is the mantissa width the "even" scale mode rounds
    amax to (6 for MXINT8, whose significand has 6 fractional bits).
    """

    name: str
    is_int: bool
    ebits: int
    mbits: int
    bias: int
    emax: int
    max_k: int
    max_j: int
    max_code_mag: int  # largest finite magnitude code (no sign bit)

    @property
    def lsb(self) -> int:
        return -6 if self.is_int else 1 - self.bias - self.mbits

    @property
    def round_mbits(self) -> int:
        return 6 if self.is_int else self.mbits

    @property
    def sign_bit(self) -> int:
        """Code bit holding the sign (float formats only)."""
        return 1 << (self.ebits + self.mbits)

    @property
    def max_normal(self) -> Fraction:
        return Fraction(self.max_k) * Fraction(2) ** self.max_j


FORMATS: dict[str, Fmt] = {
    # 6 = 3 * 2^1, codes 0..15
    "e2m1": Fmt("e2m1", False, 2, 1, 1, 2, 3, 1, 0x7),
    # 7.5 = 15 * 2^-1
    "e2m3": Fmt("e2m3", False, 2, 3, 1, 2, 15, -1, 0x1F),
    # 28 = 7 * 2^2
    "e3m2": Fmt("e3m2", False, 3, 2, 3, 4, 7, 2, 0x1F),
    # 448 = 7 * 2^6; 0x7F is NaN so the top finite code is 0x7E
    "e4m3": Fmt("e4m3", False, 4, 3, 7, 8, 7, 6, 0x7E),
    # 57344 = 7 * 2^13; 0x7C is inf so the top finite code is 0x7B
    "e5m2": Fmt("e5m2", False, 5, 2, 15, 15, 7, 13, 0x7B),
    # MXINT8: value = int8 / 64, max 127/64
    "int8": Fmt("int8", True, 0, 0, 0, 0, 127, -6, 127),
}
FMT_NAMES = tuple(FORMATS)


def _fmt(fmt: str | Fmt) -> Fmt:
    """Accept a format name or a ``Fmt``."""
    if isinstance(fmt, Fmt):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown MX format {fmt!r}") from None


# ---------------------------------------------------------------------------
# float32 <-> integers
# ---------------------------------------------------------------------------


def f32_bits_of(x: float) -> int:
    """uint32 bit pattern of ``x``, which must already be exactly a float32."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if not math.isnan(x) and struct.unpack("<f", struct.pack("<I", bits))[0] != x:
        raise ValueError(f"{x!r} is not exactly representable as float32")
    return bits


def bits_to_f32(bits: int) -> np.float32:
    """float32 with the given uint32 bit pattern."""
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def _is_special(bits: int) -> bool:
    return (bits >> 23) & 0xFF == 0xFF


def _dyadic(bits: int) -> tuple[bool, int, int]:
    """Finite float32 bits -> (neg, m, e) with value (-1)^neg * m * 2^e."""
    neg = bool(bits >> 31)
    exp = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    if exp == 0:
        return neg, frac, -149
    return neg, frac | 0x800000, exp - 150


def _floor_log2_ratio(num: int, den: int) -> int:
    """floor(log2(num / den)) for positive integers."""
    fl = num.bit_length() - den.bit_length()
    # num/den lies in (2^(fl-1), 2^(fl+1)); one comparison settles it.
    big = num >= (den << fl) if fl >= 0 else (num << -fl) >= den
    return fl if big else fl - 1


def _f32_bits_from_ratio(neg: bool, num: int, den: int, exp2: int = 0) -> int:
    """Bits of the float32 nearest (ties to even) to ``(-1)^neg * num/den * 2^exp2``.

    Handles the subnormal range (spacing 2^-149 below 2^-126) and overflow:
    anything that rounds to 2^128 or beyond becomes +-inf.  A value that
    rounds to zero keeps its sign, as IEEE rounding does.
    """
    sign = F32_SIGN if neg else 0
    if num == 0:
        return sign
    fl = _floor_log2_ratio(num, den) + exp2
    if fl > 127:
        return sign | F32_INF_BITS
    qe = max(fl, -126) - 23  # exponent of one ulp at this magnitude
    sh = exp2 - qe
    n_, d_ = (num << sh, den) if sh >= 0 else (num, den << -sh)
    n, r = divmod(n_, d_)
    if 2 * r > d_ or (2 * r == d_ and n & 1):
        n += 1
    if n == 1 << 24:  # carried into the next binade
        n >>= 1
        qe += 1
    if qe + 23 > 127:
        return sign | F32_INF_BITS
    if n < 1 << 23:  # subnormal (only possible when qe == -149)
        return sign | n
    return sign | ((qe + 23 + 127) << 23) | (n - (1 << 23))


def round_fraction_to_f32(q: Fraction) -> np.float32:
    """Correctly rounded (nearest, ties to even) float32 of the exact rational ``q``.

    Includes float32 subnormals and overflow to +-inf; a negative ``q`` that
    underflows gives -0.0.  Done with integers only (no double rounding).
    """
    q = Fraction(q)
    return bits_to_f32(_f32_bits_from_ratio(q < 0, abs(q.numerator), q.denominator))


def f32_to_fraction(x) -> Fraction:
    """Exact value of a finite float32 (or anything exactly a float32)."""
    neg, m, e = _dyadic(f32_bits_of(float(x)))
    v = Fraction(m) * Fraction(2) ** e
    return -v if neg else v


def _f32_add_bits(a: int, b: int) -> int:
    """IEEE float32 addition (round to nearest even) on bit patterns."""
    ea, eb = (a >> 23) & 0xFF, (b >> 23) & 0xFF
    a_nan = ea == 0xFF and a & 0x7FFFFF
    b_nan = eb == 0xFF and b & 0x7FFFFF
    if a_nan or b_nan:
        return F32_NAN_BITS
    a_inf, b_inf = ea == 0xFF, eb == 0xFF
    if a_inf and b_inf:
        return a if a == b else F32_NAN_BITS  # inf + -inf = NaN
    if a_inf:
        return a
    if b_inf:
        return b
    na, ma, xa = _dyadic(a)
    nb, mb, xb = _dyadic(b)
    e = min(xa, xb)
    sa = (ma << (xa - e)) * (-1 if na else 1)
    sb = (mb << (xb - e)) * (-1 if nb else 1)
    s = sa + sb
    if s == 0:
        # Exact zero: -0 only for (-0) + (-0); x + (-x) and +0 + -0 give +0.
        return F32_SIGN if (ma == 0 and mb == 0 and na and nb) else 0
    return _f32_bits_from_ratio(s < 0, abs(s), 1, e)


def f32_add(a, b) -> np.float32:
    """IEEE float32 ``a + b`` computed exactly then rounded (RNE) with integers."""
    return bits_to_f32(_f32_add_bits(f32_bits_of(float(a)), f32_bits_of(float(b))))


# ---------------------------------------------------------------------------
# element codes
# ---------------------------------------------------------------------------


def _round_int(m: int, e: int, mode: str) -> int:
    """Round ``m * 2^e`` (``m >= 0``) to an integer.

    ``mode``: "rne" (ties to even), "rna" / "tie_up" (ties away from zero),
    "rz" (toward zero), "ru" (away from zero).
    """
    if e >= 0:
        return m << e
    sh = -e
    n = m >> sh
    r = m - (n << sh)
    if r == 0 or mode == "rz":
        return n
    if mode == "ru":
        return n + 1
    half = 1 << (sh - 1)
    if r != half:
        return n + (r > half)
    if mode in ("rna", "tie_up"):
        return n + 1
    if mode == "rne":
        return n + (n & 1)
    raise ValueError(f"unknown rounding {mode!r}")


def _float_mag_code(f: Fmt, n: int, qexp: int) -> int:
    """Magnitude code of ``n * 2^qexp`` (a point of the grid, possibly beyond max).

    Codes of the finite values are monotone in magnitude, so a result
    beyond the format is just a code > ``max_code_mag``; callers saturate.
    """
    if n == 0:
        return 0
    fl = n.bit_length() - 1 + qexp
    if fl < 1 - f.bias:  # subnormal: E = 0, value = F * 2^lsb
        assert qexp == f.lsb
        return n
    shift = (fl - f.mbits) - qexp
    assert shift >= 0 and (n >> shift) << shift == n
    return ((fl + f.bias) << f.mbits) | ((n >> shift) - (1 << f.mbits))


def _encode(f: Fmt, neg: bool, m: int, e: int, rounding: str) -> int:
    """Code of the element whose scaled value is ``(-1)^neg * m * 2^e``."""
    if f.is_int:
        n = min(_round_int(m, e + 6, rounding), 127)  # saturate, never -128
        return (-n) & 0xFF if neg else n
    if m == 0:
        n, qexp = 0, 0
    else:
        fl = m.bit_length() - 1 + e
        qexp = max(fl, 1 - f.bias) - f.mbits  # grid step at |v|
        n = _round_int(m, e - qexp, rounding)
    code = min(_float_mag_code(f, n, qexp), f.max_code_mag)  # saturate
    # The sign is copied from x even when the magnitude rounds to zero.
    return code | (f.sign_bit if neg else 0)


def _shared_exp(f: Fmt, m: int, e: int, scale_mode: str) -> int:
    """Unclamped shared exponent for a block whose amax is ``m * 2^e > 0``."""
    fl = m.bit_length() - 1 + e  # exact floor(log2(amax)), subnormals too
    if scale_mode == "floor":
        return fl - f.emax
    if scale_mode == "ceil":
        return fl - f.emax + (0 if m & (m - 1) == 0 else 1)
    if scale_mode == "even":
        # Round amax's significand to round_mbits fractional bits, ties up.
        step = fl - f.round_mbits
        n = _round_int(m, e - step, "tie_up")
        return n.bit_length() - 1 + step - f.emax
    if scale_mode == "rceil":
        # q = RN_f32(amax / max_normal); smallest s with 2^s >= q.
        qbits = _f32_bits_from_ratio(False, m, f.max_k, e - f.max_j)
        if qbits == 0:
            return -127  # clamps to -127 anyway
        assert not _is_special(qbits)
        _, qm, qe = _dyadic(qbits)
        return qm.bit_length() - 1 + qe + (0 if qm & (qm - 1) == 0 else 1)
    raise ValueError(f"unknown scale_mode {scale_mode!r}")


def quantize_block(values_f32, fmt, scale_mode: str = "floor", rounding: str = "rne"):
    """Quantise one block.

    ``values_f32`` are exact float32 numbers (as Python floats).  Returns
    ``(scale_byte, codes)`` following the MX v1.0 rules in the test brief.
    """
    f = _fmt(fmt)
    bits = [f32_bits_of(float(v)) for v in values_f32]
    if any(_is_special(b) for b in bits):  # NaN or +-inf anywhere
        return SCALE_NAN, [0] * len(bits)
    # |x| ordering equals ordering of the bit patterns without the sign.
    amax_bits = max(b & 0x7FFFFFFF for b in bits)
    if amax_bits == 0:
        if f.is_int:
            return 0, [0] * len(bits)
        return 0, [f.sign_bit if b >> 31 else 0 for b in bits]
    _, am, ae = _dyadic(amax_bits)
    s = min(max(_shared_exp(f, am, ae, scale_mode), -127), 127)
    codes = []
    for b in bits:
        neg, m, e = _dyadic(b)
        codes.append(_encode(f, neg, m, e - s, rounding))  # v = x / 2^s exactly
    return s + 127, codes


def element_neighbours(value_f32: float, scale_byte: int, fmt) -> tuple[int, int]:
    """(toward-zero code, away-from-zero code) of ``x / 2^(scale_byte-127)``.

    Used for stochastic rounding, whose result must be one of these two
    (both saturate at max normal).
    """
    f = _fmt(fmt)
    neg, m, e = _dyadic(f32_bits_of(float(value_f32)))
    s = scale_byte - 127
    return _encode(f, neg, m, e - s, "rz"), _encode(f, neg, m, e - s, "ru")


def _blocked_view(a: np.ndarray, axis: int, block_size: int) -> tuple[np.ndarray, tuple]:
    """Move ``axis`` last and split it into blocks: returns ([R, nb, bs] array, moved shape)."""
    moved = np.moveaxis(a, axis, -1)
    n = moved.shape[-1]
    if n % block_size:
        raise ValueError(f"axis length {n} not divisible by block_size {block_size}")
    return moved.reshape(-1, n // block_size, block_size), moved.shape


def quantize(x, fmt, axis: int = -1, block_size: int = 32, scale_mode: str = "floor",
             rounding: str = "rne"):
    """Quantise an array; returns (codes uint8 like x, scales uint8 with axis / block_size)."""
    x32 = np.asarray(x).astype(np.float32)  # f16 / bf16 -> f32 is exact
    axis = axis % x32.ndim
    blocks, moved_shape = _blocked_view(x32, axis, block_size)
    codes = np.zeros(blocks.shape, dtype=np.uint8)
    scales = np.zeros(blocks.shape[:2], dtype=np.uint8)
    for r in range(blocks.shape[0]):
        for j in range(blocks.shape[1]):
            sb, cs = quantize_block(blocks[r, j].tolist(), fmt, scale_mode, rounding)
            scales[r, j] = sb
            codes[r, j] = cs
    codes = np.moveaxis(codes.reshape(moved_shape), -1, axis)
    scale_shape = (*moved_shape[:-1], moved_shape[-1] // block_size)
    scales = np.moveaxis(scales.reshape(scale_shape), -1, axis)
    return np.ascontiguousarray(codes), np.ascontiguousarray(scales)


# ---------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------


def _special_code_bits(f: Fmt, code: int) -> int | None:
    """float32 bits for a NaN / inf element code, else None."""
    if f.is_int:
        return None
    mag = code & (f.sign_bit - 1)
    if f.name == "e4m3" and mag == 0x7F:
        return F32_NAN_BITS
    if f.name == "e5m2" and mag >= 0x7C:
        if mag == 0x7C:
            return F32_INF_BITS | (F32_SIGN if code & f.sign_bit else 0)
        return F32_NAN_BITS
    return None


def _decode_int(f: Fmt, code: int) -> tuple[bool, int]:
    """Finite code -> (neg, k) with value (-1)^neg * k * 2^f.lsb."""
    code = int(code)
    if f.is_int:
        if not 0 <= code <= 0xFF:
            raise ValueError(f"bad int8 code {code}")
        v = code - 256 if code >= 128 else code
        return v < 0, abs(v)
    if not 0 <= code < 2 * f.sign_bit:
        raise ValueError(f"code {code:#x} has bits above the sign of {f.name}")
    if _special_code_bits(f, code) is not None:
        raise ValueError(f"code {code:#x} is NaN/inf in {f.name}")
    neg = bool(code & f.sign_bit)
    ef = (code >> f.mbits) & ((1 << f.ebits) - 1)
    mf = code & ((1 << f.mbits) - 1)
    if ef == 0:
        return neg, mf
    return neg, ((1 << f.mbits) + mf) << (ef - 1)


def decode(code: int, fmt) -> Fraction:
    """Exact value of one finite element code (raises ValueError for NaN/inf codes).

    Note a -0 code decodes to Fraction(0); use ``dequantize`` to keep the sign.
    """
    f = _fmt(fmt)
    neg, k = _decode_int(f, code)
    v = Fraction(k) * Fraction(2) ** f.lsb
    return -v if neg else v


def dequantize(codes, scales, fmt, axis: int = -1, block_size: int = 32) -> np.ndarray:
    """Exact ``decode(code) * 2^(scale-127)`` rounded correctly to float32.

    Scale 0xFF gives NaN; NaN / inf element codes give NaN / inf; a -0 code
    gives -0.0.
    """
    f = _fmt(fmt)
    codes = np.asarray(codes)
    axis = axis % codes.ndim
    blocks, moved_shape = _blocked_view(codes, axis, block_size)
    sc = np.moveaxis(np.asarray(scales), axis, -1).reshape(blocks.shape[:2])
    out = np.zeros(blocks.shape, dtype=np.uint32)
    for r in range(blocks.shape[0]):
        for j in range(blocks.shape[1]):
            sb = int(sc[r, j])
            for i, c in enumerate(blocks[r, j].tolist()):
                if sb == SCALE_NAN:
                    out[r, j, i] = F32_NAN_BITS
                    continue
                sp = _special_code_bits(f, c)
                if sp is not None:
                    out[r, j, i] = sp
                    continue
                neg, k = _decode_int(f, c)
                out[r, j, i] = _f32_bits_from_ratio(neg, k, 1, f.lsb + sb - 127)
    res = out.reshape(moved_shape).view(np.float32)
    return np.ascontiguousarray(np.moveaxis(res, -1, axis))


# ---------------------------------------------------------------------------
# matmul
# ---------------------------------------------------------------------------


def matmul(a_codes, a_scales, a_fmt, b_codes, b_scales, b_fmt, block_size: int = 32):
    """Reference MX matmul: a [M, K] blocked along K, b [K, N] blocked along K.

    For each output: acc = +0.0f; per K-block j in order, the block dot
    product is computed exactly, scaled by 2^(sa+sb), rounded once to
    float32 and added to acc with a float32 (RNE) add.  A 0xFF scale in any
    block of the pair makes that output NaN.
    """
    fa, fb = _fmt(a_fmt), _fmt(b_fmt)
    a_codes, b_codes = np.asarray(a_codes), np.asarray(b_codes)
    a_scales, b_scales = np.asarray(a_scales), np.asarray(b_scales)
    m_, k_ = a_codes.shape
    k2, n_ = b_codes.shape
    if k_ != k2 or k_ % block_size:
        raise ValueError("bad matmul shapes")
    nb = k_ // block_size
    if a_scales.shape != (m_, nb) or b_scales.shape != (nb, n_):
        raise ValueError("bad scale shapes")

    def signed(f, c):
        neg, k = _decode_int(f, c)
        return -k if neg else k

    # Integer element values: value = ai * 2^fa.lsb, bi * 2^fb.lsb.
    ai = [[signed(fa, c) for c in row] for row in a_codes.tolist()]
    bi_t = [[signed(fb, c) for c in col] for col in b_codes.T.tolist()]
    sa_all, sb_all = a_scales.tolist(), b_scales.tolist()
    out = np.zeros((m_, n_), dtype=np.uint32)
    for i in range(m_):
        for j in range(n_):
            acc = 0  # +0.0f
            for blk in range(nb):
                sa, sb = sa_all[i][blk], sb_all[blk][j]
                if sa == SCALE_NAN or sb == SCALE_NAN:
                    acc = F32_NAN_BITS
                    break
                lo, hi = blk * block_size, (blk + 1) * block_size
                d = sum(x * y for x, y in zip(ai[i][lo:hi], bi_t[j][lo:hi], strict=True))
                e = fa.lsb + fb.lsb + (sa - 127) + (sb - 127)
                acc = _f32_add_bits(acc, _f32_bits_from_ratio(d < 0, abs(d), 1, e))
            out[i, j] = acc
    return out.view(np.float32)
