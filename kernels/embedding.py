"""``embedding``: out[t, :] = table[ids[t], :], one ``dma.gather`` per chunk of tokens, spread over
cores and DMA queues (the gather pays one set-up round per 16 rows per queue).

Stage: kernels; a model step's first operator (``model/fused.py`` wires it as ``embed``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.lazy import LazyModule

from .base import KernelBuild, KernelDef, ShapeKey, TensorSpec, Tolerance
from .emit import EmitCtx, Emitter, Out, Piece, TensorRef, run_emitter
from .planning import Budget, DoesNotFit
from .registry import register

ml_dtypes = LazyModule("ml_dtypes")  # loaded on first use: importing it costs 0.5 s

__all__ = ["EMBEDDING", "build_embedding", "embedding_tensors", "emit_embedding"]

jnp = LazyModule("jax.numpy")  # the reference only: JAX loads when a check runs


def _embedding_rows(t: int, h: int, spec: ChipSpec, budget: Budget) -> int:
    """Rows per gather (two buffers per DMA queue); DoesNotFit when one row does not fit."""
    queues = spec.dma.queues_per_core
    rows_fit = (budget.sram_bytes - 4 * t) // (2 * queues * h * 2)
    if rows_fit < 1:
        raise DoesNotFit(f"shape key hidden={h}: one bf16 row double-buffered on {queues} queues needs "
                         f"more than the {budget.sram_bytes:,} B of scratchpad {spec.name} plans with")
    return rows_fit


def emit_embedding(ctx: EmitCtx, ids: TensorRef, table: TensorRef, *, out: Out | None = None) -> Emitter:
    """Emit out[t, :] = table[ids[t], :] (see ``build_embedding``).

    ``ids`` i32[tokens, 1] and ``table`` bf16[vocab, hidden] are HBM tensors ready at the start,
    so the whole kernel is its prefetch part. ``out``: ``Out.to(ref)`` stores each chunk of rows;
    ``Out.onchip()`` (default) gathers them into buffers kept on the gathering core.
    """
    kb, spec = ctx.kb, ctx.spec
    (t, _), (vocab, h) = ids.shape, table.shape
    out = out or Out.onchip()
    queues = spec.dma.queues_per_core
    rows_fit = _embedding_rows(t, h, spec, ctx.budget)
    cores = min(ctx.budget.cores, t)
    per_core = -(-t // cores)
    table_h, ids_h = table.hbm_view(0, 0, vocab, h), ids.hbm_view(0, 0, t, 1)
    pieces: list[Piece] = []
    ref = out.ref
    for c in range(cores):
        lo, hi = c * per_core, min(t, (c + 1) * per_core)
        if lo >= hi:
            continue
        cnt = hi - lo
        rows = max(1, min(rows_fit, -(-cnt // queues)))
        core = kb.core(c)
        idx = kb.sram(c, "idx", (cnt, 1), "i32")
        have_ids = kb.semaphore(f"c{c}.ids")
        core.dma[0].load(idx, ids_h.sub(lo, 0, cnt, 1))
        core.dma[0].signal(have_ids)
        chunks = list(range(lo, hi, rows))
        kept = None if out.in_hbm else kb.sram(c, "out", (cnt, h), "bf16", keep=True)
        for q in range(min(queues, len(chunks))):
            dq = core.dma[q]
            bufs = [kb.sram(c, f"rows{q}.{b}", (rows, h), "bf16") for b in range(2)] if out.in_hbm else []
            got, put = kb.semaphore(f"c{c}.q{q}.got"), kb.semaphore(f"c{c}.q{q}.put")
            dq.wait(have_ids, 1)
            for use, r0 in enumerate(chunks[q::queues]):
                nr = min(rows, hi - r0)
                if kept is not None:  # gathered straight into the kept output
                    dq.gather(kept.sub(r0 - lo, 0, nr, h), table_h, idx.sub(r0 - lo, 0, nr, 1))
                    dq.signal(got)
                    pieces.append(Piece(r0, 0, nr, h, kept.sub(r0 - lo, 0, nr, h), None, (got.id, use + 1)))
                    continue
                buf = bufs[use % 2].sub(0, 0, nr, h)
                if use >= 2:  # the store that last read this buffer is done
                    dq.wait(put, use - 1)
                dq.gather(buf, table_h, idx.sub(r0 - lo, 0, nr, 1))
                dq.signal(got)
                dq.wait(got, use + 1)
                dq.store(ref.hbm_view(r0, 0, nr, h), buf)
                dq.signal(put)
                ref = ref.with_ready(r0, 0, nr, h, (put.id, use + 1))
    outs = {"out": ref if out.in_hbm else TensorRef.onchip("out", (t, h), "bf16", pieces)}
    yield outs
    return outs


def embedding_tensors(shape: dict[str, Any], spec: ChipSpec) -> tuple[TensorSpec, ...]:
    """The embedding's HBM tensors: table (weight), ids (weight: the runtime's token ids), out."""
    t, vocab, h = shape["tokens"], shape["vocab"], shape["hidden"]
    return (TensorSpec("table", (vocab, h), "bf16", "weight"), TensorSpec("ids", (t, 1), "i32", "weight"),
            TensorSpec("out", (t, h), "bf16", "output"))


def build_embedding(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """out[t, :] = table[ids[t], :]: tokens split over cores, each core's rows over its DMA queues.

    Each queue gathers a chunk of rows into one of its two SRAM buffers and stores it; the ids
    come in once per core. HBM tensors: ``table`` bf16[vocab, hidden], ``ids`` i32[tokens, 1],
    output ``out`` bf16[tokens, hidden].
    """
    t, vocab, h = shape["tokens"], shape["vocab"], shape["hidden"]
    for key in ("tokens", "vocab", "hidden"):
        if shape[key] < 1:
            raise InvalidArgumentError(f"shape key {key}={shape[key]} must be >= 1")
    _embedding_rows(t, h, spec, Budget.of(spec))
    cores = min(spec.core.count, t)
    per_core = -(-t // cores)
    kb = KernelBuilder(f"embedding_{t}x{vocab}x{h}", chip=spec)
    table = kb.hbm("table", (vocab, h), "bf16")
    ids_h = kb.hbm("ids", (t, 1), "i32")
    out_h = kb.hbm("out", (t, h), "bf16")
    run_emitter(emit_embedding(EmitCtx.standalone(kb), TensorRef.hbm("ids", ids_h),
                               TensorRef.hbm("table", table), out=Out.to(TensorRef.hbm("out", out_h))))

    def make_inputs(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        return {"table": rng.standard_normal((vocab, h)).astype(ml_dtypes.bfloat16),
                "ids": rng.integers(0, vocab, (t, 1)).astype(np.int32)}

    def reference(inputs):
        return {"out": np.asarray(jnp.take(jnp.asarray(inputs["table"]),
                                           jnp.asarray(inputs["ids"][:, 0]), axis=0))}

    return KernelBuild(
        program=kb.build(), make_inputs=make_inputs, reference=reference,
        outputs={"out": ("bf16", (t, h))},
        tolerance=Tolerance(0.0, 0.0, "bit-exact: rows are copied unchanged"),
        notes={"cores": cores, "rows_per_core": per_core},
    )


EMBEDDING = register(KernelDef(
    name="embedding",
    doc="out[t, :] = table[ids[t], :] (bf16), one dma.gather per chunk of tokens, spread over "
        "cores and DMA queues.",
    shape_keys=(
        ShapeKey("tokens", int, 8, "token ids to look up", minimum=1),
        ShapeKey("vocab", int, 512, "table rows (gpt-oss: 201088)", minimum=1),
        ShapeKey("hidden", int, 256, "row length (gpt-oss-120b: 2880)", minimum=1),
    ),
    build=build_embedding,
    emit=lambda ctx, shape, t, outs: emit_embedding(ctx, t["ids"], t["table"], out=outs.get("out")),
    tensors_of=embedding_tensors,
))
