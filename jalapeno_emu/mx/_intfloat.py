"""Integer-domain float arithmetic: every rounding decision of the MX library is made here.

Why integers: XLA on CPU flushes subnormal results to zero and may compute a division through a
reciprocal, so float arithmetic cannot be trusted to round the way the MX and IEEE rules say.
These helpers work on int32 significands and exponents and are exact by construction. All of them
are elementwise, jit- and vmap-safe, and avoid data-dependent Python control flow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32_EXP_MIN = -126
F32_MBITS = 23
F32_INF_BITS = 0x7F800000
F32_NAN_BITS = 0x7FC00000
F32_MAG_MASK = 0x7FFFFFFF
_SHIFT_CAP = 31  # int32 shifts by >= 32 are not portable; larger shifts are handled explicitly


def f32_to_bits(x: jax.Array) -> jax.Array:
    """int32 bit pattern of a float32 array (same shape)."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def bits_to_f32(bits: jax.Array) -> jax.Array:
    """float32 array from int32 bit patterns (same shape)."""
    return lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def floor_log2_int(m: jax.Array) -> jax.Array:
    """floor(log2(m)) of a positive int32 array; -1 where m == 0."""
    return 31 - lax.clz(m.astype(jnp.int32))


def f32_significand(mag_bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Split |x| (its int32 bits, sign cleared, finite) into (M, ex0) with |x| = M * 2^ex0.

    M is the integer significand (hidden bit included for normals, < 2^24); ex0 is int32.
    """
    e_field = mag_bits >> F32_MBITS
    frac = mag_bits & 0x7FFFFF
    normal = e_field > 0
    m = jnp.where(normal, frac | 0x800000, frac)
    ex0 = jnp.where(normal, e_field - 150, -149)
    return m, ex0


def shift_right_round(
    m: jax.Array, shift: jax.Array, rounding: str, rand_u32: jax.Array | None
) -> jax.Array:
    """round(m / 2^shift) for int32 m >= 0 (< 2^31) and int32 shift >= 0, by ``rounding``.

    rounding: "rne" (ties to even), "rna" (ties away from zero), "stochastic" (round up with
    probability remainder / 2^shift, resolved to 2^-32 by the uint32 ``rand_u32``), or "rtz".
    """
    big = shift > _SHIFT_CAP  # m < 2^31 <= 2^shift: quotient 0, remainder m, below half
    s = jnp.minimum(shift, _SHIFT_CAP)
    q = jnp.where(big, 0, m >> s)
    rem = jnp.where(big, m, m & ((jnp.int32(1) << s) - 1))
    if rounding == "rtz":
        return q
    if rounding == "stochastic":
        # The remainder as a 32-bit fraction of 2^shift, compared with a uniform 32-bit draw.
        rem_u = rem.astype(jnp.uint32)
        up_scaled = jnp.where(
            shift <= 32,
            rem_u << jnp.clip(32 - shift, 0, 31).astype(jnp.uint32),
            rem_u >> jnp.clip(shift - 32, 0, 31).astype(jnp.uint32),
        )
        up = (shift > 0) & (rand_u32 < up_scaled)
        return q + up.astype(jnp.int32)
    half = jnp.int32(1) << jnp.maximum(s - 1, 0)
    in_range = (shift >= 1) & ~big
    if rounding == "rne":
        up = in_range & ((rem > half) | ((rem == half) & ((q & 1) == 1)))
    elif rounding == "rna":
        up = in_range & (rem >= half)
    else:  # pragma: no cover - callers validate the mode first
        raise ValueError(rounding)
    return q + up.astype(jnp.int32)


def round_to_grid(
    m: jax.Array,
    ex0: jax.Array,
    *,
    emin: int,
    mbits: int,
    rounding: str = "rne",
    rand_u32: jax.Array | None = None,
) -> jax.Array:
    """Round the magnitude m * 2^ex0 onto a binary float grid and return its magnitude code.

    The grid has ``mbits`` fraction bits, smallest normal exponent ``emin`` and gradual underflow
    (quantum 2^(emin - mbits) below 2^emin). The code is
    ``((max(e, emin) - emin) << mbits) + N`` where N is the rounded significand: that is the
    sign-less bit pattern of the IEEE-style format, and a carry out of the significand lands in the
    exponent field on its own. No saturation here: callers clamp to their own maximum.

    Args:
        m: int32 significands, 0 <= m < 2^31.
        ex0: int32 exponents.
        emin, mbits: the target grid (float32: -126 and 23).
        rounding: see ``shift_right_round``.
        rand_u32: uint32 random bits, same shape, for stochastic rounding.

    Returns:
        int32 magnitude codes (0 where m == 0).
    """
    e = floor_log2_int(m) + ex0
    qe = jnp.maximum(e, emin) - mbits  # exponent of the target quantum
    shift = qe - ex0
    exact = m << jnp.clip(-shift, 0, _SHIFT_CAP)
    rounded = shift_right_round(m, jnp.maximum(shift, 0), rounding, rand_u32)
    n = jnp.where(shift <= 0, exact, rounded)
    exp_term = qe + mbits - emin  # = max(e, emin) - emin >= 0
    # Largest exponent term whose code, plus a full significand carry, still fits in int32.
    cap = (1 << (31 - mbits)) - 3
    code = (jnp.minimum(exp_term, cap) << mbits) + n
    # Past the largest exponent int32 would wrap; report "beyond any finite value" instead, which
    # every caller's saturation or overflow-to-Inf clamp turns into the right answer.
    code = jnp.where(exp_term > cap, jnp.int32(0x7FFFFFFF), code)
    return jnp.where(m == 0, 0, code)


def int_times_pow2_to_f32_bits(v: jax.Array, exp: jax.Array) -> jax.Array:
    """float32 bits of RNE(v * 2^exp) for int32 v (|v| < 2^31), incl. subnormals and overflow.

    Exact zero gives +0. Overflow gives +-Inf, as IEEE round-to-nearest does.
    """
    neg = v < 0
    mag = jnp.abs(v)
    code = round_to_grid(mag, exp, emin=F32_EXP_MIN, mbits=F32_MBITS)
    code = jnp.minimum(code, F32_INF_BITS)
    return jnp.where(neg, code | jnp.int32(-0x80000000), code)


def add_f32_bits(a: jax.Array, b: jax.Array) -> jax.Array:
    """IEEE float32 addition a + b with round-to-nearest-even, on int32 bit patterns.

    Subnormals are honoured (no flush to zero), Inf and NaN follow IEEE 754 (Inf - Inf is NaN).
    """
    a = a.astype(jnp.int32)
    b = b.astype(jnp.int32)
    a_mag, b_mag = a & F32_MAG_MASK, b & F32_MAG_MASK
    a_neg, b_neg = a < 0, b < 0
    # Order by magnitude so the shift is applied to the smaller operand.
    swap = b_mag > a_mag
    big_mag = jnp.where(swap, b_mag, a_mag)
    small_mag = jnp.where(swap, a_mag, b_mag)
    big_neg = jnp.where(swap, b_neg, a_neg)
    small_neg = jnp.where(swap, a_neg, b_neg)

    m_big, ex_big = f32_significand(big_mag)
    m_small, ex_small = f32_significand(small_mag)
    d = ex_big - ex_small  # >= 0
    # Three guard bits (guard, round, sticky) make one final rounding correct.
    mb3 = m_big << 3
    ms3 = m_small << 3
    ds = jnp.minimum(d, _SHIFT_CAP)
    far = d >= 27  # every bit of the small operand lies below the sticky position
    sticky = (ms3 & ((jnp.int32(1) << ds) - 1)) != 0
    ms_sh = jnp.where(far, (ms3 != 0).astype(jnp.int32), (ms3 >> ds) | sticky.astype(jnp.int32))
    same_sign = big_neg == small_neg
    s = jnp.where(same_sign, mb3 + ms_sh, mb3 - ms_sh)
    code = round_to_grid(s, ex_big - 3, emin=F32_EXP_MIN, mbits=F32_MBITS)
    code = jnp.minimum(code, F32_INF_BITS)
    zero = s == 0
    # An exact zero sum is +0 under round-to-nearest, except (-0) + (-0).
    neg = jnp.where(zero, a_neg & b_neg, big_neg)
    out = jnp.where(neg, code | jnp.int32(-0x80000000), code)

    a_inf, b_inf = a_mag == F32_INF_BITS, b_mag == F32_INF_BITS
    a_nan, b_nan = a_mag > F32_INF_BITS, b_mag > F32_INF_BITS
    nan = a_nan | b_nan | (a_inf & b_inf & (a_neg != b_neg))
    out = jnp.where(a_inf, a, jnp.where(b_inf, b, out))
    return jnp.where(nan, F32_NAN_BITS, out)
