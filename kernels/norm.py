"""RMSNorm fused with the residual add: the normalisation before attention and before the FFN.

    h = bf16(x + residual)                    (the new residual stream, also an output)
    y = bf16(h * rsqrt(mean(h^2) + eps) * w)

With ``residual=false`` (MLA's q_a and kv_a norms) there is no residual input and no ``h``
output: ``y = bf16(x * rsqrt(mean(x^2) + eps) * w)``.

Tokens are split over cores; each core walks its rows in tiles of R rows, double-buffered: one
DMA queue loads the next tile while the vector unit normalises the current one and a second
queue stores the previous one. The kernel moves 4 bytes in and 4 out per element and does a
handful of vector operations per element, so it is HBM- or latency-bound at every model size.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder

from .base import KernelBuild, KernelDef, ShapeKey, Tolerance
from .registry import register

__all__ = ["RMSNORM", "rmsnorm_reference"]

_SRAM_SHARE = 0.9  # leave a little scratchpad for the weight, eps and per-row scalars


def rmsnorm_reference(x, residual, weight, eps: float):
    """Pure-JAX RMSNorm with residual add, same roundings as the kernel: (y, h), both bf16.

    ``residual`` None: no add (h is x itself)."""
    if residual is None:
        h = jnp.asarray(x).astype(jnp.bfloat16)
    else:
        h = (jnp.asarray(x, jnp.float32) + jnp.asarray(residual, jnp.float32)).astype(jnp.bfloat16)
    hf = h.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(hf * hf, axis=1, keepdims=True) * jnp.float32(1 / hf.shape[1])
                    + jnp.float32(eps))
    y = ((hf * inv) * jnp.asarray(weight, jnp.float32)).astype(jnp.bfloat16)
    return y, h


def _tiling(hidden: int, rows: int, fused: bool, spec: ChipSpec) -> tuple[int, int]:
    """(rows per tile, buffer slots): two slots (double-buffered) when a row fits twice, else one.

    GPU presets' 228 KiB shared memory cannot hold two 7168-wide rows with their f32 scratch;
    a single slot there serialises load, math and store of each tile, which is what fits."""
    # Per slot and element: x, residual, h, y in bf16 and one f32 scratch = 12 bytes (the
    # double-buffered sizing counts all five even without the residual, as it always has).
    per_row = 12 * hidden
    budget = int(spec.sram.scratchpad_bytes * _SRAM_SHARE) // 2 - 4 * hidden
    # At least four tiles per core when there are rows enough, so loads, math and stores overlap.
    r = min(-(-rows // 4), budget // per_row)
    if r >= 1:
        return r, 2
    # One slot: only the buffers the variant uses (x, y, f32 scratch; residual and h when fused).
    per_row_single = (12 if fused else 8) * hidden
    r = min(-(-rows // 4), (int(spec.sram.scratchpad_bytes * _SRAM_SHARE) - 4 * hidden) // per_row_single)
    if r >= 1:
        return r, 1
    raise InvalidArgumentError(
        f"hidden={hidden} needs {per_row_single + 4 * hidden:,} B of scratchpad for one row; "
        f"{spec.name} has {spec.sram.scratchpad_bytes:,} B per core")


def build_rmsnorm(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """RMSNorm + residual over ``tokens`` x ``hidden`` (shape keys), spread over the cores."""
    t, h, eps, fused = shape["tokens"], shape["hidden"], shape["eps"], shape["residual"]
    if eps <= 0:
        raise InvalidArgumentError(f"shape key eps={eps} must be positive")
    cores = min(spec.core.count, t)
    rows_per_core = -(-t // cores)
    r, n_slots = _tiling(h, rows_per_core, fused, spec)
    kb = KernelBuilder(f"rmsnorm_{t}x{h}", chip=spec)
    x_h = kb.hbm("x", (t, h), "bf16")
    res_h = kb.hbm("residual", (t, h), "bf16") if fused else None
    w_h = kb.hbm("w", (1, h), "bf16")
    eps_h = kb.hbm("eps", (1, 1), "f32")
    y_h = kb.hbm("y", (t, h), "bf16")
    hout_h = kb.hbm("h", (t, h), "bf16") if fused else None
    for c in range(cores):
        lo, hi = c * rows_per_core, min(t, (c + 1) * rows_per_core)
        if lo >= hi:
            continue
        core = kb.core(c)
        w = kb.sram(c, "w", (1, h), "bf16")
        eps_t = kb.sram(c, "eps", (1, 1), "f32")
        slots = []
        for s in range(n_slots):
            slots.append({name: kb.sram(c, f"{name}{s}", (r, h), "bf16")
                          for name in (("x", "r", "h", "y") if fused else ("x", "y"))}
                         | {"f": kb.sram(c, f"f{s}", (r, h), "f32"),
                            "ss": kb.sram(c, f"ss{s}", (r, 1), "f32"),
                            "loaded": kb.semaphore(f"c{c}.loaded{s}"),
                            "done": kb.semaphore(f"c{c}.done{s}"),
                            "stored": kb.semaphore(f"c{c}.stored{s}")})
        consts = kb.semaphore(f"c{c}.consts")
        core.dma[0].load(w, w_h)
        core.dma[0].load(eps_t, eps_h)
        core.dma[0].signal(consts)
        core.vpu.wait(consts, 1)
        for i, r0 in enumerate(range(lo, hi, r)):
            n = min(r, hi - r0)
            sl = slots[i % n_slots]
            use = i // n_slots + 1  # how many times this slot has been used, this one included
            tile = {k: (v.sub(0, 0, n, v.cols) if hasattr(v, "sub") else v) for k, v in sl.items()}
            q_load, q_store = core.dma[0], core.dma[1]
            if use > 1:  # the slot's previous tile must have been stored
                q_load.wait(sl["stored"], use - 1)
            q_load.load(tile["x"], x_h.sub(r0, 0, n, h))
            if fused:
                q_load.load(tile["r"], res_h.sub(r0, 0, n, h))
            q_load.signal(sl["loaded"])
            v = core.vpu
            v.wait(sl["loaded"], use)
            if fused:
                v.add(tile["h"], tile["x"], tile["r"])
            else:
                tile["h"] = tile["x"]
            v.square(tile["f"], tile["h"])
            v.reduce("sum", tile["ss"], tile["f"])
            v.scale(tile["ss"], tile["ss"], 1.0 / h)
            v.add(tile["ss"], tile["ss"], eps_t)
            v.rsqrt(tile["ss"], tile["ss"])
            v.mul(tile["f"], tile["h"], tile["ss"])
            v.mul(tile["y"], tile["f"], w)
            v.signal(sl["done"])
            q_store.wait(sl["done"], use)
            q_store.store(y_h.sub(r0, 0, n, h), tile["y"])
            if fused:
                q_store.store(hout_h.sub(r0, 0, n, h), tile["h"])
            q_store.signal(sl["stored"])

    def make_inputs(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        out = {
            "x": rng.standard_normal((t, h)).astype(ml_dtypes.bfloat16),
            "residual": rng.standard_normal((t, h)).astype(ml_dtypes.bfloat16),
            "w": (1 + 0.1 * rng.standard_normal((1, h))).astype(ml_dtypes.bfloat16),
            "eps": np.full((1, 1), eps, np.float32),
        }
        if not fused:
            del out["residual"]
        return out

    def reference(inputs):
        y, hh = rmsnorm_reference(inputs["x"], inputs.get("residual"), inputs["w"], eps)
        return {"y": np.asarray(y), "h": np.asarray(hh)} if fused else {"y": np.asarray(y)}

    return KernelBuild(
        program=kb.build(), make_inputs=make_inputs, reference=reference,
        outputs={"y": ("bf16", (t, h)), "h": ("bf16", (t, h))} if fused else {"y": ("bf16", (t, h))},
        tolerance=Tolerance(atol=1e-6, rtol=2.0**-7, why="the sum of squares is accumulated in "
                            "column order on the vector unit and pairwise in XLA: the f32 scale "
                            "may differ in the last bits, which can move y by one bf16 ulp"),
        notes={"rows_per_tile": r, "buffer_slots": n_slots, "cores": cores},
    )


RMSNORM = register(KernelDef(
    name="rmsnorm",
    doc=__doc__.strip().splitlines()[0],
    shape_keys=(
        ShapeKey("tokens", int, 8, "rows (tokens in the batch)", minimum=1),
        ShapeKey("hidden", int, 256, "hidden size (gpt-oss-120b: 2880)", minimum=1),
        ShapeKey("eps", float, 1e-5, "added to the mean square (gpt-oss: 1e-5)"),
        ShapeKey("residual", bool, True, "fuse the residual add (false: MLA's q_a/kv_a norms)"),
    ),
    build=build_rmsnorm,
))
