"""``matmul``: the block-scaled MX matrix product, bit-exact to the semantics below.

Semantics (the matrix unit of the emulated chip implements exactly this; the ISA reference
repeats it):

    C[m, n] = 0.0 (float32, +0)
    for j in 0, 1, ..., K / block_size - 1:            # increasing block order
        d = sum_k A[m, j*bs + k] * B[j*bs + k, n]      # exact, in unbounded precision
        t = RN_f32(d * 2^(sa[m, j] + sb[j, n]))        # one IEEE round-to-nearest-even
        C[m, n] = RN_f32(C[m, n] + t)                  # IEEE float32 addition

with sa, sb the unbiased E8M0 exponents. "IEEE" includes gradual underflow (no flush to zero) and
overflow to +-Inf; a block with a 0xFF scale makes its outputs NaN, as do NaN/Inf element codes.

What the implementation guarantees: this result, bit for bit, for every pair of element formats.
How it gets there:

- When every element product and every 32-term block sum is an integer multiple of the formats'
  smallest unit that fits in 24 bits (E2M1, E2M3, E3M2, INT8 and any mix of them), a float32
  dot over one block is exact in any summation order. When, in addition, the scales keep every
  scaled element, product and block sum a finite normal float32 (block terms >= 2^-100, below
  2^127; nonzero accumulators >= 2^-100), the operands are scaled first, ordinary float32
  matmuls give the block terms exactly, and in-order float32 adds accumulate them (fast path).
- Otherwise (FP8 element formats, extreme scales) the block sum is computed exactly as a wide
  integer from 9-bit limb products, rounded once in integer arithmetic, and accumulated with an
  integer emulation of IEEE float32 addition (slow path). The same answer, several times slower.

Under ``jax.vmap`` both paths run and one is selected per batch element.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jalapeno_emu.errors import InvalidArgumentError, InvalidTypeError
from jalapeno_emu.mx._intfloat import (
    F32_EXP_MIN,
    F32_INF_BITS,
    F32_MBITS,
    F32_NAN_BITS,
    add_f32_bits,
    bits_to_f32,
    f32_to_bits,
    floor_log2_int,
    int_times_pow2_to_f32_bits,
    round_to_grid,
)
from jalapeno_emu.mx._validate import as_array, check_int, describe
from jalapeno_emu.mx.array import MXArray
from jalapeno_emu.mx.formats import SCALE_BIAS, SCALE_NAN, ElementFormat, element_format
from jalapeno_emu.mx.quantize import element_values

__all__ = ["block_sum_is_exact_in_f32", "matmul"]

_F32_EXACT_INT_BITS = 24  # float32 holds every integer up to 2^24 exactly
_BATCHED_PARTIALS_MAX = 1 << 21  # elements of [blocks, M, N] partials materialised at once (8 MiB)
_FAST_T_MIN = -100  # smallest block-unit exponent the float32 fast path accepts
_FAST_ACC_MIN_BITS = (127 + _FAST_T_MIN) << 23  # bits of 2^-100


def block_sum_is_exact_in_f32(fa: str, fb: str, block_size: int = 32) -> bool:
    """True when any-order float32 summation of one block's products is exact for this pair.

    Args:
        fa, fb: element format names (either spelling: "e2m1" or "fp4"); block_size: elements
            per block.
    """
    a, b = element_format(fa, argname="fa"), element_format(fb, argname="fb")
    block_size = check_int(block_size, "block_size", minimum=1)
    return a.max_units * b.max_units * block_size < 2**_F32_EXACT_INT_BITS


def _limb_bits(block_size: int) -> int:
    """Limb width L so that (2^L - 1)^2 * block_size < 2^24: limb dots are exact in float32."""
    return (_F32_EXACT_INT_BITS - math.ceil(math.log2(block_size)) - 1) // 2


def _check_operand(x: object, name: str, blocked_axis: int) -> MXArray:
    if not isinstance(x, MXArray):
        raise InvalidTypeError(f"{name} must be an MXArray (see mx.quantize), got {describe(x)}")
    x.validate(argname=name)
    if x.ndim != 2:
        raise InvalidArgumentError(f"{name} must be 2-D, got shape {x.shape}")
    if x.norm_axis != blocked_axis:
        want = "along K, its last axis" if blocked_axis == 1 else "along K, its first axis"
        raise InvalidArgumentError(
            f"{name} is blocked along axis {x.norm_axis}; matmul needs {name} blocked {want}"
        )
    return x


def matmul(a: MXArray, b: MXArray) -> jax.Array:
    """Block-scaled product of two MX matrices, in float32 (semantics in the module docstring).

    Args:
        a: MXArray [M, K] blocked along K (axis 1).
        b: MXArray [K, N] blocked along K (axis 0), with a's block size.

    Returns:
        float32[M, N]. Never materialises more than one block's worth of [M, N] partials.
    """
    m, n = _check_pair(a, b)
    return _matmul_jit(a, b, jnp.zeros((m, n), jnp.float32))


def matmul_accumulate(acc: jax.Array, a: MXArray, b: MXArray) -> jax.Array:
    """``matmul`` starting from ``acc`` instead of +0: the matrix unit's accumulate mode.

    Issuing the K range in pieces, in increasing order, each piece accumulating onto the last,
    gives exactly ``matmul`` over the whole K range.

    Args:
        acc: float32[M, N] accumulators (any values, subnormals and Inf/NaN included).
        a, b: as for ``matmul``.

    Returns:
        float32[M, N].
    """
    m, n = _check_pair(a, b)
    acc = as_array(acc, "acc", f"a float32 array of shape {(m, n)}")
    if acc.shape != (m, n) or acc.dtype != jnp.float32:
        raise InvalidArgumentError(f"acc must be float32{[m, n]}, got {acc.dtype}{list(acc.shape)}")
    return _matmul_jit(a, b, acc)


def _check_pair(a: MXArray, b: MXArray) -> tuple[int, int]:
    _check_operand(a, "a", 1)
    _check_operand(b, "b", 0)
    if a.shape[1] != b.shape[0]:
        raise InvalidArgumentError(
            f"a is {a.shape} and b is {b.shape}: K differs ({a.shape[1]} vs {b.shape[0]})"
        )
    if a.block_size != b.block_size:
        raise InvalidArgumentError(
            f"a.block_size={a.block_size} and b.block_size={b.block_size} differ; "
            "block pairs need one size"
        )
    return a.shape[0], b.shape[1]


def _element_units(codes: jax.Array, f: ElementFormat) -> tuple[jax.Array, ...]:
    """(sign, units, shift, bad): value = sign * units * 2^(shift + unit_exp); bad marks NaN/Inf."""
    neg, units, exp, special = element_values(codes, f)
    return jnp.where(neg, -1, 1), units, exp - f.unit_exp, special != 0


def _limbs(sign: jax.Array, units: jax.Array, shift: jax.Array, count: int, bits: int) -> jax.Array:
    """float32[count, ...] signed limbs with units << shift = sum_i limb_i 2^(bits*i).

    Works where ``units << shift`` itself would overflow int32 (E5M2 reaches 2^32): each limb only
    needs the low bits of a shift by at most 31.
    """
    mask = (1 << bits) - 1
    parts = []
    for i in range(count):
        s = shift - bits * i
        up = (units << jnp.clip(s, 0, 31)) & mask
        down = (units >> jnp.clip(-s, 0, 31)) & mask
        parts.append(jnp.where(s >= bits, 0, jnp.where(s >= 0, up, down)) * sign)
    return jnp.stack(parts).astype(jnp.float32)


@jax.jit
def _matmul_jit(a: MXArray, b: MXArray, acc0: jax.Array) -> jax.Array:
    fa, fb = element_format(a.fmt), element_format(b.fmt)
    bs = a.block_size
    (m, k), n = a.shape, b.shape[1]
    nb = k // bs
    exact = block_sum_is_exact_in_f32(fa.name, fb.name, bs)
    unit = fa.unit_exp + fb.unit_exp - 2 * SCALE_BIAS

    a_sign, a_units, a_shift, a_bad = _element_units(a.codes, fa)
    b_sign, b_units, b_shift, b_bad = _element_units(b.codes, fb)
    sa = a.scales.astype(jnp.int32)  # [M, nb]
    sb = b.scales.astype(jnp.int32)  # [nb, N]
    # A NaN/Inf element code poisons its block like a NaN scale does.
    sa = jnp.where(a_bad.reshape(m, nb, bs).any(-1), SCALE_NAN, sa)
    sb = jnp.where(b_bad.reshape(nb, bs, n).any(1), SCALE_NAN, sb)

    if exact:  # one limb holds a whole element: units << shift < 2^12 for every such format
        la, lb, limb = 1, 1, 0
        a_l = (a_sign * (a_units << a_shift)).astype(jnp.float32)[None]
        b_l = (b_sign * (b_units << b_shift)).astype(jnp.float32)[None]
    else:
        limb = _limb_bits(bs)
        la = -(-fa.max_units.bit_length() // limb)
        lb = -(-fb.max_units.bit_length() // limb)
        a_l = _limbs(a_sign, a_units, a_shift, la, limb)
        b_l = _limbs(b_sign, b_units, b_shift, lb, limb)
    # Blocks lead so lax.scan walks them in increasing order.
    a_blocks = a_l.reshape(la, m, nb, bs).transpose(2, 0, 1, 3)  # [nb, la, M, bs]
    b_blocks = b_l.reshape(lb, nb, bs, n).transpose(1, 0, 2, 3)  # [nb, lb, bs, N]
    xs = (a_blocks, b_blocks, sa.T, sb)

    # Per-operand scale exponents: a value is its integer units times 2^(ea) (or 2^(eb)).
    ea = sa - SCALE_BIAS + fa.unit_exp  # [M, nb]
    eb = sb - SCALE_BIAS + fb.unit_exp  # [nb, N]

    def fast(_):
        # Scale the operands first: every scaled element and every product is an exact normal
        # float32 and each block's sum an exact multiple of 2^t_min (conditions below), so the
        # matmul of scaled blocks IS the correctly rounded block term, and only the in-order adds
        # remain. A NaN scale becomes a NaN factor, which poisons exactly its outputs.
        fa_f = jnp.where(sa == SCALE_NAN, jnp.nan, bits_to_f32((jnp.clip(ea, -126, 127) + 127) << F32_MBITS))
        fb_f = jnp.where(sb == SCALE_NAN, jnp.nan, bits_to_f32((jnp.clip(eb, -126, 127) + 127) << F32_MBITS))
        a_s = (a_l[0] * jnp.repeat(fa_f, bs, axis=1)).reshape(m, nb, bs).transpose(1, 0, 2)
        b_s = (b_l[0] * jnp.repeat(fb_f, bs, axis=0)).reshape(nb, bs, n)
        if nb * m * n <= _BATCHED_PARTIALS_MAX:
            # Small enough to hold every block's partial product at once: one batched matmul is
            # far faster than nb small ones, and the ordered accumulation stays elementwise.
            p_all = jnp.einsum("jmk,jkn->jmn", a_s, b_s, precision=lax.Precision.HIGHEST)
            acc = acc0
            for j in range(nb):
                acc = acc + p_all[j]
            return acc

        def body(acc, x):
            a_j, b_j = x
            return acc + jnp.matmul(a_j, b_j, precision=lax.Precision.HIGHEST), None

        acc, _ = lax.scan(body, acc0, (a_s, b_s))
        return acc

    def slow(_):
        def body(acc_bits, x):
            ab, bb, sa_j, sb_j = x
            e0 = sa_j[:, None] + sb_j[None, :] + unit
            classes = [jnp.zeros((m, n), jnp.int32) for _ in range(la + lb - 1)]
            for i in range(la):
                for j in range(lb):
                    d = jnp.matmul(ab[i], bb[j], precision=lax.Precision.HIGHEST)
                    classes[i + j] = classes[i + j] + d.astype(jnp.int32)
            if la == lb == 1:
                term = int_times_pow2_to_f32_bits(classes[0], e0)
            else:
                term = _wide_int_to_f32_bits(classes, limb, e0)
            nan = (sa_j[:, None] == SCALE_NAN) | (sb_j[None, :] == SCALE_NAN)
            term = jnp.where(nan, F32_NAN_BITS, term)
            return add_f32_bits(acc_bits, term), None

        acc, _ = lax.scan(body, f32_to_bits(acc0), xs)
        return bits_to_f32(acc)

    if not exact:
        return slow(None)
    # The fast path is exact when every value it forms is 0 or a finite normal float32:
    # - each scaled element (units x 2^ea) is normal and finite: ea >= -126 and the largest
    #   element stays below 2^128 (likewise for b);
    # - every product and block sum is an integer multiple of 2^t_min >= 2^-100, below 2^127;
    # - nonzero accumulators are >= 2^-100, so multiples of 2^-123: every nonzero sum is at least
    #   2^-123 and float32 hardware (even flushing subnormals) rounds it exactly as IEEE says.
    sa_ok = jnp.where(sa == SCALE_NAN, SCALE_BIAS, sa)
    sb_ok = jnp.where(sb == SCALE_NAN, SCALE_BIAS, sb)
    sa_min, sa_max = jnp.min(sa_ok, initial=SCALE_BIAS), jnp.max(sa_ok, initial=SCALE_BIAS)
    sb_min, sb_max = jnp.min(sb_ok, initial=SCALE_BIAS), jnp.max(sb_ok, initial=SCALE_BIAS)
    t_min = sa_min + sb_min + unit
    t_max = sa_max + sb_max + unit
    block_bits = (fa.max_units * fb.max_units * bs).bit_length()
    operands_ok = ((sa_min - SCALE_BIAS + fa.unit_exp >= -126)
                   & (sa_max - SCALE_BIAS + fa.unit_exp + fa.max_units.bit_length() <= 127)
                   & (sb_min - SCALE_BIAS + fb.unit_exp >= -126)
                   & (sb_max - SCALE_BIAS + fb.unit_exp + fb.max_units.bit_length() <= 127))
    acc_mag = f32_to_bits(acc0) & 0x7FFFFFFF
    acc_ok = jnp.all((acc_mag == 0) | (acc_mag >= _FAST_ACC_MIN_BITS))
    fast_ok = (t_min >= _FAST_T_MIN) & (t_max + block_bits <= 127) & operands_ok & acc_ok
    return lax.cond(fast_ok, fast, slow, None)


def _normalize_digits(digits: list[jax.Array], bits: int) -> list[jax.Array]:
    """Carry-propagate so every digit but the last is in [0, 2^bits); the last keeps the sign."""
    out, carry = [], jnp.zeros_like(digits[0])
    for d in digits[:-1]:
        d = d + carry
        carry = d >> bits  # arithmetic shift: floor division, right for negatives too
        out.append(d & ((1 << bits) - 1))
    out.append(digits[-1] + carry)
    return out


def _wide_int_to_f32_bits(classes: list[jax.Array], bits: int, e0: jax.Array) -> jax.Array:
    """float32 bits of RNE(V * 2^e0) with V = sum_w classes[w] * 2^(bits * w), exactly.

    Args:
        classes: int32 arrays (|value| < 2^30), weights 2^(bits * w).
        bits: digit width (< 16).
        e0: int32 exponent, broadcastable.
    """
    digits = _normalize_digits([*classes, *(jnp.zeros_like(classes[0]) for _ in range(3))], bits)
    neg = digits[-1] < 0
    negated = _normalize_digits([-d for d in digits], bits)
    digits = [jnp.where(neg, nd, d) for d, nd in zip(digits, negated, strict=True)]
    # Position of the leading one bit of V.
    lead = jnp.full_like(digits[0], -1)
    for i, d in enumerate(digits):
        lead = jnp.where(d != 0, i * bits + floor_log2_int(d), lead)
    # A 27-bit window under the leading bit plus a sticky bit rounds exactly like all of V.
    lo = lead - 26
    window = jnp.zeros_like(lead)
    sticky = jnp.zeros_like(lead, dtype=bool)
    for i, d in enumerate(digits):
        sh = i * bits - lo
        up = d << jnp.clip(sh, 0, 31)
        down_by = jnp.clip(-sh, 0, 31)
        window = window + jnp.where(sh >= 0, up, d >> down_by)
        sticky = sticky | ((sh < 0) & ((d & ((jnp.int32(1) << down_by) - 1)) != 0))
    mag = (window << 1) | sticky.astype(jnp.int32)
    code = round_to_grid(mag, lo - 1 + e0, emin=F32_EXP_MIN, mbits=F32_MBITS)
    code = jnp.minimum(code, F32_INF_BITS)
    return jnp.where(neg, code | jnp.int32(-0x80000000), code)


