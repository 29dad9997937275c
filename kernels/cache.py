"""KV-cache append: the decode step writes its new token into the cache the attention kernels read.

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
(``q_rot``; the nope part is copied unchanged) and writes row ``b*context + context - 1`` of
``kv_cache`` = [c_kv | rope(k_pe)], ``mla-decode``'s layout. The RoPE is DeepSeek-V3's
(``apply_rotary_pos_emb`` of HF ``modeling_deepseek``): the rope dims are de-interleaved (pair
(x[2i], x[2i+1]) -> x1[i] = x[2i], x2[i] = x[2i+1]), then rotated with rotate-half as above and
stored in that de-interleaved order, for q and k alike (so scores q.k are those of the interleaved
rotation). The tables come from ``deepseek_yarn_cos_sin``.

How it runs: work items (kv-append: (sequence, KV head) pairs; mla-append: query rows and cache
rows) go to the cores in contiguous blocks, so that one core's rows are contiguous in the inputs
and evenly strided in the caches: each block moves with one DMA descriptor per tensor. The K^T
column of a block of items is one strided [items*head_dim, 1] store (the K^T rows of consecutive
(sequence, head) pairs follow each other), the V rows one [items, head_dim] store with a stride of
``cap`` rows. The de-interleave of the MLA rope dims is one vector copy per half: the rope part
is loaded packed, [rows, rope_dim] is viewed as [rows*rope_dim/2, 2], and its two columns are the
even and the odd dims. A core whose share does not fit its scratchpad walks it in jobs on two
buffer slots (loads of job j+1 overlap the work on job j).

What bounds them: a few KB per core, so the DMA fixed costs (descriptor set-up, HBM latency) and
the launch: about two DMA round trips plus a dozen vector instructions. Latency-bound at every size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu.program import Tile
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import EngineHandle, KernelBuilder
from jalapeno_emu.isa.table import DTYPES

from .attention_ref import yarn_cos_sin
from .base import KernelBuild, KernelDef, ShapeKey, Tolerance
from .registry import register

__all__ = [
    "KV_APPEND",
    "MLA_APPEND",
    "YARN_DEEPSEEK_V3",
    "deepseek_yarn_cos_sin",
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


def mla_append_reference(q, kv_a, rope_cos, rope_sin, kv_cache, *, batch: int, context: int, q_heads: int,
                         nope_dim: int, rope_dim: int, kv_lora_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(q_rot, kv_cache) after ``mla-append``, BF16 arrays of the inputs' shapes.

    q_rot[r] = [q_nope[r] | rope(q_pe[r])] for every row r = b*q_heads + h;
    kv_cache[b*context + context-1] = [c_kv[b] | rope(k_pe[b])]; rope = ``rope_deinterleaved``.
    """
    cos = np.asarray(rope_cos, np.float32).reshape(1, -1)
    sin = np.asarray(rope_sin, np.float32).reshape(1, -1)
    n, r = nope_dim, kv_lora_rank
    qq = np.asarray(q, np.float32).reshape(batch * q_heads, n + rope_dim)
    q_rot = np.concatenate([qq[:, :n], rope_deinterleaved(qq[:, n:], cos, sin)], axis=1).astype(_BF16)
    kv = np.asarray(kv_a, np.float32).reshape(batch, r + rope_dim)
    row = np.concatenate([kv[:, :r], rope_deinterleaved(kv[:, r:], cos, sin)], axis=1).astype(_BF16)
    cache = np.array(kv_cache, dtype=_BF16, copy=True)
    cache[np.arange(batch) * context + context - 1] = row
    return q_rot, cache


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


def _nbytes(rows: int, cols: int, dtype: str) -> int:
    return -(-rows * DTYPES[dtype].row_bytes(cols) // _ALIGN_BYTES) * _ALIGN_BYTES


# --- the per-core pipeline ----------------------------------------------------------------------
@dataclass
class _Job:
    """One core's block of rows: what to load, store as loaded, compute, and store after.

    loads: (SRAM dst, HBM src); passthrough: (HBM dst, SRAM src) stored as soon as loaded;
    compute: issues the vector work on the vector unit; stores: (HBM dst, SRAM src) after it.
    """

    loads: list[tuple[Tile, Tile]] = field(default_factory=list)
    passthrough: list[tuple[Tile, Tile]] = field(default_factory=list)
    compute: Callable[[EngineHandle], None] | None = None
    stores: list[tuple[Tile, Tile]] = field(default_factory=list)


def _emit_core(kb: KernelBuilder, c: int, consts: list[tuple[Tile, Tile]], jobs: list[_Job]) -> None:
    """Issue core ``c``'s jobs on two buffer slots: slot s loads on queue s and stores on queue
    2+s; a slot is reloaded once its previous job is stored; the vector unit starts once the
    constants (``consts``, queue 0) and the job's loads have landed."""
    if not jobs:
        return
    core, slots = kb.core(c), min(2, len(jobs))
    nq = len(core.dma)
    sem = {n: [kb.semaphore(f"c{c}.{n}{s}") for s in range(slots)] for n in ("loaded", "done", "stored")}
    if consts:
        ready = kb.semaphore(f"c{c}.consts")
        for dst, src in consts:
            core.dma[0].load(dst, src)
        core.dma[0].signal(ready)
        core.vpu.wait(ready, 1)
    for j, job in enumerate(jobs):
        s, use = j % slots, j // slots + 1
        lq, sq = core.dma[s % nq], core.dma[(2 + s) % nq]
        if use > 1:
            lq.wait(sem["stored"][s], use - 1)
        for dst, src in job.loads:
            lq.load(dst, src)
        lq.signal(sem["loaded"][s])
        sq.wait(sem["loaded"][s], use)
        for dst, src in job.passthrough:
            sq.store(dst, src)
        if job.compute is not None:
            core.vpu.wait(sem["loaded"][s], use)
            job.compute(core.vpu)
            core.vpu.signal(sem["done"][s])
            sq.wait(sem["done"][s], use)
        for dst, src in job.stores:
            sq.store(dst, src)
        sq.signal(sem["stored"][s])


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
    d, kvd = shape["head_dim"], shape["kv_dtype"]
    if d % 32:
        raise InvalidArgumentError(f"shape key head_dim={d} must be a multiple of 32: attention-decode "
                                   "contracts over head_dim in 32-element matrix-unit blocks")
    if kvd != "bf16":
        raise InvalidArgumentError(
            f"shape key kv_dtype={kvd!r}: kv-append writes BF16 caches only. An MXFP8 V cache is "
            "blocked by 32 along tokens, so appending re-quantises a partly filled block along rows, "
            "which the vector unit's vec.quantize (blocked along columns) does not do")


def build_kv_append(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """kv-append: rotate each sequence's new key and write it and its value into the caches."""
    _check_kv(shape)
    bsz, ctx, hkv, d, kvd = (shape[k] for k in ("batch", "context", "kv_heads", "head_dim", "kv_dtype"))
    h, items = d // 2, bsz * hkv
    cap = -(-ctx // 32) * 32
    pad_k = spec.hbm.interleave_bytes * 8 // DTYPES[kvd].bits  # attention-decode's K^T row padding
    blocks = _split(items, min(spec.core.count, items))
    per_core = blocks[0][1] - blocks[0][0]
    budget = int(spec.sram.scratchpad_bytes * _SRAM_SHARE) - 2 * _nbytes(1, h, "f32")

    def fits(n: list[int]) -> bool:  # two slots of k in/out and v, one pair of FP32 temporaries
        g = n[0]
        return 2 * 3 * _nbytes(g, d, "bf16") + 2 * _nbytes(g, h, "f32") <= budget

    n_jobs = _jobs_needed([per_core], fits, f"shape key head_dim={d}: one (sequence, KV head) item "
                          f"does not fit {spec.name}'s {spec.sram.scratchpad_bytes:,} B scratchpad")
    per_job = -(-per_core // n_jobs)

    kb = KernelBuilder(f"kv_append_b{bsz}_ctx{ctx}", chip=spec)
    k_new = kb.hbm("k_new", (bsz, hkv * d), "bf16")
    v_new = kb.hbm("v_new", (bsz, hkv * d), "bf16")
    cos_h, sin_h = kb.hbm("rope_cos", (1, h), "f32"), kb.hbm("rope_sin", (1, h), "f32")
    k_cache = kb.hbm("k_cache", (items * d, cap + pad_k), kvd)
    v_cache = kb.hbm("v_cache", (items * cap, d), kvd)
    k_rows, v_rows = _packed(k_new, items, d), _packed(v_new, items, d)  # row b*G + g
    for c, (lo, hi) in enumerate(blocks):
        cos, sin = kb.sram(c, "cos", (1, h), "f32"), kb.sram(c, "sin", (1, h), "f32")
        slots = min(2, n_jobs)
        kin = [kb.sram(c, f"kin{s}", (per_job, d), "bf16") for s in range(slots)]
        kout = [kb.sram(c, f"kout{s}", (per_job, d), "bf16") for s in range(slots)]
        vbuf = [kb.sram(c, f"v{s}", (per_job, d), "bf16") for s in range(slots)]
        t1, t2 = kb.sram(c, "t1", (per_job, h), "f32"), kb.sram(c, "t2", (per_job, h), "f32")
        jobs = []
        for j, i0 in enumerate(range(lo, hi, per_job)):
            n, s = min(per_job, hi - i0), j % slots
            x, out, v = kin[s].sub(0, 0, n, d), kout[s].sub(0, 0, n, d), vbuf[s].sub(0, 0, n, d)
            compute = functools.partial(
                _rotate_half, out1=out.sub(0, 0, n, h), out2=out.sub(0, h, n, h), x1=x.sub(0, 0, n, h),
                x2=x.sub(0, h, n, h), cos=cos, sin=sin, t1=t1.sub(0, 0, n, h), t2=t2.sub(0, 0, n, h))
            jobs.append(_Job(
                loads=[(x, k_rows.sub(i0, 0, n, d)), (v, v_rows.sub(i0, 0, n, d))],
                # row i0*cap + ctx-1 of V, then every cap-th row: the next (sequence, head)'s
                passthrough=[(_rows_every(v_cache, i0 * cap + ctx - 1, n, cap), v)],
                compute=compute,
                # column ctx-1 of K^T rows i0*D .. (i0+n)*D: the rotated rows, packed, as a column
                stores=[(k_cache.sub(i0 * d, ctx - 1, n * d, 1), _packed(out, n * d, 1))]))
        _emit_core(kb, c, [(cos, cos_h), (sin, sin_h)], jobs)

    def make_inputs(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        cos_t, sin_t = yarn_cos_sin(ctx, d)
        return {
            "k_new": rng.standard_normal((bsz, hkv * d)).astype(_BF16),
            "v_new": rng.standard_normal((bsz, hkv * d)).astype(_BF16),
            "rope_cos": cos_t[ctx - 1:ctx], "rope_sin": sin_t[ctx - 1:ctx],
            # the whole allocation random (padding included): any byte the kernel must not touch
            # differs from what it would write
            "k_cache": rng.standard_normal((items * d, cap + pad_k)).astype(_BF16),
            "v_cache": rng.standard_normal((items * cap, d)).astype(_BF16),
        }

    def reference(inputs):
        kc, vc = kv_append_reference(inputs["k_new"], inputs["v_new"], inputs["rope_cos"], inputs["rope_sin"],
                                     inputs["k_cache"], inputs["v_cache"], batch=bsz, context=ctx,
                                     kv_heads=hkv, head_dim=d)
        return {"k_cache": kc, "v_cache": vc}

    return KernelBuild(
        program=kb.build(), make_inputs=make_inputs, reference=reference,
        outputs={"k_cache": (kvd, (items * d, cap + pad_k)), "v_cache": (kvd, (items * cap, d))},
        tolerance=_EXACT,
        notes={"cores": len(blocks), "items": items, "items_per_core": per_core, "jobs_per_core": n_jobs,
               "cap": cap, "k_row_pad": pad_k, "bytes_written": items * d * 2 * 2},
    )


_EXACT = Tolerance(atol=0.0, rtol=0.0, why="bit-exact: the same FP32 vector operations in the same "
                   "order as the reference, one rounding to BF16; every other byte is copied")

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
        ShapeKey("kv_dtype", str, "bf16", "KV cache element type (fp8e4 is refused: see the error)",
                 choices=("bf16", "fp8e4")),
    ),
    build=build_kv_append,
))


# --- mla-append ---------------------------------------------------------------------------------
def _check_mla(shape: dict[str, Any]) -> None:
    p = shape["rope_dim"]
    if p % 2:
        raise InvalidArgumentError(f"shape key rope_dim={p} must be even: RoPE rotates pairs of dims")


def _deinterleave_rotate(vpu: EngineHandle, out: Tile, packed: Tile, x1: Tile, x2: Tile, cos: Tile,
                         sin: Tile, t1: Tile, t2: Tile) -> None:
    """out [n, P] = DeepSeek RoPE of ``packed`` [n, P] (BF16, packed rows): its [n*P/2, 2] view's
    columns are the even and odd dims, copied (exactly) into x1, x2 [n, P/2], then rotate-half."""
    n, p = packed.rows, packed.cols
    h = p // 2
    pairs = n * h
    vpu.copy(_packed(x1, pairs, 1), _packed(packed, pairs, 1, stride=4))
    vpu.copy(_packed(x2, pairs, 1), _packed(packed, pairs, 1, byte_off=2, stride=4))
    _rotate_half(vpu, out.sub(0, 0, n, h), out.sub(0, h, n, h), x1, x2, cos, sin, t1, t2)


def _rotate_parts(vpu: EngineHandle, parts: list[tuple[Tile, Tile]], scratch: tuple[Tile, ...], cos: Tile,
                  sin: Tile) -> None:
    """``_deinterleave_rotate`` of each (out, packed) pair, on the first rows of the shared
    scratch tiles (x1, x2 BF16 and t1, t2 FP32, each [rows, P/2])."""
    for out, packed in parts:
        n, h = packed.rows, packed.cols // 2
        x1, x2, t1, t2 = (t.sub(0, 0, n, h) for t in scratch)
        _deinterleave_rotate(vpu, out, packed, x1, x2, cos, sin, t1, t2)


def build_mla_append(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """mla-append: rotate the rope part of q and of the new latent row, write the row into the cache."""
    _check_mla(shape)
    B, C, H = shape["batch"], shape["context"], shape["q_heads"]
    N, P, R = shape["nope_dim"], shape["rope_dim"], shape["kv_lora_rank"]
    h, wq, wk = P // 2, N + P, R + P
    cores = min(spec.core.count, B * H)
    q_blocks, kv_blocks = _split(B * H, cores), _split(B, cores)
    q_per, kv_per = q_blocks[0][1] - q_blocks[0][0], kv_blocks[0][1] - kv_blocks[0][0]
    budget = int(spec.sram.scratchpad_bytes * _SRAM_SHARE) - 2 * _nbytes(1, h, "f32")

    def fits(n: list[int]) -> bool:  # per slot the row buffers and packed rope parts; shared scratch
        nq, nk = n
        rows = max(nq, nk)
        slot = sum(_nbytes(n, w, "bf16") for n, w in ((nq, wq), (nq, P), (nk, wk), (nk, P)))
        return 2 * slot + 2 * _nbytes(rows, h, "bf16") + 2 * _nbytes(rows, h, "f32") <= budget

    n_jobs = _jobs_needed([q_per, kv_per], fits,
                          f"shape keys nope_dim={N}, rope_dim={P}, kv_lora_rank={R}: one query row and one "
                          f"cache row do not fit {spec.name}'s {spec.sram.scratchpad_bytes:,} B scratchpad")
    nq_job, nk_job = -(-q_per // n_jobs), -(-kv_per // n_jobs)

    kb = KernelBuilder(f"mla_append_b{B}_c{C}_h{H}", chip=spec)
    q_h = kb.hbm("q", (B * H, wq), "bf16")
    kva_h = kb.hbm("kv_a", (B, wk), "bf16")
    cos_h, sin_h = kb.hbm("rope_cos", (1, h), "f32"), kb.hbm("rope_sin", (1, h), "f32")
    cache_h = kb.hbm("kv_cache", (B * C, wk), "bf16")
    qrot_h = kb.hbm("q_rot", (B * H, wq), "bf16")
    for c in range(max(len(q_blocks), len(kv_blocks))):
        cos, sin = kb.sram(c, "cos", (1, h), "f32"), kb.sram(c, "sin", (1, h), "f32")
        slots = min(2, n_jobs)
        rows = max(nq_job, nk_job)
        sizes = (("q", nq_job, wq), ("qpe", nq_job, P), ("kv", nk_job, wk), ("kpe", nk_job, P))
        buf = {name: [kb.sram(c, f"{name}{s}", (n, w), "bf16") for s in range(slots)] for name, n, w in sizes}
        scratch = (kb.sram(c, "x1", (rows, h), "bf16"), kb.sram(c, "x2", (rows, h), "bf16"),
                   kb.sram(c, "t1", (rows, h), "f32"), kb.sram(c, "t2", (rows, h), "f32"))
        q_lo, q_hi = q_blocks[c] if c < len(q_blocks) else (0, 0)
        k_lo, k_hi = kv_blocks[c] if c < len(kv_blocks) else (0, 0)
        jobs = []
        for j in range(n_jobs):
            s = j % slots
            job, parts = _Job(), []
            r0, r1 = q_lo + j * nq_job, min(q_hi, q_lo + (j + 1) * nq_job)
            if r0 < r1:  # query rows: nope copied through, rope part rotated into the row buffer
                n, qb, pe = r1 - r0, buf["q"][s], buf["qpe"][s]
                job.loads += [(qb.sub(0, 0, n, N), q_h.sub(r0, 0, n, N)),
                              (pe.sub(0, 0, n, P), q_h.sub(r0, N, n, P))]
                job.stores.append((qrot_h.sub(r0, 0, n, wq), qb.sub(0, 0, n, wq)))
                parts.append((qb.sub(0, N, n, P), pe.sub(0, 0, n, P)))
            b0, b1 = k_lo + j * nk_job, min(k_hi, k_lo + (j + 1) * nk_job)
            if b0 < b1:  # the new latent rows: c_kv through, k_pe rotated; row b*C + C-1 of the cache
                n, row, pe = b1 - b0, buf["kv"][s], buf["kpe"][s]
                job.loads += [(row.sub(0, 0, n, R), kva_h.sub(b0, 0, n, R)),
                              (pe.sub(0, 0, n, P), kva_h.sub(b0, R, n, P))]
                job.stores.append((_rows_every(cache_h, b0 * C + C - 1, n, C), row.sub(0, 0, n, wk)))
                parts.append((row.sub(0, R, n, P), pe.sub(0, 0, n, P)))
            if parts:
                job.compute = functools.partial(_rotate_parts, parts=parts, scratch=scratch, cos=cos, sin=sin)
                jobs.append(job)
        _emit_core(kb, c, [(cos, cos_h), (sin, sin_h)], jobs)

    dims = {"batch": B, "context": C, "q_heads": H, "nope_dim": N, "rope_dim": P, "kv_lora_rank": R}

    def make_inputs(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        cos_t, sin_t = deepseek_yarn_cos_sin(C, P)
        return {"q": rng.standard_normal((B * H, wq)).astype(_BF16),
                "kv_a": rng.standard_normal((B, wk)).astype(_BF16),
                "rope_cos": cos_t[C - 1:C], "rope_sin": sin_t[C - 1:C],
                "kv_cache": rng.standard_normal((B * C, wk)).astype(_BF16)}

    def reference(inputs):
        q_rot, cache = mla_append_reference(inputs["q"], inputs["kv_a"], inputs["rope_cos"],
                                            inputs["rope_sin"], inputs["kv_cache"], **dims)
        return {"q_rot": q_rot, "kv_cache": cache}

    return KernelBuild(
        program=kb.build(), make_inputs=make_inputs, reference=reference,
        outputs={"q_rot": ("bf16", (B * H, wq)), "kv_cache": ("bf16", (B * C, wk))},
        tolerance=_EXACT,
        notes={"cores": len(q_blocks), "q_rows_per_core": q_per, "cache_rows_per_core": kv_per,
               "jobs_per_core": n_jobs, "bytes_written": (B * H * wq + B * wk) * 2},
    )


MLA_APPEND = register(KernelDef(
    name="mla-append",
    doc="Decode-step MLA append (DeepSeek-V3/R1, Kimi K2.5): DeepSeek RoPE (de-interleaved, YaRN) "
        "on q's rope part and on the new latent row's k_pe; the row goes into mla-decode's cache.",
    shape_keys=(
        ShapeKey("batch", int, 2, "sequences, one new token each", minimum=1),
        ShapeKey("context", int, 96, "tokens in each sequence's cache, the new one (at context-1) "
                 "included", minimum=1),
        ShapeKey("q_heads", int, 8, "query heads (DeepSeek-R1: 128, Kimi K2.5: 64)", minimum=1),
        ShapeKey("nope_dim", int, 32, "per-head non-rope q width (qk_nope_head_dim, 128)", minimum=1),
        ShapeKey("rope_dim", int, 32, "rope width of q and k_pe (qk_rope_head_dim, 64); even", minimum=2),
        ShapeKey("kv_lora_rank", int, 64, "latent width c_kv (DeepSeek/Kimi: 512)", minimum=1),
    ),
    build=build_mla_append,
))
