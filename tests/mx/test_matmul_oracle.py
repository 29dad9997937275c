"""mx.matmul against the oracle, bit for bit.

The oracle's contract: per output, acc = +0.0f; for each K-block in order the
block's dot product is exact, scaled by 2^(sa+sb), rounded once to float32
and added to acc with one float32 RNE add.  Inputs are built directly as
MXArrays so the tests control every scale byte.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.mx import oracle
from tests.mx.helpers import (
    assert_f32_identical,
    lib,
    make_mx,
    negate_code,
    random_codes,
    random_mx_operands,
)

fp8 = pytest.mark.fp8_exact
PAIRS = [
    pytest.param("e2m1", "e2m1", id="e2m1xe2m1"),
    pytest.param("e2m3", "e2m3", id="e2m3xe2m3"),
    pytest.param("e3m2", "e3m2", id="e3m2xe3m2"),
    pytest.param("int8", "int8", id="int8xint8"),
    pytest.param("e2m1", "e3m2", id="e2m1xe3m2"),
    pytest.param("e4m3", "e4m3", id="e4m3xe4m3", marks=fp8),
    pytest.param("e5m2", "e5m2", id="e5m2xe5m2", marks=fp8),
    pytest.param("e4m3", "e2m1", id="e4m3xe2m1", marks=fp8),
]


def run_and_compare(a, sa, fa, b, sb, fb, a_axis=1):
    """Library matmul of the hand-built MXArrays equals the oracle; returns the result."""
    qa = make_mx(a, sa, fa, axis=a_axis)
    qb = make_mx(b, sb, fb, axis=0)
    got = np.asarray(lib().matmul(qa, qb))
    expected = oracle.matmul(a, sa, fa, b, sb, fb)
    assert got.shape == expected.shape
    assert_f32_identical(got, expected, f"matmul {fa} x {fb}")
    return got


@pytest.mark.parametrize("m, k, n, a_axis", [
    pytest.param(3, 32, 5, 1, id="3x32x5"),
    pytest.param(3, 256, 5, 1, id="3x256x5"),
    pytest.param(2, 4096, 2, -1, id="2x4096x2-axis-1"),
])
@pytest.mark.parametrize("fa, fb", PAIRS)
def test_random(fa, fb, m, k, n, a_axis):
    rng = np.random.default_rng(m * 1000 + k + len(fa + fb))
    a, sa, b, sb = random_mx_operands(rng, fa, fb, m, k, n)
    run_and_compare(a, sa, fa, b, sb, fb, a_axis)


@pytest.mark.parametrize("fa, fb", PAIRS)
def test_scale_regimes(fa, fb):
    """Rows of a and columns of b live in different scale regimes, so the
    5x5 outputs cover: scales far apart (2^127 * 2^-127 must not overflow or
    underflow on the way), float32-subnormal results (one rounding, not two),
    total underflow to 0, overflow to +-inf (and inf + -inf = NaN)."""
    rng = np.random.default_rng(20)
    regimes = [(245, 254), (0, 10), (0, 12), (120, 134), (190, 200)]
    # Column 2 is aimed at float32-subnormal outputs; shift it by the operand
    # magnitude (log2 of max_a * max_b) so it lands there for every format.
    t = int(np.log2(float(oracle.FORMATS[fa].max_normal * oracle.FORMATS[fb].max_normal)))
    regimes_b = [(0, 10), (245, 254), (105 - t, 117 - t), (0, 3), (190, 200)]
    k = 128
    a = random_codes(rng, fa, (5, k))
    b = random_codes(rng, fb, (k, 5))
    sa = np.stack([rng.integers(lo, hi + 1, k // 32) for lo, hi in regimes]).astype(np.uint8)
    sb = np.stack([rng.integers(lo, hi + 1, k // 32) for lo, hi in regimes_b], 1).astype(np.uint8)
    out = run_and_compare(a, sa, fa, b, sb, fb)
    # The oracle agrees; make sure the regimes really produced what they claim
    # (so this test keeps its teeth if the data changes).
    assert (np.abs(out[2, 2]) < 2.0**-126) and (out[2, :] != 0).any()
    assert out[1, 3] == 0
    assert not np.isfinite(out[4, 4])


@pytest.mark.parametrize("fa, fb", PAIRS)
def test_cancellation_across_blocks(fa, fb):
    """Per-block results B (big) and s (far below ulp(B)/2) in different orders.

    row 0: B, s, -B, s  -> sequential float32 gives s (exact: 2s, pairwise: 0)
    row 1: B, -B' + e   -> (block 1 holds 31 big negatives and one small)
    row 2: s, B, -B, 0  -> 0 (s is absorbed into B first)
    row 3: B, -B, s, s  -> 2s
    row 4: random codes
    """
    fa_, fb_ = oracle.FORMATS[fa], oracle.FORMATS[fb]
    big_a, big_b, small = fa_.max_code_mag, fb_.max_code_mag, 1
    k = 128
    a = np.zeros((5, k), np.uint8)
    blk = [slice(32 * j, 32 * j + 32) for j in range(4)]

    def put(row, j, kind):
        if kind == "B":
            a[row, blk[j]] = big_a
        elif kind == "-B":
            a[row, blk[j]] = negate_code(fa, big_a)
        elif kind == "s":
            a[row, 32 * j + 5] = small

    for row, kinds in enumerate([["B", "s", "-B", "s"], ["B", "-B", None, None],
                                 ["s", "B", "-B", None], ["B", "-B", "s", "s"]]):
        for j, kind in enumerate(kinds):
            put(row, j, kind)
    a[1, 32 + 7] = small  # block 1 of row 1: 31 x -big and one small
    a[4] = random_codes(np.random.default_rng(21), fa, k)
    b = np.full((k, 5), big_b, np.uint8)
    b[:, 1] = negate_code(fb, big_b)  # column 1 flips every sign
    b[:, 4] = random_codes(np.random.default_rng(22), fb, k)
    # a's scales carry the magnitudes: big blocks at 2^20, small ones at 2^-20.
    sa = np.tile(np.array([147, 107, 147, 107], np.uint8), (5, 1))
    sa[2] = [107, 147, 147, 107]
    sa[3] = [147, 147, 107, 107]
    sb = np.full((4, 5), 127, np.uint8)
    sb[:, 2] = [120, 134, 127, 100]  # one column with uneven b scales
    out = run_and_compare(a, sa, fa, b, sb, fb)
    s_val = float(oracle.decode(small, fa) * oracle.decode(big_b, fb)) * 2.0**-20
    assert out[0, 0] == np.float32(s_val)  # sequential order, not exact / pairwise
    assert out[3, 0] == np.float32(2 * s_val)
    assert out[2, 0] == 0


@pytest.mark.parametrize("fa, fb", PAIRS)
def test_nan_scale(fa, fb):
    """A 0xFF scale makes exactly the outputs that use that block NaN."""
    rng = np.random.default_rng(23)
    a, sa, b, sb = random_mx_operands(rng, fa, fb, 5, 128, 5)
    sa[1, 2] = 0xFF  # row 1
    sb[0, 3] = 0xFF  # column 3
    out = run_and_compare(a, sa, fa, b, sb, fb)
    expected_nan = np.zeros((5, 5), bool)
    expected_nan[1, :] = True
    expected_nan[:, 3] = True
    assert (np.isnan(out) == expected_nan).all()


@fp8
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_in_block_cancellation(fmt):
    """Within one block, max^2 + min^2 - max^2 must give exactly min^2 (an
    exact block dot product, not a float32 running sum)."""
    f = oracle.FORMATS[fmt]
    a = np.zeros((1, 32), np.uint8)
    b = np.zeros((32, 1), np.uint8)
    a[0, :3] = [f.max_code_mag, 1, negate_code(fmt, f.max_code_mag)]
    b[:3, 0] = [f.max_code_mag, 1, f.max_code_mag]
    out = run_and_compare(a, np.array([[127]], np.uint8), fmt, b, np.array([[127]], np.uint8), fmt)
    assert out[0, 0] == np.float32(2.0 ** (2 * f.lsb))
