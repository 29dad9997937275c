"""KV-cache append (``kv-append``): a decode step writes each sequence's new token into the caches
attention-decode reads. (MLA's latent cache: ``mla_append.py``; the job pipeline both run:
``append_base.py``.)

``kv-append`` (grouped-query attention, gpt-oss) takes the K and V columns of the QKV projection
for the new token of every sequence, rotates K (RoPE at position ``context - 1``) and writes

- the rotated key as column ``context - 1`` of each (sequence, KV head)'s K^T block of ``k_cache``,
- the value as row ``context - 1`` of each (sequence, KV head)'s block of ``v_cache``,

in exactly the contiguous layout ``attention-decode`` reads (``page_size`` 0): ``k_cache``
[batch*kv_heads*head_dim, cap + pad_k] with ``cap`` = context rounded up to 32 and the K^T rows
padded by one HBM interleave granule (``pad_k`` elements), ``v_cache`` [batch*kv_heads*cap,
head_dim]. Every other byte of both caches is left as it was. The rotation is the one
``attention-prefill`` applies when it writes its ``k_cache`` (gpt-oss rotate-half with the YaRN
tables of ``attention_ref.yarn_cos_sin``), with the same operations in the same order, so the two
agree bit for bit::

    t1 = x1 * cos;  t2 = x2 * sin;  k[:D/2] = bf16(t1 - t2)       (FP32 products and difference)
    t1 = x2 * cos;  t2 = x1 * sin;  k[D/2:] = bf16(t1 + t2)

``kv-append`` with ``kv_dtype`` fp8e4 writes attention-decode's MXFP8 cache: the rotated key
(BF16, as above) quantised along head_dim, and the value re-quantised with the other tokens of
its 32-token block (V scales run along tokens); ``build_kv_append`` says how.

How it runs (``append_base``): (sequence, KV head) pairs go to the cores in contiguous blocks. The
K^T column of a block of items is one strided [items*head_dim, 1] store (the K^T rows of
consecutive (sequence, head) pairs follow each other), the V rows one [items, head_dim] store with
a stride of ``cap`` rows.

In a fused decode step ``kv-append`` given ``Out.onchip()`` for its (BF16) caches still updates
them in place and keeps each job's rotated keys and values where it made them (kept allocations),
as pieces of the returned cache refs that carry their scratchpad tile, ready when the job's
vector unit is done: attention-decode takes the new token from there instead of waiting for the
stores (``emit_kv_append``; loads then on queue 2, stores on queue 3).

What bounds it: a decode step moves a few KB per core, so the DMA fixed costs (descriptor
set-up, HBM latency) and the launch: about two DMA round trips plus a dozen vector instructions.
Latency-bound at every batch size.
The MXFP8 append adds two matrix-unit passes per item and (j+1) small stores per item (the block's
token rows 0..j, j = (context-1) % 32), which take up to four rounds of DMA set-up at 8 items per
core (13.5 us on jalapeno-v1 at j = 31, against 5.6 us for BF16).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import CoreHandle, KernelBuilder, Semaphore
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import DTYPES
from jalapeno_emu.lazy import LazyModule

from .append_base import (
    APPEND_SRAM_SHARE,
    BIT_EXACT,
    CorePlan,
    Job,
    aligned_nbytes,
    jobs_needed,
    packed_view,
    plan_core,
    prefetch_core,
    rope_rotate_half,
    rotate_half,
    rotate_job,
    rows_every,
    rows_loads,
    run_core,
    split_blocks,
)
from .attention_ref import yarn_cos_sin
from .base import KernelBuild, KernelDef, ShapeKey, TensorSpec, Tolerance
from .emit import EmitCtx, Emitter, Out, Piece, TensorRef, run_emitter
from .planning import Budget
from .registry import register

ml_dtypes = LazyModule("ml_dtypes")  # loaded on first use: importing it costs 0.5 s
jnp = LazyModule("jax.numpy")

__all__ = ["KV_APPEND", "kv_append_fp8_reference", "kv_append_reference", "rope_rotate_half"]


def kv_append_reference(k_new, v_new, rope_cos, rope_sin, k_cache, v_cache, *, batch: int, context: int,
                        kv_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The caches after ``kv-append``: (k_cache, v_cache) as BF16 arrays of the inputs' shapes.

    Column ``context-1`` of K^T block (b, g) (rows (b*G + g)*D ..+D of ``k_cache``) becomes
    rope(k_new[b, g*D:(g+1)*D]); row ``context-1`` of V block (b, g) (row (b*G + g)*cap +
    context-1 of ``v_cache``) becomes v_new[b, g*D:(g+1)*D]; nothing else changes.
    """
    items, d = batch * kv_heads, head_dim
    cap = v_cache.shape[0] // items
    k_rows = np.asarray(k_new, np.float32).reshape(items, d)
    kc = np.array(k_cache, dtype=ml_dtypes.bfloat16, copy=True)
    vc = np.array(v_cache, dtype=ml_dtypes.bfloat16, copy=True)
    cos, sin = np.asarray(rope_cos).reshape(1, -1), np.asarray(rope_sin).reshape(1, -1)
    rotated = rope_rotate_half(k_rows, cos, sin)
    kc[:, context - 1] = rotated.reshape(items * d).astype(ml_dtypes.bfloat16)
    vc[np.arange(items) * cap + context - 1] = np.asarray(v_new, ml_dtypes.bfloat16).reshape(items, d)
    return kc, vc


def kv_append_fp8_reference(k_new, v_new, rope_cos, rope_sin, caches: Mapping[str, Any], *, batch: int,
                            context: int, kv_heads: int, head_dim: int) -> dict[str, np.ndarray]:
    """The MXFP8 caches after ``kv-append``: updated copies of ``caches``' uint8 arrays ``k_cache``,
    ``k_cache.scales``, ``v_cache``, ``v_cache.scales`` (attention-decode's fp8e4 layout).

    K: the rotated key (``rope_rotate_half``, BF16) quantised to E4M3 along head_dim (one scale
    per 32 dims), written as column ``context-1`` of the codes and of the scales. V: the new
    token's 32-token block ``blk = (context-1) // 32`` as values (earlier tokens dequantised, the
    new token in row ``j = (context-1) % 32``, zero after it; zeros positive, as the matrix unit
    leaves them), quantised along tokens (one scale per head_dim column); rows 0..j of the block
    and its scale row are written, rows after j keep their bytes.
    """
    items, d = batch * kv_heads, head_dim
    kc, ks, vc, vs = (np.array(caches[n], dtype=np.uint8, copy=True)
                      for n in ("k_cache", "k_cache.scales", "v_cache", "v_cache.scales"))
    cap = vc.shape[0] // items
    blk, j = divmod(context - 1, 32)
    cos, sin = np.asarray(rope_cos).reshape(1, -1), np.asarray(rope_sin).reshape(1, -1)
    kr = rope_rotate_half(np.asarray(k_new, np.float32).reshape(items, d), cos, sin)
    kq = mx.quantize(jnp.asarray(kr), "e4m3", axis=1)
    kc[:, context - 1] = np.asarray(kq.codes).reshape(-1)
    ks[:, context - 1] = np.asarray(kq.scales).reshape(-1)
    rows = (np.arange(items) * cap + blk * 32)[:, None] + np.arange(32)  # [items, 32] V rows
    srows = np.arange(items) * (cap // 32) + blk
    old = mx.dequantize(mx.MXArray(codes=jnp.asarray(vc[rows.reshape(-1)]), scales=jnp.asarray(vs[srows]),
                                   fmt="e4m3", axis=0, block_size=32))
    block = np.asarray(old, np.float32).reshape(items, 32, d) + np.float32(0)  # -0 -> +0
    block[:, j] = np.asarray(v_new, np.float32).reshape(items, d) + np.float32(0)
    block[:, j + 1:] = 0
    vq = mx.quantize(jnp.asarray(block.reshape(items * 32, d)), "e4m3", axis=0)
    codes = np.asarray(vq.codes).reshape(items, 32, d)
    vc[rows[:, :j + 1].reshape(-1)] = codes[:, :j + 1].reshape(-1, d)
    vs[srows] = np.asarray(vq.scales)
    return {"k_cache": kc, "k_cache.scales": ks, "v_cache": vc, "v_cache.scales": vs}


# --- kv-append ----------------------------------------------------------------------------------
def _check_kv(shape: dict[str, Any]) -> None:
    d = shape["head_dim"]
    if d % 32:
        raise InvalidArgumentError(f"shape key head_dim={d} must be a multiple of 32: attention-decode "
                                   "contracts over head_dim in 32-element matrix-unit blocks")


def _kv_buffers(n: int, d: int, fp8: bool) -> tuple[list, list, list]:
    """Buffers for ``n`` items per job: (per-slot SRAM, shared SRAM, per-slot accumulators), each
    a list of (name, (rows, cols), dtype); accumulators are FP32."""
    h = d // 2
    slot = [("kin", (n, d), "bf16"), ("kout", (n, d), "bf16"), ("v", (n, d), "bf16")]
    shared = [("t1", (n, h), "f32"), ("t2", (n, h), "f32")]
    acc: list = []
    if fp8:  # K codes and scales; the V block (codes, scales), dequantised, transposed, re-quantised
        slot += [("kq", (n, d), "fp8e4"), ("ks", (n, d // 32), "e8m0"), ("vold", (n * 32, d), "fp8e4"),
                 ("vold_s", (n, d), "e8m0"), ("vblk", (n * 32, d), "bf16"), ("vt", (n * d, 32), "bf16"),
                 ("vq", (n * d, 32), "fp8e4"), ("vq_s", (n * d, 1), "e8m0")]
        acc = [("deq", (n * 32, d), "f32"), ("tr", (n * d, 32), "f32")]
    return slot, shared, acc


def _fp8_job(core: CoreHandle, ready: tuple[Semaphore, int], *, k: int, sem: dict[str, Semaphore], eye: Tile,
             rot: dict[str, Tile], t: dict[str, Tile], j: int) -> None:
    """One job of the MXFP8 append on core ``core`` (its k-th): rotate and quantise the keys;
    re-quantise each item's V block with the new token in row ``j`` (see ``build_kv_append``).

    ``t`` holds the job's tiles: kout, kq, ks (keys), v [n, D] (new values), vold/vold_s (the
    blocks' codes [n*32, D] and scales [n, D]), vblk [n*32, D], vt [n*D, 32], vq/vq_s (the
    transposed codes and their scales [n*D, 1]), deq/tr (accumulators).
    """
    mxu, vpu = core.mxu, core.vpu
    n, d = t["v"].rows, t["v"].cols
    mxu.wait(*ready)
    for i in range(n):  # I_32 @ codes with the block's scales: the block's values, exactly, in FP32
        mxu.matmul(t["deq"].sub(i * 32, 0, 32, d), eye.sub(0, 0, 32, 32), t["vold"].sub(i * 32, 0, 32, d),
                   b_scale=t["vold_s"].sub(i, 0, 1, d), mode="overwrite")
    mxu.signal(sem["deq"])
    rotate_half(vpu, **rot)
    vpu.quantize(t["kq"], t["ks"], t["kout"])  # blocked along head_dim: one scale per 32 dims
    vpu.wait(sem["deq"], k + 1)
    vpu.acc_read(t["vblk"], t["deq"])  # exact: MXFP8 values fit BF16
    vpu.copy(rows_every(t["vblk"], j, n, 32), t["v"])  # the new token's row
    if j < 31:  # slots after it hold no token yet: zero, so they do not raise the block's scale
        tail = packed_view(t["vblk"], n, 32 * d).sub(0, (j + 1) * d, n, (31 - j) * d)
        vpu.scale(tail, tail, 0.0)
    vpu.signal(sem["vready"])
    mxu.wait(sem["vready"], k + 1)
    for i in range(n):  # I_D @ block^T: the block transposed, exactly, so tokens run along columns
        mxu.matmul_t(t["tr"].sub(i * d, 0, d, 32), eye, t["vblk"].sub(i * 32, 0, 32, d), mode="overwrite")
    mxu.signal(sem["tr"])
    vpu.wait(sem["tr"], k + 1)
    vpu.acc_read(t["vt"], t["tr"])
    vpu.quantize(t["vq"], t["vq_s"], t["vt"])  # one scale per (head_dim column, 32 tokens)


@dataclass(frozen=True)
class _KvGeom:
    """Sizes of one kv-append instance: items = batch*kv_heads (sequence, KV head) pairs, head_dim
    ``d``, the cache capacity ``cap`` (tokens, padded to 32), the new token's position ``ctx - 1``
    = 32*``blk`` + ``j``, the K^T row padding ``pad_k`` and its scale rows' ``pad_s``."""

    items: int
    d: int
    ctx: int
    cap: int
    pad_k: int
    pad_s: int
    fp8: bool
    heads: int = 1

    @property
    def blk(self) -> int:
        return (self.ctx - 1) // 32

    @property
    def j(self) -> int:
        return (self.ctx - 1) % 32


def _kv_hbm_alloc(kb: KernelBuilder, bsz: int, g: _KvGeom) -> dict[str, TensorRef]:
    """The stand-alone launch's HBM tensors (attention-decode's names and shapes for the caches),
    allocated in the order its program has always had them."""
    d, kvd = g.d, "fp8e4" if g.fp8 else "bf16"
    names = [("k_new", (bsz, g.items * d // bsz), "bf16"), ("v_new", (bsz, g.items * d // bsz), "bf16"),
             ("rope_cos", (1, d // 2), "f32"), ("rope_sin", (1, d // 2), "f32"),
             ("k_cache", (g.items * d, g.cap + g.pad_k), kvd), ("v_cache", (g.items * g.cap, d), kvd)]
    if g.fp8:
        names += [("k_cache.scales", (g.items * d // 32, g.cap + g.pad_s), "e8m0"),
                  ("v_cache.scales", (g.items * g.cap // 32, d), "e8m0"), ("eye", (d, d), "bf16")]
    return {n: TensorRef.hbm(n, kb.hbm(n, sh, dt)) for n, sh, dt in names}

def _kv_bf16_job(g: _KvGeom, hbm: dict[str, Any], tl: dict[str, Tile], rot: dict[str, Tile], i0: int,
                 n: int) -> Job:
    """Items i0..i0+n (BF16): rotate K; V stored as loaded."""
    d, ctx, cap = g.d, g.ctx, g.cap
    return Job(
        loads=[*rows_loads(hbm["k_new"], tl["kin"], i0, n, g.heads, d),
               *rows_loads(hbm["v_new"], tl["v"], i0, n, g.heads, d)],
        # row i0*cap + ctx-1 of V, then every cap-th row: the next (sequence, head)'s
        passthrough=[(rows_every(hbm["v_cache"], i0 * cap + ctx - 1, n, cap), tl["v"])],
        compute=functools.partial(rotate_job, **rot),
        # column ctx-1 of K^T rows i0*D .. (i0+n)*D: the rotated rows, packed, as a column
        stores=[(hbm["k_cache"].sub(i0 * d, ctx - 1, n * d, 1), packed_view(tl["kout"], n * d, 1))])


def _kv_fp8_job(g: _KvGeom, hbm: dict[str, Any], tl: dict[str, Tile], compute: Callable, i0: int,
                n: int) -> Job:
    """Items i0..i0+n (MXFP8): K codes and scales as columns; the V blocks in, re-quantised, and
    back a token row at a time (see ``build_kv_append``)."""
    d, ctx, cap, per = g.d, g.ctx, g.cap, g.cap // 32
    first = i0 * per + g.blk  # item i0's block: a row of v_blocks and of the V scales
    job = Job(loads=[*rows_loads(hbm["k_new"], tl["kin"], i0, n, g.heads, d),
                      *rows_loads(hbm["v_new"], tl["v"], i0, n, g.heads, d),
                      (packed_view(tl["vold"], n, 32 * d), rows_every(hbm["v_blocks"], first, n, per)),
                      (tl["vold_s"], rows_every(hbm["v_cache.scales"], first, n, per))],
               compute=compute)
    job.stores += [(hbm["k_cache"].sub(i0 * d, ctx - 1, n * d, 1), packed_view(tl["kq"], n * d, 1)),
                   (hbm["k_cache.scales"].sub(i0 * d // 32, ctx - 1, n * d // 32, 1),
                    packed_view(tl["ks"], n * d // 32, 1)),
                   (rows_every(hbm["v_cache.scales"], first, n, per), packed_view(tl["vq_s"], n, d))]
    for i in range(n):  # token t of item i is column t of its transposed codes
        for tok in range(g.j + 1):
            row = (i0 + i) * cap + g.blk * 32 + tok
            dst = packed_view(hbm["v_cache"], d, 1, byte_off=row * d)
            job.stores.append((dst, tl["vq"].sub(i * d, tok, d, 1)))
    return job


def _kv_written(g: _KvGeom, i0: int, n: int) -> list[tuple[str, int, int, int, int]]:
    """(cache tensor, r0, c0, rows, cols) regions items i0 .. i0+n write: a fused reader of the
    cache waits for these and nothing else of it."""
    d, ctx, cap = g.d, g.ctx, g.cap
    out = [("k_cache", i0 * d, ctx - 1, n * d, 1)]
    if not g.fp8:
        return out + [("v_cache", i * cap + ctx - 1, 0, 1, d) for i in range(i0, i0 + n)]
    per = cap // 32
    out.append(("k_cache.scales", i0 * d // 32, ctx - 1, n * d // 32, 1))
    for i in range(i0, i0 + n):
        out += [("v_cache", i * cap + g.blk * 32, 0, g.j + 1, d),
                ("v_cache.scales", i * per + g.blk, 0, 1, d)]
    return out


def _kv_kept_rows(g: _KvGeom, p: CorePlan, spans: list[range],
                  refs: dict[str, TensorRef]) -> dict[str, TensorRef]:
    """The caches' refs with the new rows of core ``p``'s jobs also on chip (BF16): each job's
    rotated keys (its ``kout`` rows, packed: the [n*D, 1] K^T column of its items) and values
    (its ``v`` rows), pieces of the HBM tensors with their tiles, ready once the job's vector
    unit is done (the values had landed before it started). A reader takes those bytes, the
    ones the stores write, from there instead of waiting for the stores."""
    k_ref, v_ref = refs["k_cache"], refs["v_cache"]
    slots = min(2, len(p.jobs))
    for k, (job, span) in enumerate(zip(p.jobs, spans, strict=True)):
        ready = (p.sem["done"][k % slots].id, k // slots + 1)
        (_, k_rows), (_, v_rows) = job.stores[0], job.passthrough[0]
        i0, n = span.start, len(span)
        k_new = Piece(i0 * g.d, g.ctx - 1, n * g.d, 1, k_rows, None, ready)
        v_new = [Piece(i * g.cap + g.ctx - 1, 0, 1, g.d, v_rows.sub(i - i0, 0, 1, g.d), None, ready)
                 for i in span]
        k_ref = replace(k_ref, pieces=(*k_ref.pieces, k_new))
        v_ref = replace(v_ref, pieces=(*v_ref.pieces, *v_new))
    return refs | {"k_cache": k_ref, "v_cache": v_ref}


def _kv_core(kb: KernelBuilder, c: int, items: range, per_job: int, slots: int, g: _KvGeom,
             hbm: dict[str, Any], keep: tuple[str, ...] = ()) -> tuple[CorePlan, list[range]]:
    """Core ``c``'s share, planned: ``items`` in jobs of ``per_job`` on ``slots`` buffer slots;
    also each job's items. ``keep``: slot buffers that outlive the emitter (``kb.sram(keep=)``:
    the new rows kept on chip for a reader of the caches)."""
    d, h = g.d, g.d // 2
    slot_specs, shared_specs, acc_specs = _kv_buffers(per_job, d, g.fp8)
    buf = {name: [kb.sram(c, f"{name}{s}", sh, dt, keep=name in keep) for s in range(slots)]
           for name, sh, dt in slot_specs}
    buf |= {name: [kb.acc(c, f"{name}{s}", sh) for s in range(slots)] for name, sh, _ in acc_specs}
    cos, sin = kb.sram(c, "cos", (1, h), "f32"), kb.sram(c, "sin", (1, h), "f32")
    consts = [(cos, hbm["rope_cos"]), (sin, hbm["rope_sin"])]
    t1, t2 = (kb.sram(c, name, sh, dt) for name, sh, dt in shared_specs)
    if g.fp8:
        eye = kb.sram(c, "eye", (d, d), "bf16")
        consts.append((eye, hbm["eye"]))
        sem = {n: kb.semaphore(f"c{c}.{n}") for n in ("deq", "vready", "tr")}
    jobs, spans = [], []
    for k, i0 in enumerate(range(items.start, items.stop, per_job)):
        n, s = min(per_job, items.stop - i0), k % slots
        slot_n, _, acc_n = _kv_buffers(n, d, g.fp8)  # this job's shapes (the last may be smaller)
        tl = {name: buf[name][s].sub(0, 0, *sh) for name, sh, _ in slot_n + acc_n}
        x, out = tl["kin"], tl["kout"]
        rot = {"out1": out.sub(0, 0, n, h), "out2": out.sub(0, h, n, h), "x1": x.sub(0, 0, n, h),
               "x2": x.sub(0, h, n, h), "cos": cos, "sin": sin, "t1": t1.sub(0, 0, n, h),
               "t2": t2.sub(0, 0, n, h)}
        if g.fp8:
            compute = functools.partial(_fp8_job, k=k, sem=sem, eye=eye, rot=rot, t=tl, j=g.j)
            jobs.append(_kv_fp8_job(g, hbm, tl, compute, i0, n))
        else:
            jobs.append(_kv_bf16_job(g, hbm, tl, rot, i0, n))
        spans.append(range(i0, i0 + n))
    return plan_core(kb, c, consts, jobs, mxu_reads_consts=g.fp8), spans


def _kv_plan(shape: dict[str, Any], spec: ChipSpec,
             budget: Budget) -> tuple[_KvGeom, list[tuple[int, int]], int, int]:
    """(geometry, per-core item blocks, items per job, jobs per core) of a kv-append shape.

    Raises:
        InvalidArgumentError: a head_dim that is not a multiple of 32, or one item that does not
            fit the budget.
    """
    _check_kv(shape)
    bsz, ctx, hkv, d, kvd = (shape[k] for k in ("batch", "context", "kv_heads", "head_dim", "kv_dtype"))
    fp8 = kvd == "fp8e4"
    h, items, cap = d // 2, bsz * hkv, -(-ctx // 32) * 32
    # attention-decode's K^T row padding (elements) and that of its scale rows
    g = _KvGeom(items=items, d=d, ctx=ctx, cap=cap, pad_k=spec.hbm.interleave_bytes * 8 // DTYPES[kvd].bits,
                pad_s=spec.hbm.interleave_bytes, fp8=fp8, heads=hkv)
    blocks = split_blocks(items, min(budget.cores, items))
    per_core = blocks[0][1] - blocks[0][0]
    consts_bytes = 2 * aligned_nbytes(1, h, "f32") + (aligned_nbytes(d, d, "bf16") if fp8 else 0)
    sram = min(budget.sram_bytes, int(spec.sram.scratchpad_bytes * APPEND_SRAM_SHARE)) - consts_bytes

    def fits(n: list[int]) -> bool:
        slot, shared, acc = (sum(aligned_nbytes(*sh, dt) for _, sh, dt in specs)
                             for specs in _kv_buffers(n[0], d, fp8))
        return 2 * slot + shared <= sram and 2 * acc <= budget.acc_bytes

    n_jobs = jobs_needed([per_core], fits, f"shape key head_dim={d}: one (sequence, KV head) item "
                          f"does not fit {spec.name}'s {spec.sram.scratchpad_bytes:,} B scratchpad or "
                          f"{spec.sram.accumulator_bytes:,} B of accumulators")
    return g, blocks, -(-per_core // n_jobs), n_jobs


def emit_kv_append(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                   outs: dict[str, Out] | None = None) -> Emitter:
    """Emit kv-append (``KernelDef.emit``): ``t`` holds k_new and v_new (token-major [batch,
    kv_heads*head_dim], in HBM or on chip), rope_cos / rope_sin [1, head_dim/2] and the caches
    (HBM, updated in place; fp8e4: with their ``.scales``); an ``eye`` [head_dim, head_dim] BF16
    identity is the emitter's own constant unless given.

    The prefetch part loads each core's RoPE row (and identity); the rest waits for the new
    rows. Yields/returns the caches, each region a job writes ready once that job's stores
    have landed (an attention reading the cache waits for the new token's bytes only).
    """
    kb, spec = ctx.kb, ctx.spec
    g, blocks, per_job, n_jobs = _kv_plan(shape, spec, ctx.budget)
    names = ("k_cache", "v_cache") + (("k_cache.scales", "v_cache.scales") if g.fp8 else ())
    kept = 0
    for name in names:
        place = (outs or {}).get(name)
        if place is not None and place.ref is None and place.cores is None:
            kept += 1  # Out.onchip(): updated in place, and the new rows also kept on chip
        elif place is not None and (place.ref is None or place.ref.base != t[name].base):
            raise InvalidArgumentError(f"kv-append updates {name} in place: its output must be the "
                                       "input tensor (or Out.onchip(): in place, new rows kept on chip)")
    # The rows stay where the jobs made them: BF16 caches (an MXFP8 append re-quantises a whole
    # 32-token V block), each job on a slot of its own (no slot reuse overwrites them).
    keep = ("kout", "v") if kept == len(names) and not g.fp8 and n_jobs <= 2 else ()
    hbm: dict[str, Any] = {name: t[name].base for name in ("rope_cos", "rope_sin", *names)}
    hbm |= {"k_new": t["k_new"], "v_new": t["v_new"]}
    if g.fp8:
        hbm["eye"] = (t["eye"].base if "eye" in t
                      else ctx.const("eye", np.eye(g.d, dtype=ml_dtypes.bfloat16), "bf16"))
        # a row per 32-token block
        hbm["v_blocks"] = packed_view(hbm["v_cache"], g.items * g.cap // 32, 32 * g.d)
    plans = [_kv_core(kb, c, range(lo, hi), per_job, min(2, n_jobs), g, hbm, keep)
             for c, (lo, hi) in enumerate(blocks)]
    for p, _ in plans:
        if keep:
            # A decode attention in the same program takes these rows from this core (its KV
            # split holding the new token runs here): the loads share queue 2 with its query
            # fetch (both read the QKV projection's output) rather than queue 0, where the next
            # operators' weights stream in; the stores go on queue 3, after which nothing of the
            # attention's waits (a DMA queue's signal waits for everything issued before it).
            p.load_queue, p.store_queue = 2, 3
        prefetch_core(kb, p)
    refs = {name: t[name] for name in names}
    for p, spans in plans:
        for cond, span in zip(p.stored, spans, strict=True):
            for name, *region in _kv_written(g, span.start, len(span)):
                refs[name] = refs[name].with_ready(*region, cond)
        if keep:
            refs = _kv_kept_rows(g, p, spans, refs)
    yield refs
    waited: dict[Any, set] = {}
    for p, _ in plans:
        run_core(kb, p, waited)
    return refs


def kv_append_tensors(shape: dict[str, Any], spec: ChipSpec) -> tuple[TensorSpec, ...]:
    """kv-append's tensors: k_new, v_new (inputs, token-major [batch, kv_heads*head_dim]), the
    RoPE row of position context-1 (weights) and the caches in attention-decode's layout (inout)."""
    g, *_ = _kv_plan(shape, spec, Budget.of(spec))
    bsz, d, kvd = shape["batch"], g.d, shape["kv_dtype"]
    specs = [TensorSpec("k_new", (bsz, g.heads * d), "bf16", "input"),
             TensorSpec("v_new", (bsz, g.heads * d), "bf16", "input"),
             TensorSpec("rope_cos", (1, d // 2), "f32", "weight"),
             TensorSpec("rope_sin", (1, d // 2), "f32", "weight"),
             TensorSpec("k_cache", (g.items * d, g.cap + g.pad_k), kvd, "inout"),
             TensorSpec("v_cache", (g.items * g.cap, d), kvd, "inout")]
    if g.fp8:
        specs += [TensorSpec("k_cache.scales", (g.items * d // 32, g.cap + g.pad_s), "e8m0", "inout"),
                  TensorSpec("v_cache.scales", (g.items * g.cap // 32, d), "e8m0", "inout")]
    return tuple(specs)


def build_kv_append(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """kv-append: rotate each sequence's new key and write it and its value into the caches.

    BF16 caches: the rotated K row is stored as a K^T column, the V row as a V row (see the
    module doc). MXFP8 caches (``kv_dtype`` fp8e4, attention-decode's layout: K^T codes blocked
    by 32 along head_dim with scales in ``k_cache.scales``, V codes blocked by 32 along tokens with
    scales in ``v_cache.scales``): the rotated key (rounded to BF16, as the BF16 cache holds it)
    is quantised on its own, one scale per 32 dims. The value shares its scales with the other
    tokens of its 32-token block, so the block is re-quantised: its codes are dequantised on the
    matrix unit (I_32 @ codes, exact), the new token replaces row ``j = (context-1) % 32``, the rows
    after it (no token yet) become 0, the block is transposed on the matrix unit (I_D @ block^T,
    exact) so that tokens run along columns, and ``vec.quantize`` gives one scale per (column,
    32 tokens), as the cache keeps them. Its codes go back one token row per DMA (rows 0..j of
    each item's block; the transposed codes' column t is token t): (j+1) stores per item. The
    identity comes from the host (input ``eye``, [head_dim, head_dim] BF16). The padding slots of
    the block must hold finite codes (attention-decode already needs that: P.V multiplies them by
    0); earlier tokens keep their values when the new token does not raise the block's scale and
    are rounded to the new scale otherwise.
    """
    g, blocks, _, n_jobs = _kv_plan(shape, spec, Budget.of(spec))  # refuse before building
    per_core = blocks[0][1] - blocks[0][0]
    bsz, ctx, hkv, d, kvd = (shape[k] for k in ("batch", "context", "kv_heads", "head_dim", "kv_dtype"))
    fp8, items, cap, pad_k, pad_s = g.fp8, g.items, g.cap, g.pad_k, g.pad_s
    kb = KernelBuilder(f"kv_append_b{bsz}_ctx{ctx}", chip=spec)
    refs = _kv_hbm_alloc(kb, bsz, g)
    run_emitter(emit_kv_append(EmitCtx.standalone(kb), shape, refs))

    def make_inputs(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        cos_t, sin_t = yarn_cos_sin(ctx, d)
        # The whole allocations random, padding included: a byte the kernel must not touch differs
        # from what it would write.
        kc = rng.standard_normal((items * d, cap + pad_k)).astype(np.float32)
        vc = rng.standard_normal((items * cap, d)).astype(np.float32)
        ins = {"k_new": rng.standard_normal((bsz, hkv * d)).astype(ml_dtypes.bfloat16),
               "v_new": rng.standard_normal((bsz, hkv * d)).astype(ml_dtypes.bfloat16),
               "rope_cos": cos_t[ctx - 1:ctx], "rope_sin": sin_t[ctx - 1:ctx]}
        if not fp8:
            return ins | {"k_cache": kc.astype(ml_dtypes.bfloat16), "v_cache": vc.astype(ml_dtypes.bfloat16)}
        kq, vq = (mx.quantize(jnp.asarray(a), "e4m3", axis=0) for a in (kc, vc))
        return ins | {"k_cache": np.asarray(kq.codes), "k_cache.scales": np.asarray(kq.scales),
                      "v_cache": np.asarray(vq.codes), "v_cache.scales": np.asarray(vq.scales),
                      "eye": np.eye(d, dtype=ml_dtypes.bfloat16)}

    dims = {"batch": bsz, "context": ctx, "kv_heads": hkv, "head_dim": d}

    def reference(inputs):
        args = (inputs["k_new"], inputs["v_new"], inputs["rope_cos"], inputs["rope_sin"])
        if fp8:
            return kv_append_fp8_reference(*args, inputs, **dims)
        kc, vc = kv_append_reference(*args, inputs["k_cache"], inputs["v_cache"], **dims)
        return {"k_cache": kc, "v_cache": vc}

    outputs = {"k_cache": (kvd, (items * d, cap + pad_k)), "v_cache": (kvd, (items * cap, d))}
    if fp8:
        outputs |= {"k_cache.scales": ("e8m0", (items * d // 32, cap + pad_s)),
                    "v_cache.scales": ("e8m0", (items * cap // 32, d))}
    return KernelBuild(
        program=kb.build(), make_inputs=make_inputs, reference=reference, outputs=outputs,
        tolerance=_EXACT_FP8 if fp8 else BIT_EXACT,
        notes={"cores": len(blocks), "items": items, "items_per_core": per_core, "jobs_per_core": n_jobs,
               "cap": cap, "k_row_pad": pad_k, "block_row": g.j,
               "v_code_stores": items * (g.j + 1) if fp8 else 0},
    )


_EXACT_FP8 = Tolerance(atol=0.0, rtol=0.0, why="bit-exact codes and scales: the rotation as in BF16, "
                       "then the same MX quantisation (jalapeno_emu.mx.quantize) of the same values; "
                       "the matrix-unit dequantise and transpose are exact")

KV_APPEND = register(KernelDef(
    name="kv-append",
    doc="Decode-step KV-cache append (GQA, gpt-oss): rotate each sequence's new key (YaRN RoPE at "
        "position context-1) and write it and its value into attention-decode's contiguous cache.",
    shape_keys=(
        ShapeKey("batch", int, 2, "sequences, one new token each", minimum=1),
        ShapeKey("context", int, 40, "tokens in each sequence's cache, the new one (at context-1) "
                 "included", minimum=1),
        ShapeKey("kv_heads", int, 2, "KV heads (gpt-oss-120b: 8)", minimum=1),
        ShapeKey("head_dim", int, 64, "head dimension, a multiple of 32 (gpt-oss-120b: 64)", minimum=32),
        ShapeKey("kv_dtype", str, "bf16", "KV cache element type; fp8e4 = MXFP8 E4M3 as attention-decode "
                 "reads it (re-quantises the new token's 32-token V block)", choices=("bf16", "fp8e4")),
    ),
    build=build_kv_append,
    emit=lambda ctx, shape, t, outs: emit_kv_append(ctx, shape, t, outs),
    tensors_of=kv_append_tensors,
))
