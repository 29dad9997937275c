"""Shared helpers for the MX oracle tests: input builders and exact comparisons.

The data builders return float32 arrays shaped ``[n_blocks, block_size]``
(one MX block per row) together with a label per row, so a failing
comparison can say *which* adversarial case broke.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from tests.mx import oracle

F32_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------
# bit views and comparisons
# ---------------------------------------------------------------------------


def f32_bits(a) -> np.ndarray:
    """uint32 view of a float32 array (any array-like, e.g. a jax array)."""
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def nxt(x: float, toward: float) -> float:
    """Next float32 after ``x`` in the direction of ``toward`` (one float32 ulp)."""
    return float(np.nextafter(np.float32(x), np.float32(toward)))


def f32(x: float) -> float:
    """``x`` rounded to float32 (used only to *build* inputs, never as a reference)."""
    return float(np.float32(x))


def _where(idx: tuple, labels: list[str] | None) -> str:
    if labels is not None and len(idx) == 2:
        return f"block row {idx[0]} ({labels[idx[0]]}), element {idx[1]}"
    return f"index {idx}"


def assert_f32_identical(actual, expected, what: str = "values") -> None:
    """Bit-for-bit float32 equality; any NaN matches any NaN (payloads may differ)."""
    act = np.asarray(actual)
    exp = np.asarray(expected)
    assert act.dtype == np.float32, f"{what}: dtype {act.dtype}, expected float32"
    assert act.shape == exp.shape, f"{what}: shape {act.shape} != {exp.shape}"
    act_nan, exp_nan = np.isnan(act), np.isnan(exp)
    bad = (act_nan != exp_nan) | (~act_nan & ~exp_nan & (f32_bits(act) != f32_bits(exp)))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} mismatches; first at {idx}: "
            f"got {act[idx]!r} (0x{int(f32_bits(act)[idx]):08x}), "
            f"expected {exp[idx]!r} (0x{int(f32_bits(exp)[idx]):08x})"
        )


def assert_quantized_equal(q, exp_codes, exp_scales, x, labels=None, axis=-1, bs=32) -> None:
    """Library MXArray ``q`` has exactly the oracle's codes and scales.

    On failure, reports the first differing block with its label and input.
    """
    codes = np.asarray(q.codes)
    scales = np.asarray(q.scales)
    assert codes.dtype == np.uint8, f"codes dtype {codes.dtype}"
    assert scales.dtype == np.uint8, f"scales dtype {scales.dtype}"
    assert codes.shape == exp_codes.shape, f"codes shape {codes.shape} != {exp_codes.shape}"
    assert scales.shape == exp_scales.shape, f"scales shape {scales.shape} != {exp_scales.shape}"
    x = np.asarray(x).astype(np.float32)
    bad_s = scales != exp_scales
    if bad_s.any():
        idx = tuple(int(i) for i in np.argwhere(bad_s)[0])
        blk = _block_of(x, idx, axis, bs)
        raise AssertionError(
            f"{int(bad_s.sum())} scale mismatches; first at scale index {idx}"
            f"{' (' + labels[idx[0]] + ')' if labels is not None and len(idx) == 2 else ''}: "
            f"got {scales[idx]}, expected {exp_scales[idx]}; block amax={np.abs(blk).max()!r} "
            f"block={blk.tolist()}"
        )
    bad_c = codes != exp_codes
    if bad_c.any():
        idx = tuple(int(i) for i in np.argwhere(bad_c)[0])
        raise AssertionError(
            f"{int(bad_c.sum())} code mismatches; first at {_where(idx, labels)}: "
            f"x={float(x[idx])!r} ({float(x[idx]).hex()}), got code 0x{codes[idx]:02x}, "
            f"expected 0x{exp_codes[idx]:02x}"
        )


def _block_of(x: np.ndarray, scale_idx: tuple, axis: int, bs: int) -> np.ndarray:
    """The input block that produced the scale at ``scale_idx``."""
    axis = axis % x.ndim
    sl = list(scale_idx)
    sl[axis] = slice(scale_idx[axis] * bs, (scale_idx[axis] + 1) * bs)
    return x[tuple(sl)]


# ---------------------------------------------------------------------------
# library access
# ---------------------------------------------------------------------------


def lib():
    """The library module under test (imported lazily so oracle self-tests run without it)."""
    from jalapeno_emu import mx

    return mx


def make_mx(codes, scales, fmt: str, axis: int, block_size: int = 32):
    """Build a library MXArray directly from codes and scale bytes."""
    import jax.numpy as jnp

    return lib().MXArray(
        codes=jnp.asarray(np.asarray(codes, dtype=np.uint8)),
        scales=jnp.asarray(np.asarray(scales, dtype=np.uint8)),
        fmt=fmt,
        axis=axis,
        block_size=block_size,
    )


# ---------------------------------------------------------------------------
# random MX operands
# ---------------------------------------------------------------------------


@functools.cache
def finite_codes(fmt: str) -> np.ndarray:
    """All finite element codes of ``fmt``.

    int8 leaves out 0x80 (-128), which quantize never produces.
    """
    f = oracle.FORMATS[fmt]
    if f.is_int:
        return np.array([c for c in range(256) if c != 0x80], dtype=np.uint8)
    out = []
    for c in range(2 * f.sign_bit):
        try:
            oracle.decode(c, f)
        except ValueError:
            continue
        out.append(c)
    return np.array(out, dtype=np.uint8)


def random_codes(rng: np.random.Generator, fmt: str, shape) -> np.ndarray:
    """Uniformly random finite codes."""
    return rng.choice(finite_codes(fmt), size=shape)


def grid_magnitudes(fmt: str) -> list[float]:
    """Sorted distinct non-negative finite element magnitudes of ``fmt``."""
    return sorted({abs(float(oracle.decode(int(c), fmt))) for c in finite_codes(fmt)})


# ---------------------------------------------------------------------------
# quantize inputs
# ---------------------------------------------------------------------------


def _pack(values: list[float], anchor: float | None, bs: int, label: str, rows, labels) -> None:
    """Append ``values`` as rows of ``bs``; each row starts with ``anchor`` (the block amax)."""
    per = bs - (anchor is not None)
    for i in range(0, len(values), per):
        chunk = values[i : i + per]
        row = ([anchor] if anchor is not None else []) + chunk
        row += [0.0] * (bs - len(row))
        rows.append(row)
        labels.append(label)


def _representable(v: float) -> bool:
    return v != 0.0 and math.isfinite(v) and abs(v) <= F32_MAX and abs(v) >= 2.0**-149


@functools.cache
def adversarial_blocks(fmt: str, bs: int = 32) -> tuple[np.ndarray, tuple[str, ...]]:
    """Hand-picked hard blocks for ``fmt`` (float32 ``[n, bs]``, labels).

    Families: random normal data at many magnitudes; zeros and -0; the
    element grid, every rounding tie and one float32 ulp either side at
    many block scales (2^-140 .. 2^120); values past max normal; amax at /
    next to the "even" and "rceil" scale boundaries and powers of two; FP32
    max; float32 subnormals; NaN / +-inf blocks.
    """
    f = oracle.FORMATS[fmt]
    rng = np.random.default_rng(1234 + len(fmt) + f.emax)
    rows: list[list[float]] = []
    labels: list[str] = []
    mn = float(f.max_normal)

    for p in (-140, -128, -126, -100, -30, -3, 0, 3, 30, 100, 120):
        for _ in range(2):
            _pack([f32(v) for v in rng.standard_normal(bs) * 2.0**p], None, bs,
                  f"normal*2^{p}", rows, labels)

    _pack([0.0] * bs, None, bs, "all +0", rows, labels)
    _pack([-0.0] * bs, None, bs, "all -0", rows, labels)
    _pack([0.0, -0.0] * (bs // 2), None, bs, "+0/-0 mixed", rows, labels)

    # Element grid and its rounding ties.  Anchor 2^(emax+k) gives shared
    # exponent k in all four modes, so the ties below 2^emax stay ties; anchor
    # max_normal*2^k covers the top binade (k in floor/even/rceil, k+1 in ceil).
    grid = grid_magnitudes(fmt)
    mids = [(a + b) / 2 for a, b in itertools.pairwise(grid)]
    ks = (-140, -127, -126, -60, -1, 0, 1, 57, 120) if len(grid) < 64 else (-133, -126, 0, 1, 90)
    for k in ks:
        families = ((2.0 ** (f.emax + k), 2.0**f.emax, "low"), (mn * 2.0**k, mn, "top"))
        for anchor, lim, name in families:
            if not _representable(anchor):
                continue
            vals = []
            for t in grid + mids:
                if t > lim:
                    continue
                v = f32(t * 2.0**k)
                vals += [v, nxt(v, 0.0), nxt(v, math.inf)] if t in mids else [v]
            vals = [v for v in vals if abs(v) <= anchor]
            # alternate signs so both signs see every tie
            vals = [v if i % 2 else -v for i, v in enumerate(vals)] + [
                -v if i % 2 else v for i, v in enumerate(vals)]
            _pack(vals, anchor, bs, f"grid+ties {name} k={k}", rows, labels)
        # Past max normal but in the same binade: must saturate.
        top = 2.0 ** (f.emax + 1 + k)
        if _representable(top):
            over = [f32(mn * 2.0**k), nxt(mn * 2.0**k, math.inf)]
            step = (mn - grid[-2]) * 2.0**k
            over += [f32(mn * 2.0**k + step / 2), f32(mn * 2.0**k + step), nxt(top, 0.0)]
            over = [v for v in over if abs(v) < top]
            _pack(over + [-v for v in over], None, bs, f"saturate k={k}", rows, labels)

    def amax_block(a: float, label: str) -> None:
        """A block whose amax is exactly ``a`` (sign random), rest random below it."""
        if not _representable(a):
            return
        rest = [f32(v) for v in rng.uniform(-1, 1, bs - 1) * abs(a)]
        rest = [v if abs(v) <= abs(a) else 0.0 for v in rest]
        rows.append([a if rng.random() < 0.5 else -a, *rest])
        labels.append(label)

    # "even" boundary: significand rounding to round_mbits bits hits 2.0.
    for k in (-145, -130, -128, -127, -126, -125, -60, -1, 0, 1, 50, 126):
        b = (2.0 - 2.0 ** -(f.round_mbits + 1)) * 2.0**k
        if _representable(b):
            for a, tag in ((b, "at"), (nxt(b, 0.0), "below"), (nxt(b, math.inf), "above")):
                amax_block(a, f"even boundary {tag} k={k}")
    # "rceil" boundary: amax / max_normal is (about) a power of two; in the
    # float32-subnormal quotient range RN can round the quotient down.
    for k in (-150, -140, -129, -128, -127, -126, -125, -1, 0, 1, 100, 127 - f.emax - 1):
        b = mn * 2.0**k
        if _representable(b):
            for a, tag in ((b, "at"), (nxt(b, 0.0), "below"), (nxt(b, math.inf), "above")):
                amax_block(a, f"rceil boundary {tag} k={k}")
            for d in (2, 3, 5):  # a few subnormal ulps above
                amax_block(f32(b + d * 2.0**-149), f"rceil boundary +{d}ulp149 k={k}")
    # Powers of two and just below.
    for k in (-149, -148, -127, -126, -125, -2, 0, 1, 2, 3, 4, 8, 15, 16, 127):
        amax_block(2.0**k, f"pow2 k={k}")
        amax_block(nxt(2.0**k, 0.0), f"below pow2 k={k}")

    amax_block(F32_MAX, "fp32 max")
    amax_block(-F32_MAX, "-fp32 max")
    _pack([F32_MAX, -F32_MAX, 1.0, -1.0, 2.0**-149], None, bs, "fp32 max + small", rows, labels)

    # float32 subnormals.
    sub = 2.0**-149
    _pack([sub, -sub] * (bs // 2), None, bs, "all +-2^-149", rows, labels)
    _pack([2.0**-130, sub, -sub, 3 * sub, -(2.0**-130)], None, bs, "2^-130 and 2^-149",
          rows, labels)
    _pack([1.0, sub, -sub, 2.0**-130, -(2.0**-127), 2.0**-126], None, bs, "normals + subnormals",
          rows, labels)
    _pack([float(v) * sub for v in rng.integers(-(1 << 23), 1 << 23, bs)], None, bs,
          "random subnormals", rows, labels)

    # Non-finite: only these blocks must become scale 0xFF.
    base = [f32(v) for v in rng.standard_normal(bs - 1)]
    for bad, name in ((math.nan, "NaN"), (math.inf, "+inf"), (-math.inf, "-inf")):
        rows.append([bad, *base])
        labels.append(f"{name} block")
    rows.append([*base[:bs // 2], math.inf, math.nan, *base[bs // 2 + 2:], -1.0])
    labels.append("inf+NaN block")

    x = np.array(rows, dtype=np.float64).astype(np.float32)
    # The float64 -> float32 cast must not have changed anything we built.
    assert all(len(r) == bs for r in rows)
    return x, tuple(labels)


def random_data(rng: np.random.Generator, shape, lo: int = -20, hi: int = 20) -> np.ndarray:
    """float32 normal data whose magnitude varies per element by 2^[lo, hi)."""
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(lo, hi, shape)).astype(np.float32)


# ---------------------------------------------------------------------------
# matmul operands
# ---------------------------------------------------------------------------


def negate_code(fmt: str, code: int) -> int:
    """Code of the negated element (sign bit for floats, two's complement for int8)."""
    f = oracle.FORMATS[fmt]
    if f.is_int:
        return (-code) & 0xFF
    return code ^ f.sign_bit


def random_mx_operands(rng, a_fmt, b_fmt, m, k, n, a_scale_range=(117, 137),
                       b_scale_range=(117, 137), bs=32):
    """Random finite codes and scale bytes: a [m, k] / [m, k/bs], b [k, n] / [k/bs, n]."""
    a = random_codes(rng, a_fmt, (m, k))
    b = random_codes(rng, b_fmt, (k, n))
    sa = rng.integers(a_scale_range[0], a_scale_range[1] + 1, (m, k // bs)).astype(np.uint8)
    sb = rng.integers(b_scale_range[0], b_scale_range[1] + 1, (k // bs, n)).astype(np.uint8)
    return a, sa, b, sb
