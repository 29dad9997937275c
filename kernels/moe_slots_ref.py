"""The reference of the moe kernel's slot program: the same operations in the same order, in JAX.

Stage: kernels (``moe`` family), beside ``moe_slots``. Routing as the device routes
(``moe_routing``), then per core its items in program order: gate|up on the slot's list rows (or
every token), the activation, the gate weight, quantised, the down projection accumulated per
term (a shared term's items summed in FP32 in the scratchpad's order), the down-bias matmul;
then the dense arrangement's partials added in core order, or the routed arrangement's terms
completed in holder order and each token's k rows added in top-k order, then the shared rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.lazy import LazyModule

from .moe_base import (
    BIAS_PARTS,
    activation_reference,
    bf16_accumulate,
    bias_parts,
    inorder_jit,
    quant_reference,
    weight_cols,
)
from .moe_pack import router_logical, unpack_expert_biases, unpack_experts
from .moe_routing import group_reference, route_reference
from .moe_slots_plan import MoePlan

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

__all__ = ["slots_reference"]


def _mm(acc: jax.Array, a: Any, b: mx.MXArray, act_fmt: str) -> jax.Array:
    return bf16_accumulate(acc, a, b) if act_fmt == "bf16" else mx.matmul_accumulate(acc, a, b)


def _down_cols(dn: mx.MXArray, c0: int, w: int) -> mx.MXArray:
    return mx.MXArray(codes=np.asarray(dn.codes)[c0:c0 + w],
                      scales=np.asarray(dn.scales)[c0 // 32:(c0 + w) // 32],
                      fmt="e2m1", axis=0, block_size=32)


def _rows(xq: Any, rows: np.ndarray) -> Any:
    if isinstance(xq, mx.MXArray):
        return mx.MXArray(codes=np.asarray(xq.codes)[rows], scales=np.asarray(xq.scales)[rows], fmt=xq.fmt,
                          axis=1, block_size=32)
    return xq[rows]


def _lists(p: MoePlan, slot_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Routed: the lists as the device makes them: (token ids, weights) of every slot's C best
    tokens, concatenated in slot order; raises when a slot has more tokens than its capacity."""
    ids, ws = [], []
    for u, cap in enumerate(p.caps):
        vals, idx = jax.lax.top_k(jnp.asarray(slot_w[u]), cap)
        if cap < p.t:
            over = float(jax.lax.top_k(jnp.asarray(slot_w[u]), cap + 1)[0][cap])
            if over > 0:
                raise InvalidArgumentError(
                    f"more than capacity={cap} tokens chose slot {u}'s expert (shape key routing=uniform "
                    "sizes each slot's list by the expected count; routing=any fits every routing)")
        ids.append(np.asarray(idx, np.int32))
        ws.append(np.asarray(vals, np.float32))
    return np.concatenate(ids), np.concatenate(ws)


def _core_partials(p: MoePlan, shape: dict[str, Any], c: int, xq: Any, terms_w: dict, lists: tuple | None,
                   slot_w: np.ndarray | None) -> tuple[jax.Array, dict[int, jax.Array]]:
    """Core c's FP32 partial, the items' operations in the program's order: dense [T, H] (then
    the down-bias matmul); routed, its slots' rows [rows, H] (then the down-bias matmul) and each
    shared term's [T, H] rows (item outputs summed in order, + the bias on the slice-0 core)."""
    act_fmt, t = shape["act_fmt"], p.t
    shared_rows: dict[int, jax.Array] = {}
    rows_c = p.rows_on(c) if p.routed else t
    acc = jnp.zeros((rows_c, p.h), jnp.float32)
    wall = np.zeros((rows_c, max(p.bias_cols, 32)), np.float32)
    b2all = np.zeros((max(p.bias_cols, 32), p.h), np.float32)
    q = 0
    row_of = dict(p.core_terms(c)) if p.routed else {}
    seen: set[int] = set()
    for n, it in enumerate(p.core_items(c)):
        is_shared, slot, j = it
        u = p.term(it)
        (g, up, dn), biases = terms_w[u]
        if p.routed and not is_shared:
            o = p.o_row(u) - p.k
            rows = p.term_rows(u)
            tok, weight = lists[0][o:o + rows], lists[1][o:o + rows]
            x_u = _rows(xq, tok)
        else:
            rows, x_u = t, xq
            weight = np.ones(t, np.float32) if is_shared else slot_w[slot]
        row = row_of.get(u, 0)
        c0, wd = p.slices[j]
        gu = _mm(jnp.zeros((rows, 2 * wd), jnp.float32), x_u, weight_cols(g, up, c0, wd), act_fmt)
        if p.expert_bias:
            gb, ub, db = biases
            gu = gu + jnp.asarray(np.concatenate([gb[c0:c0 + wd], ub[c0:c0 + wd]]))[None]
            if j == 0 and is_shared and p.routed:
                pass  # added to the term's rows below
            elif j == 0:  # this core adds weight * down_bias for the term, once
                for part, vals in enumerate(bias_parts(weight)):
                    wall[row:row + rows, BIAS_PARTS * q + part] = vals
                    b2all[BIAS_PARTS * q + part] = db
                q += 1
        a = activation_reference(gu[:, :wd], gu[:, wd:], shape["activation"])
        if not is_shared:
            a = a * jnp.asarray(weight)[:, None]
        first = u not in seen if p.routed else n == 0
        seen.add(u)
        if p.routed and is_shared:
            out = _mm(jnp.zeros((rows, p.h), jnp.float32), quant_reference(a, act_fmt),
                      _down_cols(dn, c0, wd), act_fmt)
            shared_rows[u] = out if first else shared_rows[u] + out
            continue
        cur = jnp.zeros((rows, p.h), jnp.float32) if first else acc[row:row + rows]
        down = _mm(cur, quant_reference(a, act_fmt), _down_cols(dn, c0, wd), act_fmt)
        acc = acc.at[row:row + rows].set(down)
    if q:
        acc = inorder_jit(jnp.asarray(wall[:, :p.bias_cols]), jnp.asarray(b2all[:p.bias_cols]), acc)
    if p.expert_bias:
        for u in shared_rows:
            if p.holders(u)[0] == c:
                shared_rows[u] = shared_rows[u] + jnp.asarray(terms_w[u][1][2], jnp.float32)[None]
    return acc, shared_rows


def _router_logits(x: jax.Array, wr: jax.Array, p: MoePlan) -> jax.Array:
    """FP32 logits [T, E] as the producers compute them: each K block in order on the matrix unit,
    the blocks' pieces added in block order."""
    logits = None
    for k0, k1 in p.router_k or ((0, p.h),):
        part = inorder_jit(x[:, k0:k1], wr[k0:k1])
        logits = part if logits is None else logits + part
    return logits


def slots_reference(inputs: dict[str, Any], p: MoePlan, shape: dict[str, Any]) -> dict[str, np.ndarray]:
    """Pure-JAX MoE with the slot program's numerics and summation order: {"y": bf16 [T, H]} and,
    with routed experts, "expert_ids": int32 [D, 1]."""
    t = p.t
    x = jnp.asarray(np.asarray(inputs["x"]).astype(np.float32))
    xq = quant_reference(x, shape["act_fmt"])
    terms_w: dict[int, tuple] = {}
    slots, slot_w, lists = np.zeros(0, np.int32), None, None
    if p.s:
        shared = unpack_experts(inputs["shared"], p)
        shared_b = unpack_expert_biases(inputs["shared"], p) if p.expert_bias else [None] * p.s
        terms_w.update({s: (shared[s], shared_b[s]) for s in range(p.s)})
    if p.e:
        wr = jnp.asarray(router_logical(np.asarray(inputs["router"]), p), jnp.float32)
        ids, w = route_reference(_router_logits(x, wr, p), inputs, p.rd, shape["routed_scaling_factor"])
        slots, slot_w = group_reference(ids, w, p.d)
        routed = unpack_experts(inputs["experts"], p)
        routed_b = unpack_expert_biases(inputs["experts"], p) if p.expert_bias else [None] * p.e
        terms_w.update({p.s + u: (routed[int(ex)], routed_b[int(ex)]) for u, ex in enumerate(slots)})
        if p.routed:
            lists = _lists(p, slot_w)
    partials = [_core_partials(p, shape, c, xq, terms_w, lists, slot_w) for c in range(p.cores)]
    if not p.routed:
        y = partials[0][0]
        for part, _ in partials[1:]:
            y = y + part
        return {"y": np.asarray(y.astype(jnp.bfloat16)), "expert_ids": slots[:, None]}
    o = np.zeros((p.o_rows, p.h), np.float32)

    def rows_on(c: int, u: int) -> jax.Array:
        if u < p.s:
            return partials[c][1][u]
        row = dict(p.core_terms(c))[u]
        return partials[c][0][row:row + p.term_rows(u)]

    shared_total = {}
    for u in range(p.s + p.d):
        parts = [rows_on(c, u) for c in p.holders(u)]
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        if u < p.s:
            shared_total[u] = total
        else:
            o[p.o_row(u):p.o_row(u) + p.term_rows(u)] = np.asarray(total)
    pi = np.concatenate([np.arange(p.k) % t, lists[0]]).astype(np.int32)
    pw = np.concatenate([np.zeros(p.k, np.float32), lists[1]])
    pt = np.zeros((t, len(pi)), np.float32)
    pt[pi, np.arange(len(pi))] = pw
    crl = np.asarray(jax.lax.top_k(jnp.asarray(pt), p.k)[1])
    y = jnp.asarray(o[crl[:, 0]])
    for j in range(1, p.k):
        y = y + jnp.asarray(o[crl[:, j]])
    for s in range(p.s):
        y = y + jnp.asarray(shared_total[s])
    return {"y": np.asarray(y.astype(jnp.bfloat16)), "expert_ids": slots[:, None]}

