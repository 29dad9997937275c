"""Multi-head latent attention (DeepSeek-V3/R1, Kimi K2.5): decode (absorbed) and prefill (naive).

The compressed KV cache holds per token one row ``[c_kv | k_pe]`` of ``kv_lora_rank + rope_dim``
BF16 values (512 + 64 for DeepSeek/Kimi), shared by every query head. Inputs are in HBM, BF16:

- ``q``: [tokens*q_heads, nope_dim + rope_dim], row ``token*q_heads + h`` = ``[q_nope | q_pe]``
  of head h, i.e. the output of q_b_proj with RoPE already applied to q_pe (the q down/up
  projections and RoPE are not part of these kernels).
- ``kv_cache``: [batch*cap, kv_lora_rank + rope_dim], row ``b*cap + t`` = ``[c_kv | k_pe]`` of
  position t (k_pe already rotated). ``cap`` (tokens per sequence) is shape key ``capacity``, or,
  when that is 0, the sequence's tokens rounded up to 32 (``latent_cache_capacity``): decode's
  ``context``, prefill's ``prior + seq``; mla-append writes the same layout. Rows t >= the
  sequence's tokens are padding: their contents never reach the output (decode masks them).
- ``w_kv_b``: [q_heads*(nope_dim + v_head_dim), kv_lora_rank], DeepSeek's ``kv_b_proj.weight``:
  rows ``h*(nope+v) ..+nope`` are W_UK[h] (k_nope = c_kv @ W_UK[h]^T), the next ``v`` rows
  W_UV[h] (v = c_kv @ W_UV[h]^T).
- output ``out``: [tokens*q_heads, v_head_dim], row ``token*q_heads + h``.

``mla-decode`` (one query token per sequence, absorbed form), three phases on every core:

1. absorb (heads split over cores): q_lat[b, h] = bf16(q_nope[b, h] @ W_UK[h]) for all b at
   once (M = batch), then SRAM-to-SRAM DMA copies deliver each sequence's [q_heads, R] block to
   the core that owns the sequence (no HBM round trip);
2. attention (sequences split over cores): per context tile of T tokens, one ``mxu.matmul_t``
   S = [q_lat | q_pe] @ [c_kv | k_pe]^T for all heads (M = q_heads), an online softmax on the
   vector unit, and P @ c_kv into the latent output. The cache tile is loaded once for all heads:
   that is what makes MLA decode cheap in bytes. Up to four tiles are in flight (a tile's load,
   set-up and latency included, outlasts one tile of matrix work) and the matrix unit runs the
   scores of tile j+1 before the P @ c_kv of tile j so that it does not wait on the softmax;
3. up-projection (heads split over cores): o_lat rows are copied back to their head's core and
   out[b, h] = bf16(bf16(o_lat[b, h]) @ W_UV[h]^T) (M = batch).

Any ``context`` >= 1 works: the matrix unit contracts P @ c_kv over 32-token blocks, so the
tiles cover the context rounded up to 32 (``span``), and when that adds padding, the softmax of
each sequence's last tile first sets the scores of the padded positions (its last span - context
columns) to ``MASK_VALUE`` (-1e30) with one ``vec.clamp(s, s, -1e30, -1e30)``: the same masking
as attention-decode's additive 0 / -1e30 tile, without a mask input, its load (64 cores reading
one HBM row contend on one pseudo-channel: 0.2 us at DeepSeek-R1 batch 64) or an add over
the real columns. The masked scores are exactly -1e30 whatever the padded rows hold, so their P
is exactly 0 and they add exactly 0 to the row sum and to P @ c_kv, as long as the padding is
finite (0 x inf is NaN). -1e30 rather than -inf for attention-decode's reason; here the tile also
holds the real token context-1, so the row maximum is a real score. A context that is a
multiple of 32 has no masking and the program of a full cache.

HBM traffic is the cache once, the weights once, q and out. With DeepSeek's 128 heads the
FLOPs per cached byte are 2*128*(576 + 512)/1152 = 242, just above BF16's FLOP/byte balance on
jalapeno-v1 (3.36 PFLOP/s over 15.4 TB/s = 218, or 242 against the 90 % achievable HBM rate): the
cache stream and the BF16 matrix work take about the same time, and the phases before and after
the stream (absorption, the two all-to-all copy rounds, up-projection) add a fixed ~10 us. Kimi's
64 heads halve the FLOPs and leave decode HBM-bound.

``mla-prefill`` uses the naive (non-absorbed) form on a chunk of ``seq`` new tokens per
sequence after ``prior`` tokens already cached (chunked prefill; shape key ``prior``, 0 for a
whole prompt). ``prior`` and ``seq`` must be multiples of 32: the prior context's key tiles and
the chunk's key tiles are contraction dimensions of P @ V, in 32-token blocks, and the causal
mask is one [T, T] pattern per diagonal tile (a ragged chunk would need a padding mask too; a
prompt's tail shorter than a block can go through mla-decode token by token). ``kv_cache``
arrives with all prior + seq rows of each sequence filled, the chunk's included (the model's
append step writes them, k_pe rotated), in mla-decode's layout (``cap`` rows per sequence);
the kernel only reads it. ``q`` rows are the chunk's tokens, q_pe rotated at positions
prior..prior+seq-1. Per (sequence, head) work item,
K_h = [bf16(c_kv @ W_UK[h]^T) | k_pe] and V_h = bf16(c_kv @ W_UV[h]^T) are decompressed into SRAM
for all prior + seq tokens, then causal flash attention over T-token tiles: query tile i walks
the prior context's key tiles unmasked, then the chunk's key tiles (aligned with the query
tiles) up to its diagonal, which adds a constant [T, T] mask input of 0 / -inf. Items are spread
over cores; each item re-reads the sequence's latent cache (c_kv is small next to the attention
FLOPs, which bound prefill). K_h and V_h of the whole context must fit a core's scratchpad:
with DeepSeek's dims and a 2048-token chunk on jalapeno-v1 the tile is 256 up to prior 4096,
224 at prior 6144, and shrinks to 32 (many more, smaller instructions) near prior 8192; beyond
about prior + seq = 10k tokens the shape is refused.

Softmax scale: shape key ``softmax_scale``; 0 means the plain 1/sqrt(nope_dim + rope_dim).
DeepSeek-V3/R1 with YaRN (factor 40, mscale_all_dim 1) use ``yarn_softmax_scale()`` = that times
mscale^2 = (0.1*ln(40) + 1)^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu.program import Tile
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder, Semaphore

from .attention_ref import MASK_VALUE
from .base import KernelBuild, KernelDef, ShapeKey, Tolerance
from .registry import register

__all__ = ["MLA_DECODE", "MLA_PREFILL", "latent_cache_capacity", "mla_decode_reference",
           "mla_prefill_reference", "yarn_softmax_scale"]

_MAX_DECODE_TILE = 512  # context tokens per tile: big enough to amortise DMA set-up and issue
_MAX_DECODE_BUFFERS = 4  # latent cache tiles in flight per core
_MAX_PREFILL_TILE = 256  # query/key tile: two 128-row passes; fewer, larger tiles amortise issue
_SLACK = 8192  # bytes kept free for allocation alignment (64 B per allocation)
_BLOCK = 32  # tokens per matrix-unit contraction block: cache capacities and key tiles come in these
_PAD_GARBAGE = 1e4  # magnitude of the test inputs' padding rows: large, finite, random signs
_BF16 = ml_dtypes.bfloat16


def latent_cache_capacity(tokens: int, capacity: int = 0, what: str = "context") -> int:
    """Rows per sequence of the MLA latent cache (``kv_cache`` [batch*cap, kv_lora_rank + rope_dim]).

    Args:
        tokens: the sequence's cached tokens (decode/append: ``context``; prefill: prior+seq),
            named ``what`` in messages.
        capacity: shape key ``capacity``; 0 means ``tokens`` rounded up to 32.
    Returns:
        cap in tokens: sequence b's row for position t is b*cap + t.
    Raises:
        InvalidArgumentError: capacity negative, not a multiple of 32, or below ``tokens``.
    """
    if capacity == 0:
        return -(-tokens // _BLOCK) * _BLOCK
    if capacity < 0 or capacity % _BLOCK or capacity < tokens:
        raise InvalidArgumentError(
            f"shape key capacity={capacity} must be a multiple of 32 and >= {what}={tokens} (0: {what} "
            "rounded up to 32): the kernels read the cache in 32-token blocks")
    return capacity


def yarn_softmax_scale(qk_head_dim: int = 192, factor: float = 40.0, mscale_all_dim: float = 1.0) -> float:
    """DeepSeek-V3's softmax scale under YaRN: qk_head_dim^-0.5 * (0.1*mscale_all_dim*ln(factor) + 1)^2."""
    m = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
    return qk_head_dim ** -0.5 * m * m


def _scale(shape: dict[str, Any]) -> float:
    s = shape["softmax_scale"]
    if s < 0 or not math.isfinite(s):
        raise InvalidArgumentError(f"shape key softmax_scale={s} must be a finite value >= 0 (0: default)")
    return s if s > 0 else 1.0 / math.sqrt(shape["nope_dim"] + shape["rope_dim"])


def _check_dims(shape: dict[str, Any], length_key: str | None) -> None:
    """Refuse dimensions the matrix unit's 32-element K blocks cannot take."""
    for key in ("kv_lora_rank", "rope_dim", "nope_dim") + ((length_key,) if length_key else ()):
        if shape[key] % 32:
            raise InvalidArgumentError(
                f"shape key {key}={shape[key]} must be a multiple of 32: it is a contraction (K) "
                "dimension of a matmul, which runs in 32-element blocks")
    if shape["kv_dtype"] != "bf16":
        raise InvalidArgumentError(f"shape key kv_dtype={shape['kv_dtype']!r}: only bf16 is implemented")


# --- references -----------------------------------------------------------------------------
def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _bf16(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def _split_w(w_kv_b, heads: int, nope: int, v: int):
    w = _f32(w_kv_b).reshape(heads, nope + v, -1)
    return w[:, :nope], w[:, nope:]  # W_UK [H, nope, R], W_UV [H, v, R]


def _softmax_pv(s, vals):
    """Unnormalised softmax with the P that multiplies ``vals`` rounded to BF16, as the kernel does.

    s: [..., q, k] f32 scores (masked entries -inf); vals: [..., k, d]. The row sum is taken over
    the BF16-rounded P (the kernel sums what it multiplies).
    """
    m = jnp.max(s, axis=-1, keepdims=True)
    p = _bf16(jnp.exp(s - m))
    return jnp.einsum("...qk,...kd->...qd", p, vals) / jnp.sum(p, axis=-1, keepdims=True)


def _latent_rows(kv_cache, batch: int, tokens: int, capacity: int, width: int, what: str):
    """The cache's real rows, float32 [batch, tokens, width], from kv_cache [batch*cap, width]."""
    cap = latent_cache_capacity(tokens, capacity, what)
    if np.shape(kv_cache) != (batch * cap, width):
        raise InvalidArgumentError(
            f"kv_cache has shape {np.shape(kv_cache)}; batch={batch} sequences of cap={cap} rows of "
            f"{width} need ({batch * cap}, {width})")
    return _f32(kv_cache).reshape(batch, cap, width)[:, :tokens]


def mla_decode_reference(q, kv_cache, w_kv_b, *, batch: int, context: int, heads: int, rank: int,
                         rope: int, nope: int, v: int, scale: float, capacity: int = 0):
    """Absorbed-form MLA decode in pure JAX; BF16 roundings where the kernel rounds.

    q [batch*heads, nope+rope]; kv_cache [batch*cap, rank+rope] with cap =
    ``latent_cache_capacity(context, capacity)``: rows b*cap + t for t < context are read, the
    padding rows never. Returns out [batch*heads, v] BF16. q_lat, P and o_lat are rounded to BF16
    (matrix-unit operands); products accumulate in FP32.
    """
    qq = _f32(q).reshape(batch, heads, nope + rope)
    kv = _latent_rows(kv_cache, batch, context, capacity, rank + rope, "context")
    w_uk, w_uv = _split_w(w_kv_b, heads, nope, v)
    q_lat = _bf16(jnp.einsum("bhn,hnr->bhr", qq[..., :nope], w_uk))
    q_full = jnp.concatenate([q_lat, qq[..., nope:]], axis=-1)  # [B, H, R+P]
    s = jnp.einsum("bhk,btk->bht", q_full, kv) * jnp.float32(scale)
    o_lat = _bf16(_softmax_pv(s, kv[..., :rank]))  # [B, H, R]
    out = jnp.einsum("bhr,hvr->bhv", o_lat, w_uv)
    return np.asarray(out.reshape(batch * heads, v).astype(jnp.bfloat16))


def mla_prefill_reference(q, kv_cache, w_kv_b, *, batch: int, seq: int, heads: int, rank: int,
                          rope: int, nope: int, v: int, scale: float, prior: int = 0, capacity: int = 0):
    """Naive-form causal MLA prefill in pure JAX: decompress K/V (BF16), then attention.

    q [batch*seq*heads, nope+rope] holds the chunk's queries (positions prior..prior+seq-1),
    kv_cache [batch*cap, rank+rope] every cached token, the chunk's included (cap =
    ``latent_cache_capacity(prior+seq, capacity)``, rows b*cap + t). Returns out
    [batch*seq*heads, v] BF16.
    """
    ctx = prior + seq
    qq = _f32(q).reshape(batch, seq, heads, nope + rope).transpose(0, 2, 1, 3)  # [B, H, S, .]
    kv = _latent_rows(kv_cache, batch, ctx, capacity, rank + rope, "prior+seq")
    w_uk, w_uv = _split_w(w_kv_b, heads, nope, v)
    k_nope = _bf16(jnp.einsum("bsr,hnr->bhsn", kv[..., :rank], w_uk))
    k_pe = jnp.broadcast_to(kv[:, None, :, rank:], (batch, heads, ctx, rope))
    k = jnp.concatenate([k_nope, k_pe], axis=-1)
    vv = _bf16(jnp.einsum("bsr,hvr->bhsv", kv[..., :rank], w_uv))
    s = jnp.einsum("bhqd,bhkd->bhqk", qq, k) * jnp.float32(scale)
    causal = jnp.arange(ctx)[None, :] <= prior + jnp.arange(seq)[:, None]  # key position <= query's
    s = jnp.where(causal, s, -jnp.inf)
    out = _softmax_pv(s, vv).transpose(0, 2, 1, 3)  # [B, S, H, v]
    return np.asarray(out.reshape(batch * seq * heads, v).astype(jnp.bfloat16))


def _inputs(seed: int, q_rows: int, cache: tuple[int, int, int], heads: int, rank: int, rope: int,
            nope: int, v: int) -> dict[str, np.ndarray]:
    """Random inputs; ``cache`` = (batch, tokens, cap): rows b*cap + t, t >= tokens, are padding
    filled with +-_PAD_GARBAGE, which wrecks the result unless the kernel ignores them."""
    rng = np.random.default_rng(seed)
    batch, tokens, cap = cache
    q = rng.standard_normal((q_rows, nope + rope)).astype(_BF16)
    kv = rng.standard_normal((batch, cap, rank + rope))
    # Weights ~ N(0, 1/rank) so decompressed keys and values are O(1), like a trained layer's.
    w = (rng.standard_normal((heads * (nope + v), rank)) / math.sqrt(rank)).astype(_BF16)
    # The padding's own generator: a full cache draws exactly the values it always did.
    signs = np.random.default_rng([seed, 1]).choice((-1.0, 1.0), size=kv[:, tokens:].shape)
    kv[:, tokens:] = _PAD_GARBAGE * signs
    return {"q": q, "kv_cache": kv.reshape(batch * cap, rank + rope).astype(_BF16), "w_kv_b": w}


_TOLERANCE = Tolerance(
    atol=2e-3, rtol=2.0**-5,
    why="the kernel's online softmax rounds P to BF16 relative to the running maximum and sums "
        "products in 32-element blocks in K order, the reference relative to the final maximum "
        "in XLA's order: P differs by up to one BF16 ulp (2^-8), which moves the BF16 latent "
        "output o_lat by an ulp in places and the BF16 result by a few ulps")


# --- the flash loop shared by decode and prefill --------------------------------------------
@dataclass
class _FlashTile:
    """One scores/softmax/PV step of the flash loop.

    rows: query rows (heads in decode, queries in prefill); cols: keys in this tile.
    state: which of the two softmax states (m, l, o) this tile's query block uses.
    first/last: first/last key tile of its query block. mask: [rows, cols] f32 tile added to
    the scores (causal diagonal), or None. pad_cols: the tile's last pad_cols keys are padding
    (decode's context rounded up to 32): their scores are set to MASK_VALUE. scores(acc)/pv(acc,
    p): issue the two matmuls (after whatever waits they need) on the matrix unit.
    finish(o_f32, l): issue the normalisation on the vector unit (after ``last``).
    """

    rows: int
    cols: int
    state: int
    first: bool
    last: bool
    scores: Any
    pv: Any
    finish: Any
    mask: Tile | None = None
    pad_cols: int = 0


class _Flash:
    """Per-core buffers and semaphores of the online-softmax loop; ``run`` issues a list of tiles.

    Semaphores count tiles over the core's whole program (``self.g``), each signalled by one
    in-order engine, so the j-th signal means "tile j done".
    """

    def __init__(self, kb: KernelBuilder, c: int, rows: int, tcols: int, dv: int, scale: float,
                 states: int = 2, pv_cols: int = 0) -> None:
        """``states`` 2 lets query block i+1's softmax start before block i's last update; 1
        halves the FP32 output state (small scratchpads) and issues that update first.
        ``pv_cols`` (0: dv) is the width of the FP32 buffer PV tiles are read into, column
        chunk by column chunk."""
        self.kb, self.core, self.scale, self.states = kb, kb.core(c), scale, states
        self.acc_s = [kb.acc(c, f"fl.acc_s{i}", (rows, tcols)) for i in range(2)]
        self.acc_pv = [kb.acc(c, f"fl.acc_pv{i}", (rows, dv)) for i in range(2)]
        self.s = kb.sram(c, "fl.s", (rows, tcols), "f32")
        self.p = [kb.sram(c, f"fl.p{i}", (rows, tcols), "bf16") for i in range(2)]
        self.o = [kb.sram(c, f"fl.o{i}", (rows, dv), "f32") for i in range(states)]
        self.pv_f = kb.sram(c, "fl.pv", (rows, pv_cols or dv), "f32")
        col = {n: kb.sram(c, f"fl.{n}", (rows, 1), "f32") for n in
               ("m0", "m1", "l0", "l1", "a0", "a1", "mt", "mnew", "lt", "linv")}
        self.m, self.l, self.alpha = [col["m0"], col["m1"]], [col["l0"], col["l1"]], [col["a0"], col["a1"]]
        self.mt, self.mnew, self.lt, self.linv = col["mt"], col["mnew"], col["lt"], col["linv"]
        self.s_ready = kb.semaphore(f"c{c}.s_ready")
        self.s_free = kb.semaphore(f"c{c}.s_free")
        self.p_ready = kb.semaphore(f"c{c}.p_ready")
        self.pv_done = kb.semaphore(f"c{c}.pv_done")
        self.pv_free = kb.semaphore(f"c{c}.pv_free")
        self.g = 0  # tiles issued so far on this core

    def run(self, tiles: list[_FlashTile]) -> None:
        """Issue ``tiles`` in order; the matrix unit runs scores(j+1) before pv(j)."""
        base = self.g
        mxu, vpu = self.core.mxu, self.core.vpu
        for j in range(len(tiles) + 1):
            if j < len(tiles):  # matrix unit: scores of tile j, then PV of tile j-1
                self._scores(base + j, tiles[j], mxu)
            if j >= 1:
                self._pv(base + j - 1, tiles[j - 1], mxu)
            # vector unit: softmax of tile j, then the output update of j-1; with one state a
            # new query block's softmax must wait until the previous block is finished
            update_first = self.states == 1 and 1 <= j < len(tiles) and tiles[j].first
            if update_first:
                self._update(base + j - 1, tiles[j - 1], vpu)
            if j < len(tiles):
                self._softmax(base + j, tiles[j], vpu)
            if j >= 1 and not update_first:
                self._update(base + j - 1, tiles[j - 1], vpu)
        self.g = base + len(tiles)

    def _scores(self, g: int, t: _FlashTile, mxu) -> None:
        if g >= 2:  # the vector unit has read acc_s[g % 2] of tile g-2
            mxu.wait(self.s_free, g - 1)
        t.scores(self.acc_s[g % 2].sub(0, 0, t.rows, t.cols))
        mxu.signal(self.s_ready)

    def _pv(self, g: int, t: _FlashTile, mxu) -> None:
        mxu.wait(self.p_ready, g + 1)
        if g >= 2:
            mxu.wait(self.pv_free, g - 1)
        t.pv(self.acc_pv[g % 2].sub(0, 0, t.rows, self.acc_pv[0].cols),
             self.p[g % 2].sub(0, 0, t.rows, t.cols))
        mxu.signal(self.pv_done)

    def _softmax(self, g: int, t: _FlashTile, v) -> None:
        r, n, k = t.rows, t.cols, t.state % self.states
        s = self.s.sub(0, 0, r, n)
        p = self.p[g % 2].sub(0, 0, r, n)
        m, l_, a = self.m[k].sub(0, 0, r, 1), self.l[k].sub(0, 0, r, 1), self.alpha[g % 2].sub(0, 0, r, 1)
        mt, mnew, lt = self.mt.sub(0, 0, r, 1), self.mnew.sub(0, 0, r, 1), self.lt.sub(0, 0, r, 1)
        v.wait(self.s_ready, g + 1)
        v.acc_read(s, self.acc_s[g % 2].sub(0, 0, r, n))
        v.signal(self.s_free)
        v.scale(s, s, self.scale)
        if t.mask is not None:
            v.add(s, s, t.mask)
        if t.pad_cols:  # exactly MASK_VALUE whatever the padded rows held (clamp to one value)
            pad = s.sub(0, n - t.pad_cols, r, t.pad_cols)
            v.clamp(pad, pad, MASK_VALUE, MASK_VALUE)
        if t.first:
            v.reduce("max", m, s)
        else:  # new running max; alpha = exp(m_old - m_new) rescales what came before
            v.reduce("max", mt, s)
            v.max(mnew, m, mt)
            v.sub(a, m, mnew)
            v.exp(a, a)
            v.copy(m, mnew)
        v.sub(s, s, m)
        v.exp(p, s)  # P rounded to BF16 for the matrix unit; the row sum is over that same P
        if t.first:
            v.reduce("sum", l_, p)
        else:
            v.reduce("sum", lt, p)
            v.mul(l_, l_, a)
            v.add(l_, l_, lt)
        v.signal(self.p_ready)

    def _update(self, g: int, t: _FlashTile, v) -> None:
        r, k = t.rows, t.state % self.states
        o, pv = self.o[k].sub(0, 0, r, self.o[k].cols), self.pv_f.sub(0, 0, r, self.pv_f.cols)
        v.wait(self.pv_done, g + 1)
        if t.first:
            v.acc_read(o, self.acc_pv[g % 2].sub(0, 0, r, o.cols))
        elif pv.cols == o.cols:
            v.acc_read(pv, self.acc_pv[g % 2].sub(0, 0, r, o.cols))
            v.mul(o, o, self.alpha[g % 2].sub(0, 0, r, 1))
            v.add(o, o, pv)
        else:  # the same FP32 operations, elementwise, a column chunk at a time
            v.mul(o, o, self.alpha[g % 2].sub(0, 0, r, 1))
            for c0 in range(0, o.cols, pv.cols):
                w = min(pv.cols, o.cols - c0)
                v.acc_read(pv.sub(0, 0, r, w), self.acc_pv[g % 2].sub(0, c0, r, w))
                v.add(o.sub(0, c0, r, w), o.sub(0, c0, r, w), pv.sub(0, 0, r, w))
        v.signal(self.pv_free)
        if t.last:
            v.recip(self.linv.sub(0, 0, r, 1), self.l[k].sub(0, 0, r, 1))
            t.finish(o, self.linv.sub(0, 0, r, 1))

    @staticmethod
    def sram_bytes(rows: int, tcols: int, dv: int, states: int = 2, pv_cols: int = 0) -> int:
        """Scratchpad the loop's buffers take (excluding alignment)."""
        return (rows * tcols * (4 + 2 * 2) + rows * dv * 4 * states + rows * (pv_cols or dv) * 4
                + 10 * max(rows * 4, 64))

    @staticmethod
    def acc_bytes(rows: int, tcols: int, dv: int) -> int:
        return 2 * rows * tcols * 4 + 2 * rows * dv * 4


def _decode_build(kb: KernelBuilder, batch: tuple[int, int, int], dims: tuple[int, int, int, int, int],
                  scale: float, notes: dict[str, Any]) -> KernelBuild:
    """The KernelBuild of an mla-decode Program (either tiling): its inputs, reference and output.

    Args:
        batch: (sequences B, context C, cache capacity per sequence); dims: (heads, rank, rope,
            nope, v head dim); scale: softmax scale; notes: the tiling's figures.
    """
    (B, C, cap), (H, R, P, N, V) = batch, dims
    ref_dims = {"heads": H, "rank": R, "rope": P, "nope": N, "v": V, "scale": scale}

    def make_inputs(seed: int) -> dict[str, Any]:
        return _inputs(seed, B * H, (B, C, cap), H, R, P, N, V)

    def reference(inputs):
        return {"out": mla_decode_reference(inputs["q"], inputs["kv_cache"], inputs["w_kv_b"],
                                            batch=B, context=C, capacity=cap, **ref_dims)}

    return KernelBuild(program=kb.build(), make_inputs=make_inputs, reference=reference,
                       outputs={"out": ("bf16", (B * H, V))}, tolerance=_TOLERANCE, notes=notes)


def _prefill_build(kb: KernelBuilder, batch: tuple[int, int, int, int, int, int],
                   dims: tuple[int, int, int, int, int], scale: float, notes: dict[str, Any]) -> KernelBuild:
    """The KernelBuild of an mla-prefill Program (either tiling): its inputs (with the causal mask
    of one T-token tile), reference and output.

    Args:
        batch: (sequences B, new tokens S, tile T, context C, cache capacity, prior tokens);
            dims: (heads, rank, rope, nope, v head dim); scale: softmax scale; notes: the tiling's figures.
    """
    (B, S, T, C, cap, prior), (H, R, P, N, V) = batch, dims
    ref_dims = {"heads": H, "rank": R, "rope": P, "nope": N, "v": V, "scale": scale}

    def make_inputs(seed: int) -> dict[str, Any]:
        ins = _inputs(seed, B * S * H, (B, C, cap), H, R, P, N, V)
        ins["causal_mask"] = np.where(np.tril(np.ones((T, T), bool)), 0.0, -np.inf).astype(np.float32)
        return ins

    def reference(inputs):
        return {"out": mla_prefill_reference(inputs["q"], inputs["kv_cache"], inputs["w_kv_b"],
                                             batch=B, seq=S, prior=prior, capacity=cap, **ref_dims)}

    return KernelBuild(program=kb.build(), make_inputs=make_inputs, reference=reference,
                       outputs={"out": ("bf16", (B * S * H, V))}, tolerance=_TOLERANCE, notes=notes)


def _rows_of(t: Tile, first: int, count: int, every: int) -> Tile:
    """``count`` rows of HBM/SRAM tile ``t`` starting at ``first``, taking every ``every``-th row."""
    return Tile(t.space, t.core, t.offset + first * t.stride, t.dtype, count, t.cols, t.stride * every)


def _pick_tile(limit: int, length: int, fixed: int, per: int, cap: int, what: str, override: int) -> int:
    """Largest multiple of 32 <= min(limit, length) with fixed + tile*per <= cap (or ``override``)."""
    fit = (cap - fixed) // per if per else limit
    if override:
        if override % 32 or override < 32:
            raise InvalidArgumentError(f"shape key kv_tile={override} must be a positive multiple of 32")
        if override > min(fit, limit):
            raise InvalidArgumentError(f"shape key kv_tile={override} does not fit: {what}")
        return override
    t = min(limit, length, fit) // 32 * 32
    if t < 32:
        raise InvalidArgumentError(f"the tiling cannot hold this shape: {what}")
    return t


# --- decode ---------------------------------------------------------------------------------
def build_mla_decode(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """Absorbed MLA decode: ``batch`` sequences, one query token each, ``context`` cached tokens
    (any number >= 1) in a latent cache of ``capacity`` rows per sequence (see the module doc)."""
    _check_dims(shape, None)
    B, C, H = shape["batch"], shape["context"], shape["q_heads"]
    cap = latent_cache_capacity(C, shape["capacity"])
    span = -(-C // _BLOCK) * _BLOCK  # tokens read per sequence: the context's 32-token blocks
    R, P, N, V = shape["kv_lora_rank"], shape["rope_dim"], shape["nope_dim"], shape["v_head_dim"]
    scale = _scale(shape)
    cores = spec.core.count
    n_att, n_head = min(cores, B), min(cores, H)
    hpc, bpc = -(-H // n_head), -(-B // n_att)  # heads per head-core, sequences per attention core
    n_head = -(-H // hpc)  # cores that actually own heads
    W = R + P  # one cache row

    sram_fixed = (hpc * (N * R + V * R + B * N + 2 * B * R + B * V) * 2
                  + bpc * H * (W + R) * 2 + _Flash.sram_bytes(H, 0, R) + _SLACK)
    acc_fixed = hpc * B * (R + V) * 4 + _Flash.acc_bytes(H, 0, R) + _SLACK
    per_sram = 2 * W * 2 + _Flash.sram_bytes(H, 1, R) - _Flash.sram_bytes(H, 0, R)
    cap_s, cap_a = spec.sram.scratchpad_bytes, spec.sram.accumulator_bytes
    what = (f"q_heads={H}, kv_lora_rank={R}, batch={B} need {sram_fixed:,} B of scratchpad and "
            f"{acc_fixed:,} B of accumulators before any context tile; {spec.name} has "
            f"{cap_s:,} B and {cap_a:,} B per core")
    acc_fit = (cap_a - acc_fixed) // (2 * H * 4) // 32 * 32  # scores accumulators, double-buffered
    if acc_fit < 32 or (cap_s - sram_fixed) // per_sram < 32:
        # Small scratchpads (GPU presets): weights and all heads' output state cannot stay on
        # the core; the phases go through HBM instead.
        return _build_mla_decode_small(shape, spec)
    T = _pick_tile(min(_MAX_DECODE_TILE, acc_fit), span, sram_fixed, per_sram, cap_s, what,
                   shape["kv_tile"])
    # Spare scratchpad buys deeper prefetch: a tile's load (set-up + latency + bytes) takes longer
    # than one tile of matrix work, so two buffers would leave the matrix unit waiting.
    nbuf = min(_MAX_DECODE_BUFFERS, 2 + (cap_s - sram_fixed - T * per_sram) // (T * W * 2))

    kb = KernelBuilder(f"mla_decode_b{B}_c{C}_h{H}" + (f"_cap{cap}" if cap != C else ""), chip=spec)
    q_h = kb.hbm("q", (B * H, N + P), "bf16")
    kv_h = kb.hbm("kv_cache", (B * cap, W), "bf16")
    w_h = kb.hbm("w_kv_b", (H * (N + V), R), "bf16")
    out_h = kb.hbm("out", (B * H, V), "bf16")

    head_cores = list(range(n_head))
    heads_of = {c: list(range(c * hpc, min(H, (c + 1) * hpc))) for c in head_cores}
    batches_of = {a: [b for b in range(B) if b % n_att == a] for a in range(n_att)}
    qlat_sent, olat_sent = kb.semaphore("qlat_sent"), kb.semaphore("olat_sent")
    n_copy_q = 3  # DMA queues 1..3 carry the cross-core copies

    # Allocations first, so that every core can address the others' buffers.
    hb: dict[int, dict[str, Any]] = {}
    for c in head_cores:
        nh = len(heads_of[c])
        hb[c] = {"wuk": kb.sram(c, "wuk", (nh * N, R), "bf16"),
                 "wuv": kb.sram(c, "wuv", (nh * V, R), "bf16"),
                 "qn": kb.sram(c, "qn", (nh * B, N), "bf16"),
                 "qlat": kb.sram(c, "qlat", (nh * B, R), "bf16"),  # row hl*B + b
                 "obuf": kb.sram(c, "obuf", (nh * B, R), "bf16"),  # row hl*B + b
                 "ob": kb.sram(c, "ob", (nh * B, V), "bf16"),
                 "accq": kb.acc(c, "accq", (nh * B, R)), "acco": kb.acc(c, "acco", (nh * B, V))}
    ab: dict[int, dict[str, Any]] = {}
    for a in range(n_att):
        nb = len(batches_of[a])
        ab[a] = {"qbuf": kb.sram(a, "qbuf", (nb * H, W), "bf16"),  # [q_lat | q_pe], row bl*H + h
                 "olat": kb.sram(a, "olat", (nb * H, R), "bf16"),
                 "kv": [kb.sram(a, f"kv{i}", (T, W), "bf16") for i in range(nbuf)]}

    # Phase 1: absorb W_UK into q (per head, M = batch), deliver q_lat to the sequences' cores.
    qlat_signals = 0
    for c in head_cores:
        core, hs, d = kb.core(c), heads_of[c], hb[c]
        loaded, acc_ready, read = (kb.semaphore(f"c{c}.{n}") for n in ("wq_loaded", "q_acc", "q_read"))
        wuv_loaded = d["wuv_loaded"] = kb.semaphore(f"c{c}.wuv_loaded")
        for hl, h in enumerate(hs):
            core.dma[0].load(d["wuk"].sub(hl * N, 0, N, R), w_h.sub(h * (N + V), 0, N, R))
            core.dma[0].load(d["qn"].sub(hl * B, 0, B, N), _rows_of(q_h.sub(0, 0, B * H, N), h, B, H))
            core.dma[3].load(d["wuv"].sub(hl * V, 0, V, R), w_h.sub(h * (N + V) + N, 0, V, R))
        core.dma[0].signal(loaded)
        core.dma[3].signal(wuv_loaded)
        core.mxu.wait(loaded, 1)
        for hl in range(len(hs)):
            core.mxu.matmul(d["accq"].sub(hl * B, 0, B, R), d["qn"].sub(hl * B, 0, B, N),
                            d["wuk"].sub(hl * N, 0, N, R), mode="overwrite")
        core.mxu.signal(acc_ready)
        core.vpu.wait(acc_ready, 1)
        core.vpu.acc_read(d["qlat"], d["accq"])
        core.vpu.signal(read)
        used = set()
        for i, b in enumerate(range(B)):
            a, bl = b % n_att, batches_of[b % n_att].index(b)
            q = core.dma[1 + i % n_copy_q]
            if q.engine.queue not in used:
                q.wait(read, 1)
                used.add(q.engine.queue)
            # rows b, b+B, ... (one per local head) -> rows h0.. of sequence b's [q_lat | q_pe]
            q.copy(ab[a]["qbuf"].sub(bl * H + hs[0], 0, len(hs), R), _rows_of(d["qlat"], b, len(hs), B))
        for qi in sorted(used):
            core.dma[qi].signal(qlat_sent)
        qlat_signals += len(used)

    # Phase 2: attention over the latent cache, sequences split over cores.
    olat_signals = 0
    for a in range(n_att):
        core, d, bs = kb.core(a), ab[a], batches_of[a]
        fl = _Flash(kb, a, H, T, R, scale)
        qpe_loaded, kv_loaded, olat_ready = (kb.semaphore(f"c{a}.{n}") for n in
                                             ("qpe_loaded", "kv_loaded", "olat_ready"))
        for bl, b in enumerate(bs):
            core.dma[0].load(d["qbuf"].sub(bl * H, R, H, P), q_h.sub(b * H, N, H, P))
        core.dma[0].signal(qpe_loaded)
        core.mxu.wait(qpe_loaded, 1)
        core.mxu.wait(qlat_sent, qlat_signals)
        tiles: list[_FlashTile] = []
        for bl, b in enumerate(bs):
            qbuf = d["qbuf"].sub(bl * H, 0, H, W)
            starts = list(range(0, span, T))
            for j, t0 in enumerate(starts):
                n = min(T, span - t0)
                g = fl.g + len(tiles)
                buf = d["kv"][g % nbuf].sub(0, 0, n, W)
                if g >= nbuf:  # the matrix unit is done with this buffer's previous tile
                    core.dma[0].wait(fl.pv_done, g - nbuf + 1)
                core.dma[0].load(buf, kv_h.sub(b * cap + t0, 0, n, W))
                core.dma[0].signal(kv_loaded)

                # The callbacks run inside fl.run below, in this core's iteration; defaults bind
                # the loop variables all the same.
                def scores(acc, g=g, buf=buf, qbuf=qbuf, core=core, kv_loaded=kv_loaded):
                    core.mxu.wait(kv_loaded, g + 1)
                    core.mxu.matmul_t(acc, qbuf, buf, mode="overwrite")

                def pv(acc, p, buf=buf, core=core):
                    core.mxu.matmul(acc, p, buf.sub(0, 0, buf.rows, R), mode="overwrite")

                def finish(o, linv, bl=bl, core=core, d=d, olat_ready=olat_ready):
                    core.vpu.mul(d["olat"].sub(bl * H, 0, H, R), o, linv)
                    core.vpu.signal(olat_ready)

                last = j == len(starts) - 1
                tiles.append(_FlashTile(H, n, bl % 2, j == 0, last, scores, pv, finish,
                                        pad_cols=span - C if last else 0))
        fl.run(tiles)
        used = set()
        for bl, b in enumerate(bs):
            for i, c in enumerate(head_cores):
                q = core.dma[1 + (bl * len(head_cores) + i) % n_copy_q]
                q.wait(olat_ready, bl + 1)
                used.add(q.engine.queue)
                hs = heads_of[c]
                q.copy(_rows_of(hb[c]["obuf"], b, len(hs), B), d["olat"].sub(bl * H + hs[0], 0, len(hs), R))
        for qi in sorted(used):
            core.dma[qi].signal(olat_sent)
        olat_signals += len(used)

    # Phase 3: up-projection with W_UV per head (M = batch), stored to out rows b*H + h.
    for c in head_cores:
        core, hs, d = kb.core(c), heads_of[c], hb[c]
        acc_ready, stored_ready = kb.semaphore(f"c{c}.o_acc"), kb.semaphore(f"c{c}.o_ready")
        core.mxu.wait(olat_sent, olat_signals)
        core.mxu.wait(d["wuv_loaded"], 1)
        for hl in range(len(hs)):
            core.mxu.matmul_t(d["acco"].sub(hl * B, 0, B, V), d["obuf"].sub(hl * B, 0, B, R),
                              d["wuv"].sub(hl * V, 0, V, R), mode="overwrite")
            core.mxu.signal(acc_ready)
        for hl, h in enumerate(hs):
            core.vpu.wait(acc_ready, hl + 1)
            core.vpu.acc_read(d["ob"].sub(hl * B, 0, B, V), d["acco"].sub(hl * B, 0, B, V))
            core.vpu.signal(stored_ready)
            q = core.dma[2]
            q.wait(stored_ready, hl + 1)
            q.store(_rows_of(out_h, h, B, H), d["ob"].sub(hl * B, 0, B, V))

    cache_bytes = B * span * W * 2  # what the kernel reads: the context's 32-token blocks
    return _decode_build(
        kb, (B, C, cap), (H, R, P, N, V), scale,
        {"kv_tile": T, "kv_buffers": nbuf, "attention_cores": n_att, "head_cores": n_head,
               "softmax_scale": scale, "cache_capacity": cap, "padded_tokens": span - C,
               "latent_cache_bytes": cache_bytes, "weight_bytes": H * (N + V) * R * 2,
               "q_out_bytes": B * H * (N + P + V) * 2},
    )


# --- small scratchpads (GPU presets): phases through HBM ---------------------------------------
_SMALL_HEAD_GROUPS = (128, 64, 32, 16, 8, 4, 2, 1)  # heads per attention item, largest first
_SMALL_PV_COLS = 128  # FP32 columns of PV read back at a time on the small-scratchpad path


def _view(arena: Tile, dtype: str, rows: int, cols: int, byte_off: int = 0) -> Tile:
    """A packed [rows, cols] tile of ``dtype`` inside ``arena`` (a byte region reused over phases)."""
    t = Tile(arena.space, arena.core, arena.offset + byte_off, dtype, rows, cols)
    if t.end > arena.offset + arena.nbytes:
        raise AssertionError(f"{t} is not inside {arena}")  # a kernel bug, not bad input
    return t


def _align(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


@dataclass
class _GemmJob:
    """One output tile of a small per-head GEMM: acc = sum over K panels of a @ b (or a @ b^T),
    rounded to BF16 and stored to ``dst``. panels: (a HBM [m, k], b HBM [k, n] or [n, k])."""

    panels: list[tuple[Tile, Tile]]
    dst: Tile
    transposed: bool


def _emit_gemm_jobs(kb: KernelBuilder, c: int, jobs: list[_GemmJob], bufs: dict[str, list[Tile]],
                    start: tuple[Semaphore, int] | None, done: Semaphore, tag: str) -> bool:
    """Issue core ``c``'s GEMM jobs: K panels double-buffered (loads on queues 0/1), two
    accumulators and two BF16 output buffers so that job j+1's matrix work overlaps job j's
    read-back and store (queue 2). ``start``: (semaphore, count) the loads wait for first;
    ``done`` is signalled once by queue 2 after the last store. Returns whether it issued any."""
    if not jobs:
        return False
    core = kb.core(c)
    sem = {n: kb.semaphore(f"c{c}.{tag}.{n}") for n in
           ("loaded0", "loaded1", "used0", "used1", "acc", "read", "stored")}
    step = 0
    for j, job in enumerate(jobs):
        m, n = job.dst.rows, job.dst.cols
        acc = _view(bufs["acc"][j % 2], "f32", m, n)
        for k, (a_src, b_src) in enumerate(job.panels):
            s = step % 2
            q = core.dma[s]
            if start is not None and step < 2:
                q.wait(*start)
            if step >= 2:  # the matrix unit is done with this slot's previous panels
                q.wait(sem[f"used{s}"], step // 2)
            a = _view(bufs["a"][s], "bf16", a_src.rows, a_src.cols)
            b = _view(bufs["b"][s], "bf16", b_src.rows, b_src.cols)
            q.load(a, a_src)
            q.load(b, b_src)
            q.signal(sem[f"loaded{s}"])
            core.mxu.wait(sem[f"loaded{s}"], step // 2 + 1)
            if k == 0 and j >= 2:  # the vector unit has read this accumulator's job j-2
                core.mxu.wait(sem["read"], j - 1)
            mode = "overwrite" if k == 0 else "accumulate"
            (core.mxu.matmul_t if job.transposed else core.mxu.matmul)(acc, a, b, mode=mode)
            core.mxu.signal(sem[f"used{s}"])
            step += 1
        core.mxu.signal(sem["acc"])
        out = _view(bufs["out"][j % 2], "bf16", m, n)
        core.vpu.wait(sem["acc"], j + 1)
        if j >= 2:  # job j-2's output has left this buffer
            core.vpu.wait(sem["stored"], j - 1)
        core.vpu.acc_read(out, acc)
        core.vpu.signal(sem["read"])
        core.dma[2].wait(sem["read"], j + 1)
        core.dma[2].store(job.dst, out)
        core.dma[2].signal(sem["stored"])
    core.dma[2].signal(done)
    return True


@dataclass(frozen=True)
class _DecodeTiling:
    """Small-scratchpad mla-decode tiling: ``hg`` heads per attention item, ``t`` context tokens
    per tile on ``nbuf`` buffers; GEMM jobs of ``bm`` sequences, ``rc`` absorbed columns (phase
    1) and ``kp``-wide K panels (phase 3); byte sizes of the per-core regions."""

    hg: int
    t: int
    nbuf: int
    bm: int
    rc: int
    kp: int
    flash_sram: int
    arena_sram: int
    gemm_acc: int


def _decode_small_tiling(B: int, H: int, span: int, dims: tuple[int, int, int, int], spec: ChipSpec,
                         override: int) -> _DecodeTiling | None:
    """The largest head group, then the largest context tile, that fit (None: nothing fits)."""
    R, P, N, V = dims
    W = R + P
    cap_s, cap_a = spec.sram.scratchpad_bytes - _SLACK, spec.sram.accumulator_bytes - _SLACK
    pvc = min(R, _SMALL_PV_COLS)

    def gemm(bm: int, rc: int, kp: int) -> tuple[int, int]:
        a = max(bm * N, bm * kp) * 2
        b = max(N * rc, V * kp) * 2
        o = max(bm * rc, bm * V) * 2
        return 2 * (_align(a) + _align(b) + _align(o)), 2 * _align(max(bm * rc, bm * V) * 4)

    gemm_opts = [(bm, rc, kp) for bm in (128, 64, 32, 16, 8) if bm <= max(B, 8)
                 for rc, kp in ((R, R), (R // 2, R // 2), (R // 4, R // 4), (R // 8, R // 8))
                 if rc >= 32 and rc % 32 == 0]
    tiles = [override] if override else list(range(min(_MAX_DECODE_TILE, span) // 32 * 32, 0, -32))
    for hg in (g for g in _SMALL_HEAD_GROUPS if g <= H):
        for t in tiles:
            fl_s = _Flash.sram_bytes(hg, t, R, 1, pvc) + 16 * 64
            fl_a = _Flash.acc_bytes(hg, t, R) + 4 * 64
            for nbuf in (4, 3, 2):
                att = 2 * _align(hg * W * 2) + 2 * _align(hg * R * 2) + nbuf * _align(t * W * 2)
                for bm, rc, kp in gemm_opts:
                    g_s, g_a = gemm(bm, rc, kp)
                    if fl_s + max(att, g_s) <= cap_s and fl_a + g_a <= cap_a:
                        return _DecodeTiling(hg, t, nbuf, bm, rc, kp, fl_s, max(att, g_s), g_a)
    return None


def _build_mla_decode_small(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """mla-decode for scratchpads that cannot hold a head's absorbed weights or all heads' FP32
    output state (GPU presets): three phases with the latent query and output through HBM.

    1. absorb: per (head, block of ``bm`` sequences, ``rc`` latent columns) q_lat =
       bf16(q_nope @ W_UK[h]) into HBM scratch ``q_lat`` [batch*q_heads, R];
    2. attention: per (sequence, group of ``hg`` heads) the flash loop of the v1 kernel over
       context tiles (the tile loaded once for the group's heads), one FP32 output state, PV read
       back 128 columns at a time; o_lat = bf16(o / l) into HBM scratch ``o_lat``;
    3. up-projection: per (head, block of sequences) out = bf16(o_lat @ W_UV[h]^T), K in
       ``kp``-wide panels accumulated in place.

    A global count of stores (one signal per core) separates the phases, as kernel boundaries
    would on a GPU. The numerics are the v1 kernel's: the same roundings, the same reference.
    """
    B, C, H = shape["batch"], shape["context"], shape["q_heads"]
    cap = latent_cache_capacity(C, shape["capacity"])
    span = -(-C // _BLOCK) * _BLOCK
    R, P, N, V = shape["kv_lora_rank"], shape["rope_dim"], shape["nope_dim"], shape["v_head_dim"]
    scale = _scale(shape)
    W = R + P
    til = _decode_small_tiling(B, H, span, (R, P, N, V), spec, shape["kv_tile"])
    if til is None:
        what = "shape key kv_tile=" + str(shape["kv_tile"]) if shape["kv_tile"] else "the tiling"
        raise InvalidArgumentError(
            f"{what} cannot hold this shape: q_heads={H}, kv_lora_rank={R}, rope_dim={P}: one head's "
            f"query [1, {W}] and FP32 output state [1, {R}] plus two 32-token cache tiles of "
            f"{32 * W * 2:,} B need more than {spec.name}'s {spec.sram.scratchpad_bytes:,} B of "
            f"scratchpad / {spec.sram.accumulator_bytes:,} B of accumulators per core")
    hg, T, nbuf, bm = til.hg, til.t, til.nbuf, til.bm
    cores = spec.core.count
    kb = KernelBuilder(f"mla_decode_b{B}_c{C}_h{H}" + (f"_cap{cap}" if cap != C else "") + "_small",
                       chip=spec)
    q_h = kb.hbm("q", (B * H, N + P), "bf16")
    kv_h = kb.hbm("kv_cache", (B * cap, W), "bf16")
    w_h = kb.hbm("w_kv_b", (H * (N + V), R), "bf16")
    out_h = kb.hbm("out", (B * H, V), "bf16")
    qlat_h = kb.hbm("q_lat", (B * H, R), "bf16")  # scratch: phase 1 -> 2
    olat_h = kb.hbm("o_lat", (B * H, R), "bf16")  # scratch: phase 2 -> 3

    # Per core: the flash loop's buffers, then one arena the phases reuse in turn.
    flash, arena, gacc = {}, {}, {}
    for c in range(cores):
        flash[c] = _Flash(kb, c, hg, T, R, scale, states=1, pv_cols=min(R, _SMALL_PV_COLS))
        arena[c] = kb.sram(c, "arena", (1, til.arena_sram), "u8")
        gacc[c] = [kb.acc(c, f"gemm_acc{i}", (1, til.gemm_acc // 8)) for i in range(2)]
    half = til.arena_sram // 2

    def gemm_bufs(c: int, a_bytes: int, b_bytes: int, o_bytes: int) -> dict[str, list[Tile]]:
        offs = [0, _align(a_bytes), _align(a_bytes) + _align(b_bytes)]
        ar = arena[c]
        return {"a": [_view(ar, "u8", 1, _align(a_bytes), s * half + offs[0]) for s in range(2)],
                "b": [_view(ar, "u8", 1, _align(b_bytes), s * half + offs[1]) for s in range(2)],
                "out": [_view(ar, "u8", 1, _align(o_bytes), s * half + offs[2]) for s in range(2)],
                "acc": gacc[c]}

    a_bytes = max(bm * N, bm * til.kp) * 2
    b_bytes = max(N * til.rc, V * til.kp) * 2
    o_bytes = max(bm * til.rc, bm * V) * 2

    # Phase 1: q_lat = bf16(q_nope @ W_UK[h]), jobs of (head, sequences, latent columns).
    qn_rows = q_h.sub(0, 0, B * H, N)
    p1 = [_GemmJob([(_rows_of(qn_rows, b0 * H + h, min(bm, B - b0), H),
                     w_h.sub(h * (N + V), r0, N, min(til.rc, R - r0)))],
                   _rows_of(qlat_h.sub(0, r0, B * H, min(til.rc, R - r0)), b0 * H + h, min(bm, B - b0), H),
                   transposed=False)
          for h in range(H) for b0 in range(0, B, bm) for r0 in range(0, R, til.rc)]
    qlat_done = kb.semaphore("qlat_done")
    n1 = sum(_emit_gemm_jobs(kb, c, p1[c::cores], gemm_bufs(c, a_bytes, b_bytes, o_bytes), None,
                             qlat_done, "p1") for c in range(cores))

    # Phase 2: attention per (sequence, head group).
    items = [(b, h0) for b in range(B) for h0 in range(0, H, hg)]
    olat_done = kb.semaphore("olat_done")
    n2 = 0
    for c in range(min(cores, len(items))):
        n2 += 1
        _decode_small_attention(kb, c, items[c::cores], flash[c], arena[c], (qlat_done, n1), olat_done,
                                (q_h, kv_h, qlat_h, olat_h), (H, hg, T, nbuf, span, C, cap), (R, P, N))

    # Phase 3: out = bf16(o_lat @ W_UV[h]^T), K in panels of kp.
    p3 = [_GemmJob([(_rows_of(olat_h.sub(0, k0, B * H, min(til.kp, R - k0)), b0 * H + h, min(bm, B - b0), H),
                     w_h.sub(h * (N + V) + N, k0, V, min(til.kp, R - k0))) for k0 in range(0, R, til.kp)],
                   _rows_of(out_h, b0 * H + h, min(bm, B - b0), H), transposed=True)
          for h in range(H) for b0 in range(0, B, bm)]
    out_done = kb.semaphore("out_done")
    for c in range(cores):
        _emit_gemm_jobs(kb, c, p3[c::cores], gemm_bufs(c, a_bytes, b_bytes, o_bytes), (olat_done, n2),
                        out_done, "p3")

    groups = -(-H // hg)
    return _decode_build(
        kb, (B, C, cap), (H, R, P, N, V), scale,
        {"path": "small-scratchpad", "kv_tile": T, "kv_buffers": nbuf, "head_group": hg,
               "head_groups": groups, "attention_items": len(items), "gemm_rows": bm,
               "softmax_scale": scale, "cache_capacity": cap, "padded_tokens": span - C,
               "latent_cache_bytes": groups * B * span * W * 2, "weight_bytes": H * (N + V) * R * 2,
               "q_out_bytes": B * H * (N + P + V) * 2, "scratch_bytes": 4 * B * H * R * 2},
    )


def _decode_small_attention(kb: KernelBuilder, c: int, items: list[tuple[int, int]], fl: _Flash, arena: Tile,
                            start: tuple[Semaphore, int], done: Semaphore, hbm: tuple[Tile, ...],
                            sizes: tuple[int, ...], dims: tuple[int, int, int]) -> None:
    """Core ``c``'s attention items (sequence b, first head h0): [q_lat | q_pe] of the group and
    the context tiles in, o_lat of the group out (see ``_build_mla_decode_small``)."""
    q_h, kv_h, qlat_h, olat_h = hbm
    H, hg, T, nbuf, span, C, cap = sizes
    R, P, N = dims
    W = R + P
    core = kb.core(c)
    off = 0
    qbuf, obuf, kvb = [], [], []
    for _ in range(2):
        qbuf.append(_view(arena, "bf16", hg, W, off))
        off += _align(hg * W * 2)
    for _ in range(2):
        obuf.append(_view(arena, "bf16", hg, R, off))
        off += _align(hg * R * 2)
    for _ in range(nbuf):
        kvb.append(_view(arena, "bf16", T, W, off))
        off += _align(T * W * 2)
    sem = {n: kb.semaphore(f"c{c}.p2.{n}") for n in ("q", "q_used", "kv", "o_ready", "o_stored")}
    starts = list(range(0, span, T))
    tiles: list[_FlashTile] = []
    for it, (b, h0) in enumerate(items):
        nh = min(hg, H - h0)
        qb = qbuf[it % 2].sub(0, 0, nh, W)
        q1 = core.dma[1]
        if it == 0:  # every core's q_lat is in HBM, and this core's arena is free of phase 1
            q1.wait(*start)
            core.dma[0].wait(*start)
        if it >= 2:  # the matrix unit's scores of item it-2 have read this buffer
            q1.wait(sem["q_used"], it - 1)
        q1.load(qb.sub(0, 0, nh, R), qlat_h.sub(b * H + h0, 0, nh, R))
        q1.load(qb.sub(0, R, nh, P), q_h.sub(b * H + h0, N, nh, P))
        q1.signal(sem["q"])
        for j, t0 in enumerate(starts):
            n = min(T, span - t0)
            g = fl.g + len(tiles)
            buf = kvb[g % nbuf].sub(0, 0, n, W)
            if g >= nbuf:  # the matrix unit is done with this buffer's previous tile
                core.dma[0].wait(fl.pv_done, g - nbuf + 1)
            core.dma[0].load(buf, kv_h.sub(b * cap + t0, 0, n, W))
            core.dma[0].signal(sem["kv"])
            last = j == len(starts) - 1

            def scores(acc, g=g, buf=buf, qb=qb, it=it, j=j, last=last):
                if j == 0:
                    core.mxu.wait(sem["q"], it + 1)
                core.mxu.wait(sem["kv"], g + 1)
                core.mxu.matmul_t(acc, qb, buf, mode="overwrite")
                if last:
                    core.mxu.signal(sem["q_used"])

            def pv(acc, p, buf=buf):
                core.mxu.matmul(acc, p, buf.sub(0, 0, buf.rows, R), mode="overwrite")

            def finish(o, linv, it=it, b=b, h0=h0, nh=nh):
                ob = obuf[it % 2].sub(0, 0, nh, R)
                if it >= 2:  # item it-2's o_lat has been stored
                    core.vpu.wait(sem["o_stored"], it - 1)
                core.vpu.mul(ob, o, linv)
                core.vpu.signal(sem["o_ready"])
                core.dma[2].wait(sem["o_ready"], it + 1)
                core.dma[2].store(olat_h.sub(b * H + h0, 0, nh, R), ob)
                core.dma[2].signal(sem["o_stored"])

            tiles.append(_FlashTile(nh, n, 0, j == 0, last, scores, pv, finish,
                                    pad_cols=span - C if last else 0))
    fl.run(tiles)
    core.dma[2].signal(done)


# --- prefill --------------------------------------------------------------------------------
def _prefill_key_tiles(prior: int, seq: int, t: int) -> list[tuple[int, int]]:
    """(start, n) key tiles of a prefill chunk: the prior context's from 0 in t-token tiles, then
    the chunk's from ``prior`` aligned with its query tiles (so that each query tile's last key
    tile is its diagonal, always the same causal mask)."""
    return ([(k0, min(t, prior - k0)) for k0 in range(0, prior, t)]
            + [(prior + q0, min(t, seq - q0)) for q0 in range(0, seq, t)])


def build_mla_prefill(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """Naive-form causal MLA prefill: ``batch`` sequences, each adding a chunk of ``seq`` tokens
    after ``prior`` tokens already in the latent cache (see the module doc)."""
    _check_dims(shape, "seq")
    B, S, H, prior = shape["batch"], shape["seq"], shape["q_heads"], shape["prior"]
    if prior < 0 or prior % 32:
        raise InvalidArgumentError(
            f"shape key prior={prior} must be a multiple of 32 and >= 0: the cached tokens are the "
            "contraction (K) dimension of P @ V, which runs in 32-token blocks")
    R, P, N, V = shape["kv_lora_rank"], shape["rope_dim"], shape["nope_dim"], shape["v_head_dim"]
    scale = _scale(shape)
    W, D, C = R + P, N + P, prior + S  # cache row, q/k head dim, cached tokens after this chunk
    cap = latent_cache_capacity(C, shape["capacity"], "prior+seq")
    cap_s, cap_a = spec.sram.scratchpad_bytes, spec.sram.accumulator_bytes
    # Per item: K_h and V_h for every cached token and Q_h and out_h for the chunk stay in SRAM;
    # per tile T the latent tiles, the mask and the flash buffers (quadratic in T, so try T from
    # the top).
    sram_fixed = (C + S) * (D + V) * 2 + (N + V) * R * 2 + _SLACK

    def fits(t: int) -> bool:
        sram = sram_fixed + 2 * t * W * 2 + t * t * 4 + _Flash.sram_bytes(t, t, V)
        return sram <= cap_s and _Flash.acc_bytes(t, t, V) + 2 * t * (N + V) * 4 <= cap_a

    what = (f"prior+seq={C} with head dims {D} (q/k) and {V} (v) needs {sram_fixed:,} B of scratchpad "
            f"for one (sequence, head) item's K and V over prior+seq tokens and Q and output over seq "
            f"plus the tiles; {spec.name} has {cap_s:,} B of scratchpad and {cap_a:,} B of "
            "accumulators per core")
    if shape["kv_tile"]:
        T = shape["kv_tile"]
        if T % 32:
            raise InvalidArgumentError(f"shape key kv_tile={T} must be a positive multiple of 32")
        if not fits(T):
            raise InvalidArgumentError(f"shape key kv_tile={T} does not fit: {what}")
    else:
        T = next((t for t in range(min(_MAX_PREFILL_TILE, S) // 32 * 32, 0, -32) if fits(t)), 0)
        if not T:
            # Small scratchpads (GPU presets): K and V go through HBM, key tiles stream in.
            return _build_mla_prefill_small(shape, spec)

    kb = KernelBuilder(f"mla_prefill_b{B}_s{S}_p{prior}_h{H}" + (f"_cap{cap}" if cap != C else ""),
                       chip=spec)
    q_h = kb.hbm("q", (B * S * H, D), "bf16")
    kv_h = kb.hbm("kv_cache", (B * cap, W), "bf16")
    w_h = kb.hbm("w_kv_b", (H * (N + V), R), "bf16")
    mask_h = kb.hbm("causal_mask", (T, T), "f32")
    out_h = kb.hbm("out", (B * S * H, V), "bf16")
    items = [(b, h) for b in range(B) for h in range(H)]
    cores = min(spec.core.count, len(items))
    starts = list(range(0, S, T))  # query tiles (chunk offsets)
    ktiles = _prefill_key_tiles(prior, S, T)
    n_prior = len(ktiles) - len(starts)
    for c in range(cores):
        mine = items[c::cores]
        core = kb.core(c)
        fl = _Flash(kb, c, T, T, V, scale)
        wuk, wuv = kb.sram(c, "wuk", (N, R), "bf16"), kb.sram(c, "wuv", (V, R), "bf16")
        qs, ks = kb.sram(c, "q", (S, D), "bf16"), kb.sram(c, "k", (C, D), "bf16")
        vs, os_ = kb.sram(c, "v", (C, V), "bf16"), kb.sram(c, "out", (S, V), "bf16")
        mask = kb.sram(c, "mask", (T, T), "f32")
        ckv = [kb.sram(c, f"ckv{i}", (T, W), "bf16") for i in range(2)]
        acc_k = [kb.acc(c, f"acc_k{i}", (T, N)) for i in range(2)]
        acc_v = [kb.acc(c, f"acc_v{i}", (T, V)) for i in range(2)]
        sem = {n: kb.semaphore(f"c{c}.{n}") for n in (
            "w", "ckv", "ckv_used", "kv_acc", "kv_acc_free", "kv_written", "q", "item_mxu_done",
            "out_ready", "out_stored", "mask")}
        core.dma[3].load(mask, mask_h)
        core.dma[3].signal(sem["mask"])
        core.vpu.wait(sem["mask"], 1)
        d = 0  # decompression tiles issued on this core
        for it, (b, h) in enumerate(mine):
            dq = core.dma[0]
            if it:  # the previous item's matrix-unit work read these buffers
                dq.wait(sem["item_mxu_done"], it)
            dq.load(wuk, w_h.sub(h * (N + V), 0, N, R))
            dq.load(wuv, w_h.sub(h * (N + V) + N, 0, V, R))
            dq.load(ks.sub(0, N, C, P), kv_h.sub(b * cap, R, C, P))  # k_pe, shared by all heads
            dq.signal(sem["w"])
            # Decompress K_h (nope part) and V_h tile by tile, prior context and chunk alike.
            for i, (k0, n) in enumerate(ktiles):
                k = d + i
                if k >= 2:
                    dq.wait(sem["ckv_used"], k - 1)
                dq.load(ckv[k % 2].sub(0, 0, n, W), kv_h.sub(b * cap + k0, 0, n, W))
                dq.signal(sem["ckv"])
            core.mxu.wait(sem["w"], it + 1)
            for i, (k0, n) in enumerate(ktiles):
                k = d + i
                src = ckv[k % 2].sub(0, 0, n, R)
                core.mxu.wait(sem["ckv"], k + 1)
                if k >= 2:
                    core.mxu.wait(sem["kv_acc_free"], k - 1)
                core.mxu.matmul_t(acc_k[k % 2].sub(0, 0, n, N), src, wuk, mode="overwrite")
                core.mxu.matmul_t(acc_v[k % 2].sub(0, 0, n, V), src, wuv, mode="overwrite")
                core.mxu.signal(sem["ckv_used"])
                core.mxu.signal(sem["kv_acc"])
                core.vpu.wait(sem["kv_acc"], k + 1)
                core.vpu.acc_read(ks.sub(k0, 0, n, N), acc_k[k % 2].sub(0, 0, n, N))
                core.vpu.acc_read(vs.sub(k0, 0, n, V), acc_v[k % 2].sub(0, 0, n, V))
                core.vpu.signal(sem["kv_acc_free"])
            d += len(ktiles)
            core.vpu.signal(sem["kv_written"])
            # Q_h, one query tile per descriptor so that the first tile can start early.
            q_rows = q_h.sub(0, 0, B * S * H, D)
            for t0 in starts:
                n = min(T, S - t0)
                dq.load(qs.sub(t0, 0, n, D), _rows_of(q_rows, (b * S + t0) * H + h, n, H))
                dq.signal(sem["q"])
            core.mxu.wait(sem["kv_written"], it + 1)
            tiles = []
            for i, t0 in enumerate(starts):
                nq = min(T, S - t0)
                keys = ktiles[:n_prior + i + 1]  # the whole prior context, the chunk up to the diagonal
                for j, (k0, nk) in enumerate(keys):
                    diag = j == len(keys) - 1

                    # Called inside fl.run below, in this item's iteration; defaults bind anyway.
                    def scores(acc, i=i, t0=t0, nq=nq, k0=k0, nk=nk, j=j, it=it, core=core, sem=sem,
                               qs=qs, ks=ks):
                        if j == 0:
                            core.mxu.wait(sem["q"], it * len(starts) + i + 1)
                        core.mxu.matmul_t(acc, qs.sub(t0, 0, nq, D), ks.sub(k0, 0, nk, D),
                                          mode="overwrite")

                    def pv(acc, p, k0=k0, nk=nk, core=core, vs=vs):
                        core.mxu.matmul(acc, p, vs.sub(k0, 0, nk, V), mode="overwrite")

                    def finish(o, linv, t0=t0, nq=nq, i=i, it=it, core=core, sem=sem, os_=os_):
                        if i == 0 and it:  # the previous item's output has left SRAM
                            core.vpu.wait(sem["out_stored"], it)
                        core.vpu.mul(os_.sub(t0, 0, nq, V), o, linv)
                        core.vpu.signal(sem["out_ready"])

                    tiles.append(_FlashTile(nq, nk, i % 2, j == 0, diag, scores, pv, finish,
                                            mask.sub(0, 0, nq, nk) if diag else None))
            fl.run(tiles)
            core.mxu.signal(sem["item_mxu_done"])
            sq = core.dma[2]
            for i, t0 in enumerate(starts):
                n = min(T, S - t0)
                sq.wait(sem["out_ready"], it * len(starts) + i + 1)
                sq.store(_rows_of(out_h.sub(0, 0, B * S * H, V), (b * S + t0) * H + h, n, H),
                         os_.sub(t0, 0, n, V))
            sq.signal(sem["out_stored"])

    return _prefill_build(
        kb, (B, S, T, C, cap, prior), (H, R, P, N, V), scale,
        {"tile": T, "cores": cores, "items": len(items), "softmax_scale": scale, "prior": prior,
               "cache_capacity": cap, "key_tiles": len(ktiles), "form": "naive (decompressed K/V)"},
    )


def _prefill_small_tiling(S: int, C: int, dims: tuple[int, int, int, int], spec: ChipSpec,
                          override: int) -> tuple[int, int, int, int, int, int] | None:
    """(tile T, K/V buffers, GEMM token rows, GEMM K panel, PV read-back columns, arena
    SRAM) of the small-scratchpad mla-prefill: the largest square tile that fits, then the most
    buffers."""
    R, P, N, V = dims
    D = N + P
    cap_s, cap_a = spec.sram.scratchpad_bytes - _SLACK, spec.sram.accumulator_bytes - _SLACK
    tiles = [override] if override else list(range(min(_MAX_PREFILL_TILE, S) // 32 * 32, 0, -32))
    for t, pvc in ((t, pvc) for t in tiles for pvc in (V, 64, 32) if pvc <= V):
        fl_s = _Flash.sram_bytes(t, t, V, 1, pvc) + 16 * 64
        fl_a = _Flash.acc_bytes(t, t, V) + 4 * 64
        for nbuf in (3, 2):
            att = (_align(t * D * 2) + _align(t * V * 2) + _align(t * t * 4)
                   + nbuf * (_align(t * D * 2) + _align(t * V * 2)))
            for tm, kp in ((128, R), (128, R // 2), (64, R // 2), (64, R // 4), (32, R // 4), (32, 32)):
                if kp < 32 or kp % 32:
                    continue
                g_s = 2 * (_align(tm * kp * 2) + _align(max(N, V) * kp * 2) + _align(tm * max(N, V) * 2))
                g_a = 2 * _align(tm * max(N, V) * 4)
                if fl_s + max(att, g_s) <= cap_s and fl_a + g_a <= cap_a:
                    return t, nbuf, tm, kp, pvc, max(att, g_s)
    return None


def _build_mla_prefill_small(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """mla-prefill for scratchpads that cannot hold one head's K and V over the whole context
    (GPU presets): the decompressed K_nope and V go through HBM, and the key tiles stream past
    each query tile (online softmax across tiles).

    1. decompress: per (sequence, head, K or V, ``tm`` tokens) bf16(c_kv @ W_UK[h]^T) or
       bf16(c_kv @ W_UV[h]^T), K in ``kp``-wide panels accumulated in place, into HBM scratch
       ``k_nope`` [batch*q_heads*(prior+seq), nope] and ``v`` [.., v_head_dim] (row
       ((b*q_heads + h)*(prior+seq) + t));
    2. attention: per (sequence, head, query tile) the query tile stays, the key tiles of the
       prior context and of the chunk up to the diagonal stream in ([k_nope | k_pe] with k_pe
       read straight from the latent cache, and V), flash loop as the v1 kernel.

    The roundings are those of the v1 kernel (K_nope and V rounded to BF16 once, P to BF16).
    """
    B, S, H, prior = shape["batch"], shape["seq"], shape["q_heads"], shape["prior"]
    R, P, N, V = shape["kv_lora_rank"], shape["rope_dim"], shape["nope_dim"], shape["v_head_dim"]
    scale = _scale(shape)
    W, D, C = R + P, N + P, prior + S
    cap = latent_cache_capacity(C, shape["capacity"], "prior+seq")
    got = _prefill_small_tiling(S, C, (R, P, N, V), spec, shape["kv_tile"])
    if got is None:
        what = "shape key kv_tile=" + str(shape["kv_tile"]) if shape["kv_tile"] else "the tiling"
        raise InvalidArgumentError(
            f"{what} cannot hold this shape: a 32-token query tile with head dims {D} (q/k) and {V} "
            f"(v), its FP32 output state and two key/value tiles need more than {spec.name}'s "
            f"{spec.sram.scratchpad_bytes:,} B of scratchpad / {spec.sram.accumulator_bytes:,} B "
            "of accumulators per core")
    T, nbuf, tm, kp, pv_cols, arena_sram = got
    cores = spec.core.count
    kb = KernelBuilder(f"mla_prefill_b{B}_s{S}_p{prior}_h{H}" + (f"_cap{cap}" if cap != C else "")
                       + "_small", chip=spec)
    q_h = kb.hbm("q", (B * S * H, D), "bf16")
    kv_h = kb.hbm("kv_cache", (B * cap, W), "bf16")
    w_h = kb.hbm("w_kv_b", (H * (N + V), R), "bf16")
    mask_h = kb.hbm("causal_mask", (T, T), "f32")
    out_h = kb.hbm("out", (B * S * H, V), "bf16")
    kn_h = kb.hbm("k_nope", (B * H * C, N), "bf16")  # scratch: phase 1 -> 2
    v_h = kb.hbm("v", (B * H * C, V), "bf16")

    flash, arena, gacc = {}, {}, {}
    n_gemm = max(N, V)
    for c in range(cores):
        flash[c] = _Flash(kb, c, T, T, V, scale, states=1, pv_cols=pv_cols)
        arena[c] = kb.sram(c, "arena", (1, arena_sram), "u8")
        gacc[c] = [kb.acc(c, f"gemm_acc{i}", (tm, n_gemm)) for i in range(2)]
    half = arena_sram // 2
    a_b, b_b, o_b = tm * kp * 2, n_gemm * kp * 2, tm * n_gemm * 2

    def gemm_bufs(c: int) -> dict[str, list[Tile]]:
        ar = arena[c]
        offs = (0, _align(a_b), _align(a_b) + _align(b_b))
        bufs = {name: [_view(ar, "u8", 1, _align(size), s * half + o) for s in range(2)]
                for name, size, o in zip(("a", "b", "out"), (a_b, b_b, o_b), offs, strict=True)}
        return bufs | {"acc": gacc[c]}

    # Phase 1: decompress K_nope and V of every (sequence, head) into HBM.
    jobs = []
    for b in range(B):
        for h in range(H):
            for w_row, n, dst in ((h * (N + V), N, kn_h), (h * (N + V) + N, V, v_h)):
                for t0 in range(0, C, tm):
                    m = min(tm, C - t0)
                    panels = [(kv_h.sub(b * cap + t0, k0, m, min(kp, R - k0)),
                               w_h.sub(w_row, k0, n, min(kp, R - k0))) for k0 in range(0, R, kp)]
                    jobs.append(_GemmJob(panels, dst.sub((b * H + h) * C + t0, 0, m, n), transposed=True))
    kv_done = kb.semaphore("kv_done")
    n1 = sum(_emit_gemm_jobs(kb, c, jobs[c::cores], gemm_bufs(c), None, kv_done, "p1") for c in range(cores))

    # Phase 2: flash attention per (sequence, head, query tile), longest items first.
    starts = list(range(0, S, T))
    ktiles = _prefill_key_tiles(prior, S, T)
    n_prior = len(ktiles) - len(starts)
    items = sorted(((b, h, i) for b in range(B) for h in range(H) for i in range(len(starts))),
                   key=lambda x: -x[2])
    for c in range(min(cores, len(items))):
        _prefill_small_attention(kb, c, items[c::cores], flash[c], arena[c], (kv_done, n1),
                                 (q_h, kv_h, kn_h, v_h, mask_h, out_h), (S, H, T, nbuf, C, cap, n_prior),
                                 (R, P, N, V), ktiles, starts)

    return _prefill_build(
        kb, (B, S, T, C, cap, prior), (H, R, P, N, V), scale,
        {"path": "small-scratchpad", "tile": T, "kv_buffers": nbuf, "gemm_rows": tm, "gemm_panel": kp,
               "cores": cores, "items": len(items), "softmax_scale": scale, "prior": prior,
               "cache_capacity": cap, "key_tiles": len(ktiles), "scratch_bytes": 2 * B * H * C * (N + V) * 2,
               "form": "naive (decompressed K/V through HBM)"},
    )


def _prefill_small_attention(kb: KernelBuilder, c: int, items: list[tuple[int, int, int]], fl: _Flash,
                             arena: Tile, start: tuple[Semaphore, int], hbm: tuple[Tile, ...],
                             sizes: tuple[int, ...], dims: tuple[int, int, int, int],
                             ktiles: list[tuple[int, int]], starts: list[int]) -> None:
    """Core ``c``'s (sequence, head, query tile) items of ``_build_mla_prefill_small``."""
    q_h, kv_h, kn_h, v_h, mask_h, out_h = hbm
    S, H, T, nbuf, C, cap, n_prior = sizes
    R, P, N, V = dims
    D = N + P
    core = kb.core(c)
    off = 0

    def take(rows: int, cols: int, dtype: str) -> Tile:
        nonlocal off
        t = _view(arena, dtype, rows, cols, off)
        off += _align(t.nbytes)
        return t

    qs, os_, mask = take(T, D, "bf16"), take(T, V, "bf16"), take(T, T, "f32")
    kbuf = [(take(T, D, "bf16"), take(T, V, "bf16")) for _ in range(nbuf)]
    sem = {n: kb.semaphore(f"c{c}.p2.{n}") for n in ("q", "q_used", "kv", "o_ready", "o_stored", "mask")}
    for q in (core.dma[0], core.dma[1], core.dma[3]):  # phase 1 is done with the arena everywhere
        q.wait(*start)
    core.dma[3].load(mask, mask_h)
    core.dma[3].signal(sem["mask"])
    core.vpu.wait(sem["mask"], 1)
    q_rows, o_rows = q_h.sub(0, 0, q_h.rows, D), out_h.sub(0, 0, out_h.rows, V)
    tiles: list[_FlashTile] = []
    for it, (b, h, i) in enumerate(items):
        t0 = starts[i]
        nq = min(T, S - t0)
        if it >= 1:  # the matrix unit's scores of the previous item have read the query tile
            core.dma[1].wait(sem["q_used"], it)
        core.dma[1].load(qs.sub(0, 0, nq, D), _rows_of(q_rows, (b * S + t0) * H + h, nq, H))
        core.dma[1].signal(sem["q"])
        keys = ktiles[:n_prior + i + 1]
        base = (b * H + h) * C
        for j, (k0, nk) in enumerate(keys):
            g = fl.g + len(tiles)
            kt, vt = (x.sub(0, 0, nk, x.cols) for x in kbuf[g % nbuf])
            dq = core.dma[0]
            if g >= nbuf:  # the matrix unit is done with this buffer's previous tile
                dq.wait(fl.pv_done, g - nbuf + 1)
            dq.load(kt.sub(0, 0, nk, N), kn_h.sub(base + k0, 0, nk, N))
            dq.load(kt.sub(0, N, nk, P), kv_h.sub(b * cap + k0, R, nk, P))
            dq.load(vt, v_h.sub(base + k0, 0, nk, V))
            dq.signal(sem["kv"])
            diag = j == len(keys) - 1

            def scores(acc, g=g, kt=kt, it=it, j=j, nq=nq, diag=diag):
                if j == 0:
                    core.mxu.wait(sem["q"], it + 1)
                core.mxu.wait(sem["kv"], g + 1)
                core.mxu.matmul_t(acc, qs.sub(0, 0, nq, D), kt, mode="overwrite")
                if diag:
                    core.mxu.signal(sem["q_used"])

            def pv(acc, p, vt=vt):
                core.mxu.matmul(acc, p, vt, mode="overwrite")

            def finish(o, linv, it=it, b=b, h=h, t0=t0, nq=nq):
                if it >= 1:  # the previous item's output has left SRAM
                    core.vpu.wait(sem["o_stored"], it)
                core.vpu.mul(os_.sub(0, 0, nq, V), o, linv)
                core.vpu.signal(sem["o_ready"])
                core.dma[2].wait(sem["o_ready"], it + 1)
                core.dma[2].store(_rows_of(o_rows, (b * S + t0) * H + h, nq, H), os_.sub(0, 0, nq, V))
                core.dma[2].signal(sem["o_stored"])

            tiles.append(_FlashTile(nq, nk, 0, j == 0, diag, scores, pv, finish,
                                    mask.sub(0, 0, nq, nk) if diag else None))
    fl.run(tiles)


_COMMON = (
    ShapeKey("q_heads", int, 8, "query heads (DeepSeek-R1: 128, Kimi K2.5: 64)", minimum=1),
    ShapeKey("kv_lora_rank", int, 64, "latent width of the cache (DeepSeek/Kimi: 512); multiple of 32",
             minimum=32),
    ShapeKey("rope_dim", int, 32, "shared rope key width (qk_rope_head_dim, 64); multiple of 32",
             minimum=32),
    ShapeKey("nope_dim", int, 32, "per-head non-rope q/k width (qk_nope_head_dim, 128); multiple of 32",
             minimum=32),
    ShapeKey("v_head_dim", int, 32, "per-head value width (128)", minimum=1),
    ShapeKey("kv_dtype", str, "bf16", "latent cache dtype", choices=("bf16",)),
    ShapeKey("softmax_scale", float, 0.0, "score scale; 0: 1/sqrt(nope_dim + rope_dim) "
             "(DeepSeek YaRN: mla.yarn_softmax_scale())"),
    ShapeKey("kv_tile", int, 0, "tokens per tile (multiple of 32); 0: the largest that fits", minimum=0),
)

MLA_DECODE = register(KernelDef(
    name="mla-decode",
    doc="Multi-head latent attention decode, absorbed weights: the latent cache is read once for "
        "all heads (DeepSeek-R1, Kimi K2.5).",
    shape_keys=(
        ShapeKey("batch", int, 2, "sequences (one query token each)", minimum=1),
        ShapeKey("context", int, 96, "cached tokens per sequence, the new token's included; any >= 1 "
                 "(the last 32-token block's padding is masked)", minimum=1),
        ShapeKey("capacity", int, 0, "latent cache rows per sequence (kv_cache [batch*capacity, W]); "
                 "multiple of 32, >= context; 0: context rounded up to 32", minimum=0),
        *_COMMON,
    ),
    build=build_mla_decode,
))

MLA_PREFILL = register(KernelDef(
    name="mla-prefill",
    doc="Multi-head latent attention prefill, naive form: a chunk of new tokens over the prior "
        "context in the latent cache and themselves; K/V decompressed from the latent per head, "
        "causal flash attention.",
    shape_keys=(
        ShapeKey("batch", int, 1, "sequences", minimum=1),
        ShapeKey("seq", int, 64, "new tokens per sequence (this chunk, causal); multiple of 32",
                 minimum=32),
        ShapeKey("prior", int, 0, "tokens already in each sequence's latent cache before this chunk; "
                 "multiple of 32", minimum=0),
        ShapeKey("capacity", int, 0, "latent cache rows per sequence (kv_cache [batch*capacity, W]); "
                 "multiple of 32, >= prior+seq; 0: prior+seq", minimum=0),
        *_COMMON,
    ),
    build=build_mla_prefill,
))
