"""attention-decode: one new token per sequence against its KV cache (``kernels/attention.py``
has the engine's design and the HBM layouts), as an emitter.

Split-KV (flash-decoding). A unit is the query heads of one (sequence, KV head). When there are
fewer units than cores, each unit's visible context is cut into ``splits`` contiguous ranges of
KV tiles (at ``page_size`` or 32-token boundaries), each range on a core of its own: every core
streams a share of the cache. Each split runs the engine's online softmax over its range and
keeps its partial state unnormalised in FP32: row max ``m_i``, row sum ``l_i``, output ``O_i``
(split 0 with the sink logits, which join its first tile's max and denominator as without a
split; the others without). The other splits' queue 3 copies (``dma.copy``, scratchpad to
scratchpad) their ``m_i`` and ``l_i`` into columns of two [R, splits] tiles and their ``O_i``
into a stack on split 0's core, which merges them in split order::

    m = max_i m_i;  a_i = exp(m_i - m);  l = sum_i a_i l_i;  O = O_0 a_0 + O_1 a_1 + ...
    out = bf16(O * recip(l))

(max and the [R, splits] exp over all splits at once, the weighted sum of l a row reduction in
split order, O one multiply-add per split). How many splits: ``_split_cost`` prices each split
count as max(KV bytes of the largest split at one core's share of HBM when units*splits cores
stream, its matrix-unit steps) plus, with splits, a merge round (one DMA set-up, the copy, the
merge's vector instructions); the cheapest wins (ties: fewer splits). gpt-oss at batch 1 (8
units, 64 cores): 8 splits of 1024 keys. A split is a core's only unit; with as many units as
cores (or more) there is no split and the program is the one without splits.

Placement (``emit_decode``): ``q`` token-major [batch, q_heads*head_dim] (the stand-alone HBM q
[batch*q_heads, head_dim] is the same bytes), in HBM or on chip (pieces of the QKV projection's
output): each unit fetches its [q_heads/kv_heads, head_dim] rows. ``out`` goes to an HBM tensor
(``Out.to``) or stays on chip (``Out.onchip``: each unit's rows in the scratchpad of the core that
finalised them, a piece of the token-major tensor ready when its vector unit has written it).
The caches may carry readiness regions (a kv-append's token at position context-1): a KV tile
overlapping one loads only once it is ready; every tile of the first KV slots that waits for
nothing is loaded in the prefetch part. When the append also keeps the new token's rows on chip
(pieces of the BF16 cache refs with a scratchpad tile, ``kv-append`` with ``Out.onchip()``), the
tile holding position context-1 loads only the keys around it from HBM (they wait for nothing)
and takes the new key and value from that tile: the last KV split of each (sequence, KV head)
runs on the core holding them (``_split_cores``) and its vector unit copies them into the KV
slot before the scores' matmul; from another core, its K and V queues copy them after the
tile's loads. The append's stores to HBM are then off the attention's path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import EngineHandle, KernelBuilder
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import DTYPES
from jalapeno_emu.lazy import LazyModule, lazy_jit

from .attention_engine import (
    _DECODE_TILES,
    _MAX_RING,
    _NBUF,
    _Core,
    _fits,
    _Merge,
    _NewRow,
    _Plan,
    _Step,
    _Unit,
    _view,
)
from .attention_ref import (
    MASK_VALUE,
    _f32,
    _flash_partial,
    _mx_values,
    _quantize_fp8,
    _rope_ref,
    _split_merge_ref,
    yarn_cos_sin,
)
from .base import KernelBuild, TensorSpec, Tolerance
from .emit import EmitCtx, Emitter, Out, Piece, Ready, TensorRef, fetch, run_emitter
from .planning import Budget, DoesNotFit, core_hbm_bytes_per_s, mxu_cycles_per_step

ml_dtypes = LazyModule("ml_dtypes")  # loaded on first use: importing it costs 0.5 s

jax = LazyModule("jax")

__all__ = ["DecodeLayout", "build_decode", "decode_layout", "decode_logical_cache", "decode_queries",
           "decode_reference", "decode_tensors", "emit_decode"]

_DECODE_LEAN_SLOTS = (6, 5, 4, 3, 2)  # KV slots of the small-scratchpad path
_SPLIT_TILES = 4  # a KV split walks at least this many tiles, so its loads overlap its matmuls

TOL = Tolerance(
    atol=2e-3, rtol=2.0**-7,
    why="the matrix unit sums each 32-element block in order and XLA's dot does not, and the "
        "vector unit's row sums run in column order: scores and sums differ in the last FP32 "
        "bits, which can flip a BF16 rounding of P or of the output (one BF16 ulp, 2^-8 relative)")


def check_common(shape: dict[str, Any]) -> None:
    """Refuse shapes neither attention kernel can run (GQA ratio, head_dim, window)."""
    hq, hkv, d, w = shape["q_heads"], shape["kv_heads"], shape["head_dim"], shape["window"]
    if hq % hkv:
        raise InvalidArgumentError(f"shape key q_heads={hq} must be a multiple of kv_heads={hkv} "
                                   "(grouped-query attention)")
    if d % 32:
        raise InvalidArgumentError(f"shape key head_dim={d} must be a multiple of 32: Q.K^T "
                                   "contracts over head_dim in 32-element matrix-unit blocks")
    if w < 0:
        raise InvalidArgumentError(f"shape key window={w} must be >= 0 (0: full attention)")


def k_pad(spec: ChipSpec, kv_dtype: str) -> int:
    """Elements of padding after each K^T cache row: one HBM interleave granule."""
    return spec.hbm.interleave_bytes * 8 // DTYPES[kv_dtype].bits


# --- planning ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeLayout:
    """Static choices of one attention-decode instance.

    Attributes:
        plan: the engine's sizes; cap: cache capacity in tokens; lo: the first visible key.
        splits: KV splits per unit (1: none); tiles: per split, its KV tiles (start, keys).
        mask_rows: tile start -> the additive [tk] mask row of a partly visible tile.
        cores: cores used; units_per_core: the most units one core walks.
    """

    plan: _Plan
    cap: int
    lo: int
    splits: int
    tiles: tuple[tuple[tuple[int, int], ...], ...]
    mask_rows: dict[int, np.ndarray]
    cores: int
    units_per_core: int

    @property
    def mask_order(self) -> list[int]:
        """Starts of the masked tiles, in the order of the mask constant's rows."""
        return sorted(self.mask_rows)


def _split_ranges(start: int, end: int, splits: int, align: int) -> list[tuple[int, int]]:
    """[lo, hi) token ranges cutting [start, end) into ``splits`` near-equal parts at multiples of
    ``align`` (end excepted), the longer parts first."""
    blocks = -(-(end - start) // align)
    out, b0 = [], 0
    for i in range(splits):
        nb = blocks // splits + (i < blocks % splits)
        lo, hi = start + b0 * align, min(end, start + (b0 + nb) * align)
        out.append((lo, hi))
        b0 += nb
    return out


def _split_cost(spec: ChipSpec, units: int, splits: int, keys: int, key_bytes: float, rows: int, d: int,
                kv_dtype: str) -> float:
    """Seconds one (sequence, KV head) takes with ``splits`` splits of ``keys`` visible keys each
    (the largest), ``units`` of them streaming at once: the split's KV bytes at a core's share of
    HBM or its matrix-unit steps (Q K^T and P V, rows padded to the array), whichever is longer,
    plus the merge round (one DMA set-up, the partial state's copy, the merge's vector work)."""
    m = spec.matrix
    stream = keys * key_bytes / core_hbm_bytes_per_s(spec, units * splits)
    tiles_m = -(-rows // m.tile_m)
    steps = tiles_m * (-(-keys // m.tile_n) * -(-d // m.tile_k) + -(-d // m.tile_n) * -(-keys // m.tile_k))
    mxu = steps * mxu_cycles_per_step(spec, "bf16", kv_dtype) / spec.core.clock_hz
    if splits == 1:
        return max(stream, mxu)
    vec = spec.vector
    copy_rate = min(spec.dma.bytes_per_s_per_core, spec.sram.bytes_per_cycle * spec.core.clock_hz)
    ops = 9 + 2 * splits  # copies, max, exp, weighted sum, one multiply-add per split, recip
    vector_s = ops * (vec.issue_overhead_cycles + -(-rows * max(d, splits) // vec.lanes)) / spec.core.clock_hz
    merge = spec.dma.setup_latency_s + rows * (d + 2) * 4 / copy_rate + vector_s
    return max(stream, mxu) + merge


def _choose_splits(spec: ChipSpec, budget: Budget, units: int, span: int, align: int, d: int, rows: int,
                   kv_dtype: str) -> int:
    """The split count with the least ``_split_cost`` (1 when units fill the cores)."""
    if units >= budget.cores:
        return 1
    esz = DTYPES[kv_dtype].bits / 8
    key_bytes = 2 * d * esz + (2 * d / 32 if kv_dtype != "bf16" else 0)  # K and V (+ E8M0 scales)
    blocks = -(-span // align)
    best, best_cost = 1, _split_cost(spec, units, 1, span, key_bytes, rows, d, kv_dtype)
    for s in range(2, min(budget.cores // units, blocks) + 1):
        cost = _split_cost(spec, units, s, -(-blocks // s) * align, key_bytes, rows, d, kv_dtype)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def decode_layout(shape: dict[str, Any], spec: ChipSpec, budget: Budget | None = None) -> DecodeLayout:
    """Plan attention-decode within ``budget`` (default: the stand-alone one); refuses impossible
    shapes (InvalidArgumentError) before anything is built."""
    budget = budget or Budget.of(spec)
    b, ctx, hq, hkv, d = (shape[k] for k in ("batch", "context", "q_heads", "kv_heads", "head_dim"))
    ps, kvd, w = shape["page_size"], shape["kv_dtype"], shape["window"]
    check_common(shape)
    if ps < 0:
        raise InvalidArgumentError(f"shape key page_size={ps} must be >= 0 (0: contiguous cache)")
    if ps:
        if ps % 32:
            raise InvalidArgumentError(f"shape key page_size={ps} must be a multiple of 32: "
                                       "P.V contracts over tokens in 32-token matrix-unit blocks")
        if ctx % ps:
            raise InvalidArgumentError(f"shape key page_size={ps} must divide context={ctx}")
    cap = ctx if ps else -(-ctx // 32) * 32
    lo = max(0, ctx - w) if w else 0
    align = ps or 32
    start = lo // align * align
    hpk, n_units = hq // hkv, b * hkv
    chosen = (shape.get("kv_splits", 0)
              or _choose_splits(spec, budget, n_units, cap - start, align, d, hpk, kvd))
    if chosen > 1 and n_units * chosen > budget.cores:
        raise InvalidArgumentError(f"shape key kv_splits={chosen}: batch*kv_heads={n_units} units times "
                                   f"{chosen} splits need more than the {budget.cores} cores")
    if chosen > -(-(cap - start) // align):
        raise InvalidArgumentError(f"shape key kv_splits={chosen}: the {cap - start} visible keys make only "
                                   f"{-(-(cap - start) // align)} blocks of {align}")
    for splits in dict.fromkeys((chosen, 1)):  # with splits if they fit, else without
        ranges = _split_ranges(start, cap, splits, align)
        wide = max(hi - lo_ for lo_, hi in ranges)  # no point in tiles wider than a split's keys
        if splits > 1:
            wide = max(align, wide // _SPLIT_TILES // align * align)
        per_core = -(-n_units // budget.cores) if splits == 1 else 1
        cands = [tk for tk in _DECODE_TILES if tk % align == 0 and tk <= max(wide, align)]
        # Six KV slots and every unit's query and output kept, the largest tile first; on small
        # scratchpads (GPU shared memory) a query/output ring of two, the largest tile first, then
        # the most slots. (Measured on b200 at 64 KiB, gpt-oss tp=8, batch 256, context 2048: 2
        # slots of 64 keys take 53 us, 4 slots of 32 keys 62 us: each tile's fixed instruction
        # costs outweigh the extra bytes in flight.)
        ring = per_core if 2 < per_core <= _MAX_RING else 2
        tries = [(tk, _NBUF, ring) for tk in cands or [align]]
        tries += [(tk, nbuf, 2) for tk in cands or [align] for nbuf in _DECODE_LEAN_SLOTS]
        for tk, nbuf, rg in tries:
            plan = _Plan(hpk=hpk, d=d, tk=tk, nq_max=1, nbuf=nbuf, kv_dtype=kvd, sinks=shape["sinks"],
                         scale=1 / math.sqrt(d), page_size=ps, ring=rg)
            consts = 4 * hq + 2 * 4 * tk + 4 * d + (4 * per_core * (cap // ps) if ps else 0) + 1024
            if splits > 1:  # the merge's [R, splits] tiles and the other splits' O
                consts += 4 * -(-hpk * splits * 4 // 64) * 64 + (splits - 1) * hpk * d * 4
            if not _fits(plan, budget, consts):
                continue
            tiles = tuple(tuple((t0, min(tk, hi - t0)) for t0 in range(lo_, hi, tk)) for lo_, hi in ranges)
            mask_rows: dict[int, np.ndarray] = {}  # the window's first tile, the padded tail's
            for t0, n in (t for split in tiles for t in split):
                cols = np.arange(t0, t0 + n)
                ok = (cols >= lo) & (cols < ctx)
                if not ok.all():
                    row = np.zeros(tk, np.float32)
                    row[:n] = np.where(ok, 0, MASK_VALUE)
                    mask_rows[t0] = row
            cores = n_units * splits if splits > 1 else min(budget.cores, n_units)
            return DecodeLayout(plan, cap, lo, splits, tiles, mask_rows, cores, per_core)
    raise DoesNotFit(
        f"shape key head_dim={d} with q_heads/kv_heads={hpk}"
        + (f" and page_size={ps}" if ps else "")
        + f": one {align}-token KV tile does not fit the {budget.sram_bytes:,} B of scratchpad "
        f"{spec.name} plans with ({_DECODE_LEAN_SLOTS[-1]} slots in flight) or its "
        f"{budget.acc_bytes:,} B of accumulators")


# --- tensors ------------------------------------------------------------------------------------
def decode_tensors(shape: dict[str, Any], spec: ChipSpec) -> tuple[TensorSpec, ...]:
    """attention-decode's tensors: q and out token-major [batch, q_heads*head_dim]; the caches (+
    E8M0 scales, block table), RoPE tables [context, head_dim/2] and sinks [q_heads, 1] as
    weights (the mask is a constant)."""
    bsz, ctx, hq, d, ps = (shape[k] for k in ("batch", "context", "q_heads", "head_dim", "page_size"))
    cap = ctx if ps else -(-ctx // 32) * 32
    specs = [TensorSpec("q", (bsz, hq * d), "bf16", "input"),
             TensorSpec("out", (bsz, hq * d), "bf16", "output"),
             TensorSpec("rope_cos", (ctx, d // 2), "f32", "weight"),
             TensorSpec("rope_sin", (ctx, d // 2), "f32", "weight")]
    if shape["sinks"]:
        specs.append(TensorSpec("sinks", (hq, 1), "f32", "weight"))
    specs += [TensorSpec(name, sh, dt, "weight") for name, sh, dt in _cache_specs(shape, spec, cap)]
    return tuple(specs)


def _cache_specs(shape: dict[str, Any], spec: ChipSpec, cap: int) -> list[tuple[str, tuple[int, int], str]]:
    """(name, shape, dtype) of the block table and caches, in the stand-alone allocation order."""
    bsz, hkv, d, ps, kvd = (shape[k] for k in ("batch", "kv_heads", "head_dim", "page_size", "kv_dtype"))
    fp8 = kvd != "bf16"
    if ps:
        n_pages = bsz * cap // ps
        out = [("block_table", (bsz, cap // ps), "i32"), ("k_cache", (n_pages, hkv * d * ps), kvd),
               ("v_cache", (n_pages, hkv * ps * d), kvd)]
        if fp8:
            out += [("k_cache.scales", (n_pages, hkv * d // 32 * ps), "e8m0"),
                    ("v_cache.scales", (n_pages, hkv * ps // 32 * d), "e8m0")]
        return out
    # K^T rows are padded by one interleave granule: a row stride that is a multiple of the
    # channel round would put every row of a K tile on the same few pseudo-channels.
    out = [("k_cache", (bsz * hkv * d, cap + k_pad(spec, kvd)), kvd), ("v_cache", (bsz * hkv * cap, d), kvd)]
    if fp8:
        out += [("k_cache.scales", (bsz * hkv * d // 32, cap + spec.hbm.interleave_bytes), "e8m0"),
                ("v_cache.scales", (bsz * hkv * cap // 32, d), "e8m0")]
    return out


def _mask_const(lay: DecodeLayout) -> np.ndarray:
    """f32[masked tiles, tk]: the additive mask rows, in ``lay.mask_order``."""
    return np.stack([lay.mask_rows[r] for r in lay.mask_order])


def _rows_view(base: Tile, row: int, col: int, rows: int, cols: int) -> Tile:
    """Elements [row, col .. col + rows*cols) of a row of HBM tensor ``base`` seen as a packed
    [rows, cols] tile (a unit's query heads within a token-major row)."""
    esz = DTYPES[base.dtype].bits // 8
    return Tile(base.space, base.core, base.offset + row * base.stride + col * esz, base.dtype, rows, cols)


# --- the emitter --------------------------------------------------------------------------------
def emit_decode(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef], out: Out | None = None, *,
                mask: TensorRef | None = None) -> Emitter:
    """Emit attention-decode (see the module docstring).

    Args:
        ctx: the emit context (its budget plans the kernel).
        shape: the kernel's shape keys.
        t: ``decode_tensors``' refs: q [batch, q_heads*head_dim] (HBM or on chip), the caches
            (HBM, possibly with readiness regions), rope_cos/rope_sin [context, head_dim/2],
            sinks [q_heads, 1], block_table (paged).
        out: ``Out.to(ref)`` (token-major HBM tensor) or ``Out.onchip()`` (default).
        mask: the [masked tiles, tk] f32 mask constant already allocated (stand-alone build);
            None: allocated here with ``ctx.const``.

    Yields/returns ``{"out": ref}``.
    """
    kb = ctx.kb
    lay = decode_layout(shape, ctx.spec, ctx.budget)
    plan, cap = lay.plan, lay.cap
    bsz, ctx_len, hq, hkv, d = (shape[k] for k in ("batch", "context", "q_heads", "kv_heads", "head_dim"))
    ps, hpk, fp8 = shape["page_size"], plan.hpk, shape["kv_dtype"] != "bf16"
    q = t["q"]
    if q.shape != (bsz, hq * d):
        raise InvalidArgumentError(f"attention-decode: q is {list(q.shape)}, expected [{bsz}, {hq * d}] "
                                   "(token-major: batch x q_heads*head_dim)")
    out = out or Out.onchip()
    if out.cores is not None:
        raise InvalidArgumentError("attention-decode: a replicated output is not supported "
                                   "(use Out.onchip() or Out.to(ref))")
    mask_order = lay.mask_order
    if mask is None and mask_order:
        mask = TensorRef.hbm("mask", ctx.const("mask", _mask_const(lay), "f32"))
    h2 = d // 2
    cos_h = t["rope_cos"].hbm_view(ctx_len - 1, 0, 1, h2)
    sin_h = t["rope_sin"].hbm_view(ctx_len - 1, 0, 1, h2)
    sinks_h = t["sinks"].hbm_view(0, 0, hq, 1) if plan.sinks else None
    caches = {n: t[n] for n in ("k_cache", "v_cache", "k_cache.scales", "v_cache.scales") if n in t}
    k_h, v_h = caches["k_cache"].base, caches["v_cache"].base
    ks_h = caches["k_cache.scales"].base if fp8 else None
    vs_h = caches["v_cache.scales"].base if fp8 else None
    pages_per_seq = cap // ps if ps else 0
    n_pages = bsz * pages_per_seq
    static_q = q.in_hbm and not q.waits()

    def tile_waits(row: int, t0: int, n: int) -> tuple[tuple[Ready, ...], tuple[Ready, ...]]:
        """Ready conditions of the cache regions a tile reads (paged: any, the pages are data)."""
        if ps:
            kw = tuple(caches["k_cache"].waits()) + (tuple(caches["k_cache.scales"].waits()) if fp8 else ())
            vw = tuple(caches["v_cache"].waits()) + (tuple(caches["v_cache.scales"].waits()) if fp8 else ())
            return kw, vw
        kw = caches["k_cache"].waits(row * d, t0, d, n)
        vw = caches["v_cache"].waits(row * cap + t0, 0, n, d)
        if fp8:
            kw += caches["k_cache.scales"].waits(row * d // 32, t0, d // 32, n)
            vw += caches["v_cache.scales"].waits((row * cap + t0) // 32, 0, n // 32, d)
        return tuple(dict.fromkeys(kw)), tuple(dict.fromkeys(vw))

    def q_fetch(bb: int, g: int, waited: dict[Any, set[Ready]]) -> Callable[[EngineHandle, Tile], None]:
        def issue(queue: EngineHandle, dst: Tile) -> None:
            if q.in_hbm:
                for cond in q.waits(bb, g * hpk * d, 1, hpk * d):
                    if cond not in waited.setdefault(queue.engine, set()):
                        queue.wait(*cond)
                        waited[queue.engine].add(cond)
                queue.load(dst, _rows_view(q.base, bb, g * hpk * d, hpk, d))
            else:
                fetch(queue, _view(dst, 1, hpk * d), q, bb, g * hpk * d, waited=waited)
        return issue

    # Units, core by core: without splits contiguous blocks of (sequence, KV head) pairs; with
    # splits the splits of pair u on cores u*splits .. u*splits + splits - 1.
    pairs = [(bb, g) for bb in range(bsz) for g in range(hkv)]
    # The new token's K and V rows kept on chip by the append (BF16, contiguous caches): the tile
    # holding position context-1 takes them from there; with splits, the last split of each
    # (sequence, KV head) runs on the core that holds them when it can.
    new_rows = _kept_new_rows(caches, pairs, hkv, d, cap, ctx_len) if not ps and not fp8 else {}
    split_core = {}
    if lay.splits == 1:
        chunk = -(-len(pairs) // lay.cores)
        by_core = [[(bb, g, 0) for bb, g in pairs[c * chunk:(c + 1) * chunk]] for c in range(lay.cores)]
    else:
        split_core = _split_cores(len(pairs), lay.splits, lay.cores,
                                  {u: new_rows[pr][3] for u, pr in enumerate(pairs) if pr in new_rows})
        by_core = [[] for _ in range(lay.cores)]
        for u, (bb, g) in enumerate(pairs):
            for i in range(lay.splits):
                by_core[split_core[u, i]].append((bb, g, i))
    merges: dict[tuple[int, int], _Merge] = {}
    if lay.splits > 1:
        s = lay.splits
        for u, (bb, g) in enumerate(pairs):
            c = split_core[u, 0]
            merges[(bb, g)] = _Merge(
                splits=s, m=kb.sram(c, "merge_m", (hpk, s), "f32"),
                lsum=kb.sram(c, "merge_l", (hpk, s), "f32"), a=kb.sram(c, "merge_a", (hpk, s), "f32"),
                w=kb.sram(c, "merge_w", (hpk, s), "f32"),
                o=kb.sram(c, "merge_o", ((s - 1) * hpk, d), "f32"), gathered=kb.semaphore(f"c{c}.gathered"))
    cores: list[tuple[_Core, list, Tile | None, Tile, Tile]] = []
    for c, mine in enumerate(by_core):
        if not mine:
            continue
        consts: list[tuple[Tile, Tile]] = []
        cos_row = kb.sram(c, "cos_row", (1, h2), "f32")
        sin_row = kb.sram(c, "sin_row", (1, h2), "f32")
        consts += [(cos_row, cos_h), (sin_row, sin_h)]
        sinks_s = None
        if sinks_h is not None:
            sinks_s = kb.sram(c, "sinks", (hq, 1), "f32")
            consts.append((sinks_s, sinks_h))
        masks_s = None
        if mask_order:
            masks_s = kb.sram(c, "masks", (len(mask_order), plan.tk), "f32")
            consts.append((masks_s, mask.hbm_view(0, 0, len(mask_order), plan.tk)))
        seqs = sorted({bb for bb, _, _ in mine})
        tbl = None
        if ps:
            table = t["block_table"]
            tbl = kb.sram(c, "table", (len(seqs) * pages_per_seq, 1), "i32")
            for i, sq in enumerate(seqs):
                consts.append((tbl.sub(i * pages_per_seq, 0, pages_per_seq, 1),
                               _view(table.hbm_view(sq, 0, 1, pages_per_seq), pages_per_seq, 1)))
        waited: dict[Any, set[Ready]] = {}
        units = []
        for bb, g, i in mine:
            unit = _Unit(heads=hpk, nq=1, q=[], out=[], sink_row=g * hpk, key=(bb, g), sinks=i == 0,
                         q_fetch=q_fetch(bb, g, waited), merge=merges.get((bb, g)), split=i)
            row = bb * hkv + g
            for t0, n in lay.tiles[i]:
                st = _Step(n=n)
                if t0 in lay.mask_rows:
                    st.mask = masks_s.sub(mask_order.index(t0), 0, 1, n)
                if ps:
                    st.idx = tbl.sub(seqs.index(bb) * pages_per_seq + t0 // ps, 0, n // ps, 1)
                    st.k = k_h.sub(0, g * d * ps, n_pages, d * ps)
                    st.v = v_h.sub(0, g * ps * d, n_pages, ps * d)
                    if fp8:
                        st.k_scale = ks_h.sub(0, g * d // 32 * ps, n_pages, d // 32 * ps)
                        st.v_scale = vs_h.sub(0, g * ps // 32 * d, n_pages, ps // 32 * d)
                else:
                    st.k = k_h.sub(row * d, t0, d, n)
                    st.v = v_h.sub(row * cap + t0, 0, n, d)
                    if fp8:
                        st.k_scale = ks_h.sub(row * d // 32, t0, d // 32, n)
                        st.v_scale = vs_h.sub((row * cap + t0) // 32, 0, n // 32, d)
                new = new_rows.get((bb, g)) if t0 <= ctx_len - 1 < t0 + n else None
                if new is None:
                    st.k_waits, st.v_waits = tile_waits(row, t0, n)
                else:  # the keys around the new one from HBM (they wait for nothing written)
                    k_t, v_t, ready, where = new
                    col = ctx_len - 1 - t0
                    st.new = _NewRow(col, k_t, v_t, ready, where == c)
                    kw, vw = [], []
                    for a, z in ((t0, ctx_len - 1), (ctx_len, t0 + n)):
                        if a < z:
                            ka, va = tile_waits(row, a, z - a)
                            kw += ka
                            vw += va
                    st.k_waits, st.v_waits = tuple(dict.fromkeys(kw)), tuple(dict.fromkeys(vw))
                unit.steps.append(st)
            units.append(unit)
        em = _Core(kb, c, plan, units)
        cores.append((em, consts, sinks_s, cos_row, sin_row))

    # The output's ref: HBM rows ready when their store lands, or kept rows ready when written.
    if out.in_hbm:
        ref = out.ref
        if ref.shape != (bsz, hq * d):
            raise InvalidArgumentError(f"attention-decode: out is {list(ref.shape)}, "
                                       f"expected [{bsz}, {hq * d}]")
        for em, *_ in cores:
            for u, unit in enumerate(em.units):
                bb, g = unit.key
                if unit.split == 0:
                    unit.out = [_rows_view(ref.base, bb, g * hpk * d, hpk, d)]
                    ref = ref.with_ready(bb, g * hpk * d, 1, hpk * d, (em.sem["stored"].id, u + 1))
    else:
        # A core's units of one sequence's consecutive KV heads write one contiguous row piece
        # (ready when the last of them is): a consumer of the whole row then copies one piece
        # per core, not one per head group (a DMA set-up round per max_outstanding pieces).
        pieces = []
        for em, *_ in cores:
            runs: list[list[int]] = []
            for u, unit in enumerate(em.units):
                if unit.split:
                    continue
                prev = em.units[runs[-1][-1]].key if runs else None
                if prev is not None and prev[0] == unit.key[0] and prev[1] + 1 == unit.key[1]:
                    runs[-1].append(u)
                else:
                    runs.append([u])
            for run in runs:
                bb, g0 = em.units[run[0]].key
                keep = kb.sram(em.c, f"out{run[0]}", (len(run) * hpk, d), "bf16", keep=True)
                for i, u in enumerate(run):
                    em.units[u].out_keep = keep.sub(i * hpk, 0, hpk, d)
                cols = len(run) * hpk * d
                pieces.append(Piece(bb, g0 * hpk * d, 1, cols, _view(keep, 1, cols), None,
                                    (em.sem["fin"].id, run[-1] + 1)))
        ref = TensorRef.onchip("out", (bsz, hq * d), "bf16", pieces)
    outs = {"out": ref}

    # Prefetch: constants, the queries when they are in HBM from the start, the first KV slots.
    # With splits every core's small loads go first (in program order, hence first in the HBM
    # channels' queues): 64 cores' first KV tiles would otherwise hold up the query rows and
    # with them every matmul by about a microsecond.
    gate_of = {em.c: ((em.sem["consts"], 1) if ps else None) for em, *_ in cores}  # gathers read the table
    prefetched = {em.c: em.prefetchable() for em, *_ in cores}
    early_q = {em.c: static_q and not em.query_loads_wait() for em, *_ in cores}
    for em, consts, *_ in cores:
        em.emit_consts(consts)
        if early_q[em.c]:
            em.emit_query_loads()
        if lay.splits == 1:
            em.emit_loads(gate_of[em.c], gate_of[em.c], 0, prefetched[em.c])
    if lay.splits > 1:
        for em, *_ in cores:
            em.emit_loads(gate_of[em.c], gate_of[em.c], 0, prefetched[em.c])
    yield outs
    for em, _, sinks_s, cos_row, sin_row in cores:
        if not early_q[em.c]:
            em.emit_query_loads()
        em.emit_loads(gate_of[em.c], gate_of[em.c], prefetched[em.c])
        em.emit_mxu()
        em.emit_vpu(sinks_s, cos_row, sin_row)
        em.emit_stores()
    return outs


# --- the stand-alone launch -------------------------------------------------------------------
def build_decode(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """attention-decode stand-alone: its emitter with every tensor in HBM (q and out allocated as
    [batch*q_heads, head_dim], the same bytes as token-major)."""
    lay = decode_layout(shape, spec)
    plan, cap = lay.plan, lay.cap
    bsz, ctx, hq, hkv, d = (shape[k] for k in ("batch", "context", "q_heads", "kv_heads", "head_dim"))
    ps, kvd = shape["page_size"], shape["kv_dtype"]
    fp8 = kvd != "bf16"
    mask_order = lay.mask_order
    pages_per_seq = cap // ps if ps else 0
    n_pages = bsz * pages_per_seq
    pad_k, pad_s = k_pad(spec, kvd), spec.hbm.interleave_bytes

    kb = KernelBuilder(f"attention_decode_b{bsz}_ctx{ctx}", chip=spec)
    ectx = EmitCtx.standalone(kb)

    def token_major(name: str, tile: Tile) -> TensorRef:  # [batch*q_heads, D] as [batch, q_heads*D]
        return TensorRef.hbm(name, Tile(tile.space, tile.core, tile.offset, tile.dtype, bsz, hq * d))

    q_h = kb.hbm("q", (bsz * hq, d), "bf16")
    out_h = kb.hbm("out", (bsz * hq, d), "bf16")
    refs = {"q": token_major("q", q_h),
            "rope_cos": TensorRef.hbm("rope_cos", kb.hbm("rope_cos", (ctx, d // 2), "f32")),
            "rope_sin": TensorRef.hbm("rope_sin", kb.hbm("rope_sin", (ctx, d // 2), "f32"))}
    if plan.sinks:
        refs["sinks"] = TensorRef.hbm("sinks", kb.hbm("sinks", (hq, 1), "f32"))
    mask = None
    if mask_order:
        mask = TensorRef.hbm("mask", ectx.const("mask", _mask_const(lay), "f32"))
    for name, sh, dt in _cache_specs(shape, spec, cap):
        refs[name] = TensorRef.hbm(name, kb.hbm(name, sh, dt))
    run_emitter(emit_decode(ectx, shape, refs, Out.to(token_major("out", out_h)), mask=mask))

    def make_inputs(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        cos, sin = yarn_cos_sin(ctx, d)
        kt = rng.standard_normal((bsz, hkv, d, cap)).astype(np.float32)
        vv = rng.standard_normal((bsz, hkv, cap, d)).astype(np.float32)
        ins: dict[str, Any] = {
            "q": rng.standard_normal((bsz * hq, d)).astype(ml_dtypes.bfloat16),
            "rope_cos": cos, "rope_sin": sin}
        if plan.sinks:
            ins["sinks"] = rng.standard_normal((hq, 1)).astype(np.float32)
        ins.update(ectx.consts)
        if fp8:
            kc, kscale = _quantize_fp8(kt.reshape(bsz * hkv * d, cap))
            vc, vscale = _quantize_fp8(vv.reshape(bsz * hkv * cap, d))
            kc, kscale = kc.reshape(bsz, hkv, d, cap), kscale.reshape(bsz, hkv, d // 32, cap)
            vc, vscale = vc.reshape(bsz, hkv, cap, d), vscale.reshape(bsz, hkv, cap // 32, d)
        else:
            kc, vc = kt.astype(ml_dtypes.bfloat16), vv.astype(ml_dtypes.bfloat16)
        if not ps:
            ins["k_cache"] = np.pad(kc.reshape(-1, cap), ((0, 0), (0, pad_k)))
            ins["v_cache"] = vc.reshape(-1, d)
            if fp8:
                ins["k_cache.scales"] = np.pad(kscale.reshape(-1, cap), ((0, 0), (0, pad_s)))
                ins["v_cache.scales"] = vscale.reshape(-1, d)
            return ins
        table = rng.permutation(n_pages).reshape(bsz, pages_per_seq).astype(np.int32)
        ins["block_table"] = table

        def pool(x, tok_axis, per_page):
            # x: [B, G, a, b] logical; page j of sequence b goes to physical page table[b, j].
            pages = np.split(x, x.shape[tok_axis] // per_page, axis=tok_axis)
            out = np.empty((n_pages, *pages[0].shape[1:]), x.dtype)
            for jj, pg in enumerate(pages):
                out[table[:, jj]] = pg
            return out.reshape(n_pages, -1)

        ins["k_cache"], ins["v_cache"] = pool(kc, 3, ps), pool(vc, 2, ps)
        if fp8:
            ins["k_cache.scales"] = pool(kscale, 3, ps)
            ins["v_cache.scales"] = pool(vscale, 2, ps // 32)
        return ins

    def reference(inputs):
        return {"out": np.asarray(decode_reference(inputs, shape, lay.tiles))}

    notes = {"tile_keys": plan.tk, "kv_tiles_per_unit": sum(len(s) for s in lay.tiles), "units": bsz * hkv,
             "cores": lay.cores, "kv_splits": lay.splits, "kv_slots": plan.nbuf,
             "masked_tiles": len(mask_order)}
    return KernelBuild(program=kb.build(), make_inputs=make_inputs, reference=reference,
                       outputs={"out": ("bf16", (bsz * hq, d))}, tolerance=TOL, notes=notes)


def emit_decode_kernel(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                       outs: dict[str, Out]) -> Emitter:
    """``KernelDef.emit`` of attention-decode."""
    return emit_decode(ctx, shape, t, outs.get("out"))


def _kept_new_rows(caches: dict[str, TensorRef], pairs: list[tuple[int, int]], hkv: int, d: int, cap: int,
                   ctx: int) -> dict[tuple[int, int], tuple[Tile, Tile, Ready, int]]:
    """(sequence, KV head) -> (K^T column [D, 1], V row [1, D], ready, core) of the new token at
    position ``ctx - 1`` where an append keeps both on one core (pieces of the HBM cache refs
    that have a scratchpad tile, ``kv-append`` with ``Out.onchip()``), ready under one condition."""
    k_ref, v_ref = caches["k_cache"], caches["v_cache"]
    if not any(p.tile is not None for p in k_ref.pieces):
        return {}
    out = {}
    for bb, g in pairs:
        row = bb * hkv + g
        k = _onchip_copy(k_ref, row * d, ctx - 1, d, 1)
        v = _onchip_copy(v_ref, row * cap + ctx - 1, 0, 1, d)
        if k is not None and v is not None and k[0].core == v[0].core and k[1] == v[1] and k[1] is not None:
            out[(bb, g)] = (k[0], v[0], k[1], k[0].core)
    return out


def _onchip_copy(ref: TensorRef, r0: int, c0: int, rows: int, cols: int) -> tuple[Tile, Ready | None] | None:
    """(tile, ready) of an on-chip copy of region [r0:r0+rows, c0:c0+cols] of an HBM tensor: a piece
    with a scratchpad tile that covers it; None when no piece does."""
    for k in ref._overlapping(r0, c0, rows, cols):
        p = ref.pieces[k]
        if p.tile is not None and p.covers(r0, c0, rows, cols):
            return p.tile.sub(r0 - p.r0, c0 - p.c0, rows, cols), p.ready
    return None


def _split_cores(units: int, splits: int, cores: int, want: dict[int, int]) -> dict[tuple[int, int], int]:
    """(unit, split) -> core: the last split of unit u on core ``want[u]`` (where the new token's
    rows are) when that core is free, every other split on the free cores in order (without
    ``want``: unit u's split i on core u*splits + i)."""
    placed: dict[tuple[int, int], int] = {}
    for u, c in want.items():
        if c < cores and c not in placed.values():
            placed[u, splits - 1] = c
    free = iter(c for c in range(cores) if c not in set(placed.values()))
    for u in range(units):
        for i in range(splits):
            if (u, i) not in placed:
                placed[u, i] = next(free)
    return placed


# --- references ---------------------------------------------------------------------------------
def decode_logical_cache(inputs, shape) -> tuple[np.ndarray, np.ndarray]:
    """The cache as the model sees it: (K^T float32[B, G, D, cap], V float32[B, G, cap, D]),
    read from the HBM inputs (pools through the block table, FP8 dequantised)."""
    bsz, ctx, hkv, d, ps = (shape[k] for k in ("batch", "context", "kv_heads", "head_dim", "page_size"))
    fp8 = shape["kv_dtype"] != "bf16"
    k, v = (np.asarray(inputs[n]) if fp8 else np.asarray(inputs[n], np.float32)
            for n in ("k_cache", "v_cache"))
    ks, vs = (np.asarray(inputs[f"{n}.scales"]) if fp8 else None for n in ("k_cache", "v_cache"))
    if not ps:
        cap = -(-ctx // 32) * 32
        k = k[:, :cap]  # drop the row padding
        if fp8:
            k, v = _mx_values(k, ks[:, :cap]), _mx_values(v, vs)
        return k.reshape(bsz, hkv, d, cap), v.reshape(bsz, hkv, cap, d)
    table = np.asarray(inputs["block_table"])
    npg = ctx // ps
    kt = np.concatenate([k[table[:, j]].reshape(bsz, hkv, d, ps) for j in range(npg)], axis=3)
    vv = np.concatenate([v[table[:, j]].reshape(bsz, hkv, ps, d) for j in range(npg)], axis=2)
    if fp8:
        kts = np.concatenate([ks[table[:, j]].reshape(bsz, hkv, d // 32, ps) for j in range(npg)], axis=3)
        vvs = np.concatenate([vs[table[:, j]].reshape(bsz, hkv, ps // 32, d) for j in range(npg)], axis=2)
        kt = _mx_values(kt.reshape(-1, ctx), kts.reshape(-1, ctx)).reshape(bsz, hkv, d, ctx)
        vv = _mx_values(vv.reshape(-1, d), vvs.reshape(-1, d)).reshape(bsz, hkv, ctx, d)
    return kt.astype(np.float32), vv.astype(np.float32)


def decode_queries(inputs, shape) -> np.ndarray:
    """float32[B, Hq, D]: the queries rotated at position context-1 and scaled, BF16 values."""
    bsz, ctx, hq, d = (shape[k] for k in ("batch", "context", "q_heads", "head_dim"))
    q = _f32(np.asarray(inputs["q"], np.float32)).reshape(bsz, hq, d)
    cos = _f32(inputs["rope_cos"])[ctx - 1]
    sin = _f32(inputs["rope_sin"])[ctx - 1]
    return np.asarray(_rope_ref(q, cos, sin, 1 / math.sqrt(d)))


def decode_reference(inputs, shape, splits) -> np.ndarray:
    """Pure-JAX decode attention with the kernel's roundings: BF16 values, float32[B*Hq, D].

    Masking comes from positions (keys in [context - window, context) are visible), not from
    the kernel's mask tiles. ``splits``: per KV split, the tiles [(start, n)] its online softmax
    walks (one split: no merge); each split's unnormalised state (the sinks in split 0's) is
    merged in split order as the kernel does (``attention_ref._split_merge_ref``).
    """
    bsz, ctx, hq, hkv, d = (shape[k] for k in ("batch", "context", "q_heads", "kv_heads", "head_dim"))
    w, hpk = shape["window"], hq // hkv
    kt, vv = decode_logical_cache(inputs, shape)
    qr = decode_queries(inputs, shape)
    keys = np.arange(kt.shape[-1])
    valid = (keys < ctx) & (keys >= (ctx - w if w else 0))
    valid = np.broadcast_to(valid, (hpk, len(keys)))
    sinks = None
    if shape["sinks"]:
        sinks = _f32(np.broadcast_to(np.asarray(inputs["sinks"], np.float32).reshape(1, hkv, hpk),
                                     (bsz, hkv, hpk)))
    args = (_f32(qr.reshape(bsz, hkv, hpk, d)), _f32(kt), _f32(vv), valid)
    parts = [_flash_partial_jit(*args, tuple(tiles), sinks if i == 0 else None)
             for i, tiles in enumerate(splits)]
    return np.asarray(_split_merge_ref(parts)).reshape(bsz * hq, d)


_flash_partial_jit = lazy_jit(_flash_partial, static_argnames="tiles")
