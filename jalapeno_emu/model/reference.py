"""The pure-JAX reference forward pass: textbook math in natural layouts, the chip's MX numerics.

Stage: model. This is what the die's functional run (``model.die``) is checked against. It is
written from the model definitions (HF ``modeling_gpt_oss`` / ``modeling_deepseek`` semantics),
not from the kernels' programs or layouts: full-matrix softmax instead of the kernels' online
softmax, the naive (non-absorbed) MLA form, one matmul per expert over the tokens that chose it.
What it shares with the die is the *storage* numerics a model on this chip has by definition:

- activations between kernels are BF16 (every kernel rounds its output once to BF16);
- BF16 x BF16 / BF16 x MX products are exact, sums in FP32 (``inorder_block_matmul``);
- RoPE in FP32, rotated keys stored as BF16, the query scaled before its BF16 rounding;
- attention probabilities rounded to BF16 before the P.V product (the matrix unit's operand);
- expert weights MXFP4, expert inputs and activations quantised to MXFP8 E4M3 (32-blocks along
  the contraction) before each expert matmul (``mx.matmul``), the routing weight applied to the
  activation before the down projection, as the chip's MoE kernel defines it.

Where the die differs (summation order across tiles and cores, online-softmax rescaling, the
absorbed MLA form's extra BF16 rounding of q @ W_UK) the results differ by a few BF16 ulps per
layer; ``model.die`` documents the tolerance that covers it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.emu.unit_math import inorder_block_matmul, sequential_row_sum
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.kernels.attention_ref import yarn_cos_sin
from jalapeno_emu.kernels.moe import SWIGLU_ALPHA, SWIGLU_LIMIT

from .config import ModelConfig
from .plan import mla_softmax_scale
from .weights import LayerWeights, ModelWeights

__all__ = ["ReferenceModel", "deepseek_rope_tables", "gqa_heads", "mla_heads", "rope_tables", "route"]

_MASKED = -jnp.inf


def _f32(x: Any) -> jax.Array:
    return jnp.asarray(np.asarray(x, np.float32)) if not isinstance(x, jax.Array) else x.astype(jnp.float32)


def _bf16(x: jax.Array) -> jax.Array:
    """Round to BF16 and back: the value a kernel stores."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def rope_tables(cfg: ModelConfig, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """gpt-oss YaRN tables (cos, sin) F32 [positions, head_dim/2] for ``cfg``'s rope."""
    return yarn_cos_sin(positions, cfg.head_dim, cfg.rope.as_dict())


def deepseek_rope_tables(cfg: ModelConfig, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3 YaRN tables (cos, sin) F32 [positions, rope_dim/2] (see kernels.mla_append)."""
    from jalapeno_emu.kernels.mla_append import deepseek_yarn_cos_sin

    return deepseek_yarn_cos_sin(positions, cfg.qk_rope_dim, cfg.rope.as_dict())


def _matmul(x: jax.Array, w: Any) -> jax.Array:
    """x (F32 values of BF16) @ w (BF16 array or MXArray): FP32, exact products, in-order sums."""
    wv = mx.dequantize(w) if isinstance(w, mx.MXArray) else _f32(w)
    return inorder_block_matmul(x, wv)


def _linear(x: jax.Array, w: Any, b: Any | None = None) -> jax.Array:
    """BF16 output of x @ w (+ b)."""
    y = _matmul(x, w)
    if b is not None:
        y = y + _f32(b)[None, :]
    return _bf16(y)


def _row_sum(x: jax.Array) -> jax.Array:
    """Sums over the last axis in increasing index order (the vector unit's ``vec.reduce sum``)."""
    flat = x.reshape(-1, x.shape[-1])
    return sequential_row_sum(flat).reshape(*x.shape[:-1], 1)


def _mxu(a: jax.Array, b: jax.Array) -> jax.Array:
    """Batched a [..., M, K] @ b [..., K, N] with the matrix unit's summation order (exact
    products, 32-element K blocks summed in order, blocks added in order); K is zero-padded to a
    multiple of 32 (zeros change no sum). Leading axes must match."""
    k = a.shape[-1]
    pad = -k % 32
    if pad:
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
        b = jnp.pad(b, [(0, 0)] * (b.ndim - 2) + [(0, pad), (0, 0)])
    lead = a.shape[:-2]
    flat_a = a.reshape(-1, *a.shape[-2:])
    flat_b = b.reshape(-1, *b.shape[-2:])
    out = jax.vmap(inorder_block_matmul)(flat_a, flat_b)
    return out.reshape(*lead, *out.shape[-2:])


def _rmsnorm(x: jax.Array, w: Any, eps: float) -> jax.Array:
    """y = bf16(x * rsqrt(sum(x^2) * (1/H) + eps) * w), the sum in column order."""
    ms = _row_sum(x * x) * jnp.float32(1.0 / x.shape[-1])
    return _bf16((x * jax.lax.rsqrt(ms + jnp.float32(eps))) * _f32(w))


def _rotate_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """gpt-oss rotate-half RoPE on the last axis (FP32): cos/sin broadcast [..., D/2]."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _deinterleave(x: jax.Array) -> jax.Array:
    """DeepSeek's rope input permutation: pairs (x[2i], x[2i+1]) -> evens first, then odds."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _softmax_pv(s: jax.Array, v: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """softmax(s) @ v with masked entries at -inf and an optional sink column (a logit in the
    denominator only). P is rounded to BF16 (the matrix unit's operand) and the denominator sums
    those BF16 values in key order; the output is scaled by the reciprocal of the denominator.
    s [..., Q, N], v [..., N, Dv]."""
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks)
    p = _bf16(jnp.exp(s - m))
    den = _row_sum(p)
    if sinks is not None:
        den = den + jnp.exp(sinks - m)
    return _mxu(p, v) * (jnp.float32(1) / den)


def _params(lw: LayerWeights) -> dict[str, Any]:
    """The layer's weights as a pytree of arrays (BF16 as F32 values, MXArrays as they are)."""
    def conv(v: Any) -> Any:
        if v is None or isinstance(v, mx.MXArray):
            return v
        return _f32(v)

    out: dict[str, Any] = {}
    for name in ("attn_norm", "ffn_norm", "wo", "wqkv", "bqkv", "bo", "sinks", "wqkv_a", "q_a_norm",
                 "kv_a_norm", "wq_b", "w_kv_b", "router", "router_bias", "score_bias"):
        out[name] = conv(getattr(lw, name))
    keys = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")

    def stack(experts: tuple) -> dict[str, Any]:
        # Experts stacked along a new leading axis (MXArrays leaf by leaf) for one lax.scan.
        if not experts:
            return {}
        per = [{k: conv(getattr(ex, k)) for k in keys} for ex in experts]
        return jax.tree.map(lambda *xs: jnp.stack(xs), *per)

    out["experts"] = stack(lw.experts)
    out["shared"] = stack(lw.shared)
    return out


def gqa_heads(cfg: ModelConfig, window: int, p: dict, cache: tuple, y: jax.Array, pos: jax.Array,
              cos: jax.Array, sin: jax.Array, batch: int, tp: int = 1) -> tuple[jax.Array, tuple]:
    """Attention of S new tokens per sequence at positions ``pos`` [S] against the whole cache
    (capacity-sized, masked), writing the new keys/values first, up to the output projection:
    y [B*S, H] -> o [B*S, (Hq/tp) D] (BF16 values) and the updated cache. ``tp`` > 1: the
    1/tp share of the heads whose weights ``p`` holds (the multi-chip model's slice)."""
    kc, vc = cache
    b, s = batch, pos.shape[0]
    hq, hkv, d = cfg.q_heads // tp, cfg.kv_heads // tp, cfg.head_dim
    qkv = _linear(y, p["wqkv"], p["bqkv"]).reshape(b, s, hq + 2 * hkv, d)
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    c, sn = cos[pos][None, :, None, :], sin[pos][None, :, None, :]
    k = _bf16(_rotate_half(k, c, sn))
    q = _bf16(_rotate_half(q, c, sn) * jnp.float32(1 / math.sqrt(d)))
    kc = jax.lax.dynamic_update_slice(kc, k.transpose(0, 2, 1, 3), (0, 0, pos[0], 0))
    vc = jax.lax.dynamic_update_slice(vc, v.transpose(0, 2, 1, 3), (0, 0, pos[0], 0))
    keys = jnp.arange(kc.shape[2])
    valid = keys[None, :] <= pos[:, None]
    if window:
        valid &= keys[None, :] > pos[:, None] - window
    g = hq // hkv
    # a KV head's query rows stacked head by head, as the kernels do: [B, Hkv, G*S, D]
    qg = q.reshape(b, s, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * s, d)
    sc = _mxu(qg, kc.transpose(0, 1, 3, 2))  # [B, Hkv, G*S, cap]
    sc = jnp.where(jnp.tile(valid, (g, 1)), sc, _MASKED)
    sinks = jnp.repeat(p["sinks"].reshape(1, hkv, g, 1), s, axis=2) if cfg.sinks else None
    o = _softmax_pv(sc, vc, sinks).reshape(b, hkv, g, s, d)
    return _bf16(o).transpose(0, 3, 1, 2, 4).reshape(b * s, hq * d), (kc, vc)


def _gqa(cfg: ModelConfig, window: int, p: dict, cache: tuple, y: jax.Array, pos: jax.Array,
         cos: jax.Array, sin: jax.Array, batch: int) -> tuple[jax.Array, tuple]:
    """``gqa_heads`` and the output projection: y [B*S, H] -> [B*S, H]."""
    o, cache = gqa_heads(cfg, window, p, cache, y, pos, cos, sin, batch)
    return _linear(o, p["wo"], p["bo"]), cache


def mla_heads(cfg: ModelConfig, p: dict, cache: tuple, y: jax.Array, pos: jax.Array,
              cos: jax.Array, sin: jax.Array, batch: int, tp: int = 1) -> tuple[jax.Array, tuple]:
    """MLA of S new tokens per sequence up to the output projection: o [B*S, (Hq/tp) Dv] (BF16
    values) and the latent cache [B, cap, R + rope] with the new rows written. Decode steps
    (S = 1) take the absorbed form, prefill the naive one. ``tp`` > 1: the 1/tp share of the
    heads whose weights ``p`` holds (the latent cache is shared by all heads)."""
    (lat,) = cache
    b, s = batch, pos.shape[0]
    h, nope, rope, r, vd = (cfg.q_heads // tp, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank,
                            cfg.v_head_dim)
    a = _linear(y, p["wqkv_a"])
    q_a, c_kv, k_pe = a[:, :cfg.q_lora_rank], a[:, cfg.q_lora_rank:cfg.q_lora_rank + r], a[:, -rope:]
    q = _linear(_rmsnorm(q_a, p["q_a_norm"], cfg.rms_eps), p["wq_b"]).reshape(b, s, h, nope + rope)
    c_kv = _rmsnorm(c_kv, p["kv_a_norm"], cfg.rms_eps).reshape(b, s, r)
    c, sn = cos[pos], sin[pos]
    k_pe = _bf16(_rotate_half(_deinterleave(k_pe.reshape(b, s, rope)), c[None], sn[None]))
    q_pe = _bf16(_rotate_half(_deinterleave(q[..., nope:]), c[None, :, None], sn[None, :, None]))
    lat = jax.lax.dynamic_update_slice(lat, jnp.concatenate([c_kv, k_pe], axis=-1), (0, pos[0], 0))
    wkv = p["w_kv_b"].reshape(h, nope + vd, r)
    valid = jnp.arange(lat.shape[1])[None, :] <= pos[:, None]
    if s == 1:  # decode: the absorbed form, as DeepSeek's inference code and the chip compute it
        q_lat = _bf16(_mxu(q[:, 0, :, :nope].transpose(1, 0, 2), wkv[:, :nope]))  # [H, B, R]
        q_full = jnp.concatenate([q_lat, q_pe[:, 0].transpose(1, 0, 2)], axis=-1).transpose(1, 0, 2)
        sc = _mxu(q_full, lat.transpose(0, 2, 1)) * jnp.float32(mla_softmax_scale(cfg))  # [B, H, cap]
        sc = jnp.where(valid[0][None, None], sc, _MASKED)
        o_lat = _bf16(_softmax_pv(sc, lat[..., :r], None))  # [B, H, R]
        out = _bf16(_mxu(o_lat.transpose(1, 0, 2), wkv[:, nope:].transpose(0, 2, 1)))  # [H, B, V]
        return out.transpose(1, 0, 2).reshape(b, h * vd), (lat,)
    k_nope = _bf16(jnp.einsum("bnr,hdr->bhnd", lat[..., :r], wkv[:, :nope], precision="highest"))
    v = _bf16(jnp.einsum("bnr,hdr->bhnd", lat[..., :r], wkv[:, nope:], precision="highest"))
    sc = (jnp.einsum("bshd,bhnd->bhsn", q[..., :nope], k_nope, precision="highest")
          + jnp.einsum("bshd,bnd->bhsn", q_pe, lat[..., r:], precision="highest"))
    sc = sc * jnp.float32(mla_softmax_scale(cfg))
    sc = jnp.where(valid, sc, _MASKED)
    o = _bf16(_softmax_pv(sc, v, None)).transpose(0, 2, 1, 3).reshape(b * s, h * vd)
    return o, (lat,)


def _mla(cfg: ModelConfig, p: dict, cache: tuple, y: jax.Array, pos: jax.Array,
         cos: jax.Array, sin: jax.Array, batch: int) -> tuple[jax.Array, tuple]:
    """``mla_heads`` and the output projection: y [B*S, H] -> [B*S, H]."""
    o, cache = mla_heads(cfg, p, cache, y, pos, cos, sin, batch)
    return _linear(o, p["wo"]), cache


def _expert(cfg: ModelConfig, ex: dict, xq: mx.MXArray, weight: jax.Array,
            gather: Callable[[mx.MXArray], mx.MXArray] | None = None) -> jax.Array:
    """weight[T, 1] * expert(x) in the chip's order: act * weight, MXFP8, down, + weight * b2.

    ``gather``: applied to the quantised activation before the down projection (the multi-chip
    model all-gathers its tp column slices there); None on one chip."""
    gate, up = mx.matmul(xq, ex["gate"]), mx.matmul(xq, ex["up"])
    if ex["gate_bias"] is not None:
        gate, up = gate + ex["gate_bias"][None], up + ex["up_bias"][None]
    if cfg.activation == "swiglu_oai":
        g = jnp.minimum(gate, jnp.float32(SWIGLU_LIMIT))
        u = jnp.clip(up, -SWIGLU_LIMIT, SWIGLU_LIMIT)
        act = g * jax.nn.sigmoid(g * jnp.float32(SWIGLU_ALPHA)) * (u + jnp.float32(1))
    else:
        act = gate * jax.nn.sigmoid(gate) * up
    aq = mx.quantize(act * weight, "e4m3", axis=1)
    out = mx.matmul(aq if gather is None else gather(aq), ex["down"])
    if ex["down_bias"] is not None:
        out = out + weight * ex["down_bias"][None]
    return out


def route(cfg: ModelConfig, p: dict, y: jax.Array) -> jax.Array:
    """Dense routing weights F32 [T, E] (0 for experts a token did not choose), HF semantics:
    gpt-oss softmax over the top-k (biased) logits; DeepSeek-V3 noaux_tc: sigmoid scores, top-k
    of score + correction bias within the top ``topk_group`` groups (a group's score: the sum of
    its two best), weights = chosen unbiased scores normalised (+1e-20) times the scaling factor."""
    logits = _matmul(y, p["router"])
    if cfg.router == "softmax_topk":
        if p["router_bias"] is not None:
            logits = logits + p["router_bias"][None]
        vals, ids = jax.lax.top_k(logits, cfg.top_k)
        e = jnp.exp(vals - vals[:, :1])  # top_k sorts: the first is the max
        w = e * (jnp.float32(1) / _row_sum(e))
    else:
        scores = jax.nn.sigmoid(logits)
        sel = scores + (p["score_bias"][None] if p["score_bias"] is not None else 0.0)
        if cfg.n_group > 1:
            grp = sel.reshape(sel.shape[0], cfg.n_group, -1)
            top2 = jax.lax.top_k(grp, 2)[0].sum(-1)
            keep = jax.lax.top_k(top2, cfg.topk_group)[1]
            gmask = jnp.zeros_like(top2).at[jnp.arange(sel.shape[0])[:, None], keep].set(1.0)
            # HF masks the experts of dropped groups with 0.0 (masked_fill), not -inf
            sel = jnp.where(jnp.repeat(gmask, cfg.experts // cfg.n_group, axis=1) > 0, sel, 0.0)
        _, ids = jax.lax.top_k(sel, cfg.top_k)
        chosen = jnp.take_along_axis(scores, ids, axis=1)
        w = (chosen * (jnp.float32(1) / (_row_sum(chosen) + jnp.float32(1e-20)))) * jnp.float32(
            cfg.routed_scaling_factor)
    dense = jnp.zeros((y.shape[0], cfg.experts), jnp.float32)
    return dense.at[jnp.arange(y.shape[0])[:, None], ids].add(w)


def _experts_sum(cfg: ModelConfig, stacked: dict, xq: mx.MXArray, weights: jax.Array) -> jax.Array:
    """sum_e weights[:, e] * expert_e(x), experts in index order. Traced (jit): one lax.scan over
    all experts (one compiled body); eager: a loop over the experts some token chose (an expert
    with weight 0 everywhere adds exactly 0, so skipping it changes nothing)."""
    acc = jnp.zeros((weights.shape[0], cfg.hidden), jnp.float32)
    if isinstance(weights, jax.core.Tracer):
        def body(total, item):
            ex, w = item
            return total + _expert(cfg, ex, xq, w[:, None]), None

        out, _ = jax.lax.scan(body, acc, (stacked, weights.T))
        return out
    for e in np.flatnonzero(np.asarray(jnp.any(weights != 0, axis=0))).tolist():
        ex = jax.tree.map(lambda leaf, e=e: leaf[e], stacked)
        acc = acc + _expert(cfg, ex, xq, weights[:, e:e + 1])
    return acc


def _ffn(cfg: ModelConfig, moe: bool, p: dict, y: jax.Array) -> jax.Array:
    """Routed experts (all of them, in order: a weight of 0 contributes exactly 0) + shared."""
    xq = mx.quantize(y, "e4m3", axis=1)
    out = jnp.zeros(y.shape, jnp.float32)
    if moe:
        out = _experts_sum(cfg, p["experts"], xq, route(cfg, p, y))
    shared = p["shared"]
    n_shared = jax.tree.leaves(shared)[0].shape[0] if jax.tree.leaves(shared) else 0
    if n_shared:
        out = out + _experts_sum(cfg, shared, xq, jnp.ones((y.shape[0], n_shared), jnp.float32))
    return _bf16(out)


def _layer(cfg: ModelConfig, window: int, moe: bool, batch: int, p: dict, cache: tuple, x: jax.Array,
           residual: jax.Array, pos: jax.Array, cos: jax.Array, sin: jax.Array):
    h = _bf16(x + residual)
    y = _rmsnorm(h, p["attn_norm"], cfg.rms_eps)
    if cfg.attention == "gqa":
        attn, cache = _gqa(cfg, window, p, cache, y, pos, cos, sin, batch)
    else:
        attn, cache = _mla(cfg, p, cache, y, pos, cos, sin, batch)
    h2 = _bf16(attn + h)
    return _ffn(cfg, moe, p, _rmsnorm(h2, p["ffn_norm"], cfg.rms_eps)), h2, cache


def _head(eps: float, batch: int, x: jax.Array, residual: jax.Array, norm: jax.Array, unembed: jax.Array):
    last = _bf16(x + residual).reshape(batch, -1, x.shape[-1])[:, -1]
    return _linear(_rmsnorm(last, norm, eps), unembed)


def _step(cfg: ModelConfig, batch: int, params: list[dict], caches: list[tuple], x: jax.Array,
          pos: jax.Array, cos: jax.Array, sin: jax.Array, norm: jax.Array, unembed: jax.Array
          ) -> tuple[jax.Array, list[tuple]]:
    """Every layer and the head: embedded x [B*S, H] -> (logits [B, vocab], updated caches)."""
    residual = jnp.zeros_like(x)
    out = []
    for i in range(cfg.layers):
        x, residual, cache = _layer(cfg, cfg.window(i), cfg.is_moe(i), batch, params[i], caches[i],
                                    x, residual, pos, cos, sin)
        out.append(cache)
    return _head(cfg.rms_eps, batch, x, residual, norm, unembed), out


_layer_jit = jax.jit(_layer, static_argnames=("cfg", "window", "moe", "batch"))
_head_jit = jax.jit(_head, static_argnames=("eps", "batch"))
# The caches are donated: the step rewrites one position of each, and without donation XLA would
# copy every cache on every step, which the die (updating its HBM in place) does not pay.
_step_jit = jax.jit(_step, static_argnames=("cfg", "batch"), donate_argnames=("caches",))
JIT_MODES = (False, True, "layer", "step")
"""``ReferenceModel(jit=...)`` values: False eager; True or "layer" per layer; "step" per step."""


class ReferenceModel:
    """The reference forward pass with its own KV caches (natural layouts).

    Args:
        cfg: the model (any size; meant for tiny ones).
        weights: from ``init_weights``.
        batch: sequences (all advance together: every sequence has the same length).
        max_positions: cache capacity in tokens (attention runs over the whole capacity, masked,
            so that one compiled function serves every step).
        jit: False (default): every operation is dispatched on its own (no fusion across
            operations), rounded as written, as the die executes instruction by instruction;
            this is the numerics check. True (or "layer"): each layer is
            one jitted function, several times faster, but XLA then fuses operations (a multiply
            feeding an add becomes one fused multiply-add, exp takes its vectorised path inside a
            fusion), which moves results by an FP32 ulp here and there. "step": the whole step
            (every layer and the head) is one jitted function with the caches donated (updated
            in place): the fastest form, and the speed baseline (``benchmarks/bench_model.py``);
            same fusion caveat, and under jit every expert runs (a weight of 0 adds exactly 0),
            where eager runs only the chosen ones.
    """

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, *, batch: int, max_positions: int,
                 jit: bool | str = False) -> None:
        if jit not in JIT_MODES:
            raise InvalidArgumentError(f"jit={jit!r} is not one of {JIT_MODES}")
        self.cfg, self.w, self.batch, self.cap, self.jit = cfg, weights, batch, max_positions, jit
        self.length = 0
        self.params = [_params(lw) for lw in weights.layers]
        if cfg.attention == "gqa":
            shape = (batch, cfg.kv_heads, max_positions, cfg.head_dim)
            self.cache = [(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
                          for _ in range(cfg.layers)]
            self.cos, self.sin = (jnp.asarray(t) for t in rope_tables(cfg, max_positions))
        else:
            shape = (batch, max_positions, cfg.kv_lora_rank + cfg.qk_rope_dim)
            self.cache = [(jnp.zeros(shape, jnp.float32),) for _ in range(cfg.layers)]
            self.cos, self.sin = (jnp.asarray(t) for t in deepseek_rope_tables(cfg, max_positions))
        self.embed = np.asarray(weights.embed)
        self.final_norm, self.unembed = _f32(weights.final_norm), _f32(weights.unembed)

    def forward(self, ids: np.ndarray) -> np.ndarray:
        """Run ``ids`` int [batch, S] as the next S positions; logits F32 [batch, vocab] of the
        last position (BF16 values). Updates the caches."""
        cfg = self.cfg
        ids = np.asarray(ids)
        b, s = ids.shape
        if b != self.batch:
            raise InvalidArgumentError(f"ids have batch {b}, the model was set up for {self.batch}")
        if self.length + s > self.cap:
            raise InvalidArgumentError(f"{self.length + s} positions exceed the cache capacity {self.cap}")
        pos = jnp.arange(self.length, self.length + s)
        x = _f32(self.embed[ids.reshape(-1)])
        if self.jit == "step":
            logits, self.cache = _step_jit(cfg, b, self.params, self.cache, x, pos, self.cos, self.sin,
                                           self.final_norm, self.unembed)
            self.length += s
            return np.asarray(logits)
        residual = jnp.zeros_like(x)
        layer, head = (_layer_jit, _head_jit) if self.jit else (_layer, _head)
        for i in range(cfg.layers):
            x, residual, self.cache[i] = layer(cfg, cfg.window(i), cfg.is_moe(i), b, self.params[i],
                                               self.cache[i], x, residual, pos, self.cos, self.sin)
        logits = head(cfg.rms_eps, b, x, residual, self.final_norm, self.unembed)
        self.length += s
        return np.asarray(logits)
