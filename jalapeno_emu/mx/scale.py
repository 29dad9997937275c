"""Shared-exponent (E8M0 scale) rules. Every rule is computed from exponent and significand bits.

The name "MXFP4" is used for data made under any of these four rules, so the quantiser takes the
rule as a parameter:

- ``"floor"``: OCP MX v1.0 section 6.3 and Microsoft's microxcaling reference:
  ``floor(log2(amax)) - emax``. Values between max_normal and 2^(emax+1) * (1 - ...) saturate.
- ``"ceil"``: ``ceil(log2(amax)) - emax``; never saturates, loses up to one binade of range.
- ``"even"``: amax's significand is first rounded to the element's mantissa width, ties up, then
  the floor rule applies (torchao ``ScaleCalculationMode.EVEN``, AMD Quark). For E2M1 an amax of
  at least 1.75 * 2^k gives k + 1.
- ``"rceil"``: the smallest power of two >= float32(amax / max_normal), the quotient rounded to
  nearest even in float32 (NVIDIA's ``cvt.rp.satfinite.ue8m0x2.f32`` as used for Blackwell MXFP8/
  MXFP4 recipes, torchao ``RCEIL``). Never saturates.

Every rule clamps the exponent to [-127, 127] (E8M0 has no byte for 2^128). A block whose amax is
0 gets byte 0x00; a block holding NaN or Inf gets 0xFF.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jalapeno_emu.mx._intfloat import f32_significand, floor_log2_int
from jalapeno_emu.mx.formats import SCALE_EXP_MAX, SCALE_EXP_MIN, ElementFormat

__all__ = ["SCALE_MODES", "shared_exponent"]

SCALE_MODES = ("floor", "ceil", "even", "rceil")


def _normalized_significand(units: int) -> int:
    """A positive integer shifted so its leading bit is bit 23 (exact: only zeros are shifted out)."""
    shift = units.bit_length() - 24
    assert shift <= 0 or units % (1 << shift) == 0
    return units >> shift if shift > 0 else units << -shift


def shared_exponent(amax_mag: jax.Array, fmt: ElementFormat, scale_mode: str) -> jax.Array:
    """Unbiased shared exponent of each block.

    Args:
        amax_mag: int32[...], bit pattern of each block's max |x| (finite; 0 allowed).
        fmt: the element format.
        scale_mode: one of ``SCALE_MODES``.

    Returns:
        int32[...] in [-127, 127]; -127 where amax is 0. Non-finite blocks are the caller's job.
    """
    m, ex0 = f32_significand(amax_mag)
    lead = floor_log2_int(m)  # 23 for normals, less for subnormals
    floor_log2 = lead + ex0
    if scale_mode == "floor":
        s = floor_log2 - fmt.emax
    elif scale_mode == "ceil":
        not_pow2 = (m & (m - 1)) != 0
        s = floor_log2 + not_pow2.astype(jnp.int32) - fmt.emax
    elif scale_mode == "even":
        # Round half up to `mb` fraction bits below the leading bit; only the leading bit's new
        # position matters, so adding the half-unit is enough (no truncation needed).
        drop = lead - fmt.rounding_mbits - 1
        rounded = m + jnp.where(drop >= 0, jnp.int32(1) << jnp.maximum(drop, 0), 0)
        s = floor_log2_int(rounded) + ex0 - fmt.emax
    elif scale_mode == "rceil":
        s = _rceil_exponent(m, lead, floor_log2, fmt)
    else:  # pragma: no cover - validated by the caller
        raise ValueError(scale_mode)
    s = jnp.clip(s, SCALE_EXP_MIN, SCALE_EXP_MAX)
    return jnp.where(amax_mag == 0, SCALE_EXP_MIN, s).astype(jnp.int32)


def _rceil_exponent(
    m: jax.Array, lead: jax.Array, floor_log2: jax.Array, fmt: ElementFormat
) -> jax.Array:
    """Smallest s with 2^s >= RN_f32(amax / max_normal), without a float division.

    For a normal quotient, amax and max_normal * 2^s both lie on amax's float32 grid, so the exact
    quotient is either <= 2^s or more than half a float32 ulp above it: rounding cannot move it
    onto a power of two, and the exact ceiling is the answer. Only a quotient in the float32
    subnormal range can round down onto 2^-127 (its grid is coarser), which the corner test handles.
    """
    c_n = _normalized_significand(fmt.max_units)  # max_normal's significand, bit 23 leading
    f_c = fmt.max_units.bit_length() - 1 + fmt.unit_exp  # floor(log2(max_normal))
    a_n = m << (23 - lead)
    gt = a_n > c_n
    s = floor_log2 - f_c + gt.astype(jnp.int32)
    # q <= 2^-127 + 2^-150 (a tie rounds down to the even 2^-127) <=> amax <= mn * 2^-127 (1 + 2^-23)
    rounds_down = jnp.where(gt, a_n - c_n <= 1, 2 * a_n - c_n <= 1)
    return jnp.where((s == -126) & rounds_down, -127, s)
