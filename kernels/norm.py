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

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu.unit_math import sequential_row_sum
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.lazy import LazyModule

from .base import KernelBuild, KernelDef, ShapeKey, TensorSpec, Tolerance
from .emit import EmitCtx, Emitter, Out, Piece, TensorRef, fetch, run_emitter
from .planning import Budget, DoesNotFit
from .registry import register

ml_dtypes = LazyModule("ml_dtypes")  # loaded on first use: importing it costs 0.5 s

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

__all__ = ["RMSNORM", "VECTOR_PASSES", "emit_rmsnorm", "rmsnorm_reference"]

VECTOR_PASSES = 8
"""Vector passes per element of an RMSNorm with its residual add (add, square, reduce, scale,
rsqrt, two muls, ...): what a row costs on the vector unit."""


def rmsnorm_reference(x, residual, weight, eps: float):
    """Pure-JAX RMSNorm with residual add, same roundings as the kernel: (y, h), both bf16.

    ``residual`` None: no add (h is x itself)."""
    if residual is None:
        h = jnp.asarray(x).astype(jnp.bfloat16)
    else:
        h = (jnp.asarray(x, jnp.float32) + jnp.asarray(residual, jnp.float32)).astype(jnp.bfloat16)
    hf = h.astype(jnp.float32)
    # The sum in column order, as the vector unit's ``vec.reduce sum`` does: XLA's own order
    # agrees with it only on short rows (it differs at 1024 columns).
    inv = jax.lax.rsqrt(sequential_row_sum(hf * hf) * jnp.float32(1 / hf.shape[1]) + jnp.float32(eps))
    y = ((hf * inv) * jnp.asarray(weight, jnp.float32)).astype(jnp.bfloat16)
    return y, h


def _tiling(hidden: int, rows: int, fused: bool, spec: ChipSpec, budget_bytes: int,
            min_tiles: int = 4) -> tuple[int, int]:
    """(rows per tile, buffer slots): two slots (double-buffered) when a row fits twice, else one.

    ``min_tiles``: tiles per core to aim for when there are rows enough, so that loads, math and
    stores overlap (1 for inputs copied from other cores' scratchpads: their copies are small
    and each tile's costs another DMA set-up round).

    GPU presets' 228 KiB shared memory cannot hold two 7168-wide rows with their f32 scratch;
    a single slot there serialises load, math and store of each tile, which is what fits."""
    # Per slot and element: x, residual, h, y in bf16 and one f32 scratch = 12 bytes (the
    # double-buffered sizing counts all five even without the residual, as it always has).
    per_row = 12 * hidden
    budget = budget_bytes // 2 - 4 * hidden
    r = min(-(-rows // min_tiles), budget // per_row)
    if r >= 1:
        return r, 2
    # One slot: only the buffers the variant uses (x, y, f32 scratch; residual and h when fused).
    per_row_single = (12 if fused else 8) * hidden
    r = min(-(-rows // min_tiles), (budget_bytes - 4 * hidden) // per_row_single)
    if r >= 1:
        return r, 1
    raise DoesNotFit(
        f"hidden={hidden} needs {per_row_single + 4 * hidden:,} B of scratchpad for one row; "
        f"{spec.name} plans with {budget_bytes:,} B per core")


def emit_rmsnorm(ctx: EmitCtx, x: TensorRef, w: TensorRef, *, eps: float,
                 residual: TensorRef | None = None, y_out: Out | None = None,
                 h_out: Out | None = None, eps_ref: TensorRef | None = None) -> Emitter:
    """Emit RMSNorm (+ residual add) of ``x`` [tokens, hidden] (bf16): outputs ``y`` and, with a
    residual, ``h`` (see the module docstring).

    Args:
        ctx: the emit context; x, residual: activations (HBM or on chip); w: the [1, hidden] bf16
            weight (HBM); eps: added to the mean square.
        y_out, h_out: where ``y`` and ``h`` go (default: on chip, rows where computed).
            ``Out.to(ref)``: rows split over the cores, each tile stored. ``Out.onchip()``: rows
            split over the cores, kept in each core's scratchpad. ``Out.replicated(cores)``: each
            listed core computes every row and keeps all of them (what a decode step's matrix
            units read in place); both outputs must then be placed alike.
        eps_ref: the [1, 1] f32 HBM tensor holding eps (default: a constant allocated here).

    Yields/returns ``{"y": ..., "h": ...}`` (``h`` only with a residual).
    """
    kb, spec = ctx.kb, ctx.spec
    t, h = x.shape
    fused = residual is not None
    if eps <= 0:
        raise InvalidArgumentError(f"shape key eps={eps} must be positive")
    y_out = y_out or Out.onchip()
    h_out = (h_out or Out(cores=y_out.cores)) if fused else None
    replicated = y_out.cores is not None
    if fused and (h_out.cores is not None) != replicated:
        raise InvalidArgumentError("rmsnorm: y and h must both be replicated or both not")
    if replicated:
        work = [(c, 0, t) for c in y_out.cores]
    else:
        # (Fewer, taller row blocks would let each consumer copy fewer pieces, but the kept
        # rows then crowd those cores' scratchpads: DeepSeek-R1's batch-64 FFN stopped fitting.)
        cores = min(ctx.budget.cores, t)
        per = -(-t // cores)
        work = [(c, c * per, min(t, (c + 1) * per)) for c in range(cores) if c * per < t]
    rows_here = max(hi - lo for _, lo, hi in work)
    # Outputs kept on chip live beside the tile buffers: plan the tiles in what they leave.
    kept_bytes = rows_here * h * 2 * ((not y_out.in_hbm) + (fused and not h_out.in_hbm))
    onchip_inputs = not x.in_hbm and (residual is None or not residual.in_hbm)
    r, n_slots = _tiling(h, rows_here, fused, spec, ctx.budget.sram_bytes - kept_bytes,
                         min_tiles=1 if onchip_inputs else 4)
    # No more slots than a core has tiles: a decode step's rows are one tile, and a second slot
    # would be allocated (with its semaphores) on every core and never used (a seventh of a tiny
    # model's fused decode step build went to it: its norms are replicated on 64 cores).
    n_slots = min(n_slots, -(-rows_here // r))
    w_h = w.hbm_view(0, 0, 1, h)
    eps_h = eps_ref.hbm_view(0, 0, 1, 1) if eps_ref is not None else \
        ctx.const("eps", np.full((1, 1), eps, np.float32), "f32")
    keep_y = not y_out.in_hbm
    keep_h = fused and not h_out.in_hbm
    y_pieces: list[Piece] = []
    h_pieces: list[Piece] = []
    plans = []
    for c, lo, hi in work:  # prefetch: the weight and eps rows
        core = kb.core(c)
        wt = kb.sram(c, "w", (1, h), "bf16")
        eps_t = kb.sram(c, "eps", (1, 1), "f32")
        consts = kb.semaphore(f"c{c}.consts")
        core.dma[0].load(wt, w_h)
        core.dma[0].load(eps_t, eps_h)
        core.dma[0].signal(consts)
        plans.append((c, lo, hi, core, wt, eps_t, consts))
    outs: dict[str, TensorRef] = {}
    # Output buffers (kept on chip) and readiness, decided before the work is emitted.
    kept: dict[int, dict[str, Any]] = {}
    for c, lo, hi, *_ in plans:
        fin = kb.semaphore(f"c{c}.fin")
        kept[c] = {"fin": fin, "lo": lo}
        if keep_y:
            kept[c]["y"] = kb.sram(c, "y_out", (hi - lo, h), "bf16", keep=True)
            y_pieces.append(Piece(lo, 0, hi - lo, h, kept[c]["y"], None, (fin.id, 1)))
        if keep_h:
            kept[c]["h"] = kb.sram(c, "h_out", (hi - lo, h), "bf16", keep=True)
            h_pieces.append(Piece(lo, 0, hi - lo, h, kept[c]["h"], None, (fin.id, 1)))
    stored: dict[int, Any] = {c: kb.semaphore(f"c{c}.out_stored") for c, *_ in plans}
    if keep_y:
        outs["y"] = TensorRef.onchip("y", (t, h), "bf16", y_pieces)
    else:
        outs["y"] = _stored_ref(y_out.ref, work, stored)
    if fused:
        outs["h"] = TensorRef.onchip("h", (t, h), "bf16", h_pieces) if keep_h else \
            _stored_ref(h_out.ref, work, stored)
    sources = (("x", x), ("r", residual)) if fused else (("x", x),)
    # Inputs in HBM and ready at the start are loaded in the prefetch part (the first tile of
    # each slot), so they are not queued behind the next operators' weights.
    static = all(src.in_hbm and not src.waits() for _, src in sources)
    names = [nm for nm in (("x", "r", "h", "y") if fused else ("x", "y"))
             if not (nm == "y" and keep_y) and not (nm == "h" and keep_h)]
    per_core: dict[int, dict[str, Any]] = {}
    for c, lo, hi, core, *_ in plans:
        pc = per_core[c] = {
            "slots": [{name: kb.sram(c, f"{name}{sidx}", (r, h), "bf16") for name in names}
                      | {"f": kb.sram(c, f"f{sidx}", (r, h), "f32"),
                         "ss": kb.sram(c, f"ss{sidx}", (r, 1), "f32"),
                         "loaded": kb.semaphore(f"c{c}.loaded{sidx}"),
                         "done": kb.semaphore(f"c{c}.done{sidx}"),
                         "stored": kb.semaphore(f"c{c}.stored{sidx}")} for sidx in range(n_slots)],
            "waited": {core.vpu.engine: set()}, "loaded_count": [0] * n_slots, "tiles": {},
        }
        for i, r0 in enumerate(range(lo, hi, r)):
            if static and i < n_slots:
                _load_tile(kb, c, core, pc, i, r0, min(r, hi - r0), h, sources, keep_y, keep_h, kept)
    yield outs

    for c, lo, hi, core, wt, eps_t, consts in plans:
        core.vpu.wait(consts, 1)
        pc = per_core[c]
        q_store, v = core.dma[1], core.vpu
        tiles_n = -(-(hi - lo) // r)
        for i, r0 in enumerate(range(lo, hi, r)):
            n = min(r, hi - r0)
            sl = pc["slots"][i % n_slots]
            use = i // n_slots + 1  # how many times this slot has been used, this one included
            if i not in pc["tiles"]:
                free: list = []
                if use > 1 and not (keep_y and (keep_h or not fused)):
                    free = [(sl["stored"].id, use - 1)]  # the slot's previous tile has been stored
                elif use > 1:
                    free = [(sl["done"].id, use - 1)]  # the vector unit is done with the slot
                _load_tile(kb, c, core, pc, i, r0, n, h, sources, keep_y, keep_h, kept, free)
            tile, wait = pc["tiles"][i]
            for cond in wait:
                v.wait(*cond)
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
            v.mul(tile["y"], tile["f"], wt)
            v.signal(sl["done"])
            if not keep_y or (fused and not keep_h):
                q_store.wait(sl["done"], use)
                if not keep_y:
                    q_store.store(y_out.ref.hbm_view(r0, 0, n, h), tile["y"])
                if fused and not keep_h:
                    q_store.store(h_out.ref.hbm_view(r0, 0, n, h), tile["h"])
                q_store.signal(sl["stored"])
                if i == tiles_n - 1:
                    q_store.signal(stored[c])
        if keep_y or keep_h:
            v.signal(kept[c]["fin"])
    return outs


def _load_tile(kb: KernelBuilder, c: int, core: Any, pc: dict[str, Any], i: int, r0: int, n: int, h: int,
               sources: tuple, keep_y: bool, keep_h: bool, kept: dict[int, dict[str, Any]],
               free: list | None = None) -> None:
    """Bring tile i's inputs (rows r0..r0+n) into its slot, or find them in place; records the
    tile's buffers and what the vector unit must wait for in ``pc["tiles"][i]``. ``free``: the
    conditions under which the slot is free again (every loading queue waits for them)."""
    n_slots = len(pc["slots"])
    sl = pc["slots"][i % n_slots]
    lo = kept[c].get("lo", 0)
    tile = {k: (val.sub(0, 0, n, val.cols) if hasattr(val, "sub") else val) for k, val in sl.items()}
    if keep_y:
        tile["y"] = kept[c]["y"].sub(r0 - lo, 0, n, h)
    if keep_h:
        tile["h"] = kept[c]["h"].sub(r0 - lo, 0, n, h)
    waited, vpu = pc["waited"], core.vpu.engine
    wait: list = []
    used: list[Any] = []
    for name, src in sources:
        here = src.local(c, r0, 0, n, h)
        if here is None:  # on-chip pieces elsewhere are spread over the queues
            qs = [core.dma[0]] if src.in_hbm else core.dma
            used += [q for q in fetch(qs, tile[name], src, r0, 0, waited=waited, after=free or ())
                     if q not in used]
        else:
            tile[name], ready = here
            if ready is not None and ready not in waited[vpu]:
                wait.append(ready)
                waited[vpu].add(ready)
    if len(used) == 1:
        used[0].signal(sl["loaded"])
        pc["loaded_count"][i % n_slots] += 1
        wait.append((sl["loaded"].id, pc["loaded_count"][i % n_slots]))
    elif used:  # several queues: a semaphore of the tile's own, so each count is unambiguous
        got = kb.semaphore(f"c{c}.in{i}")
        for q in used:
            q.signal(got)
        wait.append((got.id, len(used)))
    pc["tiles"][i] = (tile, wait)


def _stored_ref(ref: TensorRef, work: list[tuple[int, int, int]], stored: dict[int, Any]) -> TensorRef:
    """An HBM output whose rows [lo, hi) are ready when core c's store queue signals ``stored[c]``."""
    for c, lo, hi in work:
        ref = ref.with_ready(lo, 0, hi - lo, ref.shape[1], (stored[c].id, 1))
    return ref


def build_rmsnorm(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """RMSNorm + residual over ``tokens`` x ``hidden`` (shape keys), spread over the cores."""
    t, h, eps, fused = shape["tokens"], shape["hidden"], shape["eps"], shape["residual"]
    if eps <= 0:
        raise InvalidArgumentError(f"shape key eps={eps} must be positive")
    cores = min(spec.core.count, t)
    r, n_slots = _tiling(h, -(-t // cores), fused, spec, Budget.of(spec).sram_bytes)  # refuse before building
    kb = KernelBuilder(f"rmsnorm_{t}x{h}", chip=spec)
    x_h = kb.hbm("x", (t, h), "bf16")
    res_h = kb.hbm("residual", (t, h), "bf16") if fused else None
    w_h = kb.hbm("w", (1, h), "bf16")
    ctx = EmitCtx.standalone(kb)
    eps_h = ctx.const("eps", np.full((1, 1), eps, np.float32), "f32")
    y_h = kb.hbm("y", (t, h), "bf16")
    hout_h = kb.hbm("h", (t, h), "bf16") if fused else None
    run_emitter(emit_rmsnorm(
        ctx, TensorRef.hbm("x", x_h), TensorRef.hbm("w", w_h), eps=eps, eps_ref=TensorRef.hbm("eps", eps_h),
        residual=TensorRef.hbm("residual", res_h) if fused else None,
        y_out=Out.to(TensorRef.hbm("y", y_h)),
        h_out=Out.to(TensorRef.hbm("h", hout_h)) if fused else None))

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


def rmsnorm_tensors(shape: dict[str, Any], spec: ChipSpec) -> tuple[TensorSpec, ...]:
    """The rmsnorm HBM tensors: x (+ residual), w; outputs y (+ h)."""
    t, h, fused = shape["tokens"], shape["hidden"], shape["residual"]
    specs = [TensorSpec("x", (t, h), "bf16", "input")]
    if fused:
        specs.append(TensorSpec("residual", (t, h), "bf16", "input"))
    specs += [TensorSpec("w", (1, h), "bf16", "weight"), TensorSpec("y", (t, h), "bf16", "output")]
    if fused:
        specs.append(TensorSpec("h", (t, h), "bf16", "output"))
    return tuple(specs)


def _emit_rmsnorm_kernel(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                         outs: dict[str, Out]) -> Emitter:
    return emit_rmsnorm(ctx, t["x"], t["w"], eps=shape["eps"], residual=t.get("residual"),
                        y_out=outs.get("y"), h_out=outs.get("h"))


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
    emit=_emit_rmsnorm_kernel,
    tensors_of=rmsnorm_tensors,
))
