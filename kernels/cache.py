"""KV-cache append: a decode step (or an MLA prefill chunk) writes its new tokens into the caches
the attention kernels read.

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

``mla-append`` (MLA latent cache, DeepSeek-V3/R1, Kimi K2.5) rotates the rope part of the query
(``q_rot``; the nope part is copied unchanged) and writes row ``b*cap + context - 1`` of
``kv_cache`` [batch*cap, kv_lora_rank + rope] = [c_kv | rope(k_pe)], ``mla-decode``'s layout:
``cap`` = shape key ``capacity``, or context rounded up to 32 when that is 0
(``mla.latent_cache_capacity``), so that an append at context c and mla-decode at context c
(same ``capacity``) share one buffer. With ``tokens`` > 1 it appends a prefill chunk (what
``mla-prefill`` with ``prior`` = context - tokens reads, with the same ``capacity``): the new
tokens sit at positions context-tokens .. context-1, q rows ``(b*tokens + t)*q_heads + h`` and
kv_a rows ``b*tokens + t`` rotate at position context-tokens+t (row t of the [tokens, rope/2]
tables) and land in cache rows ``b*cap + context-tokens+t``. The RoPE is DeepSeek-V3's
(``apply_rotary_pos_emb`` of HF ``modeling_deepseek``): the rope dims are de-interleaved (pair
(x[2i], x[2i+1]) -> x1[i] = x[2i], x2[i] = x[2i+1]), then rotated with rotate-half as above and
stored in that de-interleaved order, for q and k alike (so scores q.k are those of the interleaved
rotation). The tables come from ``deepseek_yarn_cos_sin``.

``kv-append`` with ``kv_dtype`` fp8e4 writes attention-decode's MXFP8 cache: the rotated key
(BF16, as above) quantised along head_dim, and the value re-quantised with the other tokens of
its 32-token block (V scales run along tokens); ``build_kv_append`` says how.

How it runs: work items (kv-append: (sequence, KV head) pairs; mla-append: query rows and cache
rows) go to the cores in contiguous blocks, so that one core's rows are contiguous in the inputs
and evenly strided in the caches: each block moves with one DMA descriptor per tensor. The K^T
column of a block of items is one strided [items*head_dim, 1] store (the K^T rows of consecutive
(sequence, head) pairs follow each other), the V rows one [items, head_dim] store with a stride of
``cap`` rows. The de-interleave of the MLA rope dims is one vector copy per half: the rope part
is loaded packed, [rows, rope_dim] is viewed as [rows*rope_dim/2, 2], and its two columns are the
even and the odd dims. A core whose share does not fit its scratchpad walks it in jobs on two
buffer slots (loads of job j+1 overlap the work on job j). An MLA chunk's rows have a position
each: a core loads the table rows of its tokens once, the de-interleave still runs over a whole
job, and the rotation is six vector instructions per token of query rows (a [q_heads, rope/2]
block against one broadcast table row) and six per sequence run of latent rows (against the
run's table rows, one per row); each sequence's run of cache rows is one DMA (whole sequences
together: one strided DMA).

In a fused decode step ``kv-append`` given ``Out.onchip()`` for its (BF16) caches still updates
them in place and keeps each job's rotated keys and values where it made them (kept allocations),
as pieces of the returned cache refs that carry their scratchpad tile, ready when the job's
vector unit is done: attention-decode takes the new token from there instead of waiting for the
stores (``emit_kv_append``; loads then on queue 2, stores on queue 3).

What bounds them: a decode step moves a few KB per core, so the DMA fixed costs (descriptor
set-up, HBM latency) and the launch: about two DMA round trips plus a dozen vector instructions.
Latency-bound at every batch size.
The MXFP8 append adds two matrix-unit passes per item and (j+1) small stores per item (the block's
token rows 0..j, j = (context-1) % 32), which take up to four rounds of DMA set-up at 8 items per
core (13.5 us on jalapeno-v1 at j = 31, against 5.6 us for BF16). An MLA prefill chunk moves
MBs per core and is HBM-bound: q's nope part goes back while the vector unit rotates, and the
core takes at least two jobs so that loads overlap stores (DeepSeek-R1, 2048 tokens: 207 MB in
18.4 us on jalapeno-v1, 1.09x launch + the busiest channel's time).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import ml_dtypes
import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import CoreHandle, EngineHandle, KernelBuilder, Semaphore
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import DTYPES
from jalapeno_emu.lazy import LazyModule

from .attention_ref import yarn_cos_sin
from .base import KernelBuild, KernelDef, ShapeKey, TensorSpec, Tolerance
from .emit import EmitCtx, Emitter, Out, Piece, TensorRef, fetch, run_emitter
from .mla import latent_cache_capacity
from .planning import Budget
from .registry import register

jnp = LazyModule("jax.numpy")

__all__ = [
    "KV_APPEND",
    "MLA_APPEND",
    "YARN_DEEPSEEK_V3",
    "deepseek_yarn_cos_sin",
    "kv_append_fp8_reference",
    "kv_append_reference",
    "mla_append_reference",
    "rope_deinterleaved",
    "rope_rotate_half",
]

_BF16 = ml_dtypes.bfloat16
_SRAM_SHARE = 0.9  # leave a little scratchpad free (allocations are 64-byte aligned)
_ALIGN_BYTES = 64

YARN_DEEPSEEK_V3 = {"rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
"""DeepSeek-V3/R1's ``rope_theta`` and ``rope_scaling`` (YaRN), the keys of HF's config."""


# --- RoPE tables and references ---------------------------------------------------------------
def _yarn_mscale(factor: float, mscale: float) -> float:
    """HF modeling_deepseek ``yarn_get_mscale``: 0.1*mscale*ln(factor) + 1, or 1 when factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, theta: float, orig: int) -> float:
    """The dim whose wavelength fits ``rotations`` times into ``orig`` positions (HF
    ``yarn_find_correction_dim``)."""
    return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def deepseek_yarn_cos_sin(positions: int, rope_dim: int,
                          cfg: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3 YaRN RoPE tables: (cos, sin), each float32[positions, rope_dim/2].

    Follows ``DeepseekV3YarnRotaryEmbedding`` of HF ``modeling_deepseek.py`` (DeepSeek-V3/R1 and
    Kimi K2, which share the architecture). With ``i`` in [0, rope_dim/2) and
    ``f_i = theta^(-2i/rope_dim)``::

        low  = max(floor(d(beta_fast)), 0),  high = min(ceil(d(beta_slow)), rope_dim - 1)
        d(r) = rope_dim * ln(orig / (2*pi*r)) / (2 * ln(theta))
        ramp_i = clip((i - low) / (high - low), 0, 1)      (high += 0.001 when low == high)
        inv_freq_i = f_i / factor * ramp_i + f_i * (1 - ramp_i)
        cos[p, i] = cos(p * inv_freq_i) * m,  sin[p, i] = sin(p * inv_freq_i) * m
        m = mscale(factor, mscale) / mscale(factor, mscale_all_dim),
        mscale(s, k) = 0.1*k*ln(s) + 1 (1 when s <= 1)

    so the fast dims (i < low) keep their original frequency, the slow ones (i > high) are
    interpolated by ``factor``. The full-width HF table is [cos | cos]; this is its first half.
    Computed in float64 and rounded once to float32, like ``yarn_cos_sin`` (HF forms the angle
    p * inv_freq in float32, which at positions near 10^5 is off by up to ~10^-2 rad in the
    fastest dims; float64 gives the value HF approximates).

    Args:
        positions: number of positions (rows), starting at 0.
        rope_dim: rotated dims per head (``qk_rope_head_dim``, 64 for DeepSeek/Kimi); even.
        cfg: ``rope_theta`` plus HF's ``rope_scaling`` keys (``factor``,
            ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
            ``mscale_all_dim``); missing keys take HF's defaults (4096, 32, 1, 1, 0). None:
            DeepSeek-V3/R1 (``YARN_DEEPSEEK_V3``; m = 1). ``factor`` 1 is plain RoPE.
    """
    if rope_dim < 2 or rope_dim % 2:
        raise InvalidArgumentError(f"rope_dim={rope_dim} must be even and >= 2")
    c = YARN_DEEPSEEK_V3 if cfg is None else cfg
    theta, factor = float(c["rope_theta"]), float(c.get("factor", 1.0))
    orig = c.get("original_max_position_embeddings", 4096)
    half = rope_dim // 2
    freq = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    low = max(math.floor(_correction_dim(c.get("beta_fast", 32), rope_dim, theta, orig)), 0)
    high = min(math.ceil(_correction_dim(c.get("beta_slow", 1), rope_dim, theta, orig)), rope_dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid dividing by zero
    ramp = np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0, 1)
    inv_freq = freq / factor * ramp + freq * (1 - ramp)
    m = _yarn_mscale(factor, c.get("mscale", 1)) / _yarn_mscale(factor, c.get("mscale_all_dim", 0))
    ang = np.arange(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (np.cos(ang) * m).astype(np.float32), (np.sin(ang) * m).astype(np.float32)


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
    return out.astype(_BF16).astype(np.float32)


def rope_deinterleaved(x, cos, sin) -> np.ndarray:
    """DeepSeek-V3's RoPE: de-interleave the last axis (evens, then odds), then ``rope_rotate_half``."""
    x = np.asarray(x, np.float32)
    return rope_rotate_half(np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1), cos, sin)


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
    kc = np.array(k_cache, dtype=_BF16, copy=True)
    vc = np.array(v_cache, dtype=_BF16, copy=True)
    cos, sin = np.asarray(rope_cos).reshape(1, -1), np.asarray(rope_sin).reshape(1, -1)
    rotated = rope_rotate_half(k_rows, cos, sin)
    kc[:, context - 1] = rotated.reshape(items * d).astype(_BF16)
    vc[np.arange(items) * cap + context - 1] = np.asarray(v_new, _BF16).reshape(items, d)
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


def mla_append_reference(q, kv_a, rope_cos, rope_sin, kv_cache, *, batch: int, context: int, q_heads: int,
                         nope_dim: int, rope_dim: int, kv_lora_rank: int,
                         tokens: int = 1, capacity: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(q_rot, kv_cache) after ``mla-append``, BF16 arrays of the inputs' shapes.

    With ``tokens`` new tokens per sequence at positions p = context-tokens+t (t < tokens) and
    ``rope_cos``/``rope_sin`` [tokens, rope_dim/2] (row t: position p), rope = ``rope_deinterleaved``:
    q_rot[r] = [q_nope[r] | rope(q_pe[r], row t)] for every row r = (b*tokens + t)*q_heads + h;
    kv_cache [batch*cap, kv_lora_rank + rope_dim] (cap = ``latent_cache_capacity(context,
    capacity)``): row b*cap + p = [c_kv[g] | rope(k_pe[g], row t)] for kv_a row g = b*tokens + t.
    """
    n, r, t = nope_dim, kv_lora_rank, tokens
    cos = np.asarray(rope_cos, np.float32).reshape(t, -1)
    sin = np.asarray(rope_sin, np.float32).reshape(t, -1)
    qq = np.asarray(q, np.float32).reshape(batch, t, q_heads, n + rope_dim)
    q_pe = rope_deinterleaved(qq[..., n:], cos[None, :, None], sin[None, :, None])
    q_rot = np.concatenate([qq[..., :n], q_pe], axis=-1).astype(_BF16).reshape(batch * t * q_heads, -1)
    kv = np.asarray(kv_a, np.float32).reshape(batch, t, r + rope_dim)
    rows = np.concatenate([kv[..., :r], rope_deinterleaved(kv[..., r:], cos[None], sin[None])], axis=-1)
    cap = latent_cache_capacity(context, capacity)
    if np.shape(kv_cache) != (batch * cap, r + rope_dim):
        raise InvalidArgumentError(f"kv_cache has shape {np.shape(kv_cache)}; batch={batch} sequences of "
                                   f"cap={cap} rows need ({batch * cap}, {r + rope_dim})")
    cache = np.array(kv_cache, dtype=_BF16, copy=True).reshape(batch, cap, r + rope_dim)
    cache[:, context - t:context] = rows.astype(_BF16)
    return q_rot, cache.reshape(np.shape(kv_cache))


# --- tiles ------------------------------------------------------------------------------------
def _packed(t: Tile, rows: int, cols: int, byte_off: int = 0, stride: int = -1) -> Tile:
    """The bytes of tile ``t`` (from ``byte_off``) seen as [rows, cols] of the same dtype, with
    row ``stride`` in bytes (default packed); ``t`` must be packed over the span."""
    view = Tile(t.space, t.core, t.offset + byte_off, t.dtype, rows, cols, stride)
    if not t.contiguous or view.offset < t.offset or view.end > t.offset + t.nbytes:
        raise AssertionError(f"{view} is not inside packed {t}")  # a kernel bug, not bad input
    return view


def _rows_every(t: Tile, first: int, count: int, every: int) -> Tile:
    """``count`` rows of tile ``t`` from row ``first``, taking every ``every``-th row."""
    return Tile(t.space, t.core, t.offset + first * t.stride, t.dtype, count, t.cols, t.stride * every)


def _rotate_half(vpu: EngineHandle, out1: Tile, out2: Tile, x1: Tile, x2: Tile, cos: Tile, sin: Tile,
                 t1: Tile, t2: Tile) -> None:
    """out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin: attention-prefill's K^T rotation, op for op
    (FP32 temporaries t1, t2; one rounding to out's dtype)."""
    vpu.mul(t1, x1, cos)
    vpu.mul(t2, x2, sin)
    vpu.sub(out1, t1, t2)
    vpu.mul(t1, x2, cos)
    vpu.mul(t2, x1, sin)
    vpu.add(out2, t1, t2)


def _rotate_job(core: CoreHandle, ready: tuple[Semaphore, int], **tiles: Tile) -> None:
    """A job's ``_rotate_half`` on the core's vector unit (which has waited for ``ready``)."""
    _rotate_half(core.vpu, **tiles)


def _nbytes(rows: int, cols: int, dtype: str) -> int:
    return -(-rows * DTYPES[dtype].row_bytes(cols) // _ALIGN_BYTES) * _ALIGN_BYTES


# --- the per-core pipeline ----------------------------------------------------------------------
_SPREAD_STORES = 4  # a job with more stores than this spreads them over every DMA queue


@dataclass(frozen=True)
class _From:
    """A load source that is a region of a tensor given to the emitter: rows r0.. and columns c0..
    of ``ref`` (the destination tile's shape), loaded with :func:`fetch` (waiting for the
    regions its writers have not finished; on-chip pieces copied scratchpad to scratchpad)."""

    ref: TensorRef
    r0: int
    c0: int


@dataclass
class _Job:
    """One core's block of rows: what to load, store as loaded, compute, and store after.

    loads: (SRAM dst, HBM src tile or :class:`_From`); passthrough: (HBM dst, SRAM src) stored
    as soon as loaded; compute(core, ready): issues the job's work; the vector unit has waited
    for the loads already, other engines it uses wait on ``ready`` (semaphore, value)
    themselves; the vector unit's last instruction must come after all of it. stores: (HBM dst,
    SRAM src) after it.
    """

    loads: list[tuple[Tile, Tile | _From]] = field(default_factory=list)
    passthrough: list[tuple[Tile, Tile]] = field(default_factory=list)
    compute: Callable[[CoreHandle, tuple[Semaphore, int]], None] | None = None
    stores: list[tuple[Tile, Tile]] = field(default_factory=list)


@dataclass
class _CorePlan:
    """One core's pipeline, planned before any of it is emitted (a fused program hands over its
    outputs' readiness before the work): its semaphores and, per job, the condition under which
    all of that job's stores (passthrough included) have landed (``stored``)."""

    c: int
    consts: list[tuple[Tile, Tile]]
    jobs: list[_Job]
    mxu_reads_consts: bool
    sem: dict[str, list[Semaphore]]
    ready: Semaphore | None
    stored: list[tuple[int, int]]
    load_queue: int = 0  # slot s loads on queue load_queue + s (mod the queues)
    store_queue: int = 2  # and stores on queue store_queue + s


def _plan_core(kb: KernelBuilder, c: int, consts: list[tuple[Tile, Tile]], jobs: list[_Job],
               mxu_reads_consts: bool = False) -> _CorePlan:
    """Semaphores and per-job store conditions of core ``c``'s pipeline (see ``_emit_core``)."""
    slots = min(2, len(jobs))
    nq = len(kb.core(c).dma)
    sem = {n: [kb.semaphore(f"c{c}.{n}{s}") for s in range(slots)] for n in ("loaded", "done", "stored")}
    ready = kb.semaphore(f"c{c}.consts") if consts and jobs else None
    signals, stored = [0] * max(slots, 1), []
    for j, job in enumerate(jobs):
        s = j % slots
        spread = len(job.stores) > _SPREAD_STORES
        queues = nq if spread else 1
        # the store queue always signals; the others only when they got a share of the stores
        signals[s] += 1 + sum(1 for k in range(1, queues) if job.stores[k::queues])
        stored.append((sem["stored"][s].id, signals[s]))
    return _CorePlan(c, consts, jobs, mxu_reads_consts, sem, ready, stored)


def _prefetch_core(kb: KernelBuilder, p: _CorePlan) -> None:
    """The constants' loads on queue 0 (what a fused program streams in early)."""
    if p.ready is None:
        return
    core = kb.core(p.c)
    for dst, src in p.consts:
        core.dma[0].load(dst, src)
    core.dma[0].signal(p.ready)


def _run_core(kb: KernelBuilder, p: _CorePlan, waited: dict[Any, set] | None = None) -> None:
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
            if isinstance(src, _From):
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
        queues = [sq] + ([q for q in core.dma if q is not sq] if len(job.stores) > _SPREAD_STORES else [])
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


def _emit_core(kb: KernelBuilder, c: int, consts: list[tuple[Tile, Tile]], jobs: list[_Job],
               mxu_reads_consts: bool = False) -> _CorePlan:
    """Issue core ``c``'s jobs on two buffer slots: slot s loads on queue s and stores on queue
    2+s (many stores: on every queue); a slot is reloaded once its previous job is stored; the
    vector unit (and with ``mxu_reads_consts`` the matrix unit) starts once the constants
    (``consts``, queue 0) have landed. Returns the plan (its per-job store conditions)."""
    p = _plan_core(kb, c, consts, jobs, mxu_reads_consts)
    _prefetch_core(kb, p)
    _run_core(kb, p)
    return p


def _split(total: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) blocks of ``ceil(total/parts)`` covering ``total`` (the last may be shorter)."""
    per = -(-total // parts)
    return [(lo, min(total, lo + per)) for lo in range(0, total, per)]


def _jobs_needed(sizes: list[int], fits: Callable[[list[int]], bool], what: str) -> int:
    """Fewest jobs J such that ceil(size/J) rows of each kind fit (``fits``); error if none."""
    for j in range(1, max(sizes) + 1):
        if fits([-(-n // j) for n in sizes]):
            return j
    raise InvalidArgumentError(what)


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
    _rotate_half(vpu, **rot)
    vpu.quantize(t["kq"], t["ks"], t["kout"])  # blocked along head_dim: one scale per 32 dims
    vpu.wait(sem["deq"], k + 1)
    vpu.acc_read(t["vblk"], t["deq"])  # exact: MXFP8 values fit BF16
    vpu.copy(_rows_every(t["vblk"], j, n, 32), t["v"])  # the new token's row
    if j < 31:  # slots after it hold no token yet: zero, so they do not raise the block's scale
        tail = _packed(t["vblk"], n, 32 * d).sub(0, (j + 1) * d, n, (31 - j) * d)
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


def _rows_loads(ref: TensorRef, dst: Tile, i0: int, n: int, per: int,
                w: int) -> list[tuple[Tile, Tile | _From]]:
    """Loads of rows i0 .. i0+n of ``ref`` [tokens, per*w] seen as [tokens*per, w] (row
    token*per + k: the token's k-th ``w``-wide slice: a KV head's key, a query head's row) into
    ``dst`` (packed [n, w]).

    A packed HBM tensor that is ready at the start is one load of the [tokens*per, w] view (the
    stand-alone program); otherwise (a producer's output on chip, or one it stores tile by tile)
    one fetch per run of whole tokens and one per partial token at either end."""
    if ref.in_hbm and not ref.waits() and ref.base.contiguous:
        return [(dst, _packed(ref.base, ref.shape[0] * per, w).sub(i0, 0, n, w))]
    out: list[tuple[Tile, Tile | _From]] = []
    i, end = i0, i0 + n
    while i < end:
        tok, k = divmod(i, per)
        if k == 0 and end - i >= per:
            m = (end - i) // per
            out.append((_packed(dst, m, per * w, byte_off=(i - i0) * dst.stride), _From(ref, tok, 0)))
            i += m * per
        else:
            m = min(end, (tok + 1) * per) - i
            out.append((_packed(dst, 1, m * w, byte_off=(i - i0) * dst.stride), _From(ref, tok, k * w)))
            i += m
    return out


def _kv_bf16_job(g: _KvGeom, hbm: dict[str, Any], tl: dict[str, Tile], rot: dict[str, Tile], i0: int,
                 n: int) -> _Job:
    """Items i0..i0+n (BF16): rotate K; V stored as loaded."""
    d, ctx, cap = g.d, g.ctx, g.cap
    return _Job(
        loads=[*_rows_loads(hbm["k_new"], tl["kin"], i0, n, g.heads, d),
               *_rows_loads(hbm["v_new"], tl["v"], i0, n, g.heads, d)],
        # row i0*cap + ctx-1 of V, then every cap-th row: the next (sequence, head)'s
        passthrough=[(_rows_every(hbm["v_cache"], i0 * cap + ctx - 1, n, cap), tl["v"])],
        compute=functools.partial(_rotate_job, **rot),
        # column ctx-1 of K^T rows i0*D .. (i0+n)*D: the rotated rows, packed, as a column
        stores=[(hbm["k_cache"].sub(i0 * d, ctx - 1, n * d, 1), _packed(tl["kout"], n * d, 1))])


def _kv_fp8_job(g: _KvGeom, hbm: dict[str, Any], tl: dict[str, Tile], compute: Callable, i0: int,
                n: int) -> _Job:
    """Items i0..i0+n (MXFP8): K codes and scales as columns; the V blocks in, re-quantised, and
    back a token row at a time (see ``build_kv_append``)."""
    d, ctx, cap, per = g.d, g.ctx, g.cap, g.cap // 32
    first = i0 * per + g.blk  # item i0's block: a row of v_blocks and of the V scales
    job = _Job(loads=[*_rows_loads(hbm["k_new"], tl["kin"], i0, n, g.heads, d),
                      *_rows_loads(hbm["v_new"], tl["v"], i0, n, g.heads, d),
                      (_packed(tl["vold"], n, 32 * d), _rows_every(hbm["v_blocks"], first, n, per)),
                      (tl["vold_s"], _rows_every(hbm["v_cache.scales"], first, n, per))],
               compute=compute)
    job.stores += [(hbm["k_cache"].sub(i0 * d, ctx - 1, n * d, 1), _packed(tl["kq"], n * d, 1)),
                   (hbm["k_cache.scales"].sub(i0 * d // 32, ctx - 1, n * d // 32, 1),
                    _packed(tl["ks"], n * d // 32, 1)),
                   (_rows_every(hbm["v_cache.scales"], first, n, per), _packed(tl["vq_s"], n, d))]
    for i in range(n):  # token t of item i is column t of its transposed codes
        for tok in range(g.j + 1):
            row = (i0 + i) * cap + g.blk * 32 + tok
            dst = _packed(hbm["v_cache"], d, 1, byte_off=row * d)
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


def _kv_kept_rows(g: _KvGeom, p: _CorePlan, spans: list[range],
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
             hbm: dict[str, Any], keep: tuple[str, ...] = ()) -> tuple[_CorePlan, list[range]]:
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
    return _plan_core(kb, c, consts, jobs, mxu_reads_consts=g.fp8), spans


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
    blocks = _split(items, min(budget.cores, items))
    per_core = blocks[0][1] - blocks[0][0]
    consts_bytes = 2 * _nbytes(1, h, "f32") + (_nbytes(d, d, "bf16") if fp8 else 0)
    sram = min(budget.sram_bytes, int(spec.sram.scratchpad_bytes * _SRAM_SHARE)) - consts_bytes

    def fits(n: list[int]) -> bool:
        slot, shared, acc = (sum(_nbytes(*sh, dt) for _, sh, dt in specs)
                             for specs in _kv_buffers(n[0], d, fp8))
        return 2 * slot + shared <= sram and 2 * acc <= budget.acc_bytes

    n_jobs = _jobs_needed([per_core], fits, f"shape key head_dim={d}: one (sequence, KV head) item "
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
        hbm["eye"] = t["eye"].base if "eye" in t else ctx.const("eye", np.eye(g.d, dtype=_BF16), "bf16")
        hbm["v_blocks"] = _packed(hbm["v_cache"], g.items * g.cap // 32, 32 * g.d)  # a row per 32-token block
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
        _prefetch_core(kb, p)
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
        _run_core(kb, p, waited)
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
        ins = {"k_new": rng.standard_normal((bsz, hkv * d)).astype(_BF16),
               "v_new": rng.standard_normal((bsz, hkv * d)).astype(_BF16),
               "rope_cos": cos_t[ctx - 1:ctx], "rope_sin": sin_t[ctx - 1:ctx]}
        if not fp8:
            return ins | {"k_cache": kc.astype(_BF16), "v_cache": vc.astype(_BF16)}
        kq, vq = (mx.quantize(jnp.asarray(a), "e4m3", axis=0) for a in (kc, vc))
        return ins | {"k_cache": np.asarray(kq.codes), "k_cache.scales": np.asarray(kq.scales),
                      "v_cache": np.asarray(vq.codes), "v_cache.scales": np.asarray(vq.scales),
                      "eye": np.eye(d, dtype=_BF16)}

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
        tolerance=_EXACT_FP8 if fp8 else _EXACT,
        notes={"cores": len(blocks), "items": items, "items_per_core": per_core, "jobs_per_core": n_jobs,
               "cap": cap, "k_row_pad": pad_k, "block_row": g.j,
               "v_code_stores": items * (g.j + 1) if fp8 else 0},
    )


_EXACT = Tolerance(atol=0.0, rtol=0.0, why="bit-exact: the same FP32 vector operations in the same "
                   "order as the reference, one rounding to BF16; every other byte is copied")
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


# --- mla-append ---------------------------------------------------------------------------------
def _check_mla(shape: dict[str, Any]) -> int:
    """Refuse impossible mla-append shapes; the cache capacity (rows per sequence) otherwise."""
    p, t, c = shape["rope_dim"], shape["tokens"], shape["context"]
    if p % 2:
        raise InvalidArgumentError(f"shape key rope_dim={p} must be even: RoPE rotates pairs of dims")
    if t > c:
        raise InvalidArgumentError(f"shape key tokens={t} must be <= context={c}: the new tokens sit at "
                                   "positions context-tokens .. context-1 of each sequence")
    return latent_cache_capacity(c, shape["capacity"])


@dataclass(frozen=True)
class _RopeWindow:
    """The RoPE table rows one core keeps in SRAM, for its global tokens ``first`` .. ``last``
    (token g = b*tokens + t is at position t = g % tokens).

    When the core's tokens cover a whole chunk's worth (``last - first + 1 >= tokens``) it keeps
    the whole table and SRAM row t is table row t (position context-tokens+t); otherwise only
    its ``last - first + 1`` tokens' rows, SRAM row k being token ``first + k`` (a run across a
    sequence boundary wraps the positions, so it is loaded in two pieces). Either way a run of
    consecutive tokens of one sequence reads consecutive SRAM rows.
    """

    first: int
    last: int
    tokens: int

    @property
    def whole(self) -> bool:
        return self.last - self.first + 1 >= self.tokens

    @property
    def rows(self) -> int:
        return self.tokens if self.whole else self.last - self.first + 1

    def row(self, g: int) -> int:
        """SRAM row of global token ``g``'s cos and sin."""
        return g % self.tokens if self.whole else g - self.first

    def loads(self, sram: Tile, table: Tile) -> list[tuple[Tile, Tile]]:
        """(SRAM dst, HBM src) DMAs that fill ``sram`` [rows, P/2] from ``table`` [tokens, P/2]."""
        if self.whole:
            return [(sram, table)]
        p0, n, cols = self.first % self.tokens, self.rows, table.cols
        head = min(n, self.tokens - p0)  # positions p0.. up to the end of the sequence's chunk
        out = [(sram.sub(0, 0, head, cols), table.sub(p0, 0, head, cols))]
        if head < n:  # then the next sequence's first positions
            out.append((sram.sub(head, 0, n - head, cols), table.sub(0, 0, n - head, cols)))
        return out


def _rope_window(q_rows: tuple[int, int], kv_rows: tuple[int, int], q_heads: int, tokens: int) -> _RopeWindow:
    """The window of a core with query rows [lo, hi) (row g*q_heads + h) and latent rows [lo, hi)
    (row g); an empty range takes no part."""
    spans = [(lo // per, (hi - 1) // per) for (lo, hi), per in ((q_rows, q_heads), (kv_rows, 1)) if lo < hi]
    return _RopeWindow(min(s[0] for s in spans), max(s[1] for s in spans), tokens)


@dataclass(frozen=True)
class _Segment:
    """Rows ``row`` .. ``row + rows`` of a part that rotate with SRAM table rows ``cos_row`` ..:
    one row broadcast to all of them (``step`` 0: one position) or one row each (``step`` 1)."""

    row: int
    rows: int
    cos_row: int
    step: int

    def table(self, t: Tile) -> Tile:
        return t.sub(self.cos_row, 0, self.rows if self.step else 1, t.cols)


def _rope_segments(r0: int, r1: int, per_token: int, window: _RopeWindow) -> list[_Segment]:
    """Rows [r0, r1) (``per_token`` consecutive rows per token, token = row // per_token) cut into
    as few segments as possible: rows sharing a table row merge (a token's q_heads query rows; with
    one token per sequence every row of a job), and single-row tokens whose table rows follow each
    other merge into one [rows, P/2] table operand (a sequence's run of latent rows)."""
    segs: list[_Segment] = []
    for g in range(r0 // per_token, (r1 - 1) // per_token + 1):
        lo, hi = max(r0, g * per_token), min(r1, (g + 1) * per_token)
        cr = window.row(g)
        if segs:
            s = segs[-1]
            if cr == s.cos_row and s.step == 0:  # same position (one token; or tokens == 1)
                segs[-1] = _Segment(s.row, s.rows + hi - lo, cr, 0)
                continue
            if per_token == 1 and cr == s.cos_row + s.rows and (s.step == 1 or s.rows == 1):
                segs[-1] = _Segment(s.row, s.rows + 1, s.cos_row, 1)
                continue
        segs.append(_Segment(lo - r0, hi - lo, cr, 0))
    return segs


def _deinterleave_rotate(vpu: EngineHandle, out: Tile, packed: Tile, x1: Tile, x2: Tile, cos: Tile,
                         sin: Tile, t1: Tile, t2: Tile, segments: list[_Segment]) -> None:
    """out [n, P] = DeepSeek RoPE of ``packed`` [n, P] (BF16, packed rows): its [n*P/2, 2] view's
    columns are the even and odd dims, copied (exactly) into x1, x2 [n, P/2] for all n rows at
    once, then rotate-half per segment with the segment's rows of ``cos``/``sin`` (SRAM tables
    [rows, P/2])."""
    n, p = packed.rows, packed.cols
    h = p // 2
    pairs = n * h
    vpu.copy(_packed(x1, pairs, 1), _packed(packed, pairs, 1, stride=4))
    vpu.copy(_packed(x2, pairs, 1), _packed(packed, pairs, 1, byte_off=2, stride=4))
    for s in segments:
        r, m = s.row, s.rows
        _rotate_half(vpu, out.sub(r, 0, m, h), out.sub(r, h, m, h), x1.sub(r, 0, m, h), x2.sub(r, 0, m, h),
                     s.table(cos), s.table(sin), t1.sub(r, 0, m, h), t2.sub(r, 0, m, h))


def _rotate_parts(core: CoreHandle, ready: tuple[Semaphore, int] | None, parts: list[tuple[Tile, Tile, list]],
                  scratch: tuple[Tile, ...], cos: Tile, sin: Tile) -> None:
    """``_deinterleave_rotate`` of each (out, packed, segments) part, on the first rows of the
    shared scratch tiles (x1, x2 BF16 and t1, t2 FP32, each [rows, P/2])."""
    for out, packed, segments in parts:
        n, h = packed.rows, packed.cols // 2
        x1, x2, t1, t2 = (t.sub(0, 0, n, h) for t in scratch)
        _deinterleave_rotate(core.vpu, out, packed, x1, x2, cos, sin, t1, t2, segments)


def _cache_stores(cache: Tile, rows: Tile, g0: int, tokens: int, context: int,
                  cap: int) -> list[tuple[Tile, Tile]]:
    """(HBM dst, SRAM src) stores of latent rows g0 .. g0 + rows.rows (``rows`` packed [n, W], row
    g = b*tokens + t) to cache rows b*cap + context - tokens + t: a run of whole sequences
    as one strided DMA of [sequences, tokens*W] (one new row per sequence: every cap-th
    row), a partial sequence at either end as one contiguous DMA."""
    out = []
    g, g1, w, rb = g0, g0 + rows.rows, rows.cols, cache.stride
    while g < g1:
        b, t = divmod(g, tokens)
        if t == 0 and g1 - g >= tokens:
            k = (g1 - g) // tokens
            first = cache.offset + (b * cap + context - tokens) * rb
            dst = Tile(cache.space, cache.core, first, cache.dtype, k, tokens * w, cap * rb)
            out.append((dst, _packed(rows, k, tokens * w, byte_off=(g - g0) * rows.stride)))
            g += k * tokens
        else:
            n = min(g1, (b + 1) * tokens) - g
            out.append((cache.sub(b * cap + context - tokens + t, 0, n, w), rows.sub(g - g0, 0, n, w)))
            g += n
    return out


@dataclass(frozen=True)
class _MlaPlan:
    """How an mla-append shape runs: per-core query-row and latent-row blocks, RoPE windows, and
    the jobs each core walks them in."""

    q_blocks: list[tuple[int, int]]
    kv_blocks: list[tuple[int, int]]
    windows: list[_RopeWindow]
    n_jobs: int
    nq_job: int
    nk_job: int
    cap: int

    @property
    def cores(self) -> int:
        return max(len(self.q_blocks), len(self.kv_blocks))


def _mla_plan(shape: dict[str, Any], spec: ChipSpec, budget: Budget) -> _MlaPlan:
    """Plan an mla-append shape within ``budget``.

    Raises:
        InvalidArgumentError: an impossible shape, or a query row and a cache row that do not fit.
    """
    cap = _check_mla(shape)
    B, T, H = shape["batch"], shape["tokens"], shape["q_heads"]
    N, P, R = shape["nope_dim"], shape["rope_dim"], shape["kv_lora_rank"]
    h, wq, wk = P // 2, N + P, R + P
    cores = min(budget.cores, B * T * H)
    q_blocks, kv_blocks = _split(B * T * H, cores), _split(B * T, cores)
    q_per, kv_per = q_blocks[0][1] - q_blocks[0][0], kv_blocks[0][1] - kv_blocks[0][0]
    n_cores = max(len(q_blocks), len(kv_blocks))
    windows = [_rope_window(q_blocks[c] if c < len(q_blocks) else (0, 0),
                            kv_blocks[c] if c < len(kv_blocks) else (0, 0), H, T) for c in range(n_cores)]
    table_rows = max(w.rows for w in windows)
    sram = (min(budget.sram_bytes, int(spec.sram.scratchpad_bytes * _SRAM_SHARE))
            - 2 * _nbytes(table_rows, h, "f32"))

    def fits(n: list[int]) -> bool:  # per slot the row buffers and packed rope parts; shared scratch
        nq, nk = n
        rows = max(nq, nk)
        slot = sum(_nbytes(n, w, "bf16") for n, w in ((nq, wq), (nq, P), (nk, wk), (nk, P)))
        return 2 * slot + 2 * _nbytes(rows, h, "bf16") + 2 * _nbytes(rows, h, "f32") <= sram

    n_jobs = _jobs_needed([q_per, kv_per], fits,
                          f"shape keys nope_dim={N}, rope_dim={P}, kv_lora_rank={R}, tokens={T}: one query "
                          f"row and one cache row, with {table_rows} RoPE table rows, do not fit "
                          f"{spec.name}'s {spec.sram.scratchpad_bytes:,} B scratchpad")
    if T > 1 and q_per >= 2 * H:
        # A prefill chunk moves MBs per core: two jobs at least, so that the second's load
        # overlaps the first's rotation and stores (at DeepSeek-R1's 2048-token chunk 19.9 -> 18.4
        # us); a decode step (tokens 1) is latency-bound and keeps the fewest jobs.
        n_jobs = max(n_jobs, 2)
    return _MlaPlan(q_blocks, kv_blocks, windows, n_jobs, -(-q_per // n_jobs), -(-kv_per // n_jobs), cap)


def _mla_job_rows(pl: _MlaPlan, c: int) -> list[tuple[int, int, int, int]]:
    """Core ``c``'s jobs as (query rows r0, r1, latent rows b0, b1), empty ones left out."""
    q_lo, q_hi = pl.q_blocks[c] if c < len(pl.q_blocks) else (0, 0)
    k_lo, k_hi = pl.kv_blocks[c] if c < len(pl.kv_blocks) else (0, 0)
    out = []
    for j in range(pl.n_jobs):
        r0, r1 = q_lo + j * pl.nq_job, min(q_hi, q_lo + (j + 1) * pl.nq_job)
        b0, b1 = k_lo + j * pl.nk_job, min(k_hi, k_lo + (j + 1) * pl.nk_job)
        if r0 < r1 or b0 < b1:
            out.append((r0, r1, b0, b1))
    return out


def _token_regions(r0: int, r1: int, per: int, w: int) -> list[tuple[int, int, int, int]]:
    """Rows [r0, r1) of a [tokens*per, w] view as regions (r0, c0, rows, cols) of the token-major
    [tokens, per*w] tensor: a run of whole tokens is one region, a partial token one each."""
    out, i = [], r0
    while i < r1:
        tok, k = divmod(i, per)
        if k == 0 and r1 - i >= per:
            m = (r1 - i) // per
            out.append((tok, 0, m, per * w))
            i += m * per
        else:
            m = min(r1, (tok + 1) * per) - i
            out.append((tok, k * w, 1, m * w))
            i += m
    return out


def _copy_then(core: CoreHandle, ready: tuple[Semaphore, int], *, copies: list[tuple[Tile, Tile]],
               then: Callable) -> None:
    """Vector copies (the rope columns of whole query rows into their packed buffer), then ``then``."""
    for dst, src in copies:
        core.vpu.copy(dst, src)
    then(core, ready)


def emit_mla_append(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                    outs: dict[str, Out] | None = None) -> Emitter:
    """Emit mla-append (see ``_mla_append_plans``): every core's constants in the prefetch part,
    then every core's jobs. In a decode step whose q is on chip in whole heads and whose q_rot
    stays on chip, the queries rotate where they are (``_HeadLocalQ``) and the jobs carry only
    the latent rows."""
    local = None
    if _keeps_q_rot(shape, ctx.spec, (outs or {}).get("q_rot")):
        local = _HeadLocalQ.of(t["q"], shape)
    plans, refs = _mla_append_plans(ctx, shape, t, outs, skip_q=local is not None)
    if local is not None:
        local.prefetch(ctx.kb, t["rope_cos"].base, t["rope_sin"].base)
        refs = refs | {"q_rot": local.ref}
    for p in plans:
        _prefetch_core(ctx.kb, p)
    yield refs
    if local is not None:
        local.rotate(ctx.kb)
    waited: dict[Any, set] = {}
    for p in plans:
        _run_core(ctx.kb, p, waited)
    return refs


def _keeps_q_rot(shape: dict[str, Any], spec: ChipSpec, q_out: Out | None) -> bool:
    """Whether mla-append keeps q_rot on chip: asked to (``Out.onchip()``), one token per
    sequence, and at most ``dma.max_outstanding_per_queue`` sequences. Above that a head core's
    row copies of every token cost more set-up rounds than one strided load, and the kept rows
    fragment the scratchpad the next layer's experts plan in (DeepSeek-R1 layer 3 at batch 64:
    its MoE re-planned, 548 -> 840 us). A prefill chunk's queries are MBs per core: HBM."""
    if q_out is None or q_out.ref is not None or q_out.cores is not None or shape["tokens"] != 1:
        return False
    sequences = shape["batch"]
    return sequences <= spec.dma.max_outstanding_per_queue


@dataclass
class _HeadLocalQ:
    """A decode step's queries rotated on the cores that hold them (the q projection's output
    kept on chip, each piece whole heads of every token): each core copies its piece [B, k*(N+P)]
    into a kept buffer and rotates each head's rope columns there, with the one table row of
    the step's position. mla-decode's head cores then read their heads in place when the pieces
    line up with their heads (DeepSeek-R1 on jalapeno-v1: 384 columns, two heads, per core), so
    the chain from the projection to the attention has no transfer at all; otherwise they copy
    them, as from any on-chip q. Same vector operations on the same values as the row jobs
    (bit-identical q_rot)."""

    pieces: list[Piece]
    nope: int
    rope: int
    work: list[dict[str, Any]] = field(default_factory=list)
    ref: TensorRef | None = None

    @staticmethod
    def of(q: TensorRef, shape: dict[str, Any]) -> _HeadLocalQ | None:
        """The plan when every piece of an on-chip ``q`` holds whole heads of every token, one
        piece per core and none overlapping; None otherwise."""
        B, H = shape["batch"], shape["q_heads"]
        N, P = shape["nope_dim"], shape["rope_dim"]
        wq = N + P
        if q.in_hbm or not q.pieces or q.is_mx:
            return None
        cores = [p.core for p in q.pieces]
        if len(set(cores)) != len(cores) or sum(p.rows * p.cols for p in q.pieces) != B * H * wq:
            return None
        if any(p.tile is None or p.r0 != 0 or p.rows != B or p.c0 % wq or p.cols % wq for p in q.pieces):
            return None
        return _HeadLocalQ(list(q.pieces), N, P)

    def prefetch(self, kb: KernelBuilder, cos_h: Tile, sin_h: Tile) -> None:
        """Allocate each core's buffers and load its table row (the prefetch part, queue 1: queue
        0 streams the other operators' weights); build the on-chip q_rot."""
        h, rows = self.rope // 2, self.pieces[0].rows
        out = []
        for p in self.pieces:
            c = p.core
            w = {"src": p, "cos": kb.sram(c, "q_cos", (1, h), "f32"),
                 "sin": kb.sram(c, "q_sin", (1, h), "f32"),
                 "out": kb.sram(c, "q_rot", (rows, p.cols), "bf16", keep=True),
                 "packed": kb.sram(c, "q_pe", (rows, self.rope), "bf16"),
                 "scratch": (kb.sram(c, "q_x1", (rows, h), "bf16"), kb.sram(c, "q_x2", (rows, h), "bf16"),
                             kb.sram(c, "q_t1", (rows, h), "f32"), kb.sram(c, "q_t2", (rows, h), "f32")),
                 "table": kb.semaphore(f"c{c}.q_table"), "done": kb.semaphore(f"c{c}.q_rotated")}
            q1 = kb.core(c).dma[1 % len(kb.core(c).dma)]
            q1.load(w["cos"], cos_h.sub(0, 0, 1, h))
            q1.load(w["sin"], sin_h.sub(0, 0, 1, h))
            q1.signal(w["table"])
            self.work.append(w)
            out.append(Piece(p.r0, p.c0, p.rows, p.cols, w["out"], None, (w["done"].id, 1)))
        cols = sum(p.cols for p in self.pieces)
        self.ref = TensorRef.onchip("q_rot", (rows, cols), "bf16", out)

    def rotate(self, kb: KernelBuilder) -> None:
        """Each core: the whole piece, then per head its rope columns packed, de-interleaved and
        rotated into place; the piece is ready when the vector unit is done."""
        N, P, wq = self.nope, self.rope, self.nope + self.rope
        for w in self.work:
            p, out = w["src"], w["out"]
            core = kb.core(p.core)
            core.vpu.wait(w["table"], 1)
            if p.ready is not None:
                core.vpu.wait(*p.ready)
            core.vpu.copy(out, p.tile)
            seg = [_Segment(0, p.rows, 0, 0)]  # one position: table row 0 for every row
            for k in range(p.cols // wq):
                pe = out.sub(0, k * wq + N, p.rows, P)
                core.vpu.copy(w["packed"], pe)
                _rotate_parts(core, None, [(pe, w["packed"], seg)], w["scratch"], w["cos"], w["sin"])
            core.vpu.signal(w["done"])


def _mla_append_plans(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                      outs: dict[str, Out] | None = None, *, skip_q: bool = False
                      ) -> tuple[list[_CorePlan], dict[str, TensorRef]]:
    """Plan mla-append (``KernelDef.emit``): ``t`` holds q (token-major [batch*tokens,
    q_heads*(nope+rope)], in HBM or on chip), kv_a ([batch*tokens, kv_lora_rank+rope]: [c_kv |
    k_pe], HBM or on chip), rope_cos / rope_sin [tokens, rope/2] and kv_cache (HBM, updated in
    place). ``outs["q_rot"]``: an HBM tensor to store the rotated queries into; ``Out.onchip()``
    in a decode step of at most ``dma.max_outstanding_per_queue`` sequences: each core keeps
    its rotated rows (kept allocations, an on-chip q_rot); otherwise, or absent, an HBM tensor
    of the emitter's own. ``skip_q``: the jobs carry only the latent rows (the queries rotate
    where they are, ``_HeadLocalQ``) and the returned q_rot is None.

    Allocates every core's buffers and semaphores (no instruction yet). Returns each core's
    pipeline and the outputs q_rot and kv_cache, each region ready once the job that writes it
    has stored it. The prefetch part of the emitter loads each core's RoPE table rows; the rest
    waits for its rows.
    """
    kb, spec = ctx.kb, ctx.spec
    pl = _mla_plan(shape, spec, ctx.budget)
    B, C, T, H = shape["batch"], shape["context"], shape["tokens"], shape["q_heads"]
    N, P, R = shape["nope_dim"], shape["rope_dim"], shape["kv_lora_rank"]
    h, wq, wk, cap = P // 2, N + P, R + P, pl.cap
    n_jobs, nq_job, nk_job = pl.n_jobs, pl.nq_job, pl.nk_job
    place = (outs or {}).get("kv_cache")
    if place is not None and (place.ref is None or place.ref.base != t["kv_cache"].base):
        raise InvalidArgumentError("mla-append updates kv_cache in place: its output must be the input "
                                   "tensor")
    q_ref, kva_ref, cache_ref = t["q"], t["kv_a"], t["kv_cache"]
    q_out = (outs or {}).get("q_rot")
    # A small decode step's rotated queries stay where they were rotated: each core keeps its
    # job's rows, and mla-decode's head cores copy them (or read them in place) instead of a
    # store to HBM and a load back, two transfers on the chain to the attention.
    keep_q = not skip_q and _keeps_q_rot(shape, spec, q_out)
    qrot_ref = qrot_h = None
    if not keep_q and not skip_q:
        if q_out is None or q_out.ref is None:
            qrot_ref = TensorRef.hbm("q_rot", kb.hbm("q_rot", (B * T, H * wq), "bf16"))
        else:
            qrot_ref = q_out.ref
        qrot_h = _packed(qrot_ref.base, B * T * H, wq)
    q_packed = q_ref.in_hbm and not q_ref.waits() and q_ref.base.contiguous
    q_h = _packed(q_ref.base, B * T * H, wq) if q_packed else None
    cos_h, sin_h = t["rope_cos"].base, t["rope_sin"].base
    cache_h = cache_ref.base
    plans: list[tuple[_CorePlan, list[tuple[tuple[int, int], tuple[int, int]]]]] = []
    pieces: list[Piece] = []
    for c in range(pl.cores):
        win = pl.windows[c]
        cos, sin = kb.sram(c, "cos", (win.rows, h), "f32"), kb.sram(c, "sin", (win.rows, h), "f32")
        slots = min(2, n_jobs)
        rows = nk_job if skip_q else max(nq_job, nk_job)
        sizes = (("q", nq_job, wq), ("qpe", nq_job, P), ("kv", nk_job, wk), ("kpe", nk_job, P))
        buf = {name: [kb.sram(c, f"{name}{s}", (n, w), "bf16") for s in range(slots)] for name, n, w in sizes
               if not (keep_q and name == "q") and not (skip_q and name in ("q", "qpe"))}
        scratch = (kb.sram(c, "x1", (rows, h), "bf16"), kb.sram(c, "x2", (rows, h), "bf16"),
                   kb.sram(c, "t1", (rows, h), "f32"), kb.sram(c, "t2", (rows, h), "f32"))
        q_lo, q_hi = pl.q_blocks[c] if c < len(pl.q_blocks) else (0, 0)
        k_lo, k_hi = pl.kv_blocks[c] if c < len(pl.kv_blocks) else (0, 0)
        jobs, spans = [], []
        kept: list[tuple[int, int, int, Tile]] = []  # (job, first row, end row, its kept q rows)
        for j in range(n_jobs):
            s = j % slots
            job, parts, copies = _Job(), [], []
            r0, r1 = q_lo + j * nq_job, min(q_hi, q_lo + (j + 1) * nq_job)
            if skip_q:  # (the queries rotate where they are: emit_mla_append)
                r0 = r1
            if r0 < r1:  # query rows: nope copied through, rope part rotated into the row buffer
                n, pe = r1 - r0, buf["qpe"][s]
                qb = kb.sram(c, f"q_rot{j}", (nq_job, wq), "bf16", keep=True) if keep_q else buf["q"][s]
                if q_h is not None:
                    job.loads += [(qb.sub(0, 0, n, N), q_h.sub(r0, 0, n, N)),
                                  (pe.sub(0, 0, n, P), q_h.sub(r0, N, n, P))]
                else:  # whole rows from the producer, the rope part packed on the vector unit
                    job.loads += _rows_loads(q_ref, qb.sub(0, 0, n, wq), r0, n, H, wq)
                    copies.append((pe.sub(0, 0, n, P), qb.sub(0, N, n, P)))
                if keep_q:
                    kept.append((len(jobs), r0, r1, qb))
                elif T == 1:  # latency-bound: one store of whole rows after the rotation
                    job.stores.append((qrot_h.sub(r0, 0, n, wq), qb.sub(0, 0, n, wq)))
                else:  # the nope part (2/3 of the bytes) goes back while the vector unit rotates
                    job.passthrough.append((qrot_h.sub(r0, 0, n, N), qb.sub(0, 0, n, N)))
                    job.stores.append((qrot_h.sub(r0, N, n, P), qb.sub(0, N, n, P)))
                parts.append((qb.sub(0, N, n, P), pe.sub(0, 0, n, P), _rope_segments(r0, r1, H, win)))
            b0, b1 = k_lo + j * nk_job, min(k_hi, k_lo + (j + 1) * nk_job)
            if b0 < b1:  # the new latent rows: c_kv through, k_pe rotated; row b*cap + C-T+t of the cache
                n, row, pe = b1 - b0, buf["kv"][s], buf["kpe"][s]
                job.loads += [(row.sub(0, 0, n, R), _From(kva_ref, b0, 0)),
                              (pe.sub(0, 0, n, P), _From(kva_ref, b0, R))]
                job.stores += _cache_stores(cache_h, row.sub(0, 0, n, wk), b0, T, C, cap)
                parts.append((row.sub(0, R, n, P), pe.sub(0, 0, n, P), _rope_segments(b0, b1, 1, win)))
            if parts:
                rotate = functools.partial(_rotate_parts, parts=parts, scratch=scratch, cos=cos, sin=sin)
                job.compute = functools.partial(_copy_then, copies=copies, then=rotate) if copies else rotate
                jobs.append(job)
                spans.append(((r0, r1), (b0, b1)))
        plan = _plan_core(kb, c, win.loads(cos, cos_h) + win.loads(sin, sin_h), jobs)
        slots_used = min(2, len(jobs))
        for j, r0, r1, qb in kept:  # ready once the vector unit has rotated the job's rows
            done = (plan.sem["done"][j % slots_used].id, j // slots_used + 1)
            for t0, c0, nr, nc in _token_regions(r0, r1, H, wq):
                byte_off = ((t0 * H + c0 // wq) - r0) * wq * 2
                pieces.append(Piece(t0, c0, nr, nc, _packed(qb, nr, nc, byte_off), None, done))
        plans.append((plan, spans))
    q_rot = TensorRef.onchip("q_rot", (B * T, H * wq), "bf16", pieces) if keep_q else qrot_ref
    cache = cache_ref
    for p, spans in plans:
        for cond, ((r0, r1), (b0, b1)) in zip(p.stored, spans, strict=True):
            for region in _token_regions(r0, r1, H, wq) if r0 < r1 and not keep_q else ():
                q_rot = q_rot.with_ready(*region, cond)
            g = b0
            while g < b1:  # a sequence's run of new rows: cache rows b*cap + C-T+t ..
                b, tok = divmod(g, T)
                n = min(b1, (b + 1) * T) - g
                cache = cache.with_ready(b * cap + C - T + tok, 0, n, wk, cond)
                g += n
    return [p for p, _ in plans], {"q_rot": q_rot, "kv_cache": cache}


def mla_append_tensors(shape: dict[str, Any], spec: ChipSpec) -> tuple[TensorSpec, ...]:
    """mla-append's tensors: q and kv_a (inputs, token-major; the stand-alone program allocates q
    as [batch*tokens*q_heads, nope+rope]), the RoPE rows of the new positions (weights), the
    latent cache (inout) and q_rot (output, q's shape)."""
    cap = _check_mla(shape)
    B, T, H = shape["batch"], shape["tokens"], shape["q_heads"]
    N, P, R = shape["nope_dim"], shape["rope_dim"], shape["kv_lora_rank"]
    return (TensorSpec("q", (B * T, H * (N + P)), "bf16", "input"),
            TensorSpec("kv_a", (B * T, R + P), "bf16", "input"),
            TensorSpec("rope_cos", (T, P // 2), "f32", "weight"),
            TensorSpec("rope_sin", (T, P // 2), "f32", "weight"),
            TensorSpec("kv_cache", (B * cap, R + P), "bf16", "inout"),
            TensorSpec("q_rot", (B * T, H * (N + P)), "bf16", "output"))


def build_mla_append(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """mla-append: rotate the rope part of q and of the new latent rows, write the rows into the cache.

    ``tokens`` new tokens per sequence at positions context-tokens .. context-1 (1: a decode
    step; more: a prefill chunk). Inputs (HBM): q [batch*tokens*q_heads, nope+rope] BF16 (row
    (b*tokens + t)*q_heads + h), kv_a [batch*tokens, kv_lora_rank + rope] BF16 (row b*tokens + t),
    rope_cos / rope_sin [tokens, rope/2] F32 (row t: position context-tokens+t), kv_cache
    [batch*cap, kv_lora_rank + rope] BF16 (cap: ``capacity``, or context rounded up to 32).
    Outputs: q_rot (q's layout) and kv_cache with rows b*cap + context-tokens+t written, every
    other byte as it was.

    Query rows and latent rows are split over the cores in contiguous blocks (a core's tokens
    are then mostly the same for both); each core loads the RoPE table rows of its tokens once
    (``_RopeWindow``). The de-interleave runs over a whole job; the rotation takes six vector
    instructions per token of query rows ([q_heads, P/2] blocks with a broadcast table row) and
    six per sequence run of latent rows (the run's table rows, one per row).
    """
    pl = _mla_plan(shape, spec, Budget.of(spec))  # refuse before building
    cap = pl.cap
    B, C, T, H = shape["batch"], shape["context"], shape["tokens"], shape["q_heads"]
    N, P, R = shape["nope_dim"], shape["rope_dim"], shape["kv_lora_rank"]
    h, wq, wk = P // 2, N + P, R + P
    kb = KernelBuilder(f"mla_append_b{B}_c{C}_h{H}" + (f"_t{T}" if T > 1 else "")
                       + (f"_cap{cap}" if cap != C else ""), chip=spec)
    refs = {"q": kb.hbm("q", (B * T * H, wq), "bf16"), "kv_a": kb.hbm("kv_a", (B * T, wk), "bf16"),
            "rope_cos": kb.hbm("rope_cos", (T, h), "f32"), "rope_sin": kb.hbm("rope_sin", (T, h), "f32"),
            "kv_cache": kb.hbm("kv_cache", (B * cap, wk), "bf16")}
    refs = {k: TensorRef.hbm(k, v) for k, v in refs.items()}
    q_rot = TensorRef.hbm("q_rot", kb.hbm("q_rot", (B * T * H, wq), "bf16"))
    # Core by core, as the program has always been ordered (the timing pass breaks ties between
    # cores' transfers in program order; a fused program emits every core's constants first).
    plans, _ = _mla_append_plans(EmitCtx.standalone(kb), shape, refs, {"q_rot": Out.to(q_rot)})
    for p in plans:
        _prefetch_core(kb, p)
        _run_core(kb, p)
    vector_instructions = sum(
        2 * ((r1 > r0) + (b1 > b0)) + 6 * (len(_rope_segments(r0, r1, H, pl.windows[c])) if r1 > r0 else 0)
        + 6 * (len(_rope_segments(b0, b1, 1, pl.windows[c])) if b1 > b0 else 0)
        for c in range(pl.cores) for r0, r1, b0, b1 in _mla_job_rows(pl, c))
    n_jobs, table_rows = pl.n_jobs, max(w.rows for w in pl.windows)
    q_per = pl.q_blocks[0][1] - pl.q_blocks[0][0]
    kv_per = pl.kv_blocks[0][1] - pl.kv_blocks[0][0]
    q_blocks = pl.q_blocks

    dims = {"batch": B, "context": C, "tokens": T, "q_heads": H, "nope_dim": N, "rope_dim": P,
            "kv_lora_rank": R, "capacity": cap}

    def make_inputs(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        cos_t, sin_t = deepseek_yarn_cos_sin(C, P)
        return {"q": rng.standard_normal((B * T * H, wq)).astype(_BF16),
                "kv_a": rng.standard_normal((B * T, wk)).astype(_BF16),
                "rope_cos": cos_t[C - T:C], "rope_sin": sin_t[C - T:C],
                "kv_cache": rng.standard_normal((B * cap, wk)).astype(_BF16)}

    def reference(inputs):
        q_rot, cache = mla_append_reference(inputs["q"], inputs["kv_a"], inputs["rope_cos"],
                                            inputs["rope_sin"], inputs["kv_cache"], **dims)
        return {"q_rot": q_rot, "kv_cache": cache}

    return KernelBuild(
        program=kb.build(), make_inputs=make_inputs, reference=reference,
        outputs={"q_rot": ("bf16", (B * T * H, wq)), "kv_cache": ("bf16", (B * cap, wk))},
        tolerance=_EXACT,
        notes={"cores": len(q_blocks), "q_rows_per_core": q_per, "cache_rows_per_core": kv_per,
               "jobs_per_core": n_jobs, "tokens": T, "rope_table_rows": table_rows, "cache_capacity": cap,
               "vector_instructions": vector_instructions,
               "bytes_written": (B * T * H * wq + B * T * wk) * 2},
    )


MLA_APPEND = register(KernelDef(
    name="mla-append",
    doc="MLA append (DeepSeek-V3/R1, Kimi K2.5), a decode step or a prefill chunk: DeepSeek RoPE "
        "(de-interleaved, YaRN) on q's rope part and on the new latent rows' k_pe at their positions; "
        "the rows go into mla-decode's / mla-prefill's cache.",
    shape_keys=(
        ShapeKey("batch", int, 2, "sequences", minimum=1),
        ShapeKey("context", int, 96, "tokens in each sequence's cache, the new ones (at context-tokens .. "
                 "context-1) included", minimum=1),
        ShapeKey("tokens", int, 1, "new tokens per sequence (1: decode; a prefill chunk: its seq); "
                 "<= context", minimum=1),
        ShapeKey("capacity", int, 0, "latent cache rows per sequence (kv_cache [batch*capacity, W], "
                 "row b*capacity + position); multiple of 32, >= context; 0: context rounded up to 32",
                 minimum=0),
        ShapeKey("q_heads", int, 8, "query heads (DeepSeek-R1: 128, Kimi K2.5: 64)", minimum=1),
        ShapeKey("nope_dim", int, 32, "per-head non-rope q width (qk_nope_head_dim, 128)", minimum=1),
        ShapeKey("rope_dim", int, 32, "rope width of q and k_pe (qk_rope_head_dim, 64); even", minimum=2),
        ShapeKey("kv_lora_rank", int, 64, "latent width c_kv (DeepSeek/Kimi: 512)", minimum=1),
    ),
    build=build_mla_append,
    emit=lambda ctx, shape, t, outs: emit_mla_append(ctx, shape, t, outs),
    tensors_of=mla_append_tensors,
))
