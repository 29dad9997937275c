"""Routing of the moe kernel: top-k selection and gating, on the vector unit and in JAX.

Stage: kernels (``moe`` family). ``emit_routing`` issues the vector-unit program that turns a
core's FP32 logits [T, E] into the slot tables the expert items read (``vec.group``: the D
distinct experts hit and a [D, T] weight per slot and token); ``route_reference`` is the same math
in JAX, written from the models' definitions.

Routers:

- ``softmax_topk`` (gpt-oss): logits + router bias, top-k, softmax over the k selected logits.
- ``sigmoid_topk`` (DeepSeek-V3/R1, Kimi K2): scores = sigmoid(logits). Without a score bias and
  with one group, the top-k of the logits (the same experts as the top-k of the scores unless
  sigmoid saturates into ties), gated by their sigmoid. Otherwise DeepSeek-V3's ``noaux_tc``
  (HF ``DeepseekV3MoEGate``): selection on ``scores + e_score_correction_bias`` ("score_bias",
  F32 [E]); with ``n_group > 1`` the experts form n_group groups of E/n_group, a group's score is
  the sum of its two best biased scores, the ``topk_group`` best groups are kept and the other
  groups' experts masked to 0 (HF's ``masked_fill(~mask, 0.0)``); top-k of what is left; the
  gating weights are the chosen experts' *unbiased* scores. In every sigmoid case the weights are
  normalised by their sum + 1e-20 and multiplied by ``routed_scaling_factor``.

How ``noaux_tc`` runs on an ISA without compares, scatters or per-element gathers (every step
exact, so the device matches the reference bit for bit):

- group scores: the biased scores [T, E] viewed as [T*G, E/G] (a reshape of packed rows), one
  ``vec.topk`` k=2 and a ``vec.reduce sum`` give the [T*G, 1] = [T, G] group scores; ``vec.topk``
  k=topk_group gives each token's kept groups.
- group mask: ``vec.group`` of the kept-group ids (plus pad rows holding every group id with
  weight 0, so all G values appear) with weight 1 gives keep^T [G, T] (1 where token t kept group
  g); each group's [T, E/G] column block is multiplied by row g of it viewed as a [T, 1] column.
- the chosen experts' unbiased scores: ``vec.topk`` of the masked biased scores gives the ids;
  ``vec.group`` of them (pad rows: every expert id) gives the selection mask transposed, M^T
  [E, T]; ``vec.topk`` k=T of its rows sorts every row's tokens (a permutation per row), and
  ``vec.group`` of those permutations weighted by the sorted values puts the mask back in
  token-major order, M [T, E]. Then scores * M leaves exactly the chosen experts' scores, and a
  last ``vec.topk`` returns them with their ids, in decreasing score order (the order the
  weights are summed in: HF leaves it unspecified).

The ISA has no immediate fill, so the constants these steps need (ones, zeros, 1e-20, the pad
rows' id sequences) are made on the core from x: ``vec.clamp`` with lo = hi = c writes c over any
finite value, and ``vec.topk`` of a row of equal values returns 0, 1, 2, ... (ties go to the
lower index). A NaN in x, which makes the layer's output NaN anyway, also spoils them.

Ties: the device and the reference break ties in every top-k by the lower index (``lax.top_k``);
HF's ``torch.topk(sorted=False)`` leaves them unspecified. A masked expert's value is +0 or -0
(score * 0) where HF has +0.0; they only differ if fewer than top_k experts of the kept groups
have a positive biased score.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from jalapeno_emu.emu.unit_math import sequential_row_sum
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import EngineHandle
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.lazy import LazyModule, lazy_jit

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")
lax = LazyModule("jax.lax")

__all__ = ["GATE_EPS", "RoutingDims", "check_routing_keys", "emit_gating", "emit_route_constants",
           "emit_routing", "fill_constant", "fill_ids", "flat_rows", "group_reference", "route_reference",
           "routing_buffers", "routing_dims"]

GATE_EPS = 1e-20  # DeepSeek adds it to the sum of the chosen sigmoid scores


@dataclass(frozen=True)
class RoutingDims:
    """The routing's static shape.

    Attributes:
        t, e, k: tokens, experts, top_k.
        router: "softmax_topk" or "sigmoid_topk".
        noaux: DeepSeek-V3's noaux_tc selection (score bias and/or groups).
        score_bias: a F32 [E] correction bias is added before selection.
        groups, topk_group: n_group and topk_group (1, 1: no group limit).
        pad_e: pad rows of k expert ids after the T token rows (every id 0..E-1 appears).
        pad_g: pad rows of topk_group group ids after the T token rows.
    """

    t: int
    e: int
    k: int
    router: str
    noaux: bool
    score_bias: bool
    groups: int
    topk_group: int
    pad_e: int
    pad_g: int

    @property
    def group_width(self) -> int:
        """Experts per group."""
        return self.e // self.groups


def check_routing_keys(shape: dict[str, Any]) -> None:
    """Refuse inconsistent routing keys (InvalidArgumentError naming the key)."""
    e, k = shape["experts"], shape["top_k"]
    g, tg = shape["n_group"], shape["topk_group"]
    if shape["router"] != "sigmoid_topk" and (g != 1 or tg != 1 or shape["score_bias"]):
        raise InvalidArgumentError(
            f"shape keys n_group={g}, topk_group={tg}, score_bias={shape['score_bias']} apply to "
            f"router=sigmoid_topk (DeepSeek's noaux_tc), not router={shape['router']}")
    if g < 1 or e % g:
        raise InvalidArgumentError(f"shape key n_group={g} must divide experts={e}")
    if not 1 <= tg <= g:
        raise InvalidArgumentError(f"shape key topk_group={tg} must be in [1, n_group={g}]")
    if g > 1 and e // g < 2:
        raise InvalidArgumentError(f"shape key n_group={g}: each group needs at least 2 of the "
                                   f"experts={e} (a group's score is the sum of its best two)")
    if k > tg * (e // g):
        raise InvalidArgumentError(f"shape key top_k={k} must be at most topk_group * experts / "
                                   f"n_group = {tg * (e // g)} (the experts of the kept groups)")


def routing_dims(t: int, e: int, k: int, shape: dict[str, Any]) -> RoutingDims:
    """The routing dims of a (checked) shape."""
    g, tg = shape["n_group"], shape["topk_group"]
    noaux = shape["router"] == "sigmoid_topk" and (shape["score_bias"] or g > 1)
    return RoutingDims(t, e, k, shape["router"], noaux, shape["score_bias"], g, tg,
                       pad_e=-(-e // k), pad_g=-(-g // tg) if g > 1 else 0)


# --- reference ------------------------------------------------------------------------------------
def route_reference(logits: jax.Array, inputs: dict[str, Any], rd: RoutingDims,
                    routed_scaling_factor: float) -> tuple[np.ndarray, np.ndarray]:
    """(expert ids int32 [T, k], gate weights float32 [T, k]) from FP32 logits [T, E], in the
    order and with the roundings the device uses (one FP32 rounding per vector instruction)."""
    bias = inputs["router_bias"] if rd.router == "softmax_topk" else \
        inputs["score_bias"] if rd.score_bias else np.zeros((1, rd.e), np.float32)
    ids, w = _route_jit(jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32), rd,
                        float(routed_scaling_factor))
    return np.asarray(ids, np.int32), np.asarray(w, np.float32)


@functools.partial(lazy_jit, static_argnames=("rd", "routed_scaling_factor"))
def _route_jit(logits: jax.Array, bias: jax.Array, rd: RoutingDims,
               routed_scaling_factor: float) -> tuple[jax.Array, jax.Array]:
    k = rd.k
    if rd.router == "softmax_topk":
        vals, ids = lax.top_k(logits + bias, k)
        ex = jnp.exp(vals - vals[:, :1])
        return ids, ex * (jnp.float32(1) / sequential_row_sum(ex))
    if rd.noaux:
        vals, ids = _noaux_select(logits, bias, rd)
    else:
        vals, ids = lax.top_k(logits, k)
        vals = jax.nn.sigmoid(vals)
    total = sequential_row_sum(vals) + jnp.float32(GATE_EPS)
    return ids, (vals * (jnp.float32(1) / total)) * jnp.float32(routed_scaling_factor)


def _noaux_select(logits: jax.Array, score_bias: jax.Array, rd: RoutingDims) -> tuple[jax.Array, jax.Array]:
    """HF DeepseekV3 noaux_tc: (chosen unbiased scores, their ids), both [T, k], by decreasing score."""
    t, e = logits.shape
    scores = jax.nn.sigmoid(logits)
    sel = scores + score_bias if rd.score_bias else scores
    rows = jnp.arange(t)[:, None]
    if rd.groups > 1:
        top2 = lax.top_k(sel.reshape(t * rd.groups, rd.group_width), 2)[0]
        group_scores = sequential_row_sum(top2).reshape(t, rd.groups)
        kept = lax.top_k(group_scores, rd.topk_group)[1]
        keep = jnp.zeros((t, rd.groups), jnp.float32).at[rows, kept].set(1.0)
        sel = sel * jnp.repeat(keep, rd.group_width, axis=1)
    chosen = lax.top_k(sel, rd.k)[1]
    mask = jnp.zeros((t, e), jnp.float32).at[rows, chosen].set(1.0)
    return lax.top_k(scores * mask, rd.k)


def group_reference(ids: np.ndarray, w: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """``vec.group``'s semantics in numpy: (distinct ids padded to d, [d, T] weights)."""
    uniq = np.unique(ids)
    if len(uniq) > d:
        raise InvalidArgumentError(f"the routing hits {len(uniq)} distinct experts; the program "
                                   f"was built for distinct_experts={d}")
    slots = np.concatenate([uniq, np.full(d - len(uniq), uniq[-1])]).astype(np.int32)
    sw = np.zeros((d, ids.shape[0]), np.float32)
    for u, ex in enumerate(uniq):
        for j in range(ids.shape[1]):
            sw[u] = sw[u] + np.where(ids[:, j] == ex, w[:, j], np.float32(0))
    return slots, sw


# --- device ---------------------------------------------------------------------------------------
def routing_buffers(rd: RoutingDims, d_max: int) -> list[tuple[str, str, tuple[int, int]]]:
    """(name, dtype, shape) of every scratchpad tile the routing of one core uses."""
    t, e, k = rd.t, rd.e, rd.k
    out = [("logits", "f32", (t, e)), ("vals", "f32", (t, k)), ("idx", "i32", (t, k)),
           ("gw", "f32", (t, k)), ("col", "f32", (t, 1)), ("slot_ids", "i32", (d_max, 1)),
           ("slot_w", "f32", (d_max, t))]
    if rd.router == "softmax_topk":
        out.append(("bias", "bf16", (1, e)))
    else:
        out.append(("eps", "f32", (1, 1)))
    if not rd.noaux:
        return out
    rows = t + rd.pad_e
    out += [("sel", "f32", (t, e)), ("msrc", "i32", (rows, k)), ("mw", "f32", (rows, k)),
            ("mids", "i32", (e, 1)), ("mt", "f32", (e, rows)), ("lval", "f32", (e, t)),
            ("lid", "i32", (e, t)), ("tids", "i32", (t, 1)), ("mask", "f32", (t, e)),
            ("iota_src", "f32", (1, max(e, rd.groups))), ("iota_val", "f32", (1, max(e, rd.groups)))]
    if rd.score_bias:
        out.append(("score_bias", "f32", (1, e)))
    if rd.groups > 1:
        g, tg, grows = rd.groups, rd.topk_group, t + rd.pad_g
        out += [("top2", "f32", (t * g, 2)), ("top2i", "i32", (t * g, 2)), ("gscore", "f32", (t * g, 1)),
                ("gval", "f32", (t, tg)), ("gsrc", "i32", (grows, tg)), ("gw1", "f32", (grows, tg)),
                ("gids", "i32", (g, 1)), ("keep_t", "f32", (g, grows))]
    return out


def flat_rows(tile: Tile, row0: int, rows: int) -> Tile:
    """Rows row0..row0+rows of a packed tile as one [1, rows * cols] row."""
    return Tile(tile.space, tile.core, tile.offset + row0 * tile.stride, tile.dtype, 1, rows * tile.cols)


def fill_constant(v: EngineHandle, dst: Tile, value: float, src: Tile) -> None:
    """dst[:, :] = value (FP32, rounded to dst's dtype) by ``vec.clamp`` of ``src`` (any initialised,
    finite tile, read in [src.rows, src.cols] pieces) with lo = hi = value."""
    for r0 in range(0, dst.rows, src.rows):
        rr = min(src.rows, dst.rows - r0)
        for c0 in range(0, dst.cols, src.cols):
            cc = min(src.cols, dst.cols - c0)
            v.clamp(dst.sub(r0, c0, rr, cc), src.sub(0, 0, rr, cc), value, value)


def fill_ids(v: EngineHandle, dst_row: Tile, n_ids: int, ones: Tile, scratch: Tile) -> None:
    """dst_row [1, L] (i32) = 0, 1, ..., n_ids-1, 0, 1, ...: ``vec.topk`` of equal values returns
    the indices in increasing order (ties go to the lower index)."""
    for c0 in range(0, dst_row.cols, n_ids):
        n = min(n_ids, dst_row.cols - c0)
        v.topk(scratch.sub(0, 0, 1, n), dst_row.sub(0, c0, 1, n), ones.sub(0, 0, 1, n_ids))


def emit_route_constants(v: EngineHandle, B: dict[str, Tile], rd: RoutingDims, x: Tile) -> None:
    """The routing's constants, made from x (loaded): 1e-20, and for noaux_tc the pad rows of ids
    and the 1 / 0 weights of the token / pad rows."""
    if rd.router == "sigmoid_topk":
        fill_constant(v, B["eps"], GATE_EPS, x)
    if not rd.noaux:
        return
    t, e, k = rd.t, rd.e, rd.k
    ones, scratch = B["iota_src"], B["iota_val"]
    fill_constant(v, ones, 1.0, x)
    fill_ids(v, flat_rows(B["msrc"], t, rd.pad_e), e, ones, scratch)
    fill_constant(v, B["mw"].sub(0, 0, t, k), 1.0, x)
    fill_constant(v, flat_rows(B["mw"], t, rd.pad_e), 0.0, x)
    if rd.groups > 1:
        tg = rd.topk_group
        fill_ids(v, flat_rows(B["gsrc"], t, rd.pad_g), rd.groups, ones, scratch)
        fill_constant(v, B["gw1"].sub(0, 0, t, tg), 1.0, x)
        fill_constant(v, flat_rows(B["gw1"], t, rd.pad_g), 0.0, x)


def _column(tile: Tile, row: int, n: int) -> Tile:
    """Row ``row`` of a packed f32 tile, its first n elements viewed as an [n, 1] column."""
    return Tile(tile.space, tile.core, tile.offset + row * tile.stride, tile.dtype, n, 1, 4)


def emit_routing(v: EngineHandle, B: dict[str, Tile], rd: RoutingDims, routed_scaling_factor: float,
                 d: int) -> None:
    """Vector-unit routing of all T tokens from B["logits"] (FP32 [T, E], consts loaded): fills
    ``slot_ids`` [D, 1] and ``slot_w`` [D, T] with ``vec.group``."""
    emit_gating(v, B, rd, routed_scaling_factor)
    v.group(B["slot_ids"].sub(0, 0, d, 1), B["slot_w"].sub(0, 0, d, rd.t), B["idx"], B["gw"])


def emit_gating(v: EngineHandle, B: dict[str, Tile], rd: RoutingDims, routed_scaling_factor: float) -> None:
    """Vector-unit top-k and gating of all T tokens from B["logits"] (FP32 [T, E], consts loaded):
    each token's expert ids in B["idx"] and weights in B["gw"], both [T, k]."""
    t = rd.t
    logits, vals, idx, gw, col = (B[n] for n in ("logits", "vals", "idx", "gw", "col"))
    if rd.router == "softmax_topk":
        v.add(logits, logits, B["bias"])
        v.topk(vals, idx, logits)
        v.copy(col, vals.sub(0, 0, t, 1))
        v.sub(gw, vals, col)
        v.exp(gw, gw)
        v.reduce("sum", col, gw)
        v.recip(col, col)
        v.mul(gw, gw, col)
    else:
        if rd.noaux:
            _emit_noaux_select(v, B, rd)  # vals: the chosen experts' sigmoid scores
        else:
            v.topk(vals, idx, logits)
            v.sigmoid(vals, vals)
        v.reduce("sum", col, vals)
        v.add(col, col, B["eps"])
        v.recip(col, col)
        v.mul(gw, vals, col)
        v.scale(gw, gw, routed_scaling_factor)


def _emit_noaux_select(v: EngineHandle, B: dict[str, Tile], rd: RoutingDims) -> None:
    """noaux_tc selection (module docstring): leaves the chosen unbiased scores in B["vals"] and
    their ids in B["idx"], [T, k] by decreasing score."""
    t, e, k = rd.t, rd.e, rd.k
    scores, sel = B["logits"], B["sel"]
    v.sigmoid(scores, scores)
    if rd.score_bias:
        v.add(sel, scores, B["score_bias"])
    else:
        v.copy(sel, scores)
    if rd.groups > 1:
        g, gw_, tg = rd.groups, rd.group_width, rd.topk_group
        v.topk(B["top2"], B["top2i"], Tile(sel.space, sel.core, sel.offset, "f32", t * g, gw_))
        v.reduce("sum", B["gscore"], B["top2"])
        grouped = Tile(sel.space, sel.core, B["gscore"].offset, "f32", t, g)
        v.topk(B["gval"], B["gsrc"].sub(0, 0, t, tg), grouped)
        v.group(B["gids"], B["keep_t"], B["gsrc"], B["gw1"])
        for gi in range(g):
            block = sel.sub(0, gi * gw_, t, gw_)
            v.mul(block, block, _column(B["keep_t"], gi, t))
    v.topk(B["vals"], B["msrc"].sub(0, 0, t, k), sel)
    mt = B["mt"]
    v.group(B["mids"], mt, B["msrc"], B["mw"])
    v.topk(B["lval"], B["lid"], mt.sub(0, 0, e, t))
    v.group(B["tids"], B["mask"], B["lid"], B["lval"])
    v.mul(B["mask"], B["mask"], scores)
    v.topk(B["vals"], B["idx"], B["mask"])
