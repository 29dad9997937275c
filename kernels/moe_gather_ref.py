"""The gather program's reference (``moe_gather.py``): the same lists, capacities and summation
order in pure JAX, for the kernel's functional check.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.lazy import LazyModule

from .moe_base import expert_rows_reference, inorder_jit, quant_reference
from .moe_gather_plan import GatherPlan
from .moe_pack import router_logical, unpack_expert_biases, unpack_experts
from .moe_routing import route_reference

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

__all__ = ["gather_reference"]


def _rows(xq: Any, rows: np.ndarray) -> Any:
    if isinstance(xq, mx.MXArray):
        return mx.MXArray(codes=np.asarray(xq.codes)[rows], scales=np.asarray(xq.scales)[rows], fmt=xq.fmt,
                          axis=1, block_size=32)
    return xq[rows]


def _block_lists(p: GatherPlan, shape: dict[str, Any], inputs: dict[str, Any], x: jax.Array):
    """Per block: the sub-lists (ids [E, C], weights [E, C]); raises on a capacity overflow."""
    wr = jnp.asarray(router_logical(np.asarray(inputs["router"]), p), jnp.float32)
    logits = inorder_jit(x, wr)
    lids, lws = [], []
    for b in range(p.nb):
        block = logits[b * p.tb:(b + 1) * p.tb]
        ids, w = route_reference(block, inputs, p.rd, shape["routed_scaling_factor"])
        dense = _dense_weights(ids, w, p.e)
        vals, lid = jax.lax.top_k(jnp.asarray(dense), p.cap)
        if p.cap < p.tb:
            over = np.asarray(jax.lax.top_k(jnp.asarray(dense), p.cap + 1)[0])[:, p.cap]
            if (over > 0).any():
                ex = int(np.argmax(over > 0))
                raise InvalidArgumentError(
                    f"more than capacity={p.cap} tokens of block {b} chose expert {ex} (shape key "
                    f"capacity_factor={shape['capacity_factor']}: raise it)")
        lids.append(np.asarray(lid))
        lws.append(np.asarray(vals, np.float32))
    return lids, lws


def _dense_weights(ids: np.ndarray, w: np.ndarray, e: int) -> np.ndarray:
    """vec.group's [E, T] weights with every expert present: w[t, j] at (ids[t, j], t)."""
    out = np.zeros((e, ids.shape[0]), np.float32)
    for j in range(ids.shape[1]):
        out[ids[:, j], np.arange(ids.shape[0])] += w[:, j]
    return out


def gather_reference(inputs: dict[str, Any], p: GatherPlan, shape: dict[str, Any]) -> dict[str, np.ndarray]:
    """Pure-JAX MoE with the gather program's numerics and orders; {"y": bf16 [T, H]}."""
    x = jnp.asarray(np.asarray(inputs["x"]).astype(np.float32))
    xq = quant_reference(x, shape["act_fmt"])
    terms: list[list[jax.Array]] = [[] for _ in range(p.nb)]
    if p.e:
        lids, lws = _block_lists(p, shape, inputs, x)
        routed = unpack_experts(inputs["experts"], p)
        routed_b = unpack_expert_biases(inputs["experts"], p) if p.expert_bias else [None] * p.e
        o_blk = np.zeros((p.nb, p.o_rows, p.h), np.float32)
        all_slices = tuple(range(len(p.slices)))
        for ex in range(p.e):
            rows = np.concatenate([b * p.tb + lids[b][ex] for b in range(p.nb)])
            gate_w = np.concatenate([lws[b][ex] for b in range(p.nb)])
            out = np.asarray(expert_rows_reference(p, shape, _rows(xq, rows), routed[ex], routed_b[ex],
                                                   gate_w,
                                          all_slices, p.expert_bias))
            for b in range(p.nb):
                o_blk[b, p.k + ex * p.cap:p.k + (ex + 1) * p.cap] = out[b * p.cap:(b + 1) * p.cap]
        for b in range(p.nb):
            pt = np.zeros((p.tb, p.o_rows), np.float32)
            for ex in range(p.e):
                pt[lids[b][ex], p.k + ex * p.cap + np.arange(p.cap)] = lws[b][ex]
            cr = np.asarray(jax.lax.top_k(jnp.asarray(pt), p.k)[1])
            terms[b] += [o_blk[b][cr[:, j]] for j in range(p.k)]
    if p.s:
        shared = unpack_experts(inputs["shared"], p)
        shared_b = unpack_expert_biases(inputs["shared"], p) if p.expert_bias else [None] * p.s
        ranges = sorted({(it.out, it.slices, it.bias, it.expert) for it in p.items if it.shared})
        for _, slices, bias, sh in ranges:
            out = np.asarray(expert_rows_reference(p, shape, xq, shared[sh], shared_b[sh], None, slices,
                                                   bias))
            for b in range(p.nb):
                terms[b].append(out[b * p.tb:(b + 1) * p.tb])
    y = []
    for b in range(p.nb):
        acc = jnp.asarray(terms[b][0])
        for term in terms[b][1:]:
            acc = acc + jnp.asarray(term)
        y.append(acc)
    return {"y": np.asarray(jnp.concatenate(y).astype(jnp.bfloat16))}
