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

Prefill as an emitter (``emit_prefill``; decode's is in ``kernels/attention_decode.py``). In a
fused program q, k and v are column views of the QKV projection's output, token-major ([batch*seq,
heads*head_dim]: k as the projection writes it, not transposed), in HBM with readiness regions
or as on-chip pieces: each load waits only for the regions it reads. The first phase transposes
k on the matrix unit (``I_D @ rows^T``, exact) before the same rotation; the stand-alone launch
keeps its K^T input and its program (phase 1 first, nothing prefetched). The prefetch part of a
fused program loads the identity, the sinks and mask, the queries when they are in HBM from the
start, and the first KV slots' tiles of prior context. ``out`` goes to an HBM tensor (each
unit's rows ready when stored) or stays on chip (one piece per head and query tile, ready when
its vector unit has written it); the caches are updated in place and returned with each chunk's
written region ready when its store has landed. With v on chip, the chunk's V tiles are read
from ``v_cache`` once the first phase has copied them there.

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
from collections.abc import Callable
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import EngineHandle, KernelBuilder
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.lazy import LazyModule

from .attention_decode import (
    TOL,
    build_decode,
    decode_logical_cache,
    decode_queries,
    decode_reference,
    decode_tensors,
    emit_decode_kernel,
    k_pad,
)
from .attention_engine import (
    _assign,
    _Core,
    _Step,
    _Unit,
    _view,
)
from .attention_prefill_plan import (
    PrefillLayout,
    plan_prefill,
    prefill_cap,
    prefill_valid,
)
from .attention_ref import (
    MASK_VALUE,
    YARN_GPT_OSS,
    _f32,
    _flash_ref,
    _rope_ref,
    naive_attention,
    yarn_cos_sin,
)
from .base import KernelBuild, KernelDef, ShapeKey, TensorSpec
from .emit import EmitCtx, Emitter, Out, Piece, Ready, TensorRef, fetch, run_emitter
from .registry import register

ml_dtypes = LazyModule("ml_dtypes")  # loaded on first use: importing it costs 0.5 s

__all__ = [
    "ATTENTION_DECODE",
    "ATTENTION_PREFILL",
    "MASK_VALUE",
    "YARN_GPT_OSS",
    "decode_logical_cache",
    "decode_queries",
    "decode_reference",
    "emit_prefill",
    "naive_attention",
    "prefill_reference",
    "prefill_tensors",
    "yarn_cos_sin",
]

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
        ShapeKey("kv_splits", int, 0, "KV splits per (sequence, KV head) over idle cores (flash-decoding); "
                 "0 = chosen by the cost model, 1 = none", minimum=0),
    ),
    build=build_decode,
    emit=emit_decode_kernel,
    tensors_of=decode_tensors,
))


# --- attention-prefill --------------------------------------------------------------------------
# --- phase 1: the chunk's K and V into the cache ------------------------------------------------
class _CacheWriter:
    """Phase 1: rotate the chunk's keys into ``k_cache`` columns prior.. (K^T) and copy its V rows
    into ``v_cache`` rows prior.., in (sequence, KV head, ``p1_tokens``-token) chunks dealt round
    robin over the cores.

    Per core: queue 0 loads the keys and the transposed cos/sin (two slots), queue 1 loads V
    (``lay.v_slots`` slots), the vector unit rotates, queue 3 stores both. The keys arrive either
    as the stand-alone K^T input [batch*kv_heads*head_dim, seq] (loaded straight into the
    rotation's [head_dim, n] slot) or token-major [batch*seq, kv_heads*head_dim], as the QKV
    projection writes them (HBM with readiness regions, or on-chip pieces): then a chunk's
    [n, head_dim] rows land in the same slot and the matrix unit transposes them, ``I_D @
    rows^T`` (``mxu.matmul_t`` with an identity), into accumulators that the vector unit reads
    back to BF16 over the rows (which the matrix unit is done with) before the same rotation.
    The transpose is exact for finite values (each sum is one BF16 value plus zeros; a -0 comes
    out +0), so the cache bytes are the stand-alone launch's. Its accumulators are the engine's
    P.V accumulators of the core (written by the engine only after every phase-1 read, the
    vector unit running phase 1 first), or two of their own on a core without attention units;
    the [head_dim, head_dim] BF16 identity is scratchpad beyond the plan (8 KiB at head_dim 64,
    within the share the budget leaves for constants).

    The constructor allocates (in the stand-alone program's order), ``emit`` emits. Semaphores
    per core (``sem``): loaded, vloaded, roped, stored (after each K store), vstored (after each
    V store); ``written`` counts the cores whose K stores have all landed.
    """

    def __init__(self, ctx: EmitCtx, shape: dict[str, Any], lay: PrefillLayout, *, token_major: bool,
                 engine_cores: set[int]) -> None:
        kb = ctx.kb
        self.kb, self.shape, self.lay, self.token_major = kb, shape, lay, token_major
        t, nv, d = lay.p1_tokens, lay.v_slots, shape["head_dim"]
        bsz, seq, hkv = shape["batch"], shape["seq"], shape["kv_heads"]
        h2 = d // 2
        chunks = [(row, c0, min(t, seq - c0)) for row in range(bsz * hkv) for c0 in range(0, seq, t)]
        self.cores = min(ctx.budget.cores, len(chunks))
        self.written = kb.semaphore("cache_written")
        self.per: list[tuple[int, list[tuple[int, int, int]], dict[str, Any], dict[str, Any]]] = []
        for c in range(self.cores):
            mine = chunks[c::self.cores]
            b: dict[str, Any] = {
                "kin": [kb.sram(c, f"p1k{s}", (d, t), "bf16") for s in range(2)],
                "kout": [kb.sram(c, f"p1o{s}", (d, t), "bf16") for s in range(2)],
                "vin": [kb.sram(c, f"p1v{s}", (t, d), "bf16") for s in range(min(nv, len(mine)))],
                "cs": [kb.sram(c, f"p1c{s}", (h2, t), "f32") for s in range(2)],
                "sn": [kb.sram(c, f"p1s{s}", (h2, t), "f32") for s in range(2)],
                "tmp": [kb.sram(c, f"p1t{s}", (h2, t), "f32") for s in range(2)],
            }
            sem = {n: kb.semaphore(f"c{c}.p1{n}")
                   for n in ("loaded", "vloaded", "roped", "stored", "vstored")}
            if token_major:
                b["eye"] = kb.sram(c, "p1eye", (d, d), "bf16")
                if c not in engine_cores:
                    b["acc"] = [kb.acc(c, f"p1acc{s}", (d, t)) for s in range(2)]
                sem["eye"], sem["tr"] = kb.semaphore(f"c{c}.p1eye"), kb.semaphore(f"c{c}.p1tr")
            self.per.append((c, mine, b, sem))
        self.eye = ctx.const("eye", np.eye(d, dtype=ml_dtypes.bfloat16), "bf16") if token_major else None
        self._eye_loaded = False

    @property
    def gate(self) -> tuple[Any, int]:
        """(semaphore, value): every core's K stores have landed (the chunk's K^T is in the cache)."""
        return self.written, self.cores

    def written_refs(self, k_cache: TensorRef, v_cache: TensorRef) -> tuple[TensorRef, TensorRef]:
        """The caches with each chunk's region ready when its store has landed."""
        d, prior, cap = self.shape["head_dim"], self.shape["prior"], self.lay.cap
        for _, mine, _, sem in self.per:
            for i, (row, c0, n) in enumerate(mine):
                k_cache = k_cache.with_ready(row * d, prior + c0, d, n, (sem["stored"].id, i + 1))
                v_cache = v_cache.with_ready(row * cap + prior + c0, 0, n, d, (sem["vstored"].id, i + 1))
        return k_cache, v_cache

    def emit_eye(self) -> None:
        """Queue 0 of each core: the identity the transposes multiply by (a constant, so it may
        go in a prefetch part)."""
        if self.token_major and not self._eye_loaded:
            for c, _, b, sem in self.per:
                q = self.kb.core(c).dma[0]
                q.load(b["eye"], self.eye)
                q.signal(sem["eye"])
            self._eye_loaded = True

    def emit(self, t: dict[str, TensorRef], accs: dict[int, list[Tile]]) -> None:
        """Phase 1's instructions. ``t``: the kernel's refs (k, v, rope_cos_t, rope_sin_t, k_cache,
        v_cache); ``accs``: per core with attention units, the engine's two P.V accumulators."""
        self.emit_eye()
        kb, lay, tm = self.kb, self.lay, self.token_major
        nv, cap = lay.v_slots, lay.cap
        seq, prior, hkv, d = (self.shape[k] for k in ("seq", "prior", "kv_heads", "head_dim"))
        h2 = d // 2
        k, v = t["k"], t["v"]
        kc_h, vc_h = t["k_cache"].base, t["v_cache"].base
        for c, mine, b, sem in self.per:
            core = kb.core(c)
            ld, vld, vpu, st, mxu = core.dma[0], core.dma[1], core.vpu, core.dma[3], core.mxu
            kin, kout, vin, cs, sn, tmp = (b[n] for n in ("kin", "kout", "vin", "cs", "sn", "tmp"))
            acc = b.get("acc") or accs.get(c)
            waited: dict[Any, set[Ready]] = {}
            for i, (row, c0, n) in enumerate(mine):
                s, bb, g = i % 2, row // hkv, row % hkv
                if i >= 2:  # slot s free: chunk i-2 rotated
                    ld.wait(sem["roped"], i - 1)
                # Token-major rows [n, D] land in the same slot; the vector unit overwrites them
                # with their transpose once the matrix unit has read them.
                dst = _view(kin[s], n, d) if tm else kin[s].sub(0, 0, d, n)
                fetch(ld, dst, k, *((bb * seq + c0, g * d) if tm else (row * d, c0)), waited=waited)
                ld.load(cs[s].sub(0, 0, h2, n), t["rope_cos_t"].hbm_view(0, prior + c0, h2, n))
                ld.load(sn[s].sub(0, 0, h2, n), t["rope_sin_t"].hbm_view(0, prior + c0, h2, n))
                ld.signal(sem["loaded"])
                if i >= nv:
                    vld.wait(sem["vstored"], i - nv + 1)
                fetch(vld, vin[i % nv].sub(0, 0, n, d), v, bb * seq + c0, g * d, waited=waited)
                vld.signal(sem["vloaded"])
                if tm:  # K^T = I_D @ rows^T into accumulator slot s (free once chunk i-2 is rotated)
                    if i == 0:
                        mxu.wait(sem["eye"], 1)
                    mxu.wait(sem["loaded"], i + 1)
                    if i >= 2:
                        mxu.wait(sem["roped"], i - 1)
                    mxu.matmul_t(_view(acc[s], d, n), b["eye"], _view(kin[s], n, d), mode="overwrite")
                    mxu.signal(sem["tr"])
                vpu.wait(sem["loaded"], i + 1)
                if i >= 2:
                    vpu.wait(sem["stored"], i - 1)
                if tm:
                    vpu.wait(sem["tr"], i + 1)
                    vpu.acc_read(kin[s].sub(0, 0, d, n), _view(acc[s], d, n))  # exact: BF16 values
                x1, x2 = kin[s].sub(0, 0, h2, n), kin[s].sub(h2, 0, h2, n)
                c_, s_ = cs[s].sub(0, 0, h2, n), sn[s].sub(0, 0, h2, n)
                t1, t2 = tmp[0].sub(0, 0, h2, n), tmp[1].sub(0, 0, h2, n)
                vpu.mul(t1, x1, c_)
                vpu.mul(t2, x2, s_)
                vpu.sub(kout[s].sub(0, 0, h2, n), t1, t2)
                vpu.mul(t1, x2, c_)
                vpu.mul(t2, x1, s_)
                vpu.add(kout[s].sub(h2, 0, h2, n), t1, t2)
                vpu.signal(sem["roped"])
                st.wait(sem["roped"], i + 1)
                st.store(kc_h.sub(row * d, prior + c0, d, n), kout[s].sub(0, 0, d, n))
                st.signal(sem["stored"])
            st.signal(self.written)
            # V stores after every K store: attention waits for K only (it reads the chunk's V
            # from v), so a V slot's load-store round trips stay off its path.
            for i, (row, c0, n) in enumerate(mine):
                st.wait(sem["vloaded"], i + 1)
                st.store(vc_h.sub(row * cap + prior + c0, 0, n, d), vin[i % nv].sub(0, 0, n, d))
                st.signal(sem["vstored"])


def _v_parts(v: TensorRef, v_cache: TensorRef, shape: dict[str, Any], cap: int, bb: int, g: int, k0: int,
             nk: int) -> tuple[tuple[Tile, ...], tuple[Ready, ...]]:
    """HBM row blocks of the V tile of keys k0..k0+nk of sequence bb, KV head g, and the ready
    conditions they overlap: the chunk's own keys from ``v`` (so that no V load waits for phase
    1's copy into the cache), the others (prior context, padding past prior+seq) from
    ``v_cache``; with ``v`` on chip the chunk's keys too, once phase 1 has stored them there
    (``v_cache`` then carries those readiness regions)."""
    seq, prior, hkv, d = shape["seq"], shape["prior"], shape["kv_heads"], shape["head_dim"]
    row = bb * hkv + g
    parts: list[Tile] = []
    waits: list[Ready] = []
    for lo, hi, in_chunk in ((k0, min(k0 + nk, prior), False),
                             (max(k0, prior), min(k0 + nk, prior + seq), True),
                             (max(k0, prior + seq), k0 + nk, False)):
        if lo >= hi:
            continue
        if in_chunk and v.in_hbm:
            src, r0, c0 = v, bb * seq + lo - prior, g * d
        else:
            src, r0, c0 = v_cache, row * cap + lo, 0
        parts.append(src.hbm_view(r0, c0, hi - lo, d))
        waits += src.waits(r0, c0, hi - lo, d)
    return tuple(parts), tuple(dict.fromkeys(waits))


# --- tensors ------------------------------------------------------------------------------------
def prefill_tensors(shape: dict[str, Any], spec: ChipSpec) -> tuple[TensorSpec, ...]:
    """attention-prefill's tensors: q [batch*seq, q_heads*head_dim], k and v [batch*seq,
    kv_heads*head_dim] token-major (k as the QKV projection writes it, not transposed) and out
    [batch*seq, q_heads*head_dim]; the caches (decode's layout, ``capacity`` tokens) updated in
    place; RoPE tables [prior+seq, head_dim/2] and their transposes, sinks [q_heads, 1] as weights
    (the mask is a constant of the emitter)."""
    bsz, seq, prior, hq, hkv, d = (shape[k] for k in ("batch", "seq", "prior", "q_heads", "kv_heads",
                                                      "head_dim"))
    cap, ctx, h2 = prefill_cap(shape), prior + seq, d // 2
    specs = [TensorSpec("q", (bsz * seq, hq * d), "bf16", "input"),
             TensorSpec("k", (bsz * seq, hkv * d), "bf16", "input"),
             TensorSpec("v", (bsz * seq, hkv * d), "bf16", "input"),
             TensorSpec("out", (bsz * seq, hq * d), "bf16", "output"),
             TensorSpec("k_cache", (bsz * hkv * d, cap + k_pad(spec, "bf16")), "bf16", "inout"),
             TensorSpec("v_cache", (bsz * hkv * cap, d), "bf16", "inout"),
             TensorSpec("rope_cos", (ctx, h2), "f32", "weight"),
             TensorSpec("rope_sin", (ctx, h2), "f32", "weight"),
             TensorSpec("rope_cos_t", (h2, ctx), "f32", "weight"),
             TensorSpec("rope_sin_t", (h2, ctx), "f32", "weight")]
    if shape["sinks"]:
        specs.append(TensorSpec("sinks", (hq, 1), "f32", "weight"))
    return tuple(specs)


def _mask_const(lay: PrefillLayout) -> np.ndarray:
    """f32[patterns*t, t]: the [t, t] additive mask patterns stacked in increasing delta."""
    return np.concatenate([lay.patterns[dl] for dl in sorted(lay.patterns)])


def _prefetchable(em: _Core) -> int:
    """Leading steps of a core a prefetch part may load: those of the first KV slots (no slot
    reuse) that read only the prior context (no gate on phase 1) and wait for no writer."""
    n = 0
    for _, st in em.flat[:em.p.nbuf]:
        if st.gated or st.k_waits or st.v_waits:
            break
        n += 1
    return n


# --- the emitter --------------------------------------------------------------------------------
def emit_prefill(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef], out: Out | None = None, *,
                 mask: TensorRef | None = None, k_transposed: bool = False, prefetch: bool = True) -> Emitter:
    """Emit attention-prefill (see the module docstring).

    Args:
        ctx: the emit context (its budget plans the kernel).
        shape: the kernel's shape keys.
        t: ``prefill_tensors``' refs: q, k, v (HBM, possibly with readiness regions, or on chip),
            the caches (HBM, written in place), the RoPE tables and sinks (HBM).
        out: ``Out.to(ref)`` (a token-major HBM tensor), ``Out.onchip()`` (each unit's rows kept
            in the scratchpad of the core that finalised them, one piece per head, ready when its
            vector unit has written them), or None: a new HBM tensor ``out``.
        mask: the [patterns*t, t] f32 mask constant already allocated (stand-alone build);
            None: allocated here with ``ctx.const``.
        k_transposed: ``k`` is the stand-alone launch's K^T input [batch*kv_heads*head_dim, seq]
            in HBM (no transpose on chip).
        prefetch: put the constants, the queries when in HBM from the start and the first KV
            slots' prior-context tiles in the prefetch part (before phase 1 on their queues);
            False: nothing is prefetched and the program is the stand-alone launch's, phase 1
            first.

    Yields/returns ``{"out": ref, "k_cache": ref, "v_cache": ref}``: the caches with each
    chunk's written region ready when its store has landed.
    """
    kb = ctx.kb
    lay = plan_prefill(shape, ctx.spec, ctx.budget)
    plan, cap, unit_tiles = lay.plan, lay.cap, lay.tiles
    bsz, seq, prior, hq, hkv, d = (shape[k] for k in ("batch", "seq", "prior", "q_heads", "kv_heads",
                                                      "head_dim"))
    hpk, hs, tt, h2 = hq // hkv, plan.hpk, plan.tk, d // 2
    n_tiles = -(-seq // tt)
    deltas = sorted(lay.patterns)
    q, k, v, kc, vc = (t[n] for n in ("q", "k", "v", "k_cache", "v_cache"))
    want = {"q": (bsz * seq, hq * d), "k": (bsz * hkv * d, seq) if k_transposed else (bsz * seq, hkv * d),
            "v": (bsz * seq, hkv * d), "k_cache": (bsz * hkv * d, cap + k_pad(ctx.spec, "bf16")),
            "v_cache": (bsz * hkv * cap, d)}
    for name, shp in want.items():
        if t[name].shape != shp:
            raise InvalidArgumentError(f"attention-prefill: {name} is {list(t[name].shape)}, expected "
                                       f"{list(shp)}" + (" (K^T)" if name == "k" and k_transposed else ""))
    if not (kc.in_hbm and vc.in_hbm) or (k_transposed and not k.in_hbm):
        raise InvalidArgumentError("attention-prefill: the caches (and a K^T input) must be HBM tensors")
    if out is None:
        out = Out.to(TensorRef.hbm("out", kb.hbm("out", want["q"], "bf16")))
    if out.cores is not None:
        raise InvalidArgumentError("attention-prefill: a replicated output is not supported "
                                   "(use Out.onchip() or Out.to(ref))")
    if out.in_hbm and out.ref.shape != want["q"]:
        raise InvalidArgumentError(f"attention-prefill: out is {list(out.ref.shape)}, "
                                   f"expected {list(want['q'])}")
    if mask is None and deltas:
        mask = TensorRef.hbm("mask", ctx.const("mask", _mask_const(lay), "f32"))
    sinks_h = t["sinks"].hbm_view(0, 0, hq, 1) if plan.sinks else None
    static_q = q.in_hbm and not q.waits()

    def q_fetch(bb: int, q0: int, nq: int, h0: int,
                waited: dict[Any, set[Ready]]) -> Callable[[EngineHandle, Tile], None]:
        def issue(queue: EngineHandle, dst: Tile) -> None:  # heads stacked in rows, [nq, D] each
            for i, h in enumerate(range(h0, h0 + hs)):
                fetch(queue, dst.sub(i * nq, 0, nq, d), q, bb * seq + q0, h * d, waited=waited)
        return issue

    units = []
    for bb in range(bsz):
        for g in range(hkv):
            for qi in range(n_tiles):
                q0, nq = qi * tt, min(tt, seq - qi * tt)
                for h0 in range(g * hpk, (g + 1) * hpk, hs):  # one slice: the whole group unless lean
                    heads = range(h0, h0 + hs) if static_q else ()  # else q_fetch brings them
                    rows = [q.hbm_view(bb * seq + q0, h * d, nq, d) for h in heads]
                    units.append(_Unit(
                        heads=hs, nq=nq, q=rows, out=[], sink_row=h0,
                        cos=t["rope_cos"].hbm_view(prior + q0, 0, nq, h2),
                        sin=t["rope_sin"].hbm_view(prior + q0, 0, nq, h2), key=(bb, g, qi, h0)))
    cores = min(ctx.budget.cores, len(units))
    per_core = _assign(units, [len(unit_tiles[u.key[2]]) for u in units], cores)
    writer = _CacheWriter(ctx, shape, lay, token_major=not k_transposed,
                          engine_cores={c for c in range(cores) if per_core[c]})
    kc_out, vc_out = writer.written_refs(kc, vc)
    # V of the chunk comes from v when it is in HBM; from the cache, once written, when on chip.
    v_src_cache = vc if v.in_hbm else vc_out

    ems: list[tuple[_Core, list[tuple[Tile, Tile]], Tile | None]] = []
    for c in range(cores):
        mine = per_core[c]
        if not mine:
            continue
        consts: list[tuple[Tile, Tile]] = []
        sinks_s = masks_s = None
        if sinks_h is not None:
            sinks_s = kb.sram(c, "sinks", (hq, 1), "f32")
            consts.append((sinks_s, sinks_h))
        if mask is not None:
            masks_s = kb.sram(c, "masks", (len(deltas) * tt, tt), "f32")
            consts.append((masks_s, mask.hbm_view(0, 0, len(deltas) * tt, tt)))
        waited: dict[Any, set[Ready]] = {}
        for unit in mine:
            bb, g, qi, h0 = unit.key
            row = bb * hkv + g
            if not static_q:
                unit.q_fetch = q_fetch(bb, qi * tt, unit.nq, h0, waited)
            for k0, nk, delta in unit_tiles[qi]:
                # K tiles wholly in the prior context need not wait for phase 1's writes.
                parts, v_waits = _v_parts(v, v_src_cache, shape, cap, bb, g, k0, nk)
                st = _Step(n=nk, k=kc.hbm_view(row * d, k0, d, nk), gated=k0 + nk > prior, v_parts=parts,
                           k_waits=tuple(kc.waits(row * d, k0, d, nk)), v_waits=v_waits)
                if delta is not None:
                    st.mask = masks_s.sub(deltas.index(delta) * tt, 0, unit.nq, nk)
                unit.steps.append(st)
        ems.append((_Core(kb, c, plan, mine), consts, sinks_s))

    # The output: HBM rows ready when their unit's store lands, or kept rows ready when written.
    if out.in_hbm:
        ref = out.ref
        for em, *_ in ems:
            for u, unit in enumerate(em.units):
                bb, _, qi, h0 = unit.key
                r0 = bb * seq + qi * tt
                unit.out = [ref.hbm_view(r0, h * d, unit.nq, d) for h in range(h0, h0 + hs)]
                ref = ref.with_ready(r0, h0 * d, unit.nq, hs * d, (em.sem["stored"].id, u + 1))
    else:
        pieces = []
        for em, *_ in ems:
            for u, unit in enumerate(em.units):
                bb, _, qi, h0 = unit.key
                unit.out_keep = kb.sram(em.c, f"out{u}", (unit.rows, d), "bf16", keep=True)
                nq = unit.nq
                pieces += [Piece(bb * seq + qi * tt, h * d, nq, d, unit.out_keep.sub(i * nq, 0, nq, d), None,
                                 (em.sem["fin"].id, u + 1)) for i, h in enumerate(range(h0, h0 + hs))]
        ref = TensorRef.onchip("out", want["q"], "bf16", pieces)
    outs = {"out": ref, "k_cache": kc_out, "v_cache": vc_out}

    # Prefetch: the identity, the constants, the queries when in HBM from the start, and the
    # first KV slots' prior-context tiles (phase 1's loads queue behind them).
    early = {em.c: prefetch and static_q and not em.query_loads_wait() for em, *_ in ems}
    pre = {em.c: _prefetchable(em) if prefetch else 0 for em, *_ in ems}
    if prefetch:
        writer.emit_eye()
        for em, consts, _ in ems:
            em.emit_consts(consts)
            if early[em.c]:
                em.emit_query_loads()
            em.emit_loads(writer.gate, None, 0, pre[em.c])
    yield outs
    writer.emit(t, {em.c: em.acc_o for em, *_ in ems})
    for em, consts, sinks_s in ems:
        if not prefetch:
            em.emit_consts(consts)
        if not early[em.c]:
            em.emit_query_loads()
        em.emit_loads(writer.gate, None, pre[em.c])  # V never gated: the chunk's rows come from v
        em.emit_mxu()
        em.emit_vpu(sinks_s, None, None)
        em.emit_stores()
    return outs


def _emit_prefill_kernel(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                         outs: dict[str, Out]) -> Emitter:
    """``KernelDef.emit`` of attention-prefill: the caches are written in place (their ``Out``,
    if any, must be the cache tensor itself)."""
    for name in ("k_cache", "v_cache"):
        o = outs.get(name)
        if o is not None and (not o.in_hbm or o.ref.base != t[name].base):
            raise InvalidArgumentError(f"attention-prefill: {name} is updated in place; its output must "
                                       f"be the {name} tensor itself")
    return emit_prefill(ctx, shape, t, outs.get("out"))


# --- the stand-alone launch -------------------------------------------------------------------
def build_prefill(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """attention-prefill stand-alone: causal attention of ``seq`` new tokens over ``prior`` cached
    ones and themselves, writing the chunk's K and V into the decode cache (see the module doc):
    its emitter with every tensor in HBM and the K^T input, nothing prefetched (phase 1 first)."""
    lay = plan_prefill(shape, spec)
    plan, cap, unit_tiles, patterns = lay.plan, lay.cap, lay.tiles, lay.patterns
    bsz, seq, prior, hq, hkv, d = (shape[k] for k in ("batch", "seq", "prior", "q_heads", "kv_heads",
                                                      "head_dim"))
    hpk, hs, t, h2, pad_k = hq // hkv, plan.hpk, plan.tk, d // 2, k_pad(spec, "bf16")
    n_tiles, ctx = -(-seq // t), prior + seq

    kb = KernelBuilder(f"attention_prefill_b{bsz}_seq{seq}_prior{prior}", chip=spec)
    ectx = EmitCtx.standalone(kb)
    allocs = [("q", (bsz * seq, hq * d), "bf16"), ("k", (bsz * hkv * d, seq), "bf16"),
              ("v", (bsz * seq, hkv * d), "bf16"), ("out", (bsz * seq, hq * d), "bf16"),
              ("k_cache", (bsz * hkv * d, cap + pad_k), "bf16"), ("v_cache", (bsz * hkv * cap, d), "bf16"),
              ("rope_cos", (ctx, h2), "f32"), ("rope_sin", (ctx, h2), "f32"),
              ("rope_cos_t", (h2, ctx), "f32"), ("rope_sin_t", (h2, ctx), "f32")]
    if plan.sinks:
        allocs.append(("sinks", (hq, 1), "f32"))
    refs = {name: TensorRef.hbm(name, kb.hbm(name, shp, dt)) for name, shp, dt in allocs}
    mask = TensorRef.hbm("mask", ectx.const("mask", _mask_const(lay), "f32")) if patterns else None
    run_emitter(emit_prefill(ectx, shape, refs, Out.to(refs["out"]), mask=mask, k_transposed=True,
                             prefetch=False))

    def make_inputs(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        cos, sin = yarn_cos_sin(ctx, d)
        ins = {"q": rng.standard_normal((bsz * seq, hq * d)).astype(ml_dtypes.bfloat16),
               "k": rng.standard_normal((bsz * hkv * d, seq)).astype(ml_dtypes.bfloat16),
               "v": rng.standard_normal((bsz * seq, hkv * d)).astype(ml_dtypes.bfloat16),
               "rope_cos": cos, "rope_sin": sin,
               "rope_cos_t": np.ascontiguousarray(cos.T), "rope_sin_t": np.ascontiguousarray(sin.T)}
        if plan.sinks:
            ins["sinks"] = rng.standard_normal((hq, 1)).astype(np.float32)
        ins.update(ectx.consts)
        # The prior context (keys already rotated); the chunk's slots and the padding hold
        # garbage that the kernel must overwrite or never let through the mask.
        ins["k_cache"] = rng.standard_normal((bsz * hkv * d, cap + pad_k)).astype(ml_dtypes.bfloat16)
        ins["v_cache"] = rng.standard_normal((bsz * hkv * cap, d)).astype(ml_dtypes.bfloat16)
        return ins

    def reference(inputs):
        out, kc, vc = prefill_reference(inputs, shape, {qi: [(k0, n) for k0, n, _ in lst]
                                                        for qi, lst in unit_tiles.items()}, t)
        return {"out": np.asarray(out), "k_cache": kc, "v_cache": vc}

    units = bsz * hkv * n_tiles * (hpk // hs)
    chunks = bsz * hkv * -(-seq // lay.p1_tokens)
    notes = {"tile_tokens": t, "units": units, "cores": min(spec.core.count, units),
             "kv_tiles": bsz * hkv * (hpk // hs) * sum(len(lst) for lst in unit_tiles.values()),
             "mask_patterns": len(patterns), "prior": prior, "cache_capacity": cap,
             "phase1_cores": min(spec.core.count, chunks), "v_staging_slots": lay.v_slots,
             "heads_per_unit": hs, "kv_slots": plan.nbuf, "lean": plan.lean}
    return KernelBuild(program=kb.build(), make_inputs=make_inputs, reference=reference,
                       outputs={"out": ("bf16", (bsz * seq, hq * d)),
                                "k_cache": ("bf16", (bsz * hkv * d, cap + pad_k)),
                                "v_cache": ("bf16", (bsz * hkv * cap, d))},
                       tolerance=TOL, notes=notes)


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
    cap = prefill_cap(shape)
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
        valid = np.tile(prefill_valid(prior + q0, 0, nq, cap, w), (hpk, 1))
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
    emit=_emit_prefill_kernel,
    tensors_of=prefill_tensors,
))
