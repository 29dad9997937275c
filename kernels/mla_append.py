"""MLA latent-cache append (``mla-append``, DeepSeek-V3/R1, Kimi K2.5).

``mla-append`` rotates the rope part of the query (``q_rot``; the nope part is copied unchanged)
and writes row ``b*cap + context - 1`` of ``kv_cache`` [batch*cap, kv_lora_rank + rope] =
[c_kv | rope(k_pe)], ``mla-decode``'s layout: ``cap`` = shape key ``capacity``, or context
rounded up to 32 when that is 0 (``mla.latent_cache_capacity``), so that an append at context c
and mla-decode at context c (same ``capacity``) share one buffer. With ``tokens`` > 1 it appends
a prefill chunk (what ``mla-prefill`` with ``prior`` = context - tokens reads, with the same
``capacity``): the new tokens sit at positions context-tokens .. context-1, q rows
``(b*tokens + t)*q_heads + h`` and kv_a rows ``b*tokens + t`` rotate at position
context-tokens+t (row t of the [tokens, rope/2] tables) and land in cache rows
``b*cap + context-tokens+t``. The RoPE is DeepSeek-V3's (``apply_rotary_pos_emb`` of HF
``modeling_deepseek``): the rope dims are de-interleaved (pair (x[2i], x[2i+1]) -> x1[i] = x[2i],
x2[i] = x[2i+1]), then rotated with rotate-half (``append_base.rope_rotate_half``:
[x1*cos - x2*sin | x2*cos + x1*sin], FP32 products, one BF16 rounding, as kv-append does) and
stored in that de-interleaved order, for q and k alike (so scores q.k are those of the interleaved
rotation). The tables come from ``deepseek_yarn_cos_sin``.

How it runs (the job pipeline of ``append_base``): query rows and cache rows go to the cores in
contiguous blocks. The de-interleave of the rope dims is one vector copy per half: the rope part
is loaded packed, [rows, rope_dim] is viewed as [rows*rope_dim/2, 2], and its two columns are the
even and the odd dims. A chunk's rows have a position each: a core loads the table rows of its
tokens once, the de-interleave still runs over a whole job, and the rotation is six vector
instructions per token of query rows (a [q_heads, rope/2] block against one broadcast table row)
and six per sequence run of latent rows (against the run's table rows, one per row); each
sequence's run of cache rows is one DMA (whole sequences together: one strided DMA). A small
decode step in a fused program keeps its rotated queries on chip (``_keeps_q_rot``,
``_HeadLocalQ``).

What bounds it: a decode step is latency-bound (a few KB per core: DMA set-ups and the launch).
A prefill chunk moves MBs per core and is HBM-bound: q's nope part goes back while the vector
unit rotates, and the core takes at least two jobs so that loads overlap stores (DeepSeek-R1,
2048 tokens: 207 MB in 18.4 us on jalapeno-v1, 1.09x launch + the busiest channel's time).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import CoreHandle, EngineHandle, KernelBuilder, Semaphore
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.lazy import LazyModule

from .append_base import (
    APPEND_SRAM_SHARE,
    BIT_EXACT,
    CorePlan,
    From,
    Job,
    aligned_nbytes,
    jobs_needed,
    packed_view,
    plan_core,
    prefetch_core,
    rope_rotate_half,
    rotate_half,
    rows_loads,
    run_core,
    split_blocks,
)
from .base import KernelBuild, KernelDef, ShapeKey, TensorSpec
from .emit import EmitCtx, Emitter, Out, Piece, TensorRef
from .mla import latent_cache_capacity
from .planning import Budget
from .registry import register

ml_dtypes = LazyModule("ml_dtypes")  # loaded on first use: importing it costs 0.5 s

jnp = LazyModule("jax.numpy")

__all__ = ["MLA_APPEND", "YARN_DEEPSEEK_V3", "deepseek_yarn_cos_sin", "mla_append_reference",
           "rope_deinterleaved"]

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


def rope_deinterleaved(x, cos, sin) -> np.ndarray:
    """DeepSeek-V3's RoPE: de-interleave the last axis (evens, then odds), then ``rope_rotate_half``."""
    x = np.asarray(x, np.float32)
    return rope_rotate_half(np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1), cos, sin)


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
    q_rot = (np.concatenate([qq[..., :n], q_pe], axis=-1).astype(ml_dtypes.bfloat16)
             .reshape(batch * t * q_heads, -1))
    kv = np.asarray(kv_a, np.float32).reshape(batch, t, r + rope_dim)
    rows = np.concatenate([kv[..., :r], rope_deinterleaved(kv[..., r:], cos[None], sin[None])], axis=-1)
    cap = latent_cache_capacity(context, capacity)
    if np.shape(kv_cache) != (batch * cap, r + rope_dim):
        raise InvalidArgumentError(f"kv_cache has shape {np.shape(kv_cache)}; batch={batch} sequences of "
                                   f"cap={cap} rows need ({batch * cap}, {r + rope_dim})")
    cache = np.array(kv_cache, dtype=ml_dtypes.bfloat16, copy=True).reshape(batch, cap, r + rope_dim)
    cache[:, context - t:context] = rows.astype(ml_dtypes.bfloat16)
    return q_rot, cache.reshape(np.shape(kv_cache))


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
    vpu.copy(packed_view(x1, pairs, 1), packed_view(packed, pairs, 1, stride=4))
    vpu.copy(packed_view(x2, pairs, 1), packed_view(packed, pairs, 1, byte_off=2, stride=4))
    for s in segments:
        r, m = s.row, s.rows
        rotate_half(vpu, out.sub(r, 0, m, h), out.sub(r, h, m, h), x1.sub(r, 0, m, h), x2.sub(r, 0, m, h),
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
            out.append((dst, packed_view(rows, k, tokens * w, byte_off=(g - g0) * rows.stride)))
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
    q_blocks, kv_blocks = split_blocks(B * T * H, cores), split_blocks(B * T, cores)
    q_per, kv_per = q_blocks[0][1] - q_blocks[0][0], kv_blocks[0][1] - kv_blocks[0][0]
    n_cores = max(len(q_blocks), len(kv_blocks))
    windows = [_rope_window(q_blocks[c] if c < len(q_blocks) else (0, 0),
                            kv_blocks[c] if c < len(kv_blocks) else (0, 0), H, T) for c in range(n_cores)]
    table_rows = max(w.rows for w in windows)
    sram = (min(budget.sram_bytes, int(spec.sram.scratchpad_bytes * APPEND_SRAM_SHARE))
            - 2 * aligned_nbytes(table_rows, h, "f32"))

    def fits(n: list[int]) -> bool:  # per slot the row buffers and packed rope parts; shared scratch
        nq, nk = n
        rows = max(nq, nk)
        slot = sum(aligned_nbytes(n, w, "bf16") for n, w in ((nq, wq), (nq, P), (nk, wk), (nk, P)))
        return 2 * slot + 2 * aligned_nbytes(rows, h, "bf16") + 2 * aligned_nbytes(rows, h, "f32") <= sram

    n_jobs = jobs_needed([q_per, kv_per], fits,
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
        prefetch_core(ctx.kb, p)
    yield refs
    if local is not None:
        local.rotate(ctx.kb)
    waited: dict[Any, set] = {}
    for p in plans:
        run_core(ctx.kb, p, waited)
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
                      ) -> tuple[list[CorePlan], dict[str, TensorRef]]:
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
        qrot_h = packed_view(qrot_ref.base, B * T * H, wq)
    q_packed = q_ref.in_hbm and not q_ref.waits() and q_ref.base.contiguous
    q_h = packed_view(q_ref.base, B * T * H, wq) if q_packed else None
    cos_h, sin_h = t["rope_cos"].base, t["rope_sin"].base
    cache_h = cache_ref.base
    plans: list[tuple[CorePlan, list[tuple[tuple[int, int], tuple[int, int]]]]] = []
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
            job, parts, copies = Job(), [], []
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
                    job.loads += rows_loads(q_ref, qb.sub(0, 0, n, wq), r0, n, H, wq)
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
                job.loads += [(row.sub(0, 0, n, R), From(kva_ref, b0, 0)),
                              (pe.sub(0, 0, n, P), From(kva_ref, b0, R))]
                job.stores += _cache_stores(cache_h, row.sub(0, 0, n, wk), b0, T, C, cap)
                parts.append((row.sub(0, R, n, P), pe.sub(0, 0, n, P), _rope_segments(b0, b1, 1, win)))
            if parts:
                rotate = functools.partial(_rotate_parts, parts=parts, scratch=scratch, cos=cos, sin=sin)
                job.compute = functools.partial(_copy_then, copies=copies, then=rotate) if copies else rotate
                jobs.append(job)
                spans.append(((r0, r1), (b0, b1)))
        plan = plan_core(kb, c, win.loads(cos, cos_h) + win.loads(sin, sin_h), jobs)
        slots_used = min(2, len(jobs))
        for j, r0, r1, qb in kept:  # ready once the vector unit has rotated the job's rows
            done = (plan.sem["done"][j % slots_used].id, j // slots_used + 1)
            for t0, c0, nr, nc in _token_regions(r0, r1, H, wq):
                byte_off = ((t0 * H + c0 // wq) - r0) * wq * 2
                pieces.append(Piece(t0, c0, nr, nc, packed_view(qb, nr, nc, byte_off), None, done))
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
        prefetch_core(kb, p)
        run_core(kb, p)
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
        return {"q": rng.standard_normal((B * T * H, wq)).astype(ml_dtypes.bfloat16),
                "kv_a": rng.standard_normal((B * T, wk)).astype(ml_dtypes.bfloat16),
                "rope_cos": cos_t[C - T:C], "rope_sin": sin_t[C - T:C],
                "kv_cache": rng.standard_normal((B * cap, wk)).astype(ml_dtypes.bfloat16)}

    def reference(inputs):
        q_rot, cache = mla_append_reference(inputs["q"], inputs["kv_a"], inputs["rope_cos"],
                                            inputs["rope_sin"], inputs["kv_cache"], **dims)
        return {"q_rot": q_rot, "kv_cache": cache}

    return KernelBuild(
        program=kb.build(), make_inputs=make_inputs, reference=reference,
        outputs={"q_rot": ("bf16", (B * T * H, wq)), "kv_cache": ("bf16", (B * cap, wk))},
        tolerance=BIT_EXACT,
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

