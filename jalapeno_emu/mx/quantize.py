"""``quantize`` and ``dequantize``: float arrays to and from OCP MX block-scaled form.

Stage: numerics. Both run in JAX, jit once per static configuration, and make every rounding
decision on integer bit patterns (see ``_intfloat``), so results are bit-exact on any backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jalapeno_emu.errors import InvalidArgumentError, InvalidTypeError
from jalapeno_emu.mx._intfloat import (
    F32_EXP_MIN,
    F32_INF_BITS,
    F32_MAG_MASK,
    F32_MBITS,
    F32_NAN_BITS,
    bits_to_f32,
    f32_significand,
    f32_to_bits,
    round_to_grid,
    shift_right_round,
)
from jalapeno_emu.mx._validate import (
    as_array,
    check_axis,
    check_block_size,
    check_int,
    check_prng_key,
    describe,
)
from jalapeno_emu.mx.array import MXArray
from jalapeno_emu.mx.formats import SCALE_BIAS, SCALE_NAN, ElementFormat, element_format
from jalapeno_emu.mx.scale import SCALE_MODES, shared_exponent

__all__ = ["ROUNDINGS", "dequantize", "element_values", "quantize"]

ROUNDINGS = ("rne", "rna", "stochastic")
_FLOAT_INPUTS = (np.float16, np.float32, np.float64)


def _check_float_input(x: jax.Array, argname: str) -> None:
    dt = x.dtype  # compared, not converted: np.dtype() refuses JAX's PRNG key dtypes
    if dt == jnp.bfloat16 or getattr(dt, "type", None) in _FLOAT_INPUTS:
        return
    raise InvalidTypeError(
        f"{argname} has dtype {dt}; MX quantisation takes real floating point "
        "(float32, bfloat16, float16; float64 is rounded to float32 first)"
    )


def _check_blocking(shape: tuple[int, ...], axis: object, block_size: object) -> int:
    if not shape:
        raise InvalidArgumentError("x is 0-d; MX quantisation needs an axis to block along")
    ax = check_axis(axis, shape, "x")
    check_int(block_size, "block_size")
    if block_size <= 0 or shape[ax] % block_size:
        raise InvalidArgumentError(
            f"block_size={block_size} must divide axis {ax} of x (length {shape[ax]})"
        )
    check_block_size(block_size)  # any size divides an empty axis: bound it too
    return ax


def quantize(
    x: jax.Array,
    fmt: str = "e2m1",
    *,
    axis: int = -1,
    block_size: int = 32,
    scale_mode: str = "floor",
    rounding: str = "rne",
    key: jax.Array | None = None,
) -> MXArray:
    """Quantise ``x`` to an MX format, one E8M0 scale per ``block_size`` elements along ``axis``.

    Args:
        x: float32/bfloat16/float16[*shape] (float64 is rounded to float32 first).
        fmt: element format: "e2m1" (MXFP4), "e2m3", "e3m2" (MXFP6), "e4m3", "e5m2" (MXFP8),
            "int8" (MXINT8); the ISA spellings "fp4", "fp6e2", "fp6e3", "fp8e4", "fp8e5" are the
            same formats (the result's ``fmt`` is always the name above).
        axis: the axis whose consecutive runs of ``block_size`` elements share one scale.
        block_size: elements per block; must divide ``x.shape[axis]`` and be at most
            ``2**21`` (the largest block ``matmul`` sums exactly; OCP MX uses 32).
        scale_mode: "floor" (OCP v1.0), "ceil", "even" or "rceil"; see ``jalapeno_emu.mx.scale``.
        rounding: element rounding: "rne" (ties to even), "rna" (ties away, microxcaling's
            default) or "stochastic" (needs ``key``).
        key: a JAX PRNG key for stochastic rounding.

    Returns:
        MXArray with ``codes`` uint8[*shape] and ``scales`` uint8[*shape, axis // block_size].
        Out-of-range elements saturate to +-max_normal; a block holding NaN or Inf gets scale
        0xFF and zero codes; an all-zero block gets scale 0x00 (negative zeros keep their sign bit).

    Raises:
        InvalidTypeError: ``x`` is not an array of real floats (None, text, a mapping, an object
            or integer array), ``axis`` or ``block_size`` is not an int, or ``key`` is not a PRNG
            key when stochastic rounding needs one.
        InvalidArgumentError: ``x`` is ragged or 0-d, ``axis`` is out of range, ``block_size``
            does not divide that axis, or ``fmt``/``scale_mode``/``rounding`` is unknown.

    Works under ``jax.jit`` and ``jax.vmap`` (all arguments but ``x`` and ``key`` are static).

    Example:
        >>> q = quantize(jnp.array([[0.5, -3.0, 5.9, 100.0]]), "e2m1", block_size=4)
        >>> q.scales.tolist(), dequantize(q).tolist()
        ([[131]], [[0.0, -0.0, 8.0, 96.0]])
    """
    x = as_array(x, "x", "an array of real floats (float32, bfloat16, float16 or float64)")
    _check_float_input(x, "x")
    f = element_format(fmt)
    ax = _check_blocking(tuple(x.shape), axis, block_size)
    # isinstance first: `in` on a tuple compares with ==, which an array argument would broadcast.
    if not isinstance(scale_mode, str) or scale_mode not in SCALE_MODES:
        raise InvalidArgumentError(f"scale_mode={scale_mode!r} is not one of {SCALE_MODES}")
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise InvalidArgumentError(f"rounding={rounding!r} is not one of {ROUNDINGS}")
    if rounding == "stochastic":
        if key is None:
            raise InvalidArgumentError("rounding='stochastic' needs key= (a JAX PRNG key)")
        check_prng_key(key)
    codes, scales = _quantize_jit(
        x, key if rounding == "stochastic" else None,
        fmt=f.name, axis=ax, block_size=int(block_size), scale_mode=scale_mode, rounding=rounding,
    )
    return MXArray(codes=codes, scales=scales, fmt=f.name, axis=ax, block_size=int(block_size))


@functools.partial(
    jax.jit, static_argnames=("fmt", "axis", "block_size", "scale_mode", "rounding")
)
def _quantize_jit(x, key, *, fmt, axis, block_size, scale_mode, rounding):
    f = element_format(fmt)
    bits = f32_to_bits(jnp.moveaxis(x.astype(jnp.float32), axis, -1))
    lead_shape = bits.shape[:-1]
    n = bits.shape[-1]
    bits = bits.reshape(*lead_shape, n // block_size, block_size)
    mag = bits & F32_MAG_MASK
    amax = jnp.max(mag, axis=-1)  # integer max of magnitudes == max |x|, NaN/Inf sort last
    nonfinite = amax >= F32_INF_BITS
    se = shared_exponent(jnp.where(nonfinite, 0, amax), f, scale_mode)
    rand = None
    if rounding == "stochastic":
        rand = jax.random.bits(key, bits.shape, jnp.uint32)
    codes = quantize_elements(mag, bits < 0, se[..., None], f, rounding, rand)
    codes = jnp.where(nonfinite[..., None], 0, codes)
    scales = jnp.where(nonfinite, SCALE_NAN, se + SCALE_BIAS)
    codes = jnp.moveaxis(codes.reshape(*lead_shape, n).astype(jnp.uint8), -1, axis)
    scales = jnp.moveaxis(scales.astype(jnp.uint8), -1, axis)
    return codes, scales


def quantize_elements(
    mag: jax.Array,
    negative: jax.Array,
    shared_exp: jax.Array,
    fmt: ElementFormat,
    rounding: str,
    rand_u32: jax.Array | None = None,
) -> jax.Array:
    """Element codes of x / 2^shared_exp, rounded by ``rounding`` and saturated.

    Args:
        mag: int32 bit patterns of |x| (finite).
        negative: bool, the sign bits of x.
        shared_exp: int32 unbiased exponents, broadcastable to ``mag``.
        fmt: target element format.
        rounding: "rne", "rna" or "stochastic" (with ``rand_u32``).

    Returns:
        int32 codes in [0, 255].
    """
    m, ex0 = f32_significand(mag)
    ex = ex0 - shared_exp  # x / 2^s = m * 2^ex, exactly
    if fmt.is_int:
        shift = fmt.unit_exp - ex
        n = shift_right_round(m, jnp.maximum(shift, 0), rounding, rand_u32)
        # shift < 0 only happens for normal x (m >= 2^23) far beyond the range: saturate.
        n = jnp.where(shift < 0, fmt.max_code_mag, jnp.minimum(n, fmt.max_code_mag))
        return jnp.where(negative, (256 - n) & 0xFF, n)
    code = round_to_grid(m, ex, emin=fmt.emin, mbits=fmt.mbits, rounding=rounding,
                         rand_u32=rand_u32)
    code = jnp.minimum(code, fmt.max_code_mag)
    return code | (negative.astype(jnp.int32) << fmt.sign_bit)


def element_values(codes: jax.Array, fmt: str | ElementFormat) -> tuple[jax.Array, ...]:
    """Split element codes into (negative, units, exp, special) with value = +-units * 2^exp.

    ``special`` is 0 for finite codes, 1 for Inf and 2 for NaN codes (e4m3, e5m2 only).
    All outputs are int32 (bool for ``negative``) of the codes' shape.
    """
    f = element_format(fmt)
    c = codes.astype(jnp.int32)
    if f.is_int:
        signed = jnp.where(c >= 128, c - 256, c)
        return signed < 0, jnp.abs(signed), jnp.full_like(c, f.unit_exp), jnp.zeros_like(c)
    mag = c & ((1 << f.sign_bit) - 1)
    e_field = mag >> f.mbits
    frac = mag & ((1 << f.mbits) - 1)
    units = jnp.where(e_field == 0, frac, frac | (1 << f.mbits))
    exp = jnp.where(e_field == 0, f.emin, e_field - f.bias) - f.mbits
    special = jnp.zeros_like(c)
    if f.name == "e5m2":
        special = jnp.where(mag == 0x7C, 1, jnp.where(mag > 0x7C, 2, 0))
    elif f.max_code_mag < (1 << f.sign_bit) - 1:
        special = jnp.where(mag > f.max_code_mag, 2, 0)
    return ((c >> f.sign_bit) & 1) == 1, units, exp, special


def dequantize(q: MXArray, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Exact values of an MXArray.

    Args:
        q: the MXArray.
        dtype: output dtype. float32 holds every MX value exactly (including results in the
            float32 subnormal range) except products beyond float32's range, which become +-Inf;
            a narrower dtype rounds the float32 value to nearest even.

    Returns:
        dtype[*q.shape]; NaN for every element of a block whose scale is 0xFF, and for NaN element
        codes (E4M3/E5M2); +-Inf for E5M2 Inf codes.

    Raises:
        InvalidTypeError: ``q`` is not an MXArray (or its leaves not uint8 arrays), or ``dtype``
            is not a floating-point dtype.
        InvalidArgumentError: ``q``'s fields disagree (see ``MXArray.validate``).
    """
    if not isinstance(q, MXArray):
        raise InvalidTypeError(f"q must be an MXArray (see mx.quantize), got {describe(q)}")
    q.validate(argname="q")
    return _dequantize_jit(q, _float_dtype_name(dtype))


def _float_dtype_name(dtype: object) -> str:
    """The name of a floating-point ``dtype`` given as a type, dtype or string; None means float32."""
    if dtype is None:  # numpy reads None as float64, which JAX (without x64) would narrow anyway
        return "float32"
    try:
        dt = np.dtype(dtype)
    except TypeError:  # not a dtype at all ("bogus", an object)
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise InvalidTypeError(
            f"dtype={dtype!r} must be a floating-point dtype (float32, bfloat16, float16)"
        )
    return dt.name


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_jit(q: MXArray, dtype: str) -> jax.Array:
    f = element_format(q.fmt)
    ax = q.norm_axis
    neg, units, exp, special = element_values(q.codes, f)
    scales = jnp.repeat(q.scales.astype(jnp.int32), q.block_size, axis=ax)
    code = round_to_grid(units, exp + scales - SCALE_BIAS, emin=F32_EXP_MIN, mbits=F32_MBITS)
    code = jnp.minimum(code, F32_INF_BITS)
    code = jnp.where(special == 1, F32_INF_BITS, code)
    bits = code | (neg.astype(jnp.int32) << 31)
    bits = jnp.where((special == 2) | (scales == SCALE_NAN), F32_NAN_BITS, bits)
    return bits_to_f32(bits).astype(dtype)
