"""The per-core job pipeline both cache appends run, and the helpers they share.

Stage: kernels (the append family), below ``cache`` (``kv-append``) and ``mla_append``
(``mla-append``): a helper both need lives here, so neither imports the other's private names.

How an append runs: its work items (kv-append: (sequence, KV head) pairs; mla-append: query rows
and cache rows) go to the cores in contiguous blocks, so that one core's rows are contiguous in
the inputs and evenly strided in the caches: each block moves with one DMA descriptor per tensor.
A core whose share does not fit its scratchpad walks it in jobs on two buffer slots (loads of job
j+1 overlap the work on job j): :func:`plan_core` names each job's semaphores before anything is
emitted (a fused program hands over its outputs' readiness before the work), :func:`prefetch_core`
loads the constants, :func:`run_core` issues the jobs. ``rope_rotate_half`` is the vector unit's
rotate-half in numpy, the references' shared rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import CoreHandle, EngineHandle, KernelBuilder, Semaphore
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import DTYPES
from jalapeno_emu.lazy import LazyModule

from .base import Tolerance
from .emit import TensorRef, fetch

ml_dtypes = LazyModule("ml_dtypes")  # loaded on first use: importing it costs 0.5 s

__all__ = ["ALIGN_BYTES", "APPEND_SRAM_SHARE", "BIT_EXACT", "SPREAD_STORES", "CorePlan", "From",
           "Job", "aligned_nbytes", "emit_core", "jobs_needed", "packed_view", "plan_core", "prefetch_core",
           "rope_rotate_half", "rotate_half", "rotate_job", "rows_every", "rows_loads", "run_core",
           "split_blocks"]

APPEND_SRAM_SHARE = 0.9  # leave a little scratchpad free (allocations are 64-byte aligned)
ALIGN_BYTES = 64
BIT_EXACT = Tolerance(atol=0.0, rtol=0.0, why="bit-exact: the same FP32 vector operations in the same "
                   "order as the reference, one rounding to BF16; every other byte is copied")


def rope_rotate_half(x, cos, sin) -> np.ndarray:
    """Rotate-half RoPE with the kernels' roundings: BF16 result as float32[..., D].

    ``x`` [..., D] (BF16 values), ``cos``/``sin`` [..., D/2] FP32 (broadcast). Each product and
    the sum or difference is one FP32 rounding (numpy float32, no fused multiply-add), the result
    one BF16 rounding, as the vector unit does: out = [x1*cos - x2*sin | x2*cos + x1*sin].
    """
    x = np.asarray(x, np.float32)
    c, s = np.asarray(cos, np.float32), np.asarray(sin, np.float32)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(ml_dtypes.bfloat16).astype(np.float32)


# --- tiles ------------------------------------------------------------------------------------
def packed_view(t: Tile, rows: int, cols: int, byte_off: int = 0, stride: int = -1) -> Tile:
    """The bytes of tile ``t`` (from ``byte_off``) seen as [rows, cols] of the same dtype, with
    row ``stride`` in bytes (default packed); ``t`` must be packed over the span."""
    view = Tile(t.space, t.core, t.offset + byte_off, t.dtype, rows, cols, stride)
    if not t.contiguous or view.offset < t.offset or view.end > t.offset + t.nbytes:
        raise AssertionError(f"{view} is not inside packed {t}")  # a kernel bug, not bad input
    return view


def rows_every(t: Tile, first: int, count: int, every: int) -> Tile:
    """``count`` rows of tile ``t`` from row ``first``, taking every ``every``-th row."""
    return Tile(t.space, t.core, t.offset + first * t.stride, t.dtype, count, t.cols, t.stride * every)


def rotate_half(vpu: EngineHandle, out1: Tile, out2: Tile, x1: Tile, x2: Tile, cos: Tile, sin: Tile,
                 t1: Tile, t2: Tile) -> None:
    """out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin: attention-prefill's K^T rotation, op for op
    (FP32 temporaries t1, t2; one rounding to out's dtype)."""
    vpu.mul(t1, x1, cos)
    vpu.mul(t2, x2, sin)
    vpu.sub(out1, t1, t2)
    vpu.mul(t1, x2, cos)
    vpu.mul(t2, x1, sin)
    vpu.add(out2, t1, t2)


def rotate_job(core: CoreHandle, ready: tuple[Semaphore, int], **tiles: Tile) -> None:
    """A job's ``rotate_half`` on the core's vector unit (which has waited for ``ready``)."""
    rotate_half(core.vpu, **tiles)


def aligned_nbytes(rows: int, cols: int, dtype: str) -> int:
    return -(-rows * DTYPES[dtype].row_bytes(cols) // ALIGN_BYTES) * ALIGN_BYTES


# --- the per-core pipeline ----------------------------------------------------------------------
SPREAD_STORES = 4  # a job with more stores than this spreads them over every DMA queue


@dataclass(frozen=True)
class From:
    """A load source that is a region of a tensor given to the emitter: rows r0.. and columns c0..
    of ``ref`` (the destination tile's shape), loaded with :func:`fetch` (waiting for the
    regions its writers have not finished; on-chip pieces copied scratchpad to scratchpad)."""

    ref: TensorRef
    r0: int
    c0: int


@dataclass
class Job:
    """One core's block of rows: what to load, store as loaded, compute, and store after.

    loads: (SRAM dst, HBM src tile or :class:`From`); passthrough: (HBM dst, SRAM src) stored
    as soon as loaded; compute(core, ready): issues the job's work; the vector unit has waited
    for the loads already, other engines it uses wait on ``ready`` (semaphore, value)
    themselves; the vector unit's last instruction must come after all of it. stores: (HBM dst,
    SRAM src) after it.
    """

    loads: list[tuple[Tile, Tile | From]] = field(default_factory=list)
    passthrough: list[tuple[Tile, Tile]] = field(default_factory=list)
    compute: Callable[[CoreHandle, tuple[Semaphore, int]], None] | None = None
    stores: list[tuple[Tile, Tile]] = field(default_factory=list)


@dataclass
class CorePlan:
    """One core's pipeline, planned before any of it is emitted (a fused program hands over its
    outputs' readiness before the work): its semaphores and, per job, the condition under which
    all of that job's stores (passthrough included) have landed (``stored``)."""

    c: int
    consts: list[tuple[Tile, Tile]]
    jobs: list[Job]
    mxu_reads_consts: bool
    sem: dict[str, list[Semaphore]]
    ready: Semaphore | None
    stored: list[tuple[int, int]]
    load_queue: int = 0  # slot s loads on queue load_queue + s (mod the queues)
    store_queue: int = 2  # and stores on queue store_queue + s


def plan_core(kb: KernelBuilder, c: int, consts: list[tuple[Tile, Tile]], jobs: list[Job],
               mxu_reads_consts: bool = False) -> CorePlan:
    """Semaphores and per-job store conditions of core ``c``'s pipeline (see ``emit_core``)."""
    slots = min(2, len(jobs))
    nq = len(kb.core(c).dma)
    sem = {n: [kb.semaphore(f"c{c}.{n}{s}") for s in range(slots)] for n in ("loaded", "done", "stored")}
    ready = kb.semaphore(f"c{c}.consts") if consts and jobs else None
    signals, stored = [0] * max(slots, 1), []
    for j, job in enumerate(jobs):
        s = j % slots
        spread = len(job.stores) > SPREAD_STORES
        queues = nq if spread else 1
        # the store queue always signals; the others only when they got a share of the stores
        signals[s] += 1 + sum(1 for k in range(1, queues) if job.stores[k::queues])
        stored.append((sem["stored"][s].id, signals[s]))
    return CorePlan(c, consts, jobs, mxu_reads_consts, sem, ready, stored)


def prefetch_core(kb: KernelBuilder, p: CorePlan) -> None:
    """The constants' loads on queue 0 (what a fused program streams in early)."""
    if p.ready is None:
        return
    core = kb.core(p.c)
    for dst, src in p.consts:
        core.dma[0].load(dst, src)
    core.dma[0].signal(p.ready)


def run_core(kb: KernelBuilder, p: CorePlan, waited: dict[Any, set] | None = None) -> None:
    """Issue the jobs of ``p`` on two buffer slots: slot s loads on queue s and stores on queue
    2+s (many stores: on every queue); a slot is reloaded once its previous job is stored."""
    if not p.jobs:
        return
    c, jobs, sem = p.c, p.jobs, p.sem
    core, slots = kb.core(c), min(2, len(jobs))
    nq = len(core.dma)
    waited = {} if waited is None else waited
    if p.ready is not None:
        core.vpu.wait(p.ready, 1)
        if p.mxu_reads_consts:
            core.mxu.wait(p.ready, 1)
    for j, job in enumerate(jobs):
        s, use = j % slots, j // slots + 1
        lq, sq = core.dma[(p.load_queue + s) % nq], core.dma[(p.store_queue + s) % nq]
        if j >= slots:
            lq.wait(sem["stored"][s], p.stored[j - slots][1])
        for dst, src in job.loads:
            if isinstance(src, From):
                fetch([lq], dst, src.ref, src.r0, src.c0, waited=waited)
            else:
                lq.load(dst, src)
        lq.signal(sem["loaded"][s])
        loaded = (sem["loaded"][s], use)
        sq.wait(*loaded)
        for dst, src in job.passthrough:
            sq.store(dst, src)
        if job.compute is not None:
            core.vpu.wait(*loaded)
            job.compute(core, loaded)
            core.vpu.signal(sem["done"][s])
        queues = [sq] + ([q for q in core.dma if q is not sq] if len(job.stores) > SPREAD_STORES else [])
        for k, q in enumerate(queues):
            share = job.stores[k::len(queues)]
            if not share and q is not sq:
                continue
            if q is not sq and job.compute is None:
                q.wait(*loaded)
            if job.compute is not None:
                q.wait(sem["done"][s], use)
            for dst, src in share:
                q.store(dst, src)
            q.signal(sem["stored"][s])


def emit_core(kb: KernelBuilder, c: int, consts: list[tuple[Tile, Tile]], jobs: list[Job],
               mxu_reads_consts: bool = False) -> CorePlan:
    """Issue core ``c``'s jobs on two buffer slots: slot s loads on queue s and stores on queue
    2+s (many stores: on every queue); a slot is reloaded once its previous job is stored; the
    vector unit (and with ``mxu_reads_consts`` the matrix unit) starts once the constants
    (``consts``, queue 0) have landed. Returns the plan (its per-job store conditions)."""
    p = plan_core(kb, c, consts, jobs, mxu_reads_consts)
    prefetch_core(kb, p)
    run_core(kb, p)
    return p


def split_blocks(total: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) blocks of ``ceil(total/parts)`` covering ``total`` (the last may be shorter)."""
    per = -(-total // parts)
    return [(lo, min(total, lo + per)) for lo in range(0, total, per)]


def jobs_needed(sizes: list[int], fits: Callable[[list[int]], bool], what: str) -> int:
    """Fewest jobs J such that ceil(size/J) rows of each kind fit (``fits``); error if none."""
    for j in range(1, max(sizes) + 1):
        if fits([-(-n // j) for n in sizes]):
            return j
    raise InvalidArgumentError(what)


def rows_loads(ref: TensorRef, dst: Tile, i0: int, n: int, per: int,
                w: int) -> list[tuple[Tile, Tile | From]]:
    """Loads of rows i0 .. i0+n of ``ref`` [tokens, per*w] seen as [tokens*per, w] (row
    token*per + k: the token's k-th ``w``-wide slice: a KV head's key, a query head's row) into
    ``dst`` (packed [n, w]).

    A packed HBM tensor that is ready at the start is one load of the [tokens*per, w] view (the
    stand-alone program); otherwise (a producer's output on chip, or one it stores tile by tile)
    one fetch per run of whole tokens and one per partial token at either end."""
    if ref.in_hbm and not ref.waits() and ref.base.contiguous:
        return [(dst, packed_view(ref.base, ref.shape[0] * per, w).sub(i0, 0, n, w))]
    out: list[tuple[Tile, Tile | From]] = []
    i, end = i0, i0 + n
    while i < end:
        tok, k = divmod(i, per)
        if k == 0 and end - i >= per:
            m = (end - i) // per
            out.append((packed_view(dst, m, per * w, byte_off=(i - i0) * dst.stride), From(ref, tok, 0)))
            i += m * per
        else:
            m = min(end, (tok + 1) * per) - i
            out.append((packed_view(dst, 1, m * w, byte_off=(i - i0) * dst.stride), From(ref, tok, k * w)))
            i += m
    return out
