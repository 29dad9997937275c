"""Checks of the oracle itself, against independent references (ml_dtypes,
numpy's single-rounding float64 -> float32 cast, numpy float32 addition) and
hand-derived values.  If these fail, the oracle is wrong, not the library."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from tests.mx import oracle
from tests.mx.helpers import adversarial_blocks, f32_bits, finite_codes

ML_TYPES = {
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
}
F = Fraction


def bits(x) -> int:
    """uint32 bit pattern of a float32 scalar."""
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


# ---------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(ML_TYPES))
def test_decode_matches_ml_dtypes(fmt):
    f = oracle.FORMATS[fmt]
    n_finite = 0
    for code in range(2 * f.sign_bit):
        ref = float(np.array([code], dtype=np.uint8).view(ML_TYPES[fmt])[0])
        if not math.isfinite(ref):
            with pytest.raises(ValueError):
                oracle.decode(code, fmt)
            continue
        n_finite += 1
        assert oracle.decode(code, fmt) == F(ref), hex(code)
    assert n_finite == len(finite_codes(fmt))
    # max_normal, emax and the top code agree with ml_dtypes' finfo.
    fi = ml_dtypes.finfo(ML_TYPES[fmt])
    assert f.max_normal == F(float(fi.max))
    assert oracle.decode(f.max_code_mag, fmt) == f.max_normal
    assert 2**f.emax <= f.max_normal < 2 ** (f.emax + 1)
    assert f.lsb == math.log2(float(fi.smallest_subnormal))


def test_decode_int8():
    for code in range(256):
        assert oracle.decode(code, "int8") == F(int(np.uint8(code).view(np.int8)), 64)
    assert oracle.FORMATS["int8"].max_normal == F(127, 64)


# ---------------------------------------------------------------------------
# round_fraction_to_f32
# ---------------------------------------------------------------------------


def _random_f64(rng, n, lo, hi):
    """Random float64 values with exponents in [lo, hi) and random 53-bit mantissas."""
    mant = rng.integers(1 << 52, 1 << 53, n, dtype=np.int64).astype(np.float64)
    exps = rng.integers(lo - 52, hi - 52, n)
    sign = rng.choice([-1.0, 1.0], n)
    return sign * np.ldexp(mant, exps)


def test_round_fraction_matches_numpy_single_rounding():
    # np.float32(float64) is one correct rounding, so it is a valid reference
    # whenever q is exactly a float64.
    rng = np.random.default_rng(0)
    xs = np.concatenate([
        _random_f64(rng, 3000, -160, 130),
        _random_f64(rng, 1000, -152, -124),  # subnormal float32 range
    ])
    # Exact ties and near-ties: float32 value plus half an ulp (+- a little).
    base = np.abs(_random_f64(rng, 1000, -149, 128)).astype(np.float32)
    up = np.nextafter(base, np.float32(np.inf))
    half = (base.astype(np.float64) + up.astype(np.float64)) / 2
    ties = np.concatenate([half, np.nextafter(half, 0), np.nextafter(half, np.inf), -half])
    with np.errstate(over="ignore"):
        for x in np.concatenate([xs, ties]):
            if not math.isfinite(x):
                continue
            got = oracle.round_fraction_to_f32(F(float(x)))
            ref = np.float32(x)
            assert bits(got) == bits(ref), (float(x).hex(), got, ref)


@pytest.mark.parametrize(
    "q, expected_bits",
    [
        (F(0), 0x00000000),
        (F(1, 3), 0x3EAAAAAB),
        (F(-1, 3), 0xBEAAAAAB),
        (F(1, 10), 0x3DCCCCCD),
        (F(2) ** -149, 0x00000001),
        (F(2) ** -150, 0x00000000),  # tie between 0 and 2^-149 -> even (0)
        (-(F(2) ** -150), 0x80000000),  # keeps the sign: -0.0
        (F(2) ** -150 + F(2) ** -200, 0x00000001),  # just above the tie
        (F(3) * F(2) ** -150, 0x00000002),  # 1.5 ulp: tie -> even 2
        (F(5) * F(2) ** -150, 0x00000002),  # 2.5 ulp: tie -> even 2
        (F(2) ** -126 - F(2) ** -150, 0x00800000),  # rounds up into the normals
        (F(2) ** -126 - F(2) ** -149, 0x007FFFFF),  # largest subnormal
        (F(2) ** 127 * (2 - F(2) ** -23), 0x7F7FFFFF),  # fp32 max
        (F(2) ** 127 * (2 - F(2) ** -24), 0x7F800000),  # overflow threshold -> inf
        (F(2) ** 127 * (2 - F(2) ** -24) - F(1), 0x7F7FFFFF),
        (-(F(2) ** 128), 0xFF800000),
        (F(2) ** 500, 0x7F800000),
        (1 + F(2) ** -24, 0x3F800000),  # tie -> even
        (1 + 3 * F(2) ** -24, 0x3F800002),  # tie -> even (up)
        (F(2**24 + 1, 2**24), 0x3F800000),
    ],
    ids=lambda v: f"{v:#010x}" if isinstance(v, int) else None,
)
def test_round_fraction_hand_cases(q, expected_bits):
    assert bits(oracle.round_fraction_to_f32(q)) == expected_bits


def test_round_fraction_is_nearest_for_non_dyadic():
    # For rationals that are not float64s, check the defining property: no
    # float32 neighbour is closer, and exact ties pick an even significand.
    rng = np.random.default_rng(1)
    for _ in range(1500):
        q = F(int(rng.integers(1, 10**12)), int(rng.integers(1, 10**12))) * F(2) ** int(
            rng.integers(-170, 120)
        )
        r = oracle.round_fraction_to_f32(q)
        if np.isinf(r):
            assert q >= F(2) ** 127 * (2 - F(2) ** -24)
            continue
        err = abs(F(float(r)) - q)
        for nb in (np.nextafter(r, np.float32(0)), np.nextafter(r, np.float32(np.inf))):
            if np.isfinite(nb):
                e2 = abs(F(float(nb)) - q)
                assert err < e2 or (err == e2 and bits(r) % 2 == 0), (q, r, nb)


def test_f32_add_matches_numpy():
    rng = np.random.default_rng(2)
    a = _random_f64(rng, 4000, -150, 128).astype(np.float32)
    b = _random_f64(rng, 4000, -150, 128).astype(np.float32)
    # Close magnitudes (cancellation) and exact negations.
    b[:1000] = (a[:1000] * rng.uniform(-1.01, -0.99, 1000)).astype(np.float32)
    b[1000:1100] = -a[1000:1100]
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-149, -(2.0**-149),
                         3.4028235e38, -3.4028235e38], dtype=np.float32)
    sa, sb = np.meshgrid(specials, specials)
    a = np.concatenate([a, sa.ravel()])
    b = np.concatenate([b, sb.ravel()])
    with np.errstate(over="ignore", invalid="ignore"):
        ref = a + b
    got = np.array([oracle.f32_add(x, y) for x, y in zip(a, b, strict=True)], dtype=np.float32)
    nan = np.isnan(ref)
    assert (np.isnan(got) == nan).all()
    assert (f32_bits(got)[~nan] == f32_bits(ref)[~nan]).all()
    # The signed-zero rules the matmul oracle relies on.
    assert bits(oracle.f32_add(-0.0, -0.0)) == 0x80000000
    assert bits(oracle.f32_add(1.5, -1.5)) == 0
    assert bits(oracle.f32_add(-0.0, 0.0)) == 0


# ---------------------------------------------------------------------------
# quantize_block: element rounding against ml_dtypes, and hand cases
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(ML_TYPES))
def test_element_rounding_matches_ml_dtypes(fmt):
    """With the block scale forced to 2^0, rne codes equal ml_dtypes' RNE cast
    for every in-range value (ml_dtypes differs only beyond max normal)."""
    f = oracle.FORMATS[fmt]
    mn = float(f.max_normal)
    rng = np.random.default_rng(3)
    vals = np.concatenate([
        rng.uniform(-mn, mn, 3000),
        rng.uniform(-1, 1, 1000) * 2.0 ** (1 - f.bias),  # subnormal element range
    ]).astype(np.float32)
    # every grid point, midpoint and one float32 ulp either side
    grid = sorted({abs(float(oracle.decode(int(c), fmt))) for c in finite_codes(fmt)})
    mids = np.array([(a + b) / 2 for a, b in itertools.pairwise(grid)], np.float32)
    extra = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf)])
    vals = np.concatenate([vals, extra, -extra]).astype(np.float32)
    vals = vals[np.abs(vals) <= mn]
    ref = vals.astype(ML_TYPES[fmt]).view(np.uint8)
    # Anchor mn keeps the floor-mode shared exponent at 0 (scale byte 127).
    for i in range(0, len(vals), 31):
        chunk = vals[i : i + 31].tolist()
        sb, codes = oracle.quantize_block([mn, *chunk], fmt, "floor", "rne")
        assert sb == 127
        assert codes[1:] == ref[i : i + 31].tolist(), chunk


def test_int8_element_rounding():
    # Scale 2^0 (amax in [1, 2)); value = round_half_even(x * 64) / 64.
    xs = [1.5, 1 / 128, 3 / 128, -3 / 128, 5 / 128, 127.5 / 64, 1.99609375, -1.99609375, -0.0,
          2.0**-100]
    sb, codes = oracle.quantize_block(xs, "int8", "floor", "rne")
    assert sb == 127
    assert codes == [96, 0, 2, 0xFE, 2, 127, 127, 0x81, 0, 0]
    _, codes = oracle.quantize_block(xs, "int8", "floor", "rna")
    assert codes == [96, 1, 2, 0xFE, 3, 127, 127, 0x81, 0, 0]


@pytest.mark.parametrize(
    "values, fmt, mode, rounding, scale, codes",
    [
        # e2m1 grid: 0,.5,1,1.5,2,3,4,6 -> codes 0..7.  amax 6: floor s=0.
        ([6.0, 5.0, -5.0, 0.25, 0.75, -0.0], "e2m1", "floor", "rne", 127,
         [0x7, 0x6, 0xE, 0x0, 0x2, 0x8]),
        ([6.0, 5.0, -5.0, 0.25, 0.75, -0.0], "e2m1", "floor", "rna", 127,
         [0x7, 0x7, 0xF, 0x1, 0x2, 0x8]),
        # ceil: log2(6) -> 3, s = 1; v = 3, 2.5 -> 2 (even code 4), ...
        ([6.0, 5.0, -0.125], "e2m1", "ceil", "rne", 128, [0x5, 0x4, 0x8]),
        # even: 7.0 = 1.75*4 rounds up to 8 -> floor exp 3, s = 1.
        ([7.0, 1.0], "e2m1", "even", "rne", 128, [0x6, 0x1]),
        ([6.75, 1.0], "e2m1", "even", "rne", 127, [0x7, 0x2]),
        # rceil: 6/6 = 1 -> s = 0;  6.5/6 > 1 -> s = 1.
        ([6.0], "e2m1", "rceil", "rne", 127, [0x7]),
        ([6.5], "e2m1", "rceil", "rne", 128, [0x5]),
        # floor saturates: 7.5 / 1 > 6 -> 6.
        ([7.5, -7.75], "e2m1", "floor", "rne", 127, [0x7, 0xF]),
        # e4m3: amax 464 -> s = floor(log2 464) - 8 = 0; 464 ties 448/480 -> even 448.
        # 2^-10 ties 0 / 2^-9 -> 0; 1.5*2^-10 -> 2^-9; 3*2^-10 ties 1/2 -> 2 (x 2^-9).
        ([464.0, 2.0**-10, 1.5 * 2.0**-10, 3 * 2.0**-10], "e4m3", "floor", "rne", 127,
         [0x7E, 0x00, 0x01, 0x02]),
        # all-zero and NaN blocks
        ([0.0, -0.0], "e3m2", "floor", "rne", 0, [0x00, 0x20]),
        ([0.0, -0.0], "int8", "floor", "rne", 0, [0, 0]),
        ([1.0, math.nan], "e2m1", "floor", "rne", 0xFF, [0, 0]),
        ([1.0, -math.inf], "int8", "floor", "rne", 0xFF, [0, 0]),
        # FP32 max, int8 (emax 0): floor s = 127; ceil wants 128 -> clamped 127.
        ([3.4028234663852886e38], "int8", "floor", "rne", 254, [127]),
        ([3.4028234663852886e38], "int8", "ceil", "rne", 254, [127]),
        # 2^-149 in e2m1: s = -149 - 2 clamps to -127; v = 2^-22 -> +0 code.
        ([2.0**-149, -(2.0**-149)], "e2m1", "floor", "rne", 0, [0x0, 0x8]),
        # int8, amax just below 2^-126: even rounds it to 2^-126 -> s = -126.
        ([2.0**-126 - 2.0**-149], "int8", "even", "rne", 1, [64]),
        ([2.0**-126 - 2.0**-149], "int8", "floor", "rne", 0, [127]),
        ([2.0**-126 - 2.0**-149], "int8", "ceil", "rne", 1, [64]),
    ],
)
def test_quantize_block_hand_cases(values, fmt, mode, rounding, scale, codes):
    assert oracle.quantize_block(values, fmt, mode, rounding) == (scale, codes)


def test_rceil_subnormal_quotient_rounds_down():
    # e2m1: amax = 6*2^-127 + 2^-148 (one ulp above 1.5*2^-125).  amax/6 =
    # 2^-127 + 2^-149/3, which in the float32 subnormal range (ulp 2^-149)
    # rounds to 2^-127 -> s = -127.  An exact ceil(log2(amax/6)) gives -126.
    amax = 6 * 2.0**-127 + 2.0**-148
    assert oracle.quantize_block([amax], "e2m1", "rceil", "rne")[0] == 0
    # two ulps above: 2^-127 + 2^-149 * 2/3 rounds up -> s = -126
    assert oracle.quantize_block([amax + 2.0**-148], "e2m1", "rceil", "rne")[0] == 1


@pytest.mark.parametrize("fmt", oracle.FMT_NAMES)
def test_even_boundary(fmt):
    f = oracle.FORMATS[fmt]
    for k in (-3, 0, 5):
        b = (2.0 - 2.0 ** -(f.round_mbits + 1)) * 2.0**k
        below = float(np.nextafter(np.float32(b), np.float32(0)))
        assert oracle.quantize_block([b], fmt, "even")[0] == 127 + k + 1 - f.emax
        assert oracle.quantize_block([below], fmt, "even")[0] == 127 + k - f.emax
        assert oracle.quantize_block([below], fmt, "floor")[0] == 127 + k - f.emax


def test_quantize_array_layout_matches_blockwise():
    # quantize() over a 3-D array along axis 1 equals quantize_block per block.
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((2, 16, 3)) * 4).astype(np.float32)
    codes, scales = oracle.quantize(x, "e3m2", axis=1, block_size=8, scale_mode="even")
    assert codes.shape == x.shape and scales.shape == (2, 2, 3)
    for i in range(2):
        for j in range(2):
            for k in range(3):
                sb, cs = oracle.quantize_block(x[i, 8 * j : 8 * j + 8, k].tolist(), "e3m2", "even")
                assert scales[i, j, k] == sb
                assert codes[i, 8 * j : 8 * j + 8, k].tolist() == cs


@pytest.mark.parametrize("fmt", oracle.FMT_NAMES)
def test_dequantize_is_close_and_bounded(fmt):
    """Oracle dequantize(quantize(x)) is within half a grid step (rne, floor) of x."""
    x, _ = adversarial_blocks(fmt)
    codes, scales = oracle.quantize(x, fmt)
    d = oracle.dequantize(codes, scales, fmt)
    f = oracle.FORMATS[fmt]
    finite = scales[:, 0] != 0xFF
    assert np.isnan(d[~finite]).all() and not np.isnan(d[finite]).any()
    s = np.ldexp(1.0, scales[finite, 0].astype(int) - 127)[:, None]
    xf, df = x[finite].astype(np.float64), d[finite].astype(np.float64)
    # |d| <= max_normal * 2^s, and |x - d| <= 1/2 step (or saturation) where the
    # step at x is at most 2^(floor(log2 amax)-mbits) (int8: 2^-6 * 2^s).
    assert (np.abs(df) <= float(f.max_normal) * s).all()
    step = s * (2.0**-6 if f.is_int else 2.0 ** (f.emax - f.mbits))
    sat = np.abs(xf) > float(f.max_normal) * s
    ok = (np.abs(xf - df) <= step / 2) | sat | (np.abs(xf) < 2.0**-100)
    assert ok.all()


def test_dequantize_specials():
    # -0 code -> -0.0, scale 0xFF -> NaN, e5m2 inf code -> inf, overflow -> inf.
    def deq(codes, scale, fmt):
        c = np.array([codes], np.uint8)
        return oracle.dequantize(c, np.array([[scale]], np.uint8), fmt, block_size=c.shape[1])

    d = deq([0x80, 0x7C, 0xFC, 0x7B], 127, "e5m2")
    assert f32_bits(d).tolist() == [[0x80000000, 0x7F800000, 0xFF800000, 0x47600000]]
    assert deq([7, 1], 254, "e2m1").tolist() == [[math.inf, 2.0**126]]
    assert np.isnan(deq([1, 1], 0xFF, "e2m1")).all()
    assert deq([1, 0xFF], 0, "int8").tolist() == [[2.0**-133, -(2.0**-133)]]


def test_matmul_hand_case():
    # One 2-block dot: block 0 = 6*6*32 * 2^20 (=1152*2^20), block 1 = 0.25*2^-10.
    # The small block is absorbed in float32: result is exactly 1152*2^20.
    a = np.zeros((1, 64), np.uint8)
    b = np.zeros((64, 1), np.uint8)
    a[0, :32] = 7
    b[:32, 0] = 7
    a[0, 32] = 1
    b[32, 0] = 1
    out = oracle.matmul(a, np.array([[137, 122]], np.uint8), "e2m1", b,
                        np.array([[137], [123]], np.uint8), "e2m1")
    assert out.tolist() == [[1152.0 * 2.0**20]]
    # Order matters: +B, +s, -B  ->  0 in sequential float32, not s.
    a = np.zeros((1, 96), np.uint8)
    b = np.zeros((96, 1), np.uint8)
    a[0, :32] = 7
    a[0, 32] = 1
    a[0, 64:] = 0xF  # -6
    b[:, 0] = 7
    b[32, 0] = 1
    sa = np.array([[137, 122, 137]], np.uint8)
    sb = np.array([[137], [123], [137]], np.uint8)
    assert oracle.matmul(a, sa, "e2m1", b, sb, "e2m1").tolist() == [[0.0]]
    # NaN scale poisons the output.
    sa[0, 1] = 0xFF
    assert np.isnan(oracle.matmul(a, sa, "e2m1", b, sb, "e2m1")).all()
