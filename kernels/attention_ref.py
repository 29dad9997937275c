"""Host-side tables and pure-JAX references of the attention kernels (``kernels/attention.py``).

The references follow the kernels' tiling and roundings; ``naive_attention`` is the textbook
float64 check they are compared with in tests.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.lazy import LazyModule, lazy_jit

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

MASK_VALUE = -1e30
"""Additive mask for excluded keys: finite, so a row with every key of a tile masked gives
exp(0) = 1 garbage instead of NaN; the garbage is multiplied by alpha = exp(-1e30 - m) = 0 as
soon as a tile with a real key arrives (every row has one: its own position)."""

YARN_GPT_OSS = {"rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0}
"""gpt-oss-120b's ``rope_theta`` and ``rope_scaling``
(https://huggingface.co/openai/gpt-oss-120b, config.json)."""


# --- RoPE tables ----------------------------------------------------------------------------
def yarn_cos_sin(positions: int, head_dim: int, cfg: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """gpt-oss YaRN RoPE tables: (cos, sin), each float32[positions, head_dim/2].

    Follows gpt-oss's ``RotaryEmbedding``: NTK-by-parts blend of interpolated (1/(factor*freq))
    and extrapolated (1/freq) inverse frequencies with a linear ramp between the dims of
    ``beta_fast`` and ``beta_slow`` rotations over the original context, and cos/sin scaled by the
    concentration 0.1*ln(factor) + 1. Computed in float64, rounded once to float32.
    """
    c = YARN_GPT_OSS if cfg is None else cfg
    theta, factor = c["rope_theta"], c["factor"]
    orig = c["original_max_position_embeddings"]
    half = head_dim // 2
    freq = theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    concentration = 0.1 * math.log(factor) + 1.0
    low = half * math.log(orig / (c["beta_fast"] * 2 * math.pi)) / math.log(theta)
    high = half * math.log(orig / (c["beta_slow"] * 2 * math.pi)) / math.log(theta)
    ramp = (np.arange(half, dtype=np.float64) - low) / (high - low)
    extrapolate = 1 - np.clip(ramp, 0, 1)
    inv_freq = (1 / (factor * freq)) * (1 - extrapolate) + (1 / freq) * extrapolate
    ang = np.arange(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return ((np.cos(ang) * concentration).astype(np.float32),
            (np.sin(ang) * concentration).astype(np.float32))


# --- references ---------------------------------------------------------------------------------
def _f32(x) -> jnp.ndarray:
    return jnp.asarray(np.asarray(x, np.float32))


def _rope_ref(x, cos, sin, scale: float | None):
    """Rotate-half in FP32 with the kernel's roundings; BF16 result (times ``scale`` if given)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    a = x1 * cos - x2 * sin
    b = x2 * cos + x1 * sin
    if scale is not None:
        a, b = a * jnp.float32(scale), b * jnp.float32(scale)
    return jnp.concatenate([a, b], axis=-1).astype(jnp.bfloat16).astype(jnp.float32)


@functools.partial(lazy_jit, static_argnames="tiles")
def _flash_ref_jit(q, kt, v, valid, tiles, sink):
    return _flash_ref(q, kt, v, valid, tiles, sink)


def _flash_ref(q, kt, v, valid, tiles, sink):
    """Online softmax over ``tiles`` with the kernel's roundings, batched over leading axes.

    Args:
        q: float32[..., R, D] (BF16 values, rotated and scaled); kt: float32[..., D, N];
        v: float32[..., N, D]; valid: bool[..., R, N] keys each row may see (broadcastable);
        tiles: [(start, n)] in processing order; sink: float32[..., R] sink logits, or None.
    Returns:
        float32[..., R, D] of BF16 values.
    """
    _, lsum, o_acc = _flash_partial(q, kt, v, valid, tiles, sink)
    return (o_acc * (jnp.float32(1) / lsum)).astype(jnp.bfloat16).astype(jnp.float32)


def _flash_partial(q, kt, v, valid, tiles, sink):
    """The unnormalised state (m, l, O) after the online softmax over ``tiles`` (``_flash_ref``'s
    arguments): FP32 row max [..., R, 1], row sum [..., R, 1] and output [..., R, D], as a KV
    split leaves them before the merge."""
    mask = jnp.where(valid, jnp.float32(0), jnp.float32(MASK_VALUE))
    hi = "highest"
    m = lsum = o_acc = None
    for t, (t0, n) in enumerate(tiles):
        s = jnp.matmul(q, kt[..., t0:t0 + n], precision=hi) + mask[..., t0:t0 + n]
        mt = s.max(axis=-1, keepdims=True)
        if t == 0:
            m_new = mt if sink is None else jnp.maximum(mt, sink[..., None])
            alpha = None if sink is None else jnp.exp(-(m_new - sink[..., None]))
        else:
            m_new = jnp.maximum(mt, m)
            alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new).astype(jnp.bfloat16).astype(jnp.float32)
        rs = p.sum(axis=-1, keepdims=True)
        o = jnp.matmul(p, v[..., t0:t0 + n, :], precision=hi)
        if t == 0:
            l_new = rs if sink is None else alpha + rs
            o_acc = o
        else:
            l_new = lsum * alpha + rs
            o_acc = o_acc * alpha + o
        m, lsum = m_new, l_new
    return m, lsum, o_acc


def _split_merge_ref(parts):
    """Flash-decoding's merge of KV splits' partial states, in split order, as the kernel does it:
    m = max_i m_i; a_i = exp(m_i - m); l = sum_i a_i l_i (in split order, from 0); O = O_0 a_0,
    then O += O_i a_i; out = bf16(O * (1 / l)).

    Args:
        parts: [(m, l, O)] per split, as ``_flash_partial`` returns them (split 0 with the sinks).
    Returns:
        float32[..., R, D] of BF16 values.
    """
    if len(parts) == 1:
        _, lsum, o = parts[0]
        return (o * (jnp.float32(1) / lsum)).astype(jnp.bfloat16).astype(jnp.float32)
    m = parts[0][0]
    for mi, _, _ in parts[1:]:
        m = jnp.maximum(m, mi)
    a = [jnp.exp(mi - m) for mi, _, _ in parts]
    lsum = jnp.float32(0) + parts[0][1] * a[0]
    for (_, li, _), ai in zip(parts[1:], a[1:], strict=True):
        lsum = lsum + li * ai
    o = parts[0][2] * a[0]
    for (_, _, oi), ai in zip(parts[1:], a[1:], strict=True):
        o = o + oi * ai
    return (o * (jnp.float32(1) / lsum)).astype(jnp.bfloat16).astype(jnp.float32)


def naive_attention(q, k, v, valid, sinks=None) -> np.ndarray:
    """Textbook softmax attention in float64 (no tiling, no roundings): the check on the references.

    Args:
        q: [R, D] (already rotated and scaled); k: [N, D]; v: [N, D]; valid: bool[R, N];
        sinks: [R] sink logits or None.
    """
    s = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T
    s = np.where(valid, s, -np.inf)
    if sinks is not None:
        s = np.concatenate([s, np.asarray(sinks, np.float64)[:, None]], axis=1)
    s = np.exp(s - s.max(axis=1, keepdims=True))
    p = s / s.sum(axis=1, keepdims=True)
    return p[:, :v.shape[0]] @ np.asarray(v, np.float64)


def _mx_values(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 values of MXFP8 E4M3 codes blocked by 32 along axis 0."""
    return np.asarray(mx.dequantize(mx.MXArray(codes=jnp.asarray(codes), scales=jnp.asarray(scales),
                                               fmt="e4m3", axis=0, block_size=32)))


def _quantize_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of ``x`` in MXFP8 E4M3, blocked by 32 along axis 0."""
    q = mx.quantize(jnp.asarray(x, jnp.float32), "e4m3", axis=0)
    return np.asarray(q.codes), np.asarray(q.scales)


