"""The moe kernel's inputs from a layer's natural weights: router panels, packed expert tables.

Stage: model. The packed tables depend on the launch's slice plan (``kernels.moe.plan_moe``,
which depends on the token count), so they are packed once per distinct launch shape and cached
on the die model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from jalapeno_emu.kernels import moe as moe_kernel

from .plan import Launch

if TYPE_CHECKING:
    from .die import DieModel

__all__ = ["moe_inputs"]


def _table(experts: tuple, plan: Any) -> np.ndarray:
    biases = {}
    if plan.expert_bias:
        biases = {name: [getattr(e, name) for e in experts] for name in ("gate_bias", "up_bias", "down_bias")}
    return moe_kernel.pack_experts([e.gate for e in experts], [e.up for e in experts],
                                   [e.down for e in experts], plan, **biases)


def moe_inputs(die: DieModel, layer: int, launch: Launch, x: np.ndarray) -> dict[str, Any]:
    """Data for one moe launch of ``layer``: x plus the weights in the kernel's layout."""
    key = ("moe", launch.shape)
    cache = die.packed[layer]
    if key not in cache:
        lw = die.w.layers[layer]
        plan = moe_kernel.plan_moe(launch.shape_dict, die.spec)
        packed: dict[str, Any] = {}
        if lw.experts:
            packed["router"] = moe_kernel.router_panels(lw.router, plan)
            packed["experts"] = _table(lw.experts, plan)
            if lw.router_bias is not None:
                packed["router_bias"] = lw.router_bias[None, :]
            if lw.score_bias is not None:
                packed["score_bias"] = np.asarray(lw.score_bias, np.float32)[None, :]
        if lw.shared:
            packed["shared"] = _table(lw.shared, plan)
        cache[key] = packed
    return {"x": x, **cache[key]}
