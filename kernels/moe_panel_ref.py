"""The panel program's reference (``moe_panel.py``): the same numerics and summation order in pure
JAX, for the kernel's functional check.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jalapeno_emu.lazy import LazyModule

from .moe_base import expert_rows_reference, inorder_jit, quant_reference
from .moe_pack import router_logical, unpack_expert_biases, unpack_experts
from .moe_panel_plan import PanelPlan
from .moe_routing import group_reference, route_reference, routing_dims

jnp = LazyModule("jax.numpy")

__all__ = ["panel_reference"]


def panel_reference(inputs: dict[str, Any], p: PanelPlan, shape: dict[str, Any]) -> dict[str, np.ndarray]:
    """Pure-JAX MoE with this program's numerics and order: {"y": bf16 [T, H], "expert_ids": [D, 1]}."""
    x = jnp.asarray(np.asarray(inputs["x"]).astype(np.float32))
    xq = quant_reference(x, shape["act_fmt"])
    all_slices = tuple(range(len(p.slices)))
    terms: list[tuple[Any, Any, np.ndarray | None]] = []
    slots = np.zeros(0, np.int32)
    if p.s:
        shared = unpack_experts(inputs["shared"], p)
        shared_b = unpack_expert_biases(inputs["shared"], p) if p.expert_bias else [None] * p.s
        terms += [(shared[n], shared_b[n], None) for n in range(p.s)]
    if p.e:
        wr = jnp.asarray(router_logical(np.asarray(inputs["router"]), p), jnp.float32)
        rd = routing_dims(p.t, p.e, p.k, shape)
        ids, w = route_reference(inorder_jit(x, wr), inputs, rd, shape["routed_scaling_factor"])
        slots, slot_w = group_reference(ids, w, p.d)
        routed = unpack_experts(inputs["experts"], p)
        routed_b = unpack_expert_biases(inputs["experts"], p) if p.expert_bias else [None] * p.e
        terms += [(routed[int(ex)], routed_b[int(ex)], slot_w[u]) for u, ex in enumerate(slots)]
    y = None
    for weights, biases, gate_w in terms:
        out = expert_rows_reference(p, shape, xq, weights, biases, gate_w, all_slices, p.expert_bias)
        y = out if y is None else y + out
    return {"y": np.asarray(y.astype(jnp.bfloat16)), "expert_ids": slots[:, None]}
