"""The integer-domain float helpers against numpy's IEEE float32 (which keeps subnormals)."""

from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest

from jalapeno_emu.mx import _intfloat as inf


def _numpy_has_subnormals() -> bool:
    return np.float32(2.0**-140) * np.float32(2.0) != 0


def _special_floats() -> np.ndarray:
    vals = [0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-126, 2.0**-127, 1.5 * 2.0**-126, 1.0, -1.0,
            3.4028235e38, -3.4028235e38, np.inf, -np.inf, 1.0 + 2.0**-23, 2.0**127, 2.0**-130 * 3]
    return np.array(vals, np.float32)


def _random_floats(rng: np.random.Generator, n: int) -> np.ndarray:
    """Bit patterns spread over every exponent, plus clustered exponents to force cancellation."""
    bits = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    wide = bits.view(np.float32)
    near = (rng.standard_normal(n) * 2.0 ** rng.integers(-140, -110, n)).astype(np.float32)
    return np.concatenate([wide[np.isfinite(wide)], near])


@pytest.mark.skipif(not _numpy_has_subnormals(), reason="numpy flushes subnormals here")
def test_add_f32_bits_matches_ieee_float32_addition():
    rng = np.random.default_rng(1)
    x = np.concatenate([_random_floats(rng, 20000), _special_floats()])
    y = np.concatenate([_random_floats(rng, 20000), _special_floats()[::-1]])
    n = min(len(x), len(y))
    x, y = x[:n], y[:n]
    # Pair some values with their own negation and neighbours: exact cancellation and 1-ulp sums.
    x = np.concatenate([x, x[:500], x[:500]])
    y = np.concatenate([y, -x[:500], np.nextafter(-x[:500], np.float32(0))])
    with np.errstate(all="ignore"):
        want = (x + y).view(np.int32)
    got = np.asarray(inf.add_f32_bits(jnp.asarray(x.view(np.int32)), jnp.asarray(y.view(np.int32))))
    nan = np.isnan(want.view(np.float32))
    assert np.array_equal(np.isnan(got.view(np.float32)), nan)
    bad = np.flatnonzero((got != want) & ~nan)
    assert bad.size == 0, [(x[i], y[i], want[i], got[i]) for i in bad[:5]]


def _exact_f32(v: int, e: int) -> np.float32:
    """Reference RNE of v * 2^e to float32, by exact rational search (slow, small inputs only)."""
    q = Fraction(v) * Fraction(2) ** e
    if abs(q) >= Fraction(2) ** 128 - Fraction(2) ** 103:  # halfway past FP32 max rounds to Inf
        return np.float32(np.inf if q > 0 else -np.inf)
    with np.errstate(over="ignore"):
        f = np.float32(float(q))  # float64 then float32 may double-round: search the neighbours
    if not np.isfinite(f):
        f = np.float32(np.copysign(np.finfo(np.float32).max, float(q)))
    best = f
    for cand in (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))):
        if not np.isfinite(cand):
            continue
        d_c, d_b = abs(Fraction(float(cand)) - q), abs(Fraction(float(best)) - q)
        if d_c < d_b or (d_c == d_b and int(cand.view(np.int32)) % 2 == 0):
            best = cand
    return best


def test_int_times_pow2_rounds_once_including_subnormals_and_overflow():
    rng = np.random.default_rng(2)
    v = np.concatenate([rng.integers(-(2**30), 2**30, 300), [0, 1, -1, 3, 2**24 + 1, 2**25 + 3]])
    e = np.concatenate([rng.integers(-190, 110, 300), [0, -149, -150, -151, -160, 104]])
    got = np.asarray(inf.int_times_pow2_to_f32_bits(jnp.asarray(v, jnp.int32), jnp.asarray(e, jnp.int32)))
    want = np.array([_exact_f32(int(a), int(b)).view(np.int32) for a, b in zip(v, e, strict=True)])
    assert np.array_equal(got, want)


@pytest.mark.parametrize("rounding", ["rne", "rna", "rtz"])
def test_shift_right_round_ties_and_huge_shifts(rounding):
    m = jnp.array([5, 6, 7, 4, 12, 2**30, 1, 2**30 + 1], jnp.int32)
    s = jnp.array([1, 2, 1, 3, 3, 31, 40, 31], jnp.int32)
    got = np.asarray(inf.shift_right_round(m, s, rounding, None)).tolist()
    want = {
        # 2.5->2, 1.5->2, 3.5->4, 0.5->0, 1.5->2, 0.5->0, tiny->0, just over half->1
        "rne": [2, 2, 4, 0, 2, 0, 0, 1],
        "rna": [3, 2, 4, 1, 2, 1, 0, 1],
        "rtz": [2, 1, 3, 0, 1, 0, 0, 0],
    }[rounding]
    assert got == want
