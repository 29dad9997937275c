"""Flash attention on the emulated die: ``attention-decode`` and ``attention-prefill``.

Both kernels run the same per-core engine, flash-style: a *unit* is a block of query rows that
share one KV head (decode: the ``q_heads / kv_heads`` heads of one sequence's KV group, one token
each; prefill: those heads times a tile of ``T`` query tokens, stacked head by head), and a unit
walks its KV tiles with an online softmax (running row max ``m`` and sum ``l``, output ``O``
rescaled by ``alpha = exp(m_old - m_new)``), so no score matrix larger than one tile ever exists.
Each KV tile is loaded once per KV head and multiplied against all of that head's query rows at
once (grouped-query attention costs the KV bytes of ``kv_heads`` heads, not ``q_heads``).

Per KV tile ``j`` of ``n`` tokens (R query rows, head_dim D)::

    S   = Q @ K^T[:, tile]                mxu, BF16 operands (or MXFP8 K), FP32 accumulators
    s   = acc_read(S) (+ mask)            vpu: mask is an additive 0 / -1e30 tile from HBM
    m'  = max(m, rowmax(s))               (first tile: rowmax, or max with the sink logit)
    a   = exp(m - m')                     (first tile with sinks: exp(sink - m'))
    p   = bf16(exp(s - m'))               P is rounded to BF16 for the P.V matmul
    l   = l * a + rowsum(p)               (first tile: rowsum(p), plus a with sinks)
    O   = O * a + acc_read(p @ V[tile])   (first tile: O = acc_read(p @ V))
    out = bf16(O * recip(l))              after the last tile

Engines overlap: DMA queues stream K and V tiles into ``nbuf`` slots; the matrix unit runs
S(j+1) while the vector unit does the softmax of tile j, and P.V(j) right after; the vector unit
then folds P.V(j-1) into O. Streams are spread over the DMA queues (a design from when a
``sem.signal`` stalled its queue; signals now land without stalling, and the spread still
interleaves the streams over the pseudo-channels): decode (whose few units per core
keep their queries and outputs in private buffers) loads every query up front on queue 2 and
stores every output at the end of queue 3, and streams K on queues 0 and 2 and V on 1 and 3,
alternating tiles; prefill (query and output rings, vector-bound) streams K on 0 and V on 1,
queries on 2, stores on 3. Units go to cores in contiguous blocks (decode: a sequence's KV heads
together) or longest-first (prefill: causal units differ in length).

Layouts (HBM, all row-major):

- ``q`` (decode): [batch*q_heads, head_dim] BF16, row ``b*q_heads + h``; ``out`` the same.
  The query is rotated here (RoPE at position ``context - 1``) and scaled by 1/sqrt(head_dim)
  before its BF16 rounding. The cache holds keys already rotated (as prefill writes them).
- KV cache, ``page_size`` 0 (contiguous): ``k_cache`` [batch*kv_heads*head_dim, cap], K
  *transposed* per (sequence, KV head), so a tile is directly the matmul's [K=D, N=n] operand;
  ``v_cache`` [batch*kv_heads*cap, head_dim]. ``cap`` is ``context`` rounded up to 32 tokens
  (the tail is masked). K^T rows are padded by one HBM interleave granule (256 B: 128 BF16
  elements) so that the rows of a K tile spread over the pseudo-channels.
- Paged (``page_size`` > 0): ``block_table`` [batch, context/page_size] int32 of physical page
  numbers; ``k_cache`` [pages, kv_heads*head_dim*page_size] (each KV head's page is a
  [head_dim, page_size] K^T block); ``v_cache`` [pages, kv_heads*page_size*head_dim] (each a
  [page_size, head_dim] block). One ``dma.gather`` per tile fetches its pages by the table
  (indices are data: the program never reads them); S is one matmul per page, P.V one per tile.
- ``kv_dtype`` fp8e4: MXFP8 E4M3 codes with E8M0 scales in ``k_cache.scales`` / ``v_cache.scales``,
  blocked by 32 along each matmul's contraction: K along head_dim (scales [.., head_dim/32, ..]),
  V along tokens (scales per 32 tokens per head_dim column). Q and P stay BF16 (the mixed
  BF16 x MXFP8 matmul runs at the BF16 rate), so FP8 halves the KV bytes.
- Prefill runs on a chunk of ``seq`` new tokens per sequence after ``prior`` tokens already in
  the cache (chunked prefill; ``prior`` 0 is a whole prompt). The chunk's ``q`` [batch*seq,
  q_heads*head_dim] and ``v`` [batch*seq, kv_heads*head_dim], and its keys ``k`` transposed per
  KV head [batch*kv_heads*head_dim, seq] (the K projection writes them so by computing
  W_k^T X^T), not yet rotated. ``k_cache`` / ``v_cache`` are decode's contiguous BF16 cache
  (above) with ``cap`` = shape key ``capacity`` (0: prior+seq rounded up to 32): inputs whose
  positions 0..prior-1 hold the prior context (keys rotated), and outputs: a first phase
  rotates the chunk's K^T into columns prior..prior+seq-1 and copies its V rows into rows
  prior..prior+seq-1; nothing else in them changes. So the next chunk takes them as they are,
  and attention-decode at context c reads them when ``capacity`` is c rounded up to 32 (its
  ``cap``; the decode token's own K and V are appended by kv-append). The attention phase reads
  K tiles from ``k_cache`` (the prior context's at once, the chunk's once the first phase has
  written them) and V tiles from ``v_cache`` for the prior context and from ``v`` for the
  chunk's own keys, so V never waits for the copy. Query tile i (positions prior + i*T..)
  walks the T-token key tiles of absolute positions that meet its rows' causal windows: with a
  sliding window the prior context out of reach is never read. RoPE tables by position:
  ``rope_cos`` / ``rope_sin`` [prior+seq, head_dim/2] (rows prior.. rotate q) and their
  transposes ``rope_cos_t`` / ``rope_sin_t`` [head_dim/2, prior+seq] (for K^T).

Small scratchpads (GPU presets: 228 KiB of shared memory per SM; 160 and 64 KiB tried too).
The tilings above are tried first and kept whenever they fit (so the jalapeno-v1 and tiny
programs do not change); only when none fits:

- decode keeps a query/output ring of two (instead of every unit's) and 6..2 KV slots, the
  largest KV tile first;
- prefill takes the *lean* path: a unit holds a slice of ``hs`` of its KV group's query heads
  (``hs`` divides q_heads/kv_heads), so the group's KV tiles are read once per slice, as
  FlashAttention reads them once per query head; one query/output/RoPE-table buffer per core
  (the next unit's queries load when the current one's are rotated), RoPE temporaries of one
  head's rows, and phase 1 in 32-token chunks. Candidates (hs, T) are tried fewest (unit, KV
  tile) pairs first, i.e. largest hs*T^2, each with the most KV slots that fit (6, 4, 3, 2;
  gpt-oss on b200/h200: hs 2, T 32, 4 slots: 4 slots take 33 us where 2 take 50, tp=8 2k).
  Rows of the online softmax are independent, so the outputs are bit-identical to the
  whole-group tiling's.

RoPE follows gpt-oss: rotate-half (first and second half of head_dim, done on sub-tiles) with
YaRN-scaled frequencies and the concentration factor applied to cos and sin
(``yarn_cos_sin``); the tables are computed on the host per position, FP32, kept in HBM.
Sinks follow gpt-oss: one logit per query head joins the softmax denominator only.

What bounds them: decode moves 2*head_dim*context bytes per (sequence, KV head) and does
2*(q_heads/kv_heads) MACs per byte, far below the matrix unit's balance point, so it is HBM-bound
at large batch and context (the matrix unit, padded to 128 rows for 8 query rows, sits near 80 %
busy beside it); prefill is bound by the vector unit's exp (128 elements per cycle per core).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu.program import Tile
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.table import DTYPES

from .attention_engine import (
    _BF16,
    _DECODE_TILES,
    _MAX_RING,
    _NBUF,
    _PREFILL_TILES,
    _SRAM_SHARE,
    _assign,
    _Core,
    _fits,
    _Plan,
    _sram_left,
    _Step,
    _Unit,
    _view,
)
from .attention_ref import (
    MASK_VALUE,
    YARN_GPT_OSS,
    _f32,
    _flash_ref,
    _flash_ref_jit,
    _mx_values,
    _quantize_fp8,
    _rope_ref,
    naive_attention,
    yarn_cos_sin,
)
from .base import KernelBuild, KernelDef, ShapeKey, Tolerance
from .registry import register

__all__ = [
    "ATTENTION_DECODE",
    "ATTENTION_PREFILL",
    "MASK_VALUE",
    "YARN_GPT_OSS",
    "decode_reference",
    "naive_attention",
    "prefill_reference",
    "yarn_cos_sin",
]

# --- shape checks shared by both kernels ----------------------------------------------------
def _check_common(shape: dict[str, Any]) -> None:
    hq, hkv, d, w = shape["q_heads"], shape["kv_heads"], shape["head_dim"], shape["window"]
    if hq % hkv:
        raise InvalidArgumentError(f"shape key q_heads={hq} must be a multiple of kv_heads={hkv} "
                                   "(grouped-query attention)")
    if d % 32:
        raise InvalidArgumentError(f"shape key head_dim={d} must be a multiple of 32: Q.K^T "
                                   "contracts over head_dim in 32-element matrix-unit blocks")
    if w < 0:
        raise InvalidArgumentError(f"shape key window={w} must be >= 0 (0: full attention)")


def _k_pad(spec: ChipSpec, kv_dtype: str) -> int:
    """Elements of padding after each K^T cache row: one HBM interleave granule (see the module doc)."""
    return spec.hbm.interleave_bytes * 8 // DTYPES[kv_dtype].bits


# --- attention-decode ---------------------------------------------------------------------------
_DECODE_LEAN_SLOTS = (6, 5, 4, 3, 2)  # KV slots of the small-scratchpad path


def _decode_tiles(lo: int, cap: int, tk: int, align: int) -> list[tuple[int, int]]:
    """KV tiles (start, n) covering [lo, cap): from lo rounded down to ``align``, ``tk`` at a time."""
    start = lo // align * align
    return [(t0, min(tk, cap - t0)) for t0 in range(start, cap, tk)]


def _decode_plan(shape: dict[str, Any], spec: ChipSpec) -> tuple[_Plan, int]:
    b, ctx, hq, hkv, d = (shape[k] for k in ("batch", "context", "q_heads", "kv_heads", "head_dim"))
    ps, kvd = shape["page_size"], shape["kv_dtype"]
    _check_common(shape)
    if ps < 0:
        raise InvalidArgumentError(f"shape key page_size={ps} must be >= 0 (0: contiguous cache)")
    if ps:
        if ps % 32:
            raise InvalidArgumentError(f"shape key page_size={ps} must be a multiple of 32: "
                                       "P.V contracts over tokens in 32-token matrix-unit blocks")
        if ctx % ps:
            raise InvalidArgumentError(f"shape key page_size={ps} must divide context={ctx}")
    cap = ctx if ps else -(-ctx // 32) * 32
    span = cap - (max(0, ctx - shape["window"]) // 32 * 32 if shape["window"] else 0)
    units = -(-b * hkv // spec.core.count)
    align = ps or 32
    wide = -(-span // align) * align  # no point in tiles wider than the keys a unit sees
    cands = [tk for tk in _DECODE_TILES if tk % align == 0 and tk <= max(wide, align)]
    # Six KV slots and every unit's query and output kept, the largest tile first; on small
    # scratchpads (GPU shared memory) a query/output ring of two, the largest tile first, then
    # the most slots. (Measured on b200 at 64 KiB, gpt-oss tp=8, batch 256, context 2048: 2
    # slots of 64 keys take 53 us, 4 slots of 32 keys 62 us: each tile's fixed instruction costs
    # outweigh the extra bytes in flight.)
    ring = units if 2 < units <= _MAX_RING else 2
    tries = [(tk, _NBUF, ring) for tk in cands or [align]]
    tries += [(tk, nbuf, 2) for tk in cands or [align] for nbuf in _DECODE_LEAN_SLOTS]
    for tk, nbuf, rg in tries:
        plan = _Plan(hpk=hq // hkv, d=d, tk=tk, nq_max=1, nbuf=nbuf, kv_dtype=kvd,
                     sinks=shape["sinks"], scale=1 / math.sqrt(d), page_size=ps, ring=rg)
        consts = 4 * hq + 2 * 4 * tk + 4 * d + (4 * units * (cap // ps) if ps else 0) + 1024
        if _fits(plan, spec, consts):
            return plan, cap
    raise InvalidArgumentError(
        f"shape key head_dim={d} with q_heads/kv_heads={hq // hkv}"
        + (f" and page_size={ps}" if ps else "")
        + f": one {align}-token KV tile does not fit {spec.name}'s {spec.sram.scratchpad_bytes:,} B "
        f"scratchpad ({_DECODE_LEAN_SLOTS[-1]} slots in flight) or {spec.sram.accumulator_bytes:,} B "
        "of accumulators")


def build_decode(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """attention-decode: one new token per sequence against a KV cache (see the module doc)."""
    plan, cap = _decode_plan(shape, spec)
    bsz, ctx, hq, hkv, d = (shape[k] for k in ("batch", "context", "q_heads", "kv_heads", "head_dim"))
    w, ps, kvd, hpk = shape["window"], shape["page_size"], shape["kv_dtype"], plan.hpk
    fp8 = kvd != "bf16"
    lo = max(0, ctx - w) if w else 0
    tiles = _decode_tiles(lo, cap, plan.tk, ps or 32)
    # Host masks: the tile holding the window's first key, and the tile holding the padding.
    mask_rows: dict[int, np.ndarray] = {}
    for t0, n in tiles:
        cols = np.arange(t0, t0 + n)
        ok = (cols >= lo) & (cols < ctx)
        if not ok.all():
            row = np.zeros(plan.tk, np.float32)
            row[:n] = np.where(ok, 0, MASK_VALUE)
            mask_rows[t0] = row
    mask_order = sorted(mask_rows)
    pages_per_seq = cap // ps if ps else 0
    pad_k = _k_pad(spec, kvd)  # K^T row padding, elements
    pad_s = spec.hbm.interleave_bytes  # of the E8M0 scale rows
    n_pages = bsz * pages_per_seq

    kb = KernelBuilder(f"attention_decode_b{bsz}_ctx{ctx}", chip=spec)
    q_h = kb.hbm("q", (bsz * hq, d), "bf16")
    out_h = kb.hbm("out", (bsz * hq, d), "bf16")
    cos_h, sin_h = kb.hbm("rope_cos", (ctx, d // 2), "f32"), kb.hbm("rope_sin", (ctx, d // 2), "f32")
    sinks_h = kb.hbm("sinks", (hq, 1), "f32") if plan.sinks else None
    mask_h = kb.hbm("mask", (len(mask_order), plan.tk), "f32") if mask_order else None
    if ps:
        table_h = kb.hbm("block_table", (bsz, pages_per_seq), "i32")
        k_h = kb.hbm("k_cache", (n_pages, hkv * d * ps), kvd)
        v_h = kb.hbm("v_cache", (n_pages, hkv * ps * d), kvd)
        if fp8:
            ks_h = kb.hbm("k_cache.scales", (n_pages, hkv * d // 32 * ps), "e8m0")
            vs_h = kb.hbm("v_cache.scales", (n_pages, hkv * ps // 32 * d), "e8m0")
    else:
        # K^T rows are padded by one interleave granule: a row stride that is a multiple of the
        # channel round would put every row of a K tile on the same few pseudo-channels.
        k_h = kb.hbm("k_cache", (bsz * hkv * d, cap + pad_k), kvd)
        v_h = kb.hbm("v_cache", (bsz * hkv * cap, d), kvd)
        if fp8:
            ks_h = kb.hbm("k_cache.scales", (bsz * hkv * d // 32, cap + pad_s), "e8m0")
            vs_h = kb.hbm("v_cache.scales", (bsz * hkv * cap // 32, d), "e8m0")

    units = [_Unit(heads=hpk, nq=1, q=[q_h.sub(bb * hq + g * hpk, 0, hpk, d)],
                   out=[out_h.sub(bb * hq + g * hpk, 0, hpk, d)], sink_row=g * hpk, key=(bb, g))
             for bb in range(bsz) for g in range(hkv)]
    cores = min(spec.core.count, len(units))
    chunk = -(-len(units) // cores)
    for c in range(cores):
        mine = units[c * chunk:(c + 1) * chunk]
        if not mine:
            continue
        consts: list[tuple[Tile, Tile]] = []
        cos_row = kb.sram(c, "cos_row", (1, d // 2), "f32")
        sin_row = kb.sram(c, "sin_row", (1, d // 2), "f32")
        consts += [(cos_row, cos_h.sub(ctx - 1, 0, 1, d // 2)), (sin_row, sin_h.sub(ctx - 1, 0, 1, d // 2))]
        sinks_s = None
        if sinks_h is not None:
            sinks_s = kb.sram(c, "sinks", (hq, 1), "f32")
            consts.append((sinks_s, sinks_h))
        masks_s = None
        if mask_h is not None:
            masks_s = kb.sram(c, "masks", (len(mask_order), plan.tk), "f32")
            consts.append((masks_s, mask_h))
        seqs = sorted({u.key[0] for u in mine})
        if ps:
            tbl = kb.sram(c, "table", (len(seqs) * pages_per_seq, 1), "i32")
            for i, sq in enumerate(seqs):
                consts.append((tbl.sub(i * pages_per_seq, 0, pages_per_seq, 1),
                               _view(table_h.sub(sq, 0, 1, pages_per_seq), pages_per_seq, 1)))
        for unit in mine:
            bb, g = unit.key
            for t0, n in tiles:
                st = _Step(n=n)
                if t0 in mask_rows:
                    st.mask = masks_s.sub(mask_order.index(t0), 0, 1, n)
                if ps:
                    st.idx = tbl.sub(seqs.index(bb) * pages_per_seq + t0 // ps, 0, n // ps, 1)
                    st.k = k_h.sub(0, g * d * ps, n_pages, d * ps)
                    st.v = v_h.sub(0, g * ps * d, n_pages, ps * d)
                    if fp8:
                        st.k_scale = ks_h.sub(0, g * d // 32 * ps, n_pages, d // 32 * ps)
                        st.v_scale = vs_h.sub(0, g * ps // 32 * d, n_pages, ps // 32 * d)
                else:
                    row = bb * hkv + g
                    st.k = k_h.sub(row * d, t0, d, n)
                    st.v = v_h.sub(row * cap + t0, 0, n, d)
                    if fp8:
                        st.k_scale = ks_h.sub(row * d // 32, t0, d // 32, n)
                        st.v_scale = vs_h.sub((row * cap + t0) // 32, 0, n // 32, d)
                unit.steps.append(st)
        em = _Core(kb, c, plan, mine)
        em.emit_queries(consts)
        gate = (em.sem["consts"], 1) if ps else None  # the gathers read the block table
        em.emit_loads(gate, gate)
        em.emit_mxu()
        em.emit_vpu(sinks_s, cos_row, sin_row)
        em.emit_stores()

    def make_inputs(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        cos, sin = yarn_cos_sin(ctx, d)
        kt = rng.standard_normal((bsz, hkv, d, cap)).astype(np.float32)
        vv = rng.standard_normal((bsz, hkv, cap, d)).astype(np.float32)
        ins: dict[str, Any] = {
            "q": rng.standard_normal((bsz * hq, d)).astype(_BF16), "rope_cos": cos, "rope_sin": sin}
        if plan.sinks:
            ins["sinks"] = rng.standard_normal((hq, 1)).astype(np.float32)
        if mask_order:
            ins["mask"] = np.stack([mask_rows[t] for t in mask_order])
        if fp8:
            kc, kscale = _quantize_fp8(kt.reshape(bsz * hkv * d, cap))
            vc, vscale = _quantize_fp8(vv.reshape(bsz * hkv * cap, d))
            kc, kscale = kc.reshape(bsz, hkv, d, cap), kscale.reshape(bsz, hkv, d // 32, cap)
            vc, vscale = vc.reshape(bsz, hkv, cap, d), vscale.reshape(bsz, hkv, cap // 32, d)
        else:
            kc, vc = kt.astype(_BF16), vv.astype(_BF16)
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
        return {"out": np.asarray(decode_reference(inputs, shape, tiles))}

    notes = {"tile_keys": plan.tk, "kv_tiles_per_unit": len(tiles), "units": len(units),
             "cores": cores, "kv_slots": plan.nbuf, "masked_tiles": len(mask_order)}
    return KernelBuild(program=kb.build(), make_inputs=make_inputs, reference=reference,
                       outputs={"out": ("bf16", (bsz * hq, d))}, tolerance=_TOL, notes=notes)


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


def decode_reference(inputs, shape, tiles) -> np.ndarray:
    """Pure-JAX decode attention with the kernel's roundings: BF16 values, float32[B*Hq, D].

    Masking comes from positions (keys in [context - window, context) are visible), not from
    the kernel's mask tiles; ``tiles`` [(start, n)] is the KV tiling the online softmax walks.
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
    out = _flash_ref_jit(_f32(qr.reshape(bsz, hkv, hpk, d)), _f32(kt), _f32(vv), valid, tuple(tiles), sinks)
    out = np.asarray(out)
    return out.reshape(bsz * hq, d)


_TOL = Tolerance(
    atol=2e-3, rtol=2.0**-7,
    why="the matrix unit sums each 32-element block in order and XLA's dot does not, and the "
        "vector unit's row sums run in column order: scores and sums differ in the last FP32 "
        "bits, which can flip a BF16 rounding of P or of the output (one BF16 ulp, 2^-8 relative)")


_COMMON_KEYS = (
    ShapeKey("q_heads", int, 4, "query heads (gpt-oss-120b: 64)", minimum=1),
    ShapeKey("kv_heads", int, 2, "KV heads; q_heads must be a multiple (gpt-oss-120b: 8)", minimum=1),
    ShapeKey("head_dim", int, 64, "head dimension, a multiple of 32 (gpt-oss-120b: 64)", minimum=32),
    ShapeKey("window", int, 0, "sliding window in tokens, 0 = full (gpt-oss sliding layers: 128)"),
    ShapeKey("sinks", bool, True, "one learned sink logit per query head (gpt-oss)"),
    ShapeKey("kv_dtype", str, "bf16", "KV cache element type; fp8e4 = MXFP8 E4M3, 32-blocks",
             choices=("bf16", "fp8e4")),
)

ATTENTION_DECODE = register(KernelDef(
    name="attention-decode",
    doc="Flash decode attention: one query token per sequence against a (paged, BF16 or MXFP8) "
        "KV cache; GQA, sliding window, sinks, YaRN RoPE on q.",
    shape_keys=(
        ShapeKey("batch", int, 2, "sequences, one new token each", minimum=1),
        ShapeKey("context", int, 256, "tokens in each sequence's cache, the new one included",
                 minimum=1),
        *_COMMON_KEYS,
        ShapeKey("page_size", int, 0, "tokens per KV page, a multiple of 32 dividing context; "
                 "0 = contiguous cache"),
    ),
    build=build_decode,
))


# --- attention-prefill --------------------------------------------------------------------------
def _prefill_cap(shape: dict[str, Any]) -> int:
    """Cache capacity in tokens: ``capacity``, or prior+seq rounded up to 32 (decode's ``cap``)."""
    seq, prior, capacity = shape["seq"], shape["prior"], shape["capacity"]
    if prior < 0:
        raise InvalidArgumentError(f"shape key prior={prior} must be >= 0 (tokens already in the cache)")
    if capacity == 0:
        return -(-(prior + seq) // 32) * 32
    if capacity % 32 or capacity < prior + seq:
        raise InvalidArgumentError(
            f"shape key capacity={capacity} must be a multiple of 32 and >= prior+seq={prior + seq} "
            "(0: prior+seq rounded up to 32)")
    return capacity


_PREFILL_LEAN_SLOTS = (_NBUF, 4, 3, 2)  # KV slots of prefill's lean path, most first
_PrefillTiles = dict[int, list[tuple[int, int, int | None]]]  # query tile -> [(k0, n, delta or None)]


def _prefill_tiles(seq: int, prior: int, t: int, w: int) -> tuple[_PrefillTiles, dict[int, np.ndarray]]:
    """The key tiles each query tile visits, and the mask patterns of the partly visible ones.

    Query tile ``qi`` holds the chunk's tokens qi*t.. (positions prior+qi*t..); key tiles are the
    t-token tiles of absolute positions kj*t.. up to prior+seq rounded up to 32 (keys past that
    are never visible). A key tile is visited when it meets [first visible key, last query] of
    the query tile (the union of its rows' windows, contiguous), so a window skips the prior
    context it does not reach. A partly visible tile adds the [t, t] mask pattern of
    ``delta = qi - kj``: query minus key position is prior + delta*t + row - col, nothing else.
    """
    end = -(-(prior + seq) // 32) * 32
    tiles: _PrefillTiles = {}
    patterns: dict[int, np.ndarray] = {}
    for qi in range(-(-seq // t)):
        a, nq = prior + qi * t, min(t, seq - qi * t)  # first query position, query rows
        lo = max(0, a - w + 1) if w else 0
        lst = []
        for kj in range(lo // t, (a + nq - 1) // t + 1):
            k0, nk = kj * t, min(t, end - kj * t)
            delta = None
            if not (k0 + nk - 1 <= a and (not w or k0 >= a + nq - w)):  # not every key visible
                delta = qi - kj
                if delta not in patterns:
                    patterns[delta] = np.where(_prefill_valid(prior + delta * t, 0, t, t, w), 0,
                                               MASK_VALUE).astype(np.float32)
            lst.append((k0, nk, delta))
        tiles[qi] = lst
    return tiles, patterns


@dataclass(frozen=True)
class _PrefillLayout:
    """Static choices of one attention-prefill instance.

    plan: the engine's sizes (``plan.hpk``: query heads per unit, all of a KV group's or, on
    small scratchpads, a slice of them); cap: cache capacity (tokens); tiles: key tiles per query
    tile; patterns: mask pattern per delta; v_slots: phase-1 V staging buffers per core;
    p1_tokens: tokens per phase-1 chunk.
    """

    plan: _Plan
    cap: int
    tiles: _PrefillTiles
    patterns: dict[int, np.ndarray]
    v_slots: int
    p1_tokens: int


def _prefill_extra_bytes(hq: int, d: int, t: int, p1_tokens: int, n_patterns: int) -> int:
    """Scratchpad bytes per core besides the engine's buffers: sinks, [t, t] FP32 mask patterns,
    phase-1 buffers (two slots of K^T in/out and V in BF16 and of cos and sin in FP32, two FP32
    temporaries, ``p1_tokens`` wide)."""
    w1 = p1_tokens
    return (4 * hq + n_patterns * 4 * t * t + 2 * (3 * 2 * d * w1 + 2 * 4 * (d // 2) * w1)
            + 2 * 4 * (d // 2) * w1 + 1024)


def _lean_candidates(hpk: int, seq: int) -> list[tuple[int, int]]:
    """(query heads per unit, tile tokens) of the small-scratchpad path, best first: a unit's
    heads divide the KV group's ``hpk``; the (unit, KV tile) pairs, each a fixed cost of
    instructions and a KV tile load, scale as 1/(heads * t^2), so the fewest come first."""
    heads = [h for h in range(hpk, 0, -1) if hpk % h == 0]
    ts = [t for t in _PREFILL_TILES if t <= max(32, seq)]
    return sorted(((h, t) for h in heads for t in ts), key=lambda ht: (-ht[0] * ht[1] ** 2, -ht[0]))


def _prefill_layout(shape: dict[str, Any], spec: ChipSpec, cap: int, hs: int, t: int, nbuf: int,
                    lean: bool) -> _PrefillLayout | None:
    """The layout with ``hs`` query heads and ``t`` tokens per unit, ``nbuf`` KV slots; None
    when it does not fit the scratchpad or the accumulators."""
    bsz, seq, hq, hkv, d = (shape[k] for k in ("batch", "seq", "q_heads", "kv_heads", "head_dim"))
    tiles, patterns = _prefill_tiles(seq, shape["prior"], t, shape["window"])
    # The lean path writes the cache in 32-token chunks: its buffers do not grow with t.
    p1 = 32 if lean else t
    chunks = bsz * hkv * -(-seq // p1)
    chunks_per_core = -(-chunks // min(spec.core.count, chunks))
    plan = _Plan(hpk=hs, d=d, tk=t, nq_max=t, nbuf=nbuf, kv_dtype="bf16", sinks=shape["sinks"],
                 scale=1 / math.sqrt(d), page_size=0, ring=1 if lean else 2, lean=lean)
    extra = _prefill_extra_bytes(hq, d, t, p1, len(patterns))
    if not _fits(plan, spec, extra):
        return None
    # Spare scratchpad stages more of a core's V chunks at once: a slot is free again only when
    # its store has landed, a load-store round trip per reuse.
    spare = _sram_left(plan, spec, extra) // (2 * d * p1)
    return _PrefillLayout(plan, cap, tiles, patterns, max(1, min(chunks_per_core, 2 + spare)), p1)


def _prefill_plan(shape: dict[str, Any], spec: ChipSpec) -> _PrefillLayout:
    """The largest query/key tile that fits, and what goes with it; refuses impossible shapes.

    First every head of a KV group per unit (one KV tile load serves them all), the largest
    tile first; when not even 32 tokens of them fit (GPU shared memory), the lean path: fewer
    heads per unit (the group's KV tiles are read once per slice of heads) and leaner buffers.
    """
    _check_common(shape)
    seq, hq, hkv, d = (shape[k] for k in ("seq", "q_heads", "kv_heads", "head_dim"))
    if shape["kv_dtype"] != "bf16":
        raise InvalidArgumentError(
            f"shape key kv_dtype={shape['kv_dtype']!r}: prefill reads and writes a BF16 KV cache "
            "(an MXFP8 cache is implemented for decode only)")
    if seq % 32:
        raise InvalidArgumentError(f"shape key seq={seq} must be a multiple of 32: P.V contracts "
                                   "over keys in 32-token matrix-unit blocks (pad the prompt)")
    cap, hpk = _prefill_cap(shape), hq // hkv
    for t in _PREFILL_TILES:
        if t > max(32, seq):
            continue
        for nbuf in (_NBUF, 2):  # prefill is vector-bound: two KV slots in flight are enough
            lay = _prefill_layout(shape, spec, cap, hpk, t, nbuf, lean=False)
            if lay is not None:
                return lay
    for hs, t in _lean_candidates(hpk, seq):
        for nbuf in _PREFILL_LEAN_SLOTS:
            lay = _prefill_layout(shape, spec, cap, hs, t, nbuf, lean=True)
            if lay is not None:
                return lay
    smallest = _Plan(hpk=1, d=d, tk=32, nq_max=32, nbuf=2, kv_dtype="bf16", sinks=shape["sinks"],
                     scale=1.0, page_size=0, ring=1, lean=True)
    n_patterns = len(_prefill_tiles(seq, shape["prior"], 32, shape["window"])[1])
    need = int(_SRAM_SHARE * spec.sram.scratchpad_bytes) - _sram_left(
        smallest, spec, _prefill_extra_bytes(hq, d, 32, 32, n_patterns))
    raise InvalidArgumentError(
        f"shape key head_dim={d} (q_heads/kv_heads={hpk}, window={shape['window']}): one 32-token "
        f"query tile of a single head needs {need:,} B of scratchpad per core and "
        f"{smallest.acc_bytes():,} B of accumulators; {spec.name} has {spec.sram.scratchpad_bytes:,} B "
        f"({int(_SRAM_SHARE * spec.sram.scratchpad_bytes):,} B usable) and "
        f"{spec.sram.accumulator_bytes:,} B")


def _prefill_valid(q0: int, k0: int, nq: int, nk: int, w: int) -> np.ndarray:
    """bool[nq, nk]: query position q0+i sees key k0+c (causal, within the window)."""
    qp = np.arange(q0, q0 + nq)[:, None]
    kp = np.arange(k0, k0 + nk)[None, :]
    ok = kp <= qp
    if w:
        ok &= kp > qp - w
    return ok


def _emit_cache_writes(kb: KernelBuilder, spec: ChipSpec, shape: dict[str, Any], lay: _PrefillLayout,
                       hbm: dict[str, Tile]) -> tuple[Any, int]:
    """Phase 1: rotate the chunk's K^T into k_cache columns prior.. and copy its V rows into
    v_cache rows prior.., in (sequence, KV head, t-token) chunks spread over the cores.

    Per core: queue 0 loads K^T and the transposed cos/sin (two slots), queue 1 loads V
    (``lay.v_slots`` slots), the vector unit rotates, queue 3 stores both. Returns (semaphore,
    value): signalled once per core after its last store, so (sem, cores) means the whole chunk
    is in the cache.
    """
    t, cap, nv = lay.p1_tokens, lay.cap, lay.v_slots
    bsz, seq, prior, hkv, d = (shape[k] for k in ("batch", "seq", "prior", "kv_heads", "head_dim"))
    h2 = d // 2
    chunks = [(row, c0, min(t, seq - c0)) for row in range(bsz * hkv) for c0 in range(0, seq, t)]
    p1_cores = min(spec.core.count, len(chunks))
    written = kb.semaphore("cache_written")
    for c in range(p1_cores):
        core = kb.core(c)
        mine = chunks[c::p1_cores]
        kin = [kb.sram(c, f"p1k{s}", (d, t), "bf16") for s in range(2)]
        kout = [kb.sram(c, f"p1o{s}", (d, t), "bf16") for s in range(2)]
        vin = [kb.sram(c, f"p1v{s}", (t, d), "bf16") for s in range(min(nv, len(mine)))]
        cs = [kb.sram(c, f"p1c{s}", (h2, t), "f32") for s in range(2)]
        sn = [kb.sram(c, f"p1s{s}", (h2, t), "f32") for s in range(2)]
        tmp = [kb.sram(c, f"p1t{s}", (h2, t), "f32") for s in range(2)]
        loaded, vloaded, roped, stored, vstored = (
            kb.semaphore(f"c{c}.p1{n}") for n in ("loaded", "vloaded", "roped", "stored", "vstored"))
        ld, vld, vpu, st = core.dma[0], core.dma[1], core.vpu, core.dma[3]
        for i, (row, c0, n) in enumerate(mine):
            s, bb, g = i % 2, row // hkv, row % hkv
            if i >= 2:
                ld.wait(roped, i - 1)
            if i >= nv:
                vld.wait(vstored, i - nv + 1)
            ld.load(kin[s].sub(0, 0, d, n), hbm["k"].sub(row * d, c0, d, n))
            ld.load(cs[s].sub(0, 0, h2, n), hbm["rope_cos_t"].sub(0, prior + c0, h2, n))
            ld.load(sn[s].sub(0, 0, h2, n), hbm["rope_sin_t"].sub(0, prior + c0, h2, n))
            ld.signal(loaded)
            vld.load(vin[i % nv].sub(0, 0, n, d), hbm["v"].sub(bb * seq + c0, g * d, n, d))
            vld.signal(vloaded)
            vpu.wait(loaded, i + 1)
            if i >= 2:
                vpu.wait(stored, i - 1)
            x1, x2 = kin[s].sub(0, 0, h2, n), kin[s].sub(h2, 0, h2, n)
            c_, s_ = cs[s].sub(0, 0, h2, n), sn[s].sub(0, 0, h2, n)
            t1, t2 = tmp[0].sub(0, 0, h2, n), tmp[1].sub(0, 0, h2, n)
            vpu.mul(t1, x1, c_)
            vpu.mul(t2, x2, s_)
            vpu.sub(kout[s].sub(0, 0, h2, n), t1, t2)
            vpu.mul(t1, x2, c_)
            vpu.mul(t2, x1, s_)
            vpu.add(kout[s].sub(h2, 0, h2, n), t1, t2)
            vpu.signal(roped)
            st.wait(roped, i + 1)
            st.store(hbm["k_cache"].sub(row * d, prior + c0, d, n), kout[s].sub(0, 0, d, n))
            st.signal(stored)
        st.signal(written)
        # V stores after every K store: attention waits for K only (it reads the chunk's V
        # from v), so a V slot's load-store round trips stay off its path.
        for i, (row, c0, n) in enumerate(mine):
            st.wait(vloaded, i + 1)
            st.store(hbm["v_cache"].sub(row * cap + prior + c0, 0, n, d), vin[i % nv].sub(0, 0, n, d))
            st.signal(vstored)
    return written, p1_cores


def _v_parts(hbm: dict[str, Tile], shape: dict[str, Any], cap: int, bb: int, g: int, k0: int,
             nk: int) -> tuple[Tile, ...]:
    """HBM row blocks of the V tile of keys k0..k0+nk of sequence bb, KV head g: the chunk's own
    keys from ``v`` (so that no V load waits for phase 1's copy into the cache), the others
    (prior context, padding past prior+seq) from ``v_cache``."""
    seq, prior, hkv, d = shape["seq"], shape["prior"], shape["kv_heads"], shape["head_dim"]
    row = bb * hkv + g
    parts = []
    for lo, hi, in_chunk in ((k0, min(k0 + nk, prior), False),
                             (max(k0, prior), min(k0 + nk, prior + seq), True),
                             (max(k0, prior + seq), k0 + nk, False)):
        if lo < hi:
            parts.append(hbm["v"].sub(bb * seq + lo - prior, g * d, hi - lo, d) if in_chunk
                         else hbm["v_cache"].sub(row * cap + lo, 0, hi - lo, d))
    return tuple(parts)


def build_prefill(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """attention-prefill: causal attention of ``seq`` new tokens over ``prior`` cached ones and
    themselves; writes the chunk's K and V into the decode cache (see the module doc)."""
    lay = _prefill_plan(shape, spec)
    plan, cap, unit_tiles, patterns = lay.plan, lay.cap, lay.tiles, lay.patterns
    bsz, seq, prior, hq, hkv, d = (shape[k] for k in ("batch", "seq", "prior", "q_heads", "kv_heads",
                                                      "head_dim"))
    hpk, hs, t, h2, pad_k = hq // hkv, plan.hpk, plan.tk, d // 2, _k_pad(spec, "bf16")
    n_tiles, ctx = -(-seq // t), prior + seq
    deltas = sorted(patterns)

    kb = KernelBuilder(f"attention_prefill_b{bsz}_seq{seq}_prior{prior}", chip=spec)
    hbm = {
        "q": kb.hbm("q", (bsz * seq, hq * d), "bf16"),
        "k": kb.hbm("k", (bsz * hkv * d, seq), "bf16"),
        "v": kb.hbm("v", (bsz * seq, hkv * d), "bf16"),
        "out": kb.hbm("out", (bsz * seq, hq * d), "bf16"),
        "k_cache": kb.hbm("k_cache", (bsz * hkv * d, cap + pad_k), "bf16"),
        "v_cache": kb.hbm("v_cache", (bsz * hkv * cap, d), "bf16"),
        "rope_cos": kb.hbm("rope_cos", (ctx, h2), "f32"), "rope_sin": kb.hbm("rope_sin", (ctx, h2), "f32"),
        "rope_cos_t": kb.hbm("rope_cos_t", (h2, ctx), "f32"),
        "rope_sin_t": kb.hbm("rope_sin_t", (h2, ctx), "f32"),
    }
    sinks_h = kb.hbm("sinks", (hq, 1), "f32") if plan.sinks else None
    mask_h = kb.hbm("mask", (len(deltas) * t, t), "f32") if deltas else None
    q_h, out_h, kc_h = hbm["q"], hbm["out"], hbm["k_cache"]

    units = []
    for bb in range(bsz):
        for g in range(hkv):
            for qi in range(n_tiles):
                q0, nq = qi * t, min(t, seq - qi * t)
                for h0 in range(g * hpk, (g + 1) * hpk, hs):  # one slice: the whole group unless lean
                    heads = range(h0, h0 + hs)
                    unit = _Unit(heads=hs, nq=nq, q=[q_h.sub(bb * seq + q0, h * d, nq, d) for h in heads],
                                 out=[out_h.sub(bb * seq + q0, h * d, nq, d) for h in heads],
                                 sink_row=h0, cos=hbm["rope_cos"].sub(prior + q0, 0, nq, h2),
                                 sin=hbm["rope_sin"].sub(prior + q0, 0, nq, h2), key=(bb, g, qi, h0))
                    units.append(unit)
    cores = min(spec.core.count, len(units))
    per_core = _assign(units, [len(unit_tiles[u.key[2]]) for u in units], cores)
    written = _emit_cache_writes(kb, spec, shape, lay, hbm)

    for c in range(cores):
        mine = per_core[c]
        if not mine:
            continue
        consts: list[tuple[Tile, Tile]] = []
        sinks_s = masks_s = None
        if sinks_h is not None:
            sinks_s = kb.sram(c, "sinks", (hq, 1), "f32")
            consts.append((sinks_s, sinks_h))
        if mask_h is not None:
            masks_s = kb.sram(c, "masks", (len(deltas) * t, t), "f32")
            consts.append((masks_s, mask_h))
        for unit in mine:
            bb, g, qi, _ = unit.key
            row = bb * hkv + g
            for k0, nk, delta in unit_tiles[qi]:
                # K tiles wholly in the prior context need not wait for phase 1's writes.
                st = _Step(n=nk, k=kc_h.sub(row * d, k0, d, nk), gated=k0 + nk > prior,
                           v_parts=_v_parts(hbm, shape, cap, bb, g, k0, nk))
                if delta is not None:
                    st.mask = masks_s.sub(deltas.index(delta) * t, 0, unit.nq, nk)
                unit.steps.append(st)
        em = _Core(kb, c, plan, mine)
        em.emit_queries(consts)
        em.emit_loads(written, None)  # V never waits: the chunk's rows come from v itself
        em.emit_mxu()
        em.emit_vpu(sinks_s, None, None)
        em.emit_stores()

    def make_inputs(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        cos, sin = yarn_cos_sin(ctx, d)
        ins = {"q": rng.standard_normal((bsz * seq, hq * d)).astype(_BF16),
               "k": rng.standard_normal((bsz * hkv * d, seq)).astype(_BF16),
               "v": rng.standard_normal((bsz * seq, hkv * d)).astype(_BF16),
               "rope_cos": cos, "rope_sin": sin,
               "rope_cos_t": np.ascontiguousarray(cos.T), "rope_sin_t": np.ascontiguousarray(sin.T)}
        if plan.sinks:
            ins["sinks"] = rng.standard_normal((hq, 1)).astype(np.float32)
        if deltas:
            ins["mask"] = np.concatenate([patterns[dl] for dl in deltas])
        # The prior context (keys already rotated); the chunk's slots and the padding hold
        # garbage that the kernel must overwrite or never let through the mask.
        ins["k_cache"] = rng.standard_normal((bsz * hkv * d, cap + pad_k)).astype(_BF16)
        ins["v_cache"] = rng.standard_normal((bsz * hkv * cap, d)).astype(_BF16)
        return ins

    def reference(inputs):
        out, kc, vc = prefill_reference(inputs, shape, {qi: [(k0, n) for k0, n, _ in lst]
                                                        for qi, lst in unit_tiles.items()}, t)
        return {"out": np.asarray(out), "k_cache": kc, "v_cache": vc}

    notes = {"tile_tokens": t, "units": len(units), "cores": cores, "kv_tiles": sum(
        len(u.steps) for u in units), "mask_patterns": len(deltas), "prior": prior, "cache_capacity": cap,
        "phase1_cores": written[1], "v_staging_slots": lay.v_slots, "heads_per_unit": hs,
        "kv_slots": plan.nbuf, "lean": plan.lean}
    return KernelBuild(program=kb.build(), make_inputs=make_inputs, reference=reference,
                       outputs={"out": ("bf16", (bsz * seq, hq * d)),
                                "k_cache": ("bf16", (bsz * hkv * d, cap + pad_k)),
                                "v_cache": ("bf16", (bsz * hkv * cap, d))},
                       tolerance=_TOL, notes=notes)


def prefill_reference(inputs, shape, tiles: dict[int, list[tuple[int, int]]], t: int):
    """Pure-JAX prefill with the kernel's roundings, BF16 values.

    Args:
        inputs: the kernel's HBM inputs (``k_cache``/``v_cache`` hold the prior context).
        shape: its shape keys.
        tiles: ``tiles[qi]`` [(start, n)]: the absolute key tiles query tile qi walks, in order.
        t: query tile size (tokens).
    Returns:
        (out float32[B*seq, Hq*D], k_cache float32[B*G*D, cap + pad], v_cache float32[B*G*cap, D]):
        the attention output and the caches with the chunk's rotated K^T columns and V rows
        written at positions prior..prior+seq-1, everything else as it came in.
    """
    bsz, seq, prior, hq, hkv, d = (shape[k] for k in ("batch", "seq", "prior", "q_heads", "kv_heads",
                                                      "head_dim"))
    w, hpk = shape["window"], hq // hkv
    cap = _prefill_cap(shape)
    cos = _f32(inputs["rope_cos"])[prior:prior + seq]
    sin = _f32(inputs["rope_sin"])[prior:prior + seq]
    q = _f32(np.asarray(inputs["q"], np.float32)).reshape(bsz, seq, hq, d)
    qr = _rope_ref(q, cos[None, :, None, :], sin[None, :, None, :], 1 / math.sqrt(d))
    k = _f32(np.asarray(inputs["k"], np.float32)).reshape(bsz, hkv, d, seq).transpose(0, 1, 3, 2)
    kr = _rope_ref(k, cos[None, None], sin[None, None], None)  # [B, G, seq, D]
    v = np.asarray(inputs["v"], np.float32).reshape(bsz, seq, hkv, d)
    kc = np.asarray(inputs["k_cache"], np.float32).reshape(bsz, hkv, d, -1).copy()
    kc[..., prior:prior + seq] = np.asarray(kr).transpose(0, 1, 3, 2)
    vc = np.asarray(inputs["v_cache"], np.float32).reshape(bsz, hkv, cap, d).copy()
    vc[:, :, prior:prior + seq] = v.transpose(0, 2, 1, 3)
    kt_all, v_all = _f32(kc[..., :cap]), _f32(vc)
    sinks = np.asarray(inputs["sinks"], np.float32)[:, 0] if shape["sinks"] else None
    out = np.zeros((bsz, seq, hkv, hpk, d), np.float32)
    qg = qr.reshape(bsz, seq, hkv, hpk, d).transpose(0, 2, 3, 1, 4)  # [B, G, hpk, seq, D]
    for qi, lst in tiles.items():  # all sequences and KV heads at once, one query tile at a time
        q0, nq = qi * t, min(t, seq - qi * t)
        rows = qg[:, :, :, q0:q0 + nq].reshape(bsz, hkv, hpk * nq, d)  # heads stacked, as the kernel
        valid = np.tile(_prefill_valid(prior + q0, 0, nq, cap, w), (hpk, 1))
        sink = None if sinks is None else _f32(np.broadcast_to(
            np.repeat(sinks.reshape(hkv, hpk), nq, axis=1), (bsz, hkv, hpk * nq)))
        o = _flash_ref(rows, kt_all, v_all, valid, lst, sink)
        out[:, q0:q0 + nq] = np.asarray(o).reshape(bsz, hkv, hpk, nq, d).transpose(0, 3, 1, 2, 4)
    return out.reshape(bsz * seq, hq * d), kc.reshape(bsz * hkv * d, -1), vc.reshape(bsz * hkv * cap, d)


ATTENTION_PREFILL = register(KernelDef(
    name="attention-prefill",
    doc="Flash causal prefill attention of a chunk of new tokens over the prior context in the "
        "KV cache and themselves: GQA, sliding window, sinks, YaRN RoPE on q and k; writes the "
        "chunk's rotated K^T and V into the decode cache.",
    shape_keys=(
        ShapeKey("batch", int, 1, "sequences", minimum=1),
        ShapeKey("seq", int, 128, "new tokens (this chunk) per sequence, a multiple of 32", minimum=32),
        ShapeKey("prior", int, 0, "tokens already in each sequence's KV cache before this chunk",
                 minimum=0),
        ShapeKey("capacity", int, 0, "cache capacity in tokens, a multiple of 32 >= prior+seq; "
                 "0 = prior+seq rounded up to 32 (attention-decode's cap)", minimum=0),
        *_COMMON_KEYS,
    ),
    build=build_prefill,
))
