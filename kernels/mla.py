"""Multi-head latent attention (DeepSeek-V3/R1, Kimi K2.5): decode (absorbed) and prefill (naive).

The compressed KV cache holds per token one row ``[c_kv | k_pe]`` of ``kv_lora_rank + rope_dim``
BF16 values (512 + 64 for DeepSeek/Kimi), shared by every query head. The stand-alone programs
take their tensors in HBM, BF16 (``emit_mla_decode`` / ``emit_mla_prefill`` take q in HBM or on
chip, token-major, and put out in HBM or on chip: the same bytes, see below):

- ``q``: [tokens*q_heads, nope_dim + rope_dim], row ``token*q_heads + h`` = ``[q_nope | q_pe]``
  of head h, i.e. the output of q_b_proj with RoPE already applied to q_pe (the q down/up
  projections and RoPE are not part of these kernels); token-major, the same bytes are
  [tokens, q_heads*(nope_dim + rope_dim)], what the emitters take.
- ``kv_cache``: [batch*cap, kv_lora_rank + rope_dim], row ``b*cap + t`` = ``[c_kv | k_pe]`` of
  position t (k_pe already rotated). ``cap`` (tokens per sequence) is shape key ``capacity``, or,
  when that is 0, the sequence's tokens rounded up to 32 (``latent_cache_capacity``): decode's
  ``context``, prefill's ``prior + seq``; mla-append writes the same layout. Rows t >= the
  sequence's tokens are padding: their contents never reach the output (decode masks them).
- ``w_kv_b``: [q_heads*(nope_dim + v_head_dim), kv_lora_rank], DeepSeek's ``kv_b_proj.weight``:
  rows ``h*(nope+v) ..+nope`` are W_UK[h] (k_nope = c_kv @ W_UK[h]^T), the next ``v`` rows
  W_UV[h] (v = c_kv @ W_UV[h]^T).
- output ``out``: [tokens*q_heads, v_head_dim], row ``token*q_heads + h`` (token-major
  [tokens, q_heads*v_head_dim]).

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

**Split-KV** (flash-decoding) when batch leaves cores idle (``_decode_splits``; shape key
``kv_splits``): each sequence's span is cut into splits of whole 32-token blocks
(``split_ranges``), one core per (sequence, split). Phase 1 then sends every split core its
sequence's [q_lat | q_pe] for all heads (q_pe comes from the head cores with q_lat); phase 2
ends with the split's unnormalised state [O | l | m] (FP32 output, row sum, row max), which
goes to the head cores scratchpad to scratchpad; phase 3 first merges each head's states in a
fixed pairwise order (``_fold_steps``): m = max m_s, O = sum exp(m_s - m) O_s, l likewise,
o_lat = bf16(O / l). The reference does the same arithmetic (``mla_decode_reference(splits=)``:
P rounded relative to each split's maximum), bit for bit when each split is one tile. With one
cache tile per core, a core's copies to the 63 others go in one DMA set-up round (16 in flight
on each of 4 queues; its own rows by the vector unit), W_UV streams after them. DeepSeek-R1 at
batch 1, context 8192 on jalapeno-v1: 64 splits of 128 tokens, 12.6 us (one core per sequence:
57.6 us); what is left is latency: W_UK's 16.8 MB with the first load's set-up (2.7 us), the
M=1 absorption and up-projection at the BF16 rate (0.8 us each), the two exchanges (1.3 and
1.5 us: set-up plus each core's 263 KB of FP32 state through its DMA port), the store (1.5 us)
and the launch.

**Emitters.** ``emit_mla_decode`` plans within ``ctx.budget``; the prefetch part loads the
weights, q when it is an HBM tensor ready at start, and the first cache tiles that no other
operator of the program writes (a tile overlapping a readiness region of ``kv_cache``, the row
mla-append writes, loads after it); an on-chip q is fetched by each head core (in place when
its piece is on that core). The output stays where it was finished (``Out.onchip``: each head
core's heads' columns) or is stored (``Out.to``). ``emit_mla_prefill`` likewise: the mask and
each core's first item's weights and latent tiles in the prefetch part.

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
with DeepSeek's dims and a 2048-token chunk on jalapeno-v1 (planned within 95 % of the
scratchpad, ``planning.Budget``) the tile is 256 up to prior 4096; beyond that the item's output
goes through two query tiles' buffers instead of one [seq, v] buffer, which keeps the tile at
224 at prior 6144 (160 at 7168, 64 at 8192); from about prior + seq = 10k tokens the
small-scratchpad tiling takes over (K and V through HBM).

Softmax scale: shape key ``softmax_scale``; 0 means the plain 1/sqrt(nope_dim + rope_dim).
DeepSeek-V3/R1 with YaRN (factor 40, mscale_all_dim 1) use ``yarn_softmax_scale()`` = that times
mscale^2 = (0.1*ln(40) + 1)^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import EngineHandle, KernelBuilder, Semaphore
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import DTYPES
from jalapeno_emu.lazy import LazyModule

from .attention_ref import MASK_VALUE
from .base import KernelBuild, KernelDef, ShapeKey, TensorSpec, Tolerance
from .emit import EmitCtx, Emitter, Out, Piece, Ready, TensorRef, fetch, run_emitter
from .planning import Budget, DoesNotFit, mxu_macs_per_cycle
from .registry import register

jnp = LazyModule("jax.numpy")

__all__ = ["MLA_DECODE", "MLA_PREFILL", "emit_mla_decode", "emit_mla_prefill", "latent_cache_capacity",
           "mla_decode_reference", "mla_prefill_reference", "split_ranges", "yarn_softmax_scale"]

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


def _split_softmax_pv(s, vals, ranges: list[tuple[int, int]], tokens: int):
    """The split-KV kernel's softmax: per context split (``ranges``, clipped to the ``tokens``
    real keys) the unnormalised state m_i = max, P_i = bf16(exp(s - m_i)), l_i = sum P_i,
    O_i = P_i @ vals; merged in the kernel's fixed pairwise order (``_fold_steps``): m = max m_i,
    then each state scaled by exp(m_i - m) and summed; returns O * (1 / l), FP32.

    s: [..., q, k] f32 scores; vals: [..., k, d].
    """
    ms, states = [], []
    for lo, hi in ranges:
        si = s[..., lo:min(hi, tokens)]
        m = jnp.max(si, axis=-1, keepdims=True)
        p = _bf16(jnp.exp(si - m))
        o = jnp.einsum("...qk,...kd->...qd", p, vals[..., lo:min(hi, tokens), :])
        ms.append(m)
        states.append(jnp.concatenate([o, jnp.sum(p, axis=-1, keepdims=True)], axis=-1))
    m_all = jnp.stack(ms)
    mx, st = m_all, jnp.stack(states)
    for h, lo in _fold_steps(len(ranges)):
        mx = mx.at[:h].set(jnp.maximum(mx[:h], mx[lo:lo + h]))
    st = st * jnp.exp(m_all - mx[0])
    for h, lo in _fold_steps(len(ranges)):
        st = st.at[:h].set(st[:h] + st[lo:lo + h])
    return st[0][..., :-1] * (jnp.float32(1.0) / st[0][..., -1:])


def mla_decode_reference(q, kv_cache, w_kv_b, *, batch: int, context: int, heads: int, rank: int,
                         rope: int, nope: int, v: int, scale: float, capacity: int = 0, splits: int = 1):
    """Absorbed-form MLA decode in pure JAX; BF16 roundings where the kernel rounds.

    q [batch*heads, nope+rope]; kv_cache [batch*cap, rank+rope] with cap =
    ``latent_cache_capacity(context, capacity)``: rows b*cap + t for t < context are read, the
    padding rows never. Returns out [batch*heads, v] BF16. q_lat, P and o_lat are rounded to BF16
    (matrix-unit operands); products accumulate in FP32. ``splits`` > 1: the split-KV kernel's
    arithmetic (``split_ranges`` of the context rounded up to 32, each split's softmax relative to
    its own maximum, the partial states merged in the kernel's order: ``_split_softmax_pv``).
    """
    qq = _f32(q).reshape(batch, heads, nope + rope)
    kv = _latent_rows(kv_cache, batch, context, capacity, rank + rope, "context")
    w_uk, w_uv = _split_w(w_kv_b, heads, nope, v)
    q_lat = _bf16(jnp.einsum("bhn,hnr->bhr", qq[..., :nope], w_uk))
    q_full = jnp.concatenate([q_lat, qq[..., nope:]], axis=-1)  # [B, H, R+P]
    s = jnp.einsum("bhk,btk->bht", q_full, kv) * jnp.float32(scale)
    if splits > 1:
        span = -(-context // _BLOCK) * _BLOCK
        o_lat = _bf16(_split_softmax_pv(s, kv[..., :rank], split_ranges(span, splits), context))
    else:
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



# --- shared helpers: views, fetches, tile choice --------------------------------------------
def _rows_of(t: Tile, first: int, count: int, every: int) -> Tile:
    """``count`` rows of HBM/SRAM tile ``t`` starting at ``first``, taking every ``every``-th row."""
    return Tile(t.space, t.core, t.offset + first * t.stride, t.dtype, count, t.cols, t.stride * every)


def _reshaped(t: Tile, rows: int, cols: int) -> Tile:
    """The packed tile ``t`` seen as [rows, cols] (the same bytes: a stand-alone program's
    head-major [tokens*heads, width] tensor as the token-major [tokens, heads*width] it is)."""
    if not t.contiguous or rows * DTYPES[t.dtype].row_bytes(cols) != t.nbytes:
        raise AssertionError(f"{t} cannot be viewed as [{rows}, {cols}]")  # a kernel bug
    return Tile(t.space, t.core, t.offset, t.dtype, rows, cols)


def _heads_of_row(t: Tile, nh: int, head_w: int) -> Tile:
    """Of a one-row tile ``t`` that starts inside a head of a token-major row ([.., heads*head_w]),
    the same columns of ``nh`` consecutive heads as an [nh, t.cols] tile (row stride: one head)."""
    return Tile(t.space, t.core, t.offset, t.dtype, nh, t.cols, DTYPES[t.dtype].row_bytes(head_w))


def _wait_once(q: EngineHandle, ready: Ready | None, waited: dict[Any, set[Ready]]) -> None:
    """``q`` waits for ``ready`` unless it already has (``waited`` per engine, updated)."""
    done = waited.setdefault(q.engine, set())
    if ready is not None and ready not in done:
        q.wait(*ready)
        done.add(ready)


def _fetch_heads(q: EngineHandle, dst: Tile, src: TensorRef, row: int, h0: int, nh: int, col: int,
                 head_w: int, waited: dict[Any, set[Ready]]) -> None:
    """Copy columns col..col+dst.cols of heads h0..h0+nh of token ``row`` of the token-major
    ``src`` ([tokens, heads*head_w]) into ``dst`` [nh, width] on queue ``q``: from HBM one
    strided load (after the readiness regions of that row); on chip one strided copy per piece
    holding whole heads of the row (a head split between pieces: one copy per part)."""
    width = dst.cols
    if src.in_hbm:
        for r in src.waits(row, h0 * head_w, 1, nh * head_w):
            _wait_once(q, r, waited)
        q.load(dst, _heads_of_row(src.hbm_view(row, h0 * head_w + col, 1, width), nh, head_w))
        return
    h = h0
    while h < h0 + nh:
        parts = src.sources(row, h * head_w + col, 1, width, near=q.engine.core)
        if len(parts) > 1:  # this head's columns lie in several pieces
            for piece, _, b0, _, nc in parts:
                _wait_once(q, piece.ready, waited)
                off = b0 - (h * head_w + col)
                q.copy(dst.sub(h - h0, off, 1, nc), piece.tile.sub(row - piece.r0, b0 - piece.c0, 1, nc))
            h += 1
            continue
        piece = parts[0][0]
        k = 1  # further heads whose columns lie in the same piece
        while h + k < h0 + nh and (h + k) * head_w + col + width <= piece.c0 + piece.cols:
            k += 1
        _wait_once(q, piece.ready, waited)
        first = piece.tile.sub(row - piece.r0, h * head_w + col - piece.c0, 1, width)
        q.copy(dst.sub(h - h0, 0, k, width), _heads_of_row(first, k, head_w))
        h += k


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
        raise DoesNotFit(f"the tiling cannot hold this shape: {what}")
    return t


def _view(arena: Tile, dtype: str, rows: int, cols: int, byte_off: int = 0) -> Tile:
    """A packed [rows, cols] tile of ``dtype`` inside ``arena`` (a byte region reused over phases)."""
    t = Tile(arena.space, arena.core, arena.offset + byte_off, dtype, rows, cols)
    if t.end > arena.offset + arena.nbytes:
        raise AssertionError(f"{t} is not inside {arena}")  # a kernel bug, not bad input
    return t


def _align(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _hbm_scratch(ctx: EmitCtx, ref: TensorRef | None, name: str, shape: tuple[int, int]) -> Tile:
    """The HBM staging tensor ``name`` (role scratch): the given one, or allocated here when the
    caller planned a tiling that needs none (a fused operator re-planned into a smaller budget)."""
    if ref is not None:
        if ref.shape != shape or not ref.in_hbm:
            raise InvalidArgumentError(f"scratch {name} must be an HBM tensor {list(shape)}, got "
                                       f"{ref.name} {list(ref.shape)}")
        return ref.base
    return ctx.kb.hbm(name, shape, "bf16")


# --- decode: shape, splits, plan ------------------------------------------------------------
class _LatentDims:
    """The widths every checked MLA shape derives from its dims ``h, r, p, n, v``."""

    h: int
    r: int
    p: int
    n: int
    v: int

    @property
    def w(self) -> int:
        """One cache row: [c_kv | k_pe]."""
        return self.r + self.p

    @property
    def d(self) -> int:
        """One head's query: [q_nope | q_pe]."""
        return self.n + self.p

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return self.h, self.r, self.p, self.n, self.v


@dataclass(frozen=True)
class _Dec(_LatentDims):
    """A checked mla-decode shape: ``b`` sequences of ``c`` cached tokens in ``cap`` rows each
    (``span``: c rounded up to 32, the tokens read), ``h`` heads, latent width ``r``, rope ``p``,
    nope ``n``, value head ``v``, softmax ``scale``."""

    b: int
    c: int
    cap: int
    span: int
    h: int
    r: int
    p: int
    n: int
    v: int
    scale: float


def _decode_shape(shape: dict[str, Any]) -> _Dec:
    """The checked shape; InvalidArgumentError naming the key otherwise."""
    _check_dims(shape, None)
    c = shape["context"]
    cap = latent_cache_capacity(c, shape["capacity"])
    return _Dec(shape["batch"], c, cap, -(-c // _BLOCK) * _BLOCK, shape["q_heads"], shape["kv_lora_rank"],
                shape["rope_dim"], shape["nope_dim"], shape["v_head_dim"], _scale(shape))


def _decode_splits(d: _Dec, spec: ChipSpec, budget: Budget, requested: int) -> int:
    """Context splits per sequence: shape key ``kv_splits`` when > 0; automatically, when batch
    leaves at least two cores per sequence and one sequence's attention on one core (its
    matrix-unit time at the BF16 rate) outlasts two DMA set-ups (what the exchange of partial
    states adds), as many splits as the cores per sequence allow (at least one 32-token block
    each), else 1.

    (Measured on jalapeno-v1, DeepSeek-R1 dims: more splits cost at most 1 % against the best
    count, and a split program is 2-3 us faster even below the threshold, down to 64 tokens; the
    threshold keeps short contexts, the tiny models' included, on the one-core program, whose
    single softmax the model reference follows bit for bit: see ``mla_decode_reference``.)"""
    blocks = d.span // _BLOCK
    if requested:
        if requested > 1 and (requested > blocks or d.b * requested > budget.cores):
            raise InvalidArgumentError(
                f"shape key kv_splits={requested}: each of batch={d.b} sequences split {requested} ways "
                f"needs {d.b * requested} cores (of {budget.cores}) and at least {requested} 32-token "
                f"blocks of context (context={d.c} has {blocks})")
        return requested
    per_seq = budget.cores // d.b
    if per_seq < 2:
        return 1
    seq_s = d.span * d.h * (d.w + d.r) / mxu_macs_per_cycle(spec, "bf16", "bf16") / spec.core.clock_hz
    if seq_s < 2 * spec.dma.setup_latency_s:
        return 1
    return min(per_seq, blocks)


def split_ranges(span: int, splits: int) -> list[tuple[int, int]]:
    """[lo, hi) token ranges of a sequence's ``splits`` context splits over ``span`` tokens (a
    multiple of 32), in whole 32-token blocks, the later splits taking the extra blocks."""
    blocks = span // _BLOCK
    return [(s * blocks // splits * _BLOCK, (s + 1) * blocks // splits * _BLOCK) for s in range(splits)]


@dataclass(frozen=True)
class _DecodePlan:
    """How the on-core mla-decode is cut (see the module docstring).

    Attributes:
        t: context tokens per tile; nbuf: latent cache tiles in flight per attention core.
        splits: context splits per sequence (1: every sequence on one core).
        heads_of: per head core, its heads (absorption and up-projection).
        units: per attention core, its (sequence, first token, end token) attention units.
        qpe_heads: q_pe travels with q_lat from the head cores (split-KV, or q on chip); else
            each attention core loads its sequences' q_pe from HBM.
    """

    t: int
    nbuf: int
    splits: int
    heads_of: tuple[tuple[int, ...], ...]
    units: tuple[tuple[tuple[int, int, int], ...], ...]
    qpe_heads: bool


def _merge_bytes(rows: int, splits: int, r: int) -> int:
    """Scratchpad of a head core's split-KV merge: the partial states [splits*rows, R+2] FP32
    and its [splits*rows, 1] and [rows, 1] FP32 columns."""
    return _align(splits * rows * (r + 2) * 4) + 2 * _align(splits * rows * 4) + _align(rows * 4)


def _decode_v1_plan(d: _Dec, spec: ChipSpec, budget: Budget, splits: int, qpe_heads: bool,
                    kv_tile: int) -> _DecodePlan:
    """The on-core plan for ``splits`` splits per sequence; DoesNotFit when not even a 32-token
    tile fits beside the weights and the query/output state."""
    B, H, (R, _, N, V), W, D = d.b, d.h, d.dims[1:], d.w, d.d
    cores = budget.cores
    split = splits > 1
    qpe_heads = qpe_heads or split
    n_head = min(cores, H)
    hpc = -(-H // n_head)  # heads per head core
    heads_of = tuple(tuple(range(c * hpc, min(H, (c + 1) * hpc))) for c in range(-(-H // hpc)))
    if split:
        ranges = split_ranges(d.span, splits)
        units = tuple(((b, lo, hi),) for b in range(B) for lo, hi in ranges)
        bpc, longest, states = 1, max(hi - lo for lo, hi in ranges), 1
    else:
        n_att = min(cores, B)
        units = tuple(tuple((b, 0, d.span) for b in range(B) if b % n_att == a) for a in range(n_att))
        bpc, longest, states = -(-B // n_att), d.span, 2
    qw, lw = (D, W) if qpe_heads else (N, R)  # q rows a head core holds, and its q_lat rows
    sram_fixed = hpc * (N * R + V * R + B * qw + B * lw + B * R + B * V) * 2 \
        + _Flash.sram_bytes(H, 0, R, states) + _SLACK
    if split:  # the merge on the head cores; the query and the partial state on the split cores
        sram_fixed += _merge_bytes(hpc * B, splits, R) + H * W * 2 + H * (R + 2) * 4
    else:
        sram_fixed += bpc * H * (W + R) * 2
    acc_fixed = hpc * B * (R + V) * 4 + _Flash.acc_bytes(H, 0, R) + _SLACK
    per_sram = 2 * W * 2 + _Flash.sram_bytes(H, 1, R, states) - _Flash.sram_bytes(H, 0, R, states)
    cap_s, cap_a = budget.sram_bytes, budget.acc_bytes
    what = (f"q_heads={H}, kv_lora_rank={R}, batch={B} need {sram_fixed:,} B of scratchpad and "
            f"{acc_fixed:,} B of accumulators before any context tile; {spec.name} plans with "
            f"{cap_s:,} B and {cap_a:,} B per core")
    acc_fit = (cap_a - acc_fixed) // (2 * H * 4) // 32 * 32  # scores accumulators, double-buffered
    if acc_fit < 32 or (cap_s - sram_fixed) // per_sram < 32:
        raise DoesNotFit(what)
    T = _pick_tile(min(_MAX_DECODE_TILE, acc_fit), longest, sram_fixed, per_sram, cap_s, what, kv_tile)
    # Spare scratchpad buys deeper prefetch: a tile's load (set-up + latency + bytes) takes longer
    # than one tile of matrix work, so two buffers would leave the matrix unit waiting.
    nbuf = min(_MAX_DECODE_BUFFERS, 2 + (cap_s - sram_fixed - T * per_sram) // (T * W * 2))
    most = max(sum(-(-(hi - lo) // T) for _, lo, hi in us) for us in units)
    return _DecodePlan(T, min(nbuf, most), splits, heads_of, units, qpe_heads)


def _plan_mla_decode(shape: dict[str, Any], spec: ChipSpec, budget: Budget, *,
                     qpe_heads: bool = False, keep_out: bool = False) -> tuple[_Dec, Any]:
    """(shape, plan): split-KV when it pays (``_decode_splits``), else a core per sequence,
    else, on scratchpads too small for either, the small-scratchpad tiling (``_DecodeTiling``).
    ``qpe_heads``: q is on chip (q_pe then comes with q_lat); ``keep_out``: the output stays on
    chip (the small tiling keeps every output block)."""
    d = _decode_shape(shape)
    requested = shape.get("kv_splits", 0)
    splits = _decode_splits(d, spec, budget, requested)
    if splits > 1:
        try:
            return d, _decode_v1_plan(d, spec, budget, splits, qpe_heads, shape["kv_tile"])
        except DoesNotFit as exc:
            if requested:
                raise DoesNotFit(f"shape key kv_splits={requested}: split-KV needs the on-core tiling, which "
                                 f"does not fit: {exc.message}") from None
    try:
        return d, _decode_v1_plan(d, spec, budget, 1, qpe_heads, shape["kv_tile"])
    except DoesNotFit:
        pass
    # Small scratchpads (GPU presets): weights and all heads' output state cannot stay on the
    # core; the phases go through HBM instead.
    if requested > 1:
        raise InvalidArgumentError(f"shape key kv_splits={requested}: split-KV needs the on-core tiling, "
                                   f"which does not fit {spec.name}'s scratchpad (use kv_splits=0 or 1)")
    til = _decode_small_tiling(d, spec, budget, shape["kv_tile"], keep_out)
    if til is None:
        what = "shape key kv_tile=" + str(shape["kv_tile"]) if shape["kv_tile"] else "the tiling"
        raise DoesNotFit(
            f"{what} cannot hold this shape: q_heads={d.h}, kv_lora_rank={d.r}, rope_dim={d.p}: one head's "
            f"query [1, {d.w}] and FP32 output state [1, {d.r}] plus two 32-token cache tiles of "
            f"{32 * d.w * 2:,} B need more than the {budget.sram_bytes:,} B of scratchpad / "
            f"{budget.acc_bytes:,} B of accumulators per core {spec.name} plans with")
    return d, til


# --- decode: the on-core program --------------------------------------------------------------
def _emit_decode_v1(ctx: EmitCtx, d: _Dec, plan: _DecodePlan, q: TensorRef, kv: TensorRef, w: TensorRef,
                    out: Out) -> Emitter:
    """The on-core mla-decode (see the module docstring): absorb on the head cores, attention on
    the attention cores (one core per sequence, or per context split with the partial states
    merged on the head cores), up-projection on the head cores."""
    kb = ctx.kb
    B, cap, span, C = d.b, d.cap, d.span, d.c
    H, R, P, N, V = d.dims
    W, D = d.w, d.d
    T, nbuf, S = plan.t, plan.nbuf, plan.splits
    split, qpe_heads = S > 1, plan.qpe_heads
    w_h, kv_h = w.base, kv.base
    q_static = q.in_hbm and not q.waits()
    heads_of, units = plan.heads_of, plan.units
    head_cores = range(len(heads_of))
    qw, lw = (D, W) if qpe_heads else (N, R)
    split_of = {lo: s for s, (lo, _) in enumerate(split_ranges(span, S))}
    # (sequence, split) -> (attention core, local unit index), in sequence order
    unit_at = sorted(((b, lo), a, bl) for a, us in enumerate(units) for bl, (b, lo, _) in enumerate(us))
    # Queues carrying the cross-core copies: 1..3, as dma[0] streams the cache (a DMA queue's
    # signal lands after everything before it on the queue, the prefetched tiles included). With
    # split-KV and a single tile per core, dma[0]'s tile is in before the copies: all four queues,
    # so that a core's 63 copies to the others take one set-up round (16 in flight per queue).
    n_copy_q = len(kb.core(0).dma) if split and max(len(us) for us in units) == 1 and \
        max(-(-(hi - lo) // T) for us in units for _, lo, hi in us) == 1 else 3
    waited: dict[Any, set[Ready]] = {}

    # Allocations first (all of them before the prefetch part ends), so that every core can
    # address the others' buffers.
    hb: dict[int, dict[str, Any]] = {}
    for c in head_cores:
        nh = len(heads_of[c])
        hb[c] = {"wuk": kb.sram(c, "wuk", (nh * N, R), "bf16"),
                 "wuv": kb.sram(c, "wuv", (nh * V, R), "bf16"),
                 "qn": kb.sram(c, "qn", (nh * B, qw), "bf16"),  # row hl*B + b
                 "qlat": kb.sram(c, "qlat", (nh * B, lw), "bf16"),  # row hl*B + b
                 "obuf": kb.sram(c, "obuf", (nh * B, R), "bf16"),  # row hl*B + b
                 "ob": kb.sram(c, "ob", (B, nh * V), "bf16", keep=not out.in_hbm),  # token-major
                 "accq": kb.acc(c, "accq", (nh * B, R)), "acco": kb.acc(c, "acco", (nh * B, V)),
                 # q rows already in this core's scratchpad (an on-chip q), used in place
                 "local": [None if q.in_hbm else q.local(c, 0, h * D, B, D) for h in heads_of[c]]}
        if split:  # the merge: row s*k + hl*B + b holds split s's state of (head hl, sequence b)
            k = hb[c]["k"] = nh * B
            hb[c]["recv"] = kb.sram(c, "recv", (S * k, R + 2), "f32")
            hb[c]["mx"] = kb.sram(c, "merge_m", (S * k, 1), "f32")
            hb[c]["alpha"] = kb.sram(c, "merge_a", (S * k, 1), "f32")
            hb[c]["linv"] = kb.sram(c, "merge_linv", (k, 1), "f32")
    ab: dict[int, dict[str, Any]] = {}
    for a, us in enumerate(units):
        nb = len(us)
        ab[a] = {"qbuf": kb.sram(a, "qbuf", (nb * H, W), "bf16"),  # [q_lat | q_pe], row bl*H + h
                 "kv": [kb.sram(a, f"kv{i}", (T, W), "bf16") for i in range(nbuf)],
                 "fl": None}
        if split:  # the unnormalised partial state [O | l | m], FP32
            ab[a]["state"] = kb.sram(a, "state", (H, R + 2), "f32")
        else:
            ab[a]["olat"] = kb.sram(a, "olat", (nb * H, R), "bf16")
    for a in ab:
        ab[a]["fl"] = _Flash(kb, a, H, T, R, d.scale, states=1 if split else 2)

    # Prefetch part: the weights, q when it is an HBM tensor ready at start, the cache tiles.
    for c in head_cores:
        core, hs, hd = kb.core(c), heads_of[c], hb[c]
        hd["wq_loaded"], hd["wuv_loaded"] = kb.semaphore(f"c{c}.wq_loaded"), kb.semaphore(f"c{c}.wuv_loaded")
        for hl, h in enumerate(hs):
            core.dma[0].load(hd["wuk"].sub(hl * N, 0, N, R), w_h.sub(h * (N + V), 0, N, R))
            if q_static:
                core.dma[0].load(hd["qn"].sub(hl * B, 0, B, qw), q.hbm_view(0, h * D, B, qw))
            if not split:
                core.dma[3].load(hd["wuv"].sub(hl * V, 0, V, R), w_h.sub(h * (N + V) + N, 0, V, R))
        core.dma[0].signal(hd["wq_loaded"])
        if not split:  # (split-KV: W_UV comes after the q_lat copies, below)
            core.dma[3].signal(hd["wuv_loaded"])
    for a, us in enumerate(units):
        core, ad = kb.core(a), ab[a]
        ad["qpe_loaded"] = None
        if not qpe_heads and q_static:  # each sequence's q_pe, all heads, from HBM
            ad["qpe_loaded"] = kb.semaphore(f"c{a}.qpe_loaded")
            for bl, (b, _, _) in enumerate(us):
                _fetch_heads(core.dma[0], ad["qbuf"].sub(bl * H, R, H, P), q, b, 0, H, N, D, waited)
            core.dma[0].signal(ad["qpe_loaded"])
        # Context tiles, g counting this core's tiles; slot g % nbuf, whose semaphore counts its loads.
        ad["slots"] = [kb.semaphore(f"c{a}.kv_loaded{i}") for i in range(nbuf)]
        ad["tiles"] = [(bl, b, t0, min(T, hi - t0)) for bl, (b, lo, hi) in enumerate(us)
                       for t0 in range(lo, hi, T)]
        ad["early"] = set()
        for g, (_, b, t0, n) in enumerate(ad["tiles"]):
            if g < nbuf and not kv.waits(b * cap + t0, 0, n, W):
                core.dma[0].load(ad["kv"][g].sub(0, 0, n, W), kv_h.sub(b * cap + t0, 0, n, W))
                core.dma[0].signal(ad["slots"][g])
                ad["early"].add(g)

    # The output's ref (readiness decided now, the work emitted below).
    o_ready = {c: kb.semaphore(f"c{c}.o_ready") for c in head_cores}
    out_stored = {c: kb.semaphore(f"c{c}.out_stored") for c in head_cores}
    if out.in_hbm:
        ref = out.ref
        for c in head_cores:
            ref = ref.with_ready(0, heads_of[c][0] * V, B, len(heads_of[c]) * V, (out_stored[c].id, 1))
    else:
        ref = TensorRef.onchip("out", (B, H * V), "bf16", [
            Piece(0, heads_of[c][0] * V, B, len(heads_of[c]) * V, hb[c]["ob"], None,
                  (o_ready[c].id, len(heads_of[c]))) for c in head_cores])
    outs = {"out": ref}
    yield outs

    qlat_sent, olat_sent = kb.semaphore("qlat_sent"), kb.semaphore("olat_sent")
    # Phase 1: absorb W_UK into q (per head, M = batch), deliver q_lat (with q_pe when
    # qpe_heads) to the sequences' attention cores.
    qlat_signals = 0
    for c in head_cores:
        core, hs, hd = kb.core(c), heads_of[c], hb[c]
        acc_ready, read = kb.semaphore(f"c{c}.q_acc"), kb.semaphore(f"c{c}.q_read")
        hd["read"] = read
        q_src, q_waits = [], []  # per head its [B, qw] rows; what the matrix unit waits for
        used: list[EngineHandle] = []
        for hl, h in enumerate(hs):
            loc = hd["local"][hl]
            if loc is not None:
                q_src.append(loc[0])
                if loc[1] is not None and loc[1] not in q_waits:
                    q_waits.append(loc[1])
                continue
            q_src.append(hd["qn"].sub(hl * B, 0, B, qw))
            if not q_static:
                qs = [core.dma[0]] if q.in_hbm else core.dma[:3]
                used += [e for e in fetch(qs, q_src[-1], q, 0, h * D, waited=waited) if e not in used]
        if used:
            q_in = kb.semaphore(f"c{c}.q_in")
            for e in used:
                e.signal(q_in)
            q_waits.append((q_in.id, len(used)))
        core.mxu.wait(hd["wq_loaded"], 1)
        for r in q_waits:
            core.mxu.wait(*r)
        for hl in range(len(hs)):
            core.mxu.matmul(hd["accq"].sub(hl * B, 0, B, R), q_src[hl].sub(0, 0, B, N),
                            hd["wuk"].sub(hl * N, 0, N, R), mode="overwrite")
        core.mxu.signal(acc_ready)
        core.vpu.wait(acc_ready, 1)
        core.vpu.acc_read(hd["qlat"].sub(0, 0, len(hs) * B, R), hd["accq"])
        if qpe_heads:  # [q_lat | q_pe]: the rope part travels with the latent query
            for hl in range(len(hs)):
                core.vpu.copy(hd["qlat"].sub(hl * B, R, B, P), q_src[hl].sub(0, N, B, P))
        used_q: set[int] = set()
        own = [u for u in unit_at if split and u[1] == c]
        remote = [u for u in unit_at if u not in own]
        for (b, _), a, bl in own:  # split-KV: this core's own unit by the vector unit (so that one
            # DMA set-up round holds the copies to the others)
            core.vpu.copy(ab[a]["qbuf"].sub(bl * H + hs[0], 0, len(hs), lw),
                          _rows_of(hd["qlat"], b, len(hs), B))
        core.vpu.signal(read)
        for i, ((b, _), a, bl) in enumerate(remote):
            e = core.dma[(1 + i) % n_copy_q] if n_copy_q == 4 else core.dma[1 + i % n_copy_q]
            if e.engine.queue not in used_q:
                e.wait(read, 1)
                used_q.add(e.engine.queue)
            # rows b, b+B, ... (one per local head) -> rows h0.. of the unit's [q_lat | q_pe]
            e.copy(ab[a]["qbuf"].sub(bl * H + hs[0], 0, len(hs), lw), _rows_of(hd["qlat"], b, len(hs), B))
        for qi in sorted(used_q):
            core.dma[qi].signal(qlat_sent)
        qlat_signals += len(used_q)
        if split:  # W_UV is needed last: after the copies (so that they go in one round), on the
            # queue that carries no copy or one copy fewer in each exchange
            for hl, h in enumerate(hs):
                core.dma[0].load(hd["wuv"].sub(hl * V, 0, V, R), w_h.sub(h * (N + V) + N, 0, V, R))
            core.dma[0].signal(hd["wuv_loaded"])

    # Phase 2: attention over the latent cache, units (sequences, or context splits) per core.
    olat_signals = 0
    for a, us in enumerate(units):
        core, ad = kb.core(a), ab[a]
        fl = ad["fl"]
        olat_ready = kb.semaphore(f"c{a}.olat_ready")
        if not qpe_heads and ad["qpe_loaded"] is None:  # q_pe from an HBM q written in this program
            ad["qpe_loaded"] = kb.semaphore(f"c{a}.qpe_loaded")
            for bl, (b, _, _) in enumerate(us):
                _fetch_heads(core.dma[0], ad["qbuf"].sub(bl * H, R, H, P), q, b, 0, H, N, D, waited)
            core.dma[0].signal(ad["qpe_loaded"])
        if ad["qpe_loaded"] is not None:
            core.mxu.wait(ad["qpe_loaded"], 1)
        core.mxu.wait(qlat_sent, qlat_signals)
        if split and a in hb:  # the rows this core's vector unit copied itself
            core.mxu.wait(hb[a]["read"], 1)
        tiles: list[_FlashTile] = []
        for g, (bl, b, t0, n) in enumerate(ad["tiles"]):
            s, use = g % nbuf, g // nbuf
            buf = ad["kv"][s].sub(0, 0, n, W)
            if g not in ad["early"]:
                if g >= nbuf:  # the matrix unit is done with this buffer's previous tile
                    core.dma[0].wait(fl.pv_done, g - nbuf + 1)
                for r in kv.waits(b * cap + t0, 0, n, W):  # rows another operator writes
                    _wait_once(core.dma[0], r, waited)
                core.dma[0].load(buf, kv_h.sub(b * cap + t0, 0, n, W))
                core.dma[0].signal(ad["slots"][s])
            qbuf = ad["qbuf"].sub(bl * H, 0, H, W)
            first = g == 0 or ad["tiles"][g - 1][0] != bl
            last = g == len(ad["tiles"]) - 1 or ad["tiles"][g + 1][0] != bl

            # The callbacks run inside fl.run below, in this core's iteration; defaults bind
            # the loop variables all the same.
            def scores(acc, s=s, use=use, buf=buf, qbuf=qbuf, core=core, slots=ad["slots"]):
                core.mxu.wait(slots[s], use + 1)
                core.mxu.matmul_t(acc, qbuf, buf, mode="overwrite")

            def pv(acc, p, buf=buf, core=core):
                core.mxu.matmul(acc, p, buf.sub(0, 0, buf.rows, R), mode="overwrite")

            def finish(o, linv, bl=bl, core=core, ad=ad, fl=fl, olat_ready=olat_ready):
                if split:  # the unnormalised state [O | l | m] for the merge
                    st = ad["state"]
                    core.vpu.copy(st.sub(0, 0, H, R), o)
                    core.vpu.copy(st.sub(0, R, H, 1), fl.l[0].sub(0, 0, H, 1))
                    core.vpu.copy(st.sub(0, R + 1, H, 1), fl.m[0].sub(0, 0, H, 1))
                else:
                    core.vpu.mul(ad["olat"].sub(bl * H, 0, H, R), o, linv)
                core.vpu.signal(olat_ready)

            pad = span - C if last and t0 + n == span else 0
            tiles.append(_FlashTile(H, n, bl % 2, first, last, scores, pv, finish, pad_cols=pad))
        fl.run(tiles)
        used_q = set()
        for bl, (b, lo, _) in enumerate(us):
            for i, c in enumerate(head_cores):
                hs = heads_of[c]
                if split:  # rows hs of the state -> rows s*K + hl*B + b of the head core's merge
                    dst, src = (_rows_of(hb[c]["recv"], split_of[lo] * hb[c]["k"] + b, len(hs), B),
                                ad["state"].sub(hs[0], 0, len(hs), R + 2))
                    if c == a:  # its own heads: the vector unit, which merges them later
                        core.vpu.copy(dst, src)
                        continue
                    j = i - (i > a)
                    e = core.dma[(1 + j) % n_copy_q] if n_copy_q == 4 else core.dma[1 + j % n_copy_q]
                else:
                    e = core.dma[1 + (bl * len(head_cores) + i) % n_copy_q]
                    dst = _rows_of(hb[c]["obuf"], b, len(hs), B)
                    src = ad["olat"].sub(bl * H + hs[0], 0, len(hs), R)
                e.wait(olat_ready, bl + 1)
                used_q.add(e.engine.queue)
                e.copy(dst, src)
        for qi in sorted(used_q):
            core.dma[qi].signal(olat_sent)
        olat_signals += len(used_q)

    # Phase 3: (split-KV: merge the partial states,) up-projection with W_UV per head (M =
    # batch), out[b, h*V:(h+1)*V] stored or kept.
    for c in head_cores:
        core, hs, hd = kb.core(c), heads_of[c], hb[c]
        acc_ready = kb.semaphore(f"c{c}.o_acc")
        if split:
            merged = kb.semaphore(f"c{c}.merged")
            core.vpu.wait(olat_sent, olat_signals)
            _emit_merge(core.vpu, hd["recv"], hd["mx"], hd["alpha"], hd["linv"], hd["obuf"], S, hd["k"], R)
            core.vpu.signal(merged)
            core.mxu.wait(merged, 1)
        else:
            core.mxu.wait(olat_sent, olat_signals)
        core.mxu.wait(hd["wuv_loaded"], 1)
        for hl in range(len(hs)):
            core.mxu.matmul_t(hd["acco"].sub(hl * B, 0, B, V), hd["obuf"].sub(hl * B, 0, B, R),
                              hd["wuv"].sub(hl * V, 0, V, R), mode="overwrite")
            core.mxu.signal(acc_ready)
        for hl, h in enumerate(hs):
            core.vpu.wait(acc_ready, hl + 1)
            core.vpu.acc_read(hd["ob"].sub(0, hl * V, B, V), hd["acco"].sub(hl * B, 0, B, V))
            core.vpu.signal(o_ready[c])
            if out.in_hbm:
                e = core.dma[2]
                e.wait(o_ready[c], hl + 1)
                e.store(out.ref.hbm_view(0, h * V, B, V), hd["ob"].sub(0, hl * V, B, V))
        if out.in_hbm:
            core.dma[2].signal(out_stored[c])
    return outs


def _fold_steps(n: int) -> list[tuple[int, int]]:
    """The fixed pairwise order in which the split-KV merge reduces ``n`` partial states: (h, lo)
    steps, each combining rows [0, h) with rows [lo, lo + h) into [0, h), until one is left
    (the kernel and ``mla_decode_reference`` follow the same steps)."""
    steps = []
    while n > 1:
        h = n // 2
        steps.append((h, n - h))
        n -= h
    return steps


def _emit_merge(vpu: EngineHandle, recv: Tile, mx: Tile, alpha: Tile, linv: Tile, obuf: Tile, splits: int,
                k: int, r: int) -> None:
    """Merge ``splits`` partial softmax states of ``k`` rows each (flash-decoding's combine):
    ``recv`` [splits*k, r+2] FP32 holds split s's rows at s*k.., columns [O | l | m]. m = max over
    splits (``_fold_steps``), broadcast back to every split's rows by doubling copies; each state
    scaled by exp(m_s - m) and summed (``_fold_steps``); then obuf [k, r] = bf16(O * (1 / l))."""
    m_col, ol = recv.sub(0, r + 1, splits * k, 1), recv.sub(0, 0, splits * k, r + 1)
    vpu.copy(mx, m_col)
    for h, lo in _fold_steps(splits):
        vpu.max(mx.sub(0, 0, h * k, 1), mx.sub(0, 0, h * k, 1), mx.sub(lo * k, 0, h * k, 1))
    n = 1
    while n < splits:  # mx[0:k] (the global max) to rows n*k .. of every split
        m = min(n, splits - n)
        vpu.copy(mx.sub(n * k, 0, m * k, 1), mx.sub(0, 0, m * k, 1))
        n += m
    vpu.sub(alpha, m_col, mx)
    vpu.exp(alpha, alpha)
    vpu.mul(ol, ol, alpha)
    for h, lo in _fold_steps(splits):
        vpu.add(ol.sub(0, 0, h * k, r + 1), ol.sub(0, 0, h * k, r + 1), ol.sub(lo * k, 0, h * k, r + 1))
    vpu.recip(linv, recv.sub(0, r, k, 1))
    vpu.mul(obuf, recv.sub(0, 0, k, r), linv)


# --- small scratchpads (GPU presets): phases through HBM ---------------------------------------
_SMALL_HEAD_GROUPS = (128, 64, 32, 16, 8, 4, 2, 1)  # heads per attention item, largest first
_SMALL_PV_COLS = 128  # FP32 columns of PV read back at a time on the small-scratchpad path


@dataclass(frozen=True)
class _Src:
    """Region [r0:r0+rows, c0:c0+cols] of a tensor (HBM or on chip) that a GEMM job fetches."""

    ref: TensorRef
    r0: int
    c0: int
    rows: int
    cols: int


@dataclass
class _GemmJob:
    """One output tile of a small per-head GEMM: acc = sum over K panels of a @ b (or a @ b^T),
    rounded to BF16 and stored to ``dst`` (or kept: ``_emit_gemm_jobs``). panels: (a [m, k],
    b HBM [k, n] or [n, k]); a is an HBM tile or a ``_Src`` (fetched after its readiness)."""

    panels: list[tuple[Tile | _Src, Tile]]
    dst: Tile | None
    transposed: bool


def _gemm_sems(kb: KernelBuilder, c: int, tag: str) -> dict[str, Semaphore]:
    """The semaphores of core ``c``'s GEMM jobs (``read`` counts jobs read out of the accumulators)."""
    return {n: kb.semaphore(f"c{c}.{tag}.{n}") for n in
            ("loaded0", "loaded1", "used0", "used1", "acc", "read", "stored")}


def _emit_gemm_jobs(kb: KernelBuilder, c: int, jobs: list[_GemmJob], bufs: dict[str, list[Tile]],
                    start: tuple[Semaphore, int] | None, done: Semaphore, tag: str, *,
                    sem: dict[str, Semaphore] | None = None, keep: list[Tile] | None = None,
                    waited: dict[Any, set[Ready]] | None = None) -> bool:
    """Issue core ``c``'s GEMM jobs: K panels double-buffered (loads on queues 0/1), two
    accumulators and two BF16 output buffers so that job j+1's matrix work overlaps job j's
    read-back and store (queue 2). ``start``: (semaphore, count) the loads wait for first;
    ``done`` is signalled once by queue 2 after the last store. ``keep``: per job, the tile its
    result stays in (no store; ``sem["read"]`` reaching j+1 means job j is there). Returns
    whether it issued any."""
    if not jobs:
        return False
    core = kb.core(c)
    sem = sem or _gemm_sems(kb, c, tag)
    waited = {} if waited is None else waited
    step = 0
    for j, job in enumerate(jobs):
        m = job.panels[0][0].rows
        n = job.panels[0][1].rows if job.transposed else job.panels[0][1].cols
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
            if isinstance(a_src, _Src):
                fetch(q, a, a_src.ref, a_src.r0, a_src.c0, waited=waited)
            else:
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
        core.vpu.wait(sem["acc"], j + 1)
        if keep is not None:
            core.vpu.acc_read(keep[j], acc)
            core.vpu.signal(sem["read"])
            continue
        out = _view(bufs["out"][j % 2], "bf16", m, n)
        if j >= 2:  # job j-2's output has left this buffer
            core.vpu.wait(sem["stored"], j - 1)
        core.vpu.acc_read(out, acc)
        core.vpu.signal(sem["read"])
        core.dma[2].wait(sem["read"], j + 1)
        core.dma[2].store(job.dst, out)
        core.dma[2].signal(sem["stored"])
    if keep is None:
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


def _decode_small_tiling(d: _Dec, spec: ChipSpec, budget: Budget, override: int,
                         keep_out: bool = False) -> _DecodeTiling | None:
    """The largest head group, then the largest context tile, that fit (None: nothing fits).
    ``keep_out``: every phase-3 output block stays on its core beside the tiling."""
    B, H, span = d.b, d.h, d.span
    R, P, N, V = d.r, d.p, d.n, d.v
    W = R + P
    cap_s, cap_a = budget.sram_bytes, budget.acc_bytes - _SLACK
    pvc = min(R, _SMALL_PV_COLS)

    def gemm(bm: int, rc: int, kp: int) -> tuple[int, int]:
        a = max(bm * N, bm * kp) * 2
        b = max(N * rc, V * kp) * 2
        o = max(bm * rc, bm * V) * 2
        return 2 * (_align(a) + _align(b) + _align(o)), 2 * _align(max(bm * rc, bm * V) * 4)

    def kept(bm: int) -> int:  # the output blocks one core keeps (phase-3 jobs dealt round robin)
        jobs = H * -(-B // bm)
        return -(-jobs // budget.cores) * _align(min(bm, B) * V * 2) if keep_out else 0

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
                    if fl_s + max(att, g_s) + kept(bm) <= cap_s and fl_a + g_a <= cap_a:
                        return _DecodeTiling(hg, t, nbuf, bm, rc, kp, fl_s, max(att, g_s), g_a)
    return None


def _emit_decode_small(ctx: EmitCtx, d: _Dec, til: _DecodeTiling, q: TensorRef, kv: TensorRef, w: TensorRef,
                       out: Out, q_lat: TensorRef | None, o_lat: TensorRef | None) -> Emitter:
    """mla-decode for scratchpads that cannot hold a head's absorbed weights or all heads' FP32
    output state (GPU presets): three phases with the latent query and output through HBM.

    1. absorb: per (head, block of ``bm`` sequences, ``rc`` latent columns) q_lat =
       bf16(q_nope @ W_UK[h]) into HBM scratch ``q_lat`` [batch*q_heads, R];
    2. attention: per (sequence, group of ``hg`` heads) the flash loop of the v1 kernel over
       context tiles (the tile loaded once for the group's heads), one FP32 output state, PV read
       back 128 columns at a time; o_lat = bf16(o / l) into HBM scratch ``o_lat``;
    3. up-projection: per (head, block of sequences) out = bf16(o_lat @ W_UV[h]^T), K in
       ``kp``-wide panels accumulated in place (stored, or kept on the core with ``Out.onchip``).

    A global count of stores (one signal per core) separates the phases, as kernel boundaries
    would on a GPU. The numerics are the v1 kernel's: the same roundings, the same reference.
    Everything comes after the prefetch part (each phase's loads wait for the one before).
    """
    kb = ctx.kb
    B, C, cap, span = d.b, d.c, d.cap, d.span
    H, R, P, N, V = d.dims
    D = d.d
    hg, T, nbuf, bm = til.hg, til.t, til.nbuf, til.bm
    cores = ctx.budget.cores
    kv_h, w_h = kv.base, w.base
    qlat_h = _hbm_scratch(ctx, q_lat, "q_lat", (B * H, R))  # phase 1 -> 2
    olat_h = _hbm_scratch(ctx, o_lat, "o_lat", (B * H, R))  # phase 2 -> 3

    # Per core: the flash loop's buffers, then one arena the phases reuse in turn.
    flash, arena, gacc = {}, {}, {}
    for c in range(cores):
        flash[c] = _Flash(kb, c, hg, T, R, d.scale, states=1, pv_cols=min(R, _SMALL_PV_COLS))
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

    # Phase 1 jobs: q_lat = bf16(q_nope @ W_UK[h]), (head, sequences, latent columns).
    def rows(t: Tile, c0: int, cols: int, h: int, b0: int) -> Tile:  # rows (b0.., h) of a [B*H, .] tensor
        return _rows_of(t.sub(0, c0, B * H, cols), b0 * H + h, min(bm, B - b0), H)

    p1 = [_GemmJob([(_Src(q, b0, h * D, min(bm, B - b0), N),
                     w_h.sub(h * (N + V), r0, N, min(til.rc, R - r0)))],
                   rows(qlat_h, r0, min(til.rc, R - r0), h, b0), transposed=False)
          for h in range(H) for b0 in range(0, B, bm) for r0 in range(0, R, til.rc)]
    # Phase 3 jobs: out = bf16(o_lat @ W_UV[h]^T), K in panels of kp; (head, sequences).
    p3 = [(h, b0, _GemmJob([(rows(olat_h, k0, min(til.kp, R - k0), h, b0),
                             w_h.sub(h * (N + V) + N, k0, V, min(til.kp, R - k0)))
                            for k0 in range(0, R, til.kp)],
                           out.ref.hbm_view(b0, h * V, min(bm, B - b0), V) if out.in_hbm else None,
                           transposed=True))
          for h in range(H) for b0 in range(0, B, bm)]
    p3_sems = {c: _gemm_sems(kb, c, "p3") for c in range(min(cores, len(p3)))}
    keep: dict[int, list[Tile]] = {}
    if out.in_hbm:
        ref = out.ref  # ready when every core's phase-3 stores have landed (one count per core)
        out_done_sem = kb.semaphore("out_done")
        ref = ref.with_ready(0, 0, B, H * V, (out_done_sem.id, len(p3_sems)))
    else:
        pieces = []
        for c in p3_sems:
            keep[c] = []
            for j, (h, b0, _) in enumerate(p3[c::cores]):
                m = min(bm, B - b0)
                keep[c].append(kb.sram(c, f"out{j}", (m, V), "bf16", keep=True))
                pieces.append(Piece(b0, h * V, m, V, keep[c][-1], None, (p3_sems[c]["read"].id, j + 1)))
        ref = TensorRef.onchip("out", (B, H * V), "bf16", pieces)
        out_done_sem = kb.semaphore("out_done")
    outs = {"out": ref}
    yield outs

    waited: dict[Any, set[Ready]] = {}
    qlat_done = kb.semaphore("qlat_done")
    n1 = sum(_emit_gemm_jobs(kb, c, p1[c::cores], gemm_bufs(c, a_bytes, b_bytes, o_bytes), None,
                             qlat_done, "p1", waited=waited) for c in range(cores))

    # Phase 2: attention per (sequence, head group).
    items = [(b, h0) for b in range(B) for h0 in range(0, H, hg)]
    olat_done = kb.semaphore("olat_done")
    n2 = 0
    for c in range(min(cores, len(items))):
        n2 += 1
        _decode_small_attention(kb, c, items[c::cores], flash[c], arena[c], (qlat_done, n1), olat_done,
                                (q, kv_h, qlat_h, olat_h), (H, hg, T, nbuf, span, C, cap), (R, P, N), waited)

    # Phase 3: the up-projection.
    for c in range(cores):
        _emit_gemm_jobs(kb, c, [job for _, _, job in p3[c::cores]], gemm_bufs(c, a_bytes, b_bytes, o_bytes),
                        (olat_done, n2), out_done_sem, "p3", sem=p3_sems.get(c), keep=keep.get(c))
    return outs


def _decode_small_attention(kb: KernelBuilder, c: int, items: list[tuple[int, int]], fl: _Flash, arena: Tile,
                            start: tuple[Semaphore, int], done: Semaphore, hbm: tuple[Any, ...],
                            sizes: tuple[int, ...], dims: tuple[int, int, int],
                            waited: dict[Any, set[Ready]]) -> None:
    """Core ``c``'s attention items (sequence b, first head h0): [q_lat | q_pe] of the group and
    the context tiles in, o_lat of the group out (see ``_emit_decode_small``)."""
    q, kv_h, qlat_h, olat_h = hbm
    H, hg, T, nbuf, span, C, cap = sizes
    R, P, N = dims
    W, D = R + P, N + P
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
        _fetch_heads(q1, qb.sub(0, R, nh, P), q, b, h0, nh, N, D, waited)
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


# --- decode: the emitter, the stand-alone program, the kernel's tensors ------------------------
def emit_mla_decode(ctx: EmitCtx, shape: dict[str, Any], q: TensorRef, kv_cache: TensorRef, w_kv_b: TensorRef,
                    *, out: Out | None = None, q_lat: TensorRef | None = None,
                    o_lat: TensorRef | None = None) -> Emitter:
    """Emit mla-decode (see the module docstring) for ``shape`` (the kernel's shape keys).

    Args:
        ctx: the emit context (its budget's cores and scratchpad bound the plan).
        q: bf16 [batch, q_heads*(nope_dim + rope_dim)] token-major queries (head h of token b:
            columns h*(N+P) .. as [q_nope | q_pe], q_pe rotated), in HBM or on chip (mla-append's
            q_rot): each head core fetches its heads' rows (or reads them in place).
        kv_cache: bf16 [batch*cap, kv_lora_rank + rope_dim] in HBM; its readiness regions (the
            rows an append writes in the same program) are waited for by the tiles that read
            them, the other tiles load in the prefetch part.
        w_kv_b: bf16 [q_heads*(nope_dim + v_head_dim), kv_lora_rank] in HBM.
        out: ``Out.to(ref)`` (an HBM [batch, q_heads*v_head_dim] tensor: each head core stores its
            heads' columns) or ``Out.onchip()`` (default: each head core keeps its heads' columns
            [batch, heads*V], ready when its last head is read out).
        q_lat, o_lat: HBM staging [batch*q_heads, kv_lora_rank] of the small-scratchpad tiling
            (allocated here when needed and not given).

    The prefetch part loads the weights, q when it is an HBM tensor ready at start, and the first
    cache tiles of every attention core that no other operator writes. Yields/returns
    ``{"out": ...}``.
    """
    out = out or Out.onchip()
    d, plan = _plan_mla_decode(shape, ctx.spec, ctx.budget, qpe_heads=not q.in_hbm, keep_out=not out.in_hbm)
    want = {"q": (d.b, d.h * d.d), "kv_cache": (d.b * d.cap, d.w), "w_kv_b": (d.h * (d.n + d.v), d.r)}
    for name, ref in (("q", q), ("kv_cache", kv_cache), ("w_kv_b", w_kv_b)):
        if ref.shape != want[name] or ref.dtype != "bf16" or ref.is_mx:
            raise InvalidArgumentError(f"mla-decode: {name} must be bf16 {list(want[name])}, got {ref.name} "
                                       f"{ref.dtype} {list(ref.shape)}")
    if not kv_cache.in_hbm or not w_kv_b.in_hbm:
        raise InvalidArgumentError("mla-decode: kv_cache and w_kv_b must be HBM tensors")
    if out.in_hbm and out.ref.shape != (d.b, d.h * d.v):
        raise InvalidArgumentError(f"mla-decode: out must be [{d.b}, {d.h * d.v}], got {list(out.ref.shape)}")
    if isinstance(plan, _DecodePlan):
        return (yield from _emit_decode_v1(ctx, d, plan, q, kv_cache, w_kv_b, out))
    return (yield from _emit_decode_small(ctx, d, plan, q, kv_cache, w_kv_b, out, q_lat, o_lat))


def mla_decode_tensors(shape: dict[str, Any], spec: ChipSpec) -> tuple[TensorSpec, ...]:
    """mla-decode's HBM tensors: q (input, token-major [batch, q_heads*(nope+rope)]; the
    stand-alone program allocates it as [batch*q_heads, nope+rope]), kv_cache and w_kv_b
    (weights: the cache is read), out (output, [batch, q_heads*v_head_dim]), and on the
    small-scratchpad tiling the q_lat and o_lat staging (scratch)."""
    d, plan = _plan_mla_decode(shape, spec, Budget.of(spec))
    specs = [TensorSpec("q", (d.b, d.h * d.d), "bf16", "input"),
             TensorSpec("kv_cache", (d.b * d.cap, d.w), "bf16", "weight"),
             TensorSpec("w_kv_b", (d.h * (d.n + d.v), d.r), "bf16", "weight"),
             TensorSpec("out", (d.b, d.h * d.v), "bf16", "output")]
    if not isinstance(plan, _DecodePlan):
        specs += [TensorSpec("q_lat", (d.b * d.h, d.r), "bf16", "scratch"),
                  TensorSpec("o_lat", (d.b * d.h, d.r), "bf16", "scratch")]
    return tuple(specs)


def build_mla_decode(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """Absorbed MLA decode: ``batch`` sequences, one query token each, ``context`` cached tokens
    (any number >= 1) in a latent cache of ``capacity`` rows per sequence (see the module doc):
    the emitter with every tensor in HBM."""
    d, plan = _plan_mla_decode(shape, spec, Budget.of(spec))  # refuse before building
    B, C, cap, H = d.b, d.c, d.cap, d.h
    small = not isinstance(plan, _DecodePlan)
    kb = KernelBuilder(f"mla_decode_b{B}_c{C}_h{H}" + (f"_cap{cap}" if cap != C else "")
                       + ("_small" if small else ""), chip=spec)
    refs: dict[str, TensorRef] = {}
    for ts in mla_decode_tensors(shape, spec):  # q and out head-major, the rows every binding writes
        rows = {"q": (B * H, d.d), "out": (B * H, d.v)}.get(ts.name, ts.shape)
        refs[ts.name] = TensorRef.hbm(ts.name, _reshaped(kb.hbm(ts.name, rows, ts.dtype), *ts.shape))
    run_emitter(emit_mla_decode(EmitCtx.standalone(kb), shape, refs["q"], refs["kv_cache"], refs["w_kv_b"],
                                out=Out.to(refs["out"]), q_lat=refs.get("q_lat"), o_lat=refs.get("o_lat")))
    R, P, N, V = d.r, d.p, d.n, d.v
    W = d.w
    if small:
        groups = -(-H // plan.hg)
        notes = {"path": "small-scratchpad", "kv_tile": plan.t, "kv_buffers": plan.nbuf,
                 "head_group": plan.hg,
                 "head_groups": groups, "attention_items": B * groups, "gemm_rows": plan.bm,
                 "kv_splits": 1, "latent_cache_bytes": groups * B * d.span * W * 2,
                 "scratch_bytes": 4 * B * H * R * 2}
        splits = 1
    else:
        splits = plan.splits
        notes = {"kv_tile": plan.t, "kv_buffers": plan.nbuf, "kv_splits": splits,
                 "attention_cores": len(plan.units), "head_cores": len(plan.heads_of),
                 "latent_cache_bytes": B * d.span * W * 2}  # the context's 32-token blocks, once
    notes |= {"softmax_scale": d.scale, "cache_capacity": cap, "padded_tokens": d.span - C,
              "weight_bytes": H * (N + V) * R * 2, "q_out_bytes": B * H * (N + P + V) * 2}
    ref_dims = {"heads": H, "rank": R, "rope": P, "nope": N, "v": V, "scale": d.scale}

    def make_inputs(seed: int) -> dict[str, Any]:
        return _inputs(seed, B * H, (B, C, cap), H, R, P, N, V)

    def reference(inputs):
        return {"out": mla_decode_reference(inputs["q"], inputs["kv_cache"], inputs["w_kv_b"], batch=B,
                                            context=C, capacity=cap, splits=splits, **ref_dims)}

    return KernelBuild(program=kb.build(), make_inputs=make_inputs, reference=reference,
                       outputs={"out": ("bf16", (B * H, V))}, tolerance=_TOLERANCE, notes=notes)


def _emit_mla_decode_kernel(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                            outs: dict[str, Out]) -> Emitter:
    return emit_mla_decode(ctx, shape, t["q"], t["kv_cache"], t["w_kv_b"], out=outs.get("out"),
                           q_lat=t.get("q_lat"), o_lat=t.get("o_lat"))


# --- prefill --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Pre(_LatentDims):
    """A checked mla-prefill shape: ``b`` sequences each adding ``s`` tokens after ``prior``
    cached ones (``c`` = prior + s tokens in ``cap`` rows per sequence), dims as ``_Dec``."""

    b: int
    s: int
    prior: int
    c: int
    cap: int
    h: int
    r: int
    p: int
    n: int
    v: int
    scale: float


def _prefill_shape(shape: dict[str, Any]) -> _Pre:
    """The checked shape; InvalidArgumentError naming the key otherwise."""
    _check_dims(shape, "seq")
    prior = shape["prior"]
    if prior < 0 or prior % 32:
        raise InvalidArgumentError(
            f"shape key prior={prior} must be a multiple of 32 and >= 0: the cached tokens are the "
            "contraction (K) dimension of P @ V, which runs in 32-token blocks")
    s = shape["seq"]
    c = prior + s
    cap = latent_cache_capacity(c, shape["capacity"], "prior+seq")
    return _Pre(shape["batch"], s, prior, c, cap, shape["q_heads"], shape["kv_lora_rank"], shape["rope_dim"],
                shape["nope_dim"], shape["v_head_dim"], _scale(shape))


def _prefill_key_tiles(prior: int, seq: int, t: int) -> list[tuple[int, int]]:
    """(start, n) key tiles of a prefill chunk: the prior context's from 0 in t-token tiles, then
    the chunk's from ``prior`` aligned with its query tiles (so that each query tile's last key
    tile is its diagonal, always the same causal mask)."""
    return ([(k0, min(t, prior - k0)) for k0 in range(0, prior, t)]
            + [(prior + q0, min(t, seq - q0)) for q0 in range(0, seq, t)])


@dataclass(frozen=True)
class _PrefillPlan:
    """The on-core mla-prefill plan: tile ``t``; ``stream_out``: each item's output goes through
    two [t, v_head_dim] buffers, a query tile at a time, instead of one [seq, v_head_dim] buffer
    (chosen only when that buys a larger tile: long contexts, where K_h and V_h fill the core)."""

    t: int
    stream_out: bool = False


def _prefill_v1_plan(p: _Pre, spec: ChipSpec, budget: Budget, override: int, keep_out: bool) -> _PrefillPlan:
    """The on-core plan: the largest tile T that fits (or ``override``); DoesNotFit when none does.
    Per (sequence, head) item K_h and V_h for every cached token and Q_h for the chunk stay in
    SRAM, and its output (``keep_out``: every item's, kept on chip; else one buffer reused, or
    two query tiles' worth when that allows a larger T); per tile the latent tiles, the mask and
    the flash buffers (quadratic in T, so T is tried from the top)."""
    R, N, V = p.r, p.n, p.v
    W, D, C, S = p.w, p.d, p.c, p.s
    items = -(-p.b * p.h // min(budget.cores, p.b * p.h))
    cap_s, cap_a = budget.sram_bytes, budget.acc_bytes
    base = C * (D + V) * 2 + S * D * 2 + (N + V) * R * 2 + _SLACK
    sram_fixed = base + S * V * 2 * (1 + (items - 1) * keep_out)

    def fits(t: int, stream: bool = False) -> bool:
        out = 2 * t * V * 2 if stream else sram_fixed - base
        sram = base + out + 2 * t * W * 2 + t * t * 4 + _Flash.sram_bytes(t, t, V)
        return sram <= cap_s and _Flash.acc_bytes(t, t, V) + 2 * t * (N + V) * 4 <= cap_a

    what = (f"prior+seq={C} with head dims {D} (q/k) and {V} (v) needs {sram_fixed:,} B of scratchpad "
            f"for one (sequence, head) item's K and V over prior+seq tokens and Q and output over seq "
            f"plus the tiles; {spec.name} plans with {cap_s:,} B of scratchpad and {cap_a:,} B of "
            "accumulators per core")
    if override:
        if override % 32:
            raise InvalidArgumentError(f"shape key kv_tile={override} must be a positive multiple of 32")
        if fits(override):
            return _PrefillPlan(override)
        if not keep_out and fits(override, True):
            return _PrefillPlan(override, True)
        raise InvalidArgumentError(f"shape key kv_tile={override} does not fit: {what}")
    tiles = range(min(_MAX_PREFILL_TILE, S) // 32 * 32, 0, -32)
    t = next((t for t in tiles if fits(t)), 0)
    ts = 0 if keep_out else next((t for t in tiles if fits(t, True)), 0)
    if ts > t:
        return _PrefillPlan(ts, True)
    if not t:
        raise DoesNotFit(what)
    return _PrefillPlan(t)


def _plan_mla_prefill(shape: dict[str, Any], spec: ChipSpec, budget: Budget, *,
                      keep_out: bool = False) -> tuple[_Pre, Any]:
    """(shape, plan): the on-core plan (``_PrefillPlan``), else on scratchpads too small for it
    (GPU presets: K and V through HBM, key tiles streamed) the small tiling (a tuple)."""
    p = _prefill_shape(shape)
    try:
        return p, _prefill_v1_plan(p, spec, budget, shape["kv_tile"], keep_out)
    except DoesNotFit:
        pass
    got = _prefill_small_tiling(p, budget, shape["kv_tile"], keep_out)
    if got is None:
        what = "shape key kv_tile=" + str(shape["kv_tile"]) if shape["kv_tile"] else "the tiling"
        raise DoesNotFit(
            f"{what} cannot hold this shape: a 32-token query tile with head dims {p.d} (q/k) and {p.v} "
            f"(v), its FP32 output state and two key/value tiles need more than the "
            f"{budget.sram_bytes:,} B of scratchpad / {budget.acc_bytes:,} B of accumulators per core "
            f"{spec.name} plans with")
    return p, got


def _emit_prefill_v1(ctx: EmitCtx, p: _Pre, plan: _PrefillPlan, q: TensorRef, kv: TensorRef, w: TensorRef,
                     mask_h: Tile, out: Out) -> Emitter:
    """The on-core mla-prefill (see the module docstring): (sequence, head) items over the cores,
    each decompressing K_h and V_h into SRAM, then causal flash attention over its query tiles."""
    kb = ctx.kb
    B, S, prior, C, cap = p.b, p.s, p.prior, p.c, p.cap
    H, R, P, N, V = p.dims
    W, D = p.w, p.d
    kv_h, w_h = kv.base, w.base
    T, stream = plan.t, plan.stream_out
    items = [(b, h) for b in range(B) for h in range(H)]
    cores = min(ctx.budget.cores, len(items))
    starts = list(range(0, S, T))  # query tiles (chunk offsets)
    ktiles = _prefill_key_tiles(prior, S, T)
    n_prior = len(ktiles) - len(starts)
    waited: dict[Any, set[Ready]] = {}
    per: dict[int, dict[str, Any]] = {}
    for c in range(cores):
        mine = items[c::cores]
        r = per[c] = {"mine": mine, "core": kb.core(c), "fl": _Flash(kb, c, T, T, V, p.scale)}
        r["wuk"], r["wuv"] = kb.sram(c, "wuk", (N, R), "bf16"), kb.sram(c, "wuv", (V, R), "bf16")
        r["qs"], r["ks"] = kb.sram(c, "q", (S, D), "bf16"), kb.sram(c, "k", (C, D), "bf16")
        r["vs"] = kb.sram(c, "v", (C, V), "bf16")
        # out_h of each item: one buffer reused when stored (or two query tiles' worth, taken in
        # turn), one per item kept on chip
        if stream:
            r["tile_out"] = [kb.sram(c, f"out{i}", (T, V), "bf16") for i in range(2)]
        r["os"] = ([kb.sram(c, "out", (S, V), "bf16")] * len(mine) if out.in_hbm and not stream else
                   [None] * len(mine) if stream else
                   [kb.sram(c, f"out{it}", (S, V), "bf16", keep=True) for it in range(len(mine))])
        r["mask"] = kb.sram(c, "mask", (T, T), "f32")
        r["ckv"] = [kb.sram(c, f"ckv{i}", (T, W), "bf16") for i in range(2)]
        r["acc_k"] = [kb.acc(c, f"acc_k{i}", (T, N)) for i in range(2)]
        r["acc_v"] = [kb.acc(c, f"acc_v{i}", (T, V)) for i in range(2)]
        r["sem"] = {n: kb.semaphore(f"c{c}.{n}") for n in (
            "w", "ckv", "ckv_used", "kv_acc", "kv_acc_free", "kv_written", "q", "item_mxu_done",
            "out_ready", "out_stored", "mask", "tile_stored")}

    def item_loads(r: dict[str, Any], it: int, b: int, h: int, d: int) -> list[tuple[list[Ready], Any]]:
        """The dma[0] steps that bring item ``it``'s weights and latent tiles in, each with the
        conditions it waits for first (this kernel's own: buffer reuse; other operators': the
        cache rows they write)."""
        dq, sem = r["core"].dma[0], r["sem"]
        steps = [([(sem["item_mxu_done"].id, it)] if it else [], lambda: (
                     dq.load(r["wuk"], w_h.sub(h * (N + V), 0, N, R)),
                     dq.load(r["wuv"], w_h.sub(h * (N + V) + N, 0, V, R))))]

        def kpe() -> None:  # k_pe, shared by all heads
            dq.load(r["ks"].sub(0, N, C, P), kv_h.sub(b * cap, R, C, P))
            dq.signal(sem["w"])

        steps.append((kv.waits(b * cap, R, C, P), kpe))
        for i, (k0, n) in enumerate(ktiles):
            k = d + i
            own = [(sem["ckv_used"].id, k - 1)] if k >= 2 else []

            def tile(k=k, k0=k0, n=n) -> None:
                dq.load(r["ckv"][k % 2].sub(0, 0, n, W), kv_h.sub(b * cap + k0, 0, n, W))
                dq.signal(sem["ckv"])

            steps.append((own + kv.waits(b * cap + k0, 0, n, W), tile))
        return steps

    # Prefetch part: the mask, and each core's first item's loads as far as they wait for nothing.
    for r in per.values():
        core, sem = r["core"], r["sem"]
        core.dma[3].load(r["mask"], mask_h)
        core.dma[3].signal(sem["mask"])
        b, h = r["mine"][0]
        r["first"] = item_loads(r, 0, b, h, 0)
        r["early"] = 0
        for waits, step in r["first"]:
            if waits:
                break
            step()
            r["early"] += 1

    if out.in_hbm:
        ref = out.ref
        for r in per.values():
            for it, (b, h) in enumerate(r["mine"]):
                ref = ref.with_ready(b * S, h * V, S, V, (r["sem"]["out_stored"].id, it + 1))
    else:
        ref = TensorRef.onchip("out", (B * S, H * V), "bf16", [
            Piece(b * S + t0, h * V, min(T, S - t0), V, r["os"][it].sub(t0, 0, min(T, S - t0), V), None,
                  (r["sem"]["out_ready"].id, it * len(starts) + i + 1))
            for r in per.values() for it, (b, h) in enumerate(r["mine"]) for i, t0 in enumerate(starts)])
    outs = {"out": ref}
    yield outs

    for r in per.values():
        core, sem, fl = r["core"], r["sem"], r["fl"]
        wuk, wuv, qs, ks, vs, mask = r["wuk"], r["wuv"], r["qs"], r["ks"], r["vs"], r["mask"]
        ckv, acc_k, acc_v = r["ckv"], r["acc_k"], r["acc_v"]
        core.vpu.wait(sem["mask"], 1)
        d = 0  # decompression tiles issued on this core
        for it, (b, h) in enumerate(r["mine"]):
            dq = core.dma[0]
            steps = r["first"][r["early"]:] if it == 0 else item_loads(r, it, b, h, d)
            for waits, step in steps:
                for cond in waits:
                    _wait_once(dq, cond, waited)
                step()
            core.mxu.wait(sem["w"], it + 1)
            # Decompress K_h (nope part) and V_h tile by tile, prior context and chunk alike.
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
            for t0 in starts:
                n = min(T, S - t0)
                for e in fetch(dq, qs.sub(t0, 0, n, D), q, b * S + t0, h * D, waited=waited):
                    e.signal(sem["q"])
            core.mxu.wait(sem["kv_written"], it + 1)
            os_ = r["os"][it]
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

                    def pv(acc, pp, k0=k0, nk=nk, core=core, vs=vs):
                        core.mxu.matmul(acc, pp, vs.sub(k0, 0, nk, V), mode="overwrite")

                    def finish(o, linv, t0=t0, nq=nq, i=i, it=it, core=core, sem=sem, os_=os_, r=r):
                        g = it * len(starts) + i  # this core's query tiles so far
                        if stream:  # two buffers in turn: the store of tile g-2 has left this one
                            if g >= 2:
                                core.vpu.wait(sem["tile_stored"], g - 1)
                            core.vpu.mul(r["tile_out"][g % 2].sub(0, 0, nq, V), o, linv)
                        else:
                            if i == 0 and it and out.in_hbm:  # the previous item's output has left SRAM
                                core.vpu.wait(sem["out_stored"], it)
                            core.vpu.mul(os_.sub(t0, 0, nq, V), o, linv)
                        core.vpu.signal(sem["out_ready"])

                    tiles.append(_FlashTile(nq, nk, i % 2, j == 0, diag, scores, pv, finish,
                                            mask.sub(0, 0, nq, nk) if diag else None))
            fl.run(tiles)
            core.mxu.signal(sem["item_mxu_done"])
            if out.in_hbm:
                sq = core.dma[2]
                for i, t0 in enumerate(starts):
                    n, g = min(T, S - t0), it * len(starts) + i
                    sq.wait(sem["out_ready"], g + 1)
                    src = r["tile_out"][g % 2].sub(0, 0, n, V) if stream else os_.sub(t0, 0, n, V)
                    sq.store(out.ref.hbm_view(b * S + t0, h * V, n, V), src)
                    if stream:
                        sq.signal(sem["tile_stored"])
                sq.signal(sem["out_stored"])
    return outs


def _prefill_small_tiling(p: _Pre, budget: Budget, override: int,
                          keep_out: bool = False) -> tuple[int, int, int, int, int, int] | None:
    """(tile T, K/V buffers, GEMM token rows, GEMM K panel, PV read-back columns, arena
    SRAM) of the small-scratchpad mla-prefill: the largest square tile that fits, then the most
    buffers. ``keep_out``: every (sequence, head, query tile) output stays on its core too."""
    S, R, N, V = p.s, p.r, p.n, p.v
    D = p.d
    cap_s, cap_a = budget.sram_bytes, budget.acc_bytes - _SLACK
    tiles = [override] if override else list(range(min(_MAX_PREFILL_TILE, S) // 32 * 32, 0, -32))
    for t, pvc in ((t, pvc) for t in tiles for pvc in (V, 64, 32) if pvc <= V):
        fl_s = _Flash.sram_bytes(t, t, V, 1, pvc) + 16 * 64
        fl_a = _Flash.acc_bytes(t, t, V) + 4 * 64
        items = p.b * p.h * -(-S // t)
        kept = -(-items // budget.cores) * _align(t * V * 2) if keep_out else 0
        for nbuf in (3, 2):
            att = (_align(t * D * 2) + _align(t * V * 2) + _align(t * t * 4)
                   + nbuf * (_align(t * D * 2) + _align(t * V * 2)))
            for tm, kp in ((128, R), (128, R // 2), (64, R // 2), (64, R // 4), (32, R // 4), (32, 32)):
                if kp < 32 or kp % 32:
                    continue
                g_s = 2 * (_align(tm * kp * 2) + _align(max(N, V) * kp * 2) + _align(tm * max(N, V) * 2))
                g_a = 2 * _align(tm * max(N, V) * 4)
                if fl_s + max(att, g_s) + kept <= cap_s and fl_a + g_a <= cap_a:
                    return t, nbuf, tm, kp, pvc, max(att, g_s)
    return None


def _emit_prefill_small(ctx: EmitCtx, p: _Pre, til: tuple[int, ...], q: TensorRef, kv: TensorRef,
                        w: TensorRef, mask_h: Tile, out: Out, k_nope: TensorRef | None,
                        v: TensorRef | None) -> Emitter:
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
    Everything comes after the prefetch part (each phase's loads wait for the one before).
    """
    kb = ctx.kb
    B, S, prior, C, cap = p.b, p.s, p.prior, p.c, p.cap
    H, R, P, N, V = p.dims
    T, nbuf, tm, kp, pv_cols, arena_sram = til
    cores = ctx.budget.cores
    w_h = w.base
    kn_h = _hbm_scratch(ctx, k_nope, "k_nope", (B * H * C, N))  # phase 1 -> 2
    v_h = _hbm_scratch(ctx, v, "v", (B * H * C, V))

    flash, arena, gacc = {}, {}, {}
    n_gemm = max(N, V)
    for c in range(cores):
        flash[c] = _Flash(kb, c, T, T, V, p.scale, states=1, pv_cols=pv_cols)
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

    starts = list(range(0, S, T))
    ktiles = _prefill_key_tiles(prior, S, T)
    n_prior = len(ktiles) - len(starts)
    items = sorted(((b, h, i) for b in range(B) for h in range(H) for i in range(len(starts))),
                   key=lambda x: -x[2])
    att_cores = min(cores, len(items))
    sems = {c: {n: kb.semaphore(f"c{c}.p2.{n}") for n in ("q", "q_used", "kv", "o_ready", "o_stored", "mask")}
            for c in range(att_cores)}
    keep: dict[int, list[Tile]] = {}
    if out.in_hbm:
        ref = out.ref
        for c in range(att_cores):
            for it, (b, h, i) in enumerate(items[c::cores]):
                ref = ref.with_ready(b * S + starts[i], h * V, min(T, S - starts[i]), V,
                                     (sems[c]["o_stored"].id, it + 1))
    else:
        pieces = []
        for c in range(att_cores):
            keep[c] = []
            for it, (b, h, i) in enumerate(items[c::cores]):
                nq = min(T, S - starts[i])
                keep[c].append(kb.sram(c, f"out{it}", (nq, V), "bf16", keep=True))
                pieces.append(Piece(b * S + starts[i], h * V, nq, V, keep[c][-1], None,
                                    (sems[c]["o_ready"].id, it + 1)))
        ref = TensorRef.onchip("out", (B * S, H * V), "bf16", pieces)
    outs = {"out": ref}
    yield outs

    # Phase 1: decompress K_nope and V of every (sequence, head) into HBM.
    waited: dict[Any, set[Ready]] = {}
    jobs = []
    for b in range(B):
        for h in range(H):
            for w_row, n, dst in ((h * (N + V), N, kn_h), (h * (N + V) + N, V, v_h)):
                for t0 in range(0, C, tm):
                    m = min(tm, C - t0)
                    panels = [(_Src(kv, b * cap + t0, k0, m, min(kp, R - k0)),
                               w_h.sub(w_row, k0, n, min(kp, R - k0))) for k0 in range(0, R, kp)]
                    jobs.append(_GemmJob(panels, dst.sub((b * H + h) * C + t0, 0, m, n), transposed=True))
    kv_done = kb.semaphore("kv_done")
    n1 = sum(_emit_gemm_jobs(kb, c, jobs[c::cores], gemm_bufs(c), None, kv_done, "p1", waited=waited)
             for c in range(cores))

    # Phase 2: flash attention per (sequence, head, query tile), longest items first.
    for c in range(att_cores):
        _prefill_small_attention(kb, c, items[c::cores], flash[c], arena[c], (kv_done, n1),
                                 (q, kv, kn_h, v_h, mask_h, out), (S, H, T, nbuf, C, cap, n_prior),
                                 (R, P, N, V), ktiles, starts, sems[c], keep.get(c), waited)
    return outs


def _prefill_small_attention(kb: KernelBuilder, c: int, items: list[tuple[int, int, int]], fl: _Flash,
                             arena: Tile, start: tuple[Semaphore, int], refs: tuple[Any, ...],
                             sizes: tuple[int, ...], dims: tuple[int, int, int, int],
                             ktiles: list[tuple[int, int]], starts: list[int], sem: dict[str, Semaphore],
                             keep: list[Tile] | None, waited: dict[Any, set[Ready]]) -> None:
    """Core ``c``'s (sequence, head, query tile) items of ``_emit_prefill_small`` (``keep``: the
    tile each item's output stays in, instead of a store)."""
    q, kv, kn_h, v_h, mask_h, out = refs
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
    for e in (core.dma[0], core.dma[1], core.dma[3]):  # phase 1 is done with the arena everywhere
        e.wait(*start)
    core.dma[3].load(mask, mask_h)
    core.dma[3].signal(sem["mask"])
    core.vpu.wait(sem["mask"], 1)
    tiles: list[_FlashTile] = []
    for it, (b, h, i) in enumerate(items):
        t0 = starts[i]
        nq = min(T, S - t0)
        if it >= 1:  # the matrix unit's scores of the previous item have read the query tile
            core.dma[1].wait(sem["q_used"], it)
        fetch(core.dma[1], qs.sub(0, 0, nq, D), q, b * S + t0, h * D, waited=waited)
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
            fetch(dq, kt.sub(0, N, nk, P), kv, b * cap + k0, R, waited=waited)
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

            def pv(acc, pp, vt=vt):
                core.mxu.matmul(acc, pp, vt, mode="overwrite")

            def finish(o, linv, it=it, b=b, h=h, t0=t0, nq=nq):
                if keep is not None:  # this item's own kept tile
                    core.vpu.mul(keep[it], o, linv)
                    core.vpu.signal(sem["o_ready"])
                    return
                if it >= 1:  # the previous item's output has left SRAM
                    core.vpu.wait(sem["o_stored"], it)
                core.vpu.mul(os_.sub(0, 0, nq, V), o, linv)
                core.vpu.signal(sem["o_ready"])
                core.dma[2].wait(sem["o_ready"], it + 1)
                core.dma[2].store(out.ref.hbm_view(b * S + t0, h * V, nq, V), os_.sub(0, 0, nq, V))
                core.dma[2].signal(sem["o_stored"])

            tiles.append(_FlashTile(nq, nk, 0, j == 0, diag, scores, pv, finish,
                                    mask.sub(0, 0, nq, nk) if diag else None))
    fl.run(tiles)


# --- prefill: the emitter, the stand-alone program, the kernel's tensors ------------------------
def _causal_mask(t: int) -> np.ndarray:
    """The [t, t] additive mask of a diagonal tile: 0 on and below the diagonal, -inf above."""
    return np.where(np.tril(np.ones((t, t), bool)), 0.0, -np.inf).astype(np.float32)


def emit_mla_prefill(ctx: EmitCtx, shape: dict[str, Any], q: TensorRef, kv_cache: TensorRef,
                     w_kv_b: TensorRef, *, out: Out | None = None, mask: TensorRef | None = None,
                     k_nope: TensorRef | None = None, v: TensorRef | None = None) -> Emitter:
    """Emit mla-prefill (see the module docstring) for ``shape`` (the kernel's shape keys).

    Args:
        ctx: the emit context (its budget bounds the plan).
        q: bf16 [batch*seq, q_heads*(nope_dim + rope_dim)] token-major queries of the chunk, in
            HBM or on chip (each (sequence, head) item fetches its query tiles).
        kv_cache: bf16 [batch*cap, kv_lora_rank + rope_dim] in HBM, every prior + seq row filled;
            its readiness regions (the chunk's rows an append writes in the same program) are
            waited for where read.
        w_kv_b: bf16 [q_heads*(nope_dim + v_head_dim), kv_lora_rank] in HBM.
        out: ``Out.to(ref)`` (an HBM [batch*seq, q_heads*v_head_dim] tensor, each item's columns
            ready when stored) or ``Out.onchip()`` (default: each item's query tiles kept where
            they were finished, every item in its own buffer).
        mask: the [T, T] f32 causal mask of a diagonal tile (default: a constant allocated here).
        k_nope, v: HBM staging of the small-scratchpad tiling (allocated here when not given).

    The prefetch part loads the mask and each core's first item's weights and latent tiles, as
    far as they wait for nothing. Yields/returns ``{"out": ...}``.
    """
    out = out or Out.onchip()
    p, plan = _plan_mla_prefill(shape, ctx.spec, ctx.budget, keep_out=not out.in_hbm)
    want = {"q": (p.b * p.s, p.h * p.d), "kv_cache": (p.b * p.cap, p.w), "w_kv_b": (p.h * (p.n + p.v), p.r)}
    for name, ref in (("q", q), ("kv_cache", kv_cache), ("w_kv_b", w_kv_b)):
        if ref.shape != want[name] or ref.dtype != "bf16" or ref.is_mx:
            raise InvalidArgumentError(f"mla-prefill: {name} must be bf16 {list(want[name])}, got {ref.name} "
                                       f"{ref.dtype} {list(ref.shape)}")
    if not kv_cache.in_hbm or not w_kv_b.in_hbm:
        raise InvalidArgumentError("mla-prefill: kv_cache and w_kv_b must be HBM tensors")
    if out.in_hbm and out.ref.shape != (p.b * p.s, p.h * p.v):
        raise InvalidArgumentError(f"mla-prefill: out must be [{p.b * p.s}, {p.h * p.v}], got "
                                   f"{list(out.ref.shape)}")
    T = plan.t if isinstance(plan, _PrefillPlan) else plan[0]
    mask_h = mask.hbm_view(0, 0, T, T) if mask is not None else \
        ctx.const("causal_mask", _causal_mask(T), "f32")
    if isinstance(plan, _PrefillPlan):
        return (yield from _emit_prefill_v1(ctx, p, plan, q, kv_cache, w_kv_b, mask_h, out))
    return (yield from _emit_prefill_small(ctx, p, plan, q, kv_cache, w_kv_b, mask_h, out, k_nope, v))


def mla_prefill_tensors(shape: dict[str, Any], spec: ChipSpec) -> tuple[TensorSpec, ...]:
    """mla-prefill's HBM tensors: q (input, token-major [batch*seq, q_heads*(nope+rope)]; the
    stand-alone program allocates it as [batch*seq*q_heads, nope+rope]), kv_cache and w_kv_b
    (weights), out (output, [batch*seq, q_heads*v_head_dim]), and on the small-scratchpad tiling
    the k_nope and v staging (scratch). The causal mask is a constant of the emitter."""
    p, plan = _plan_mla_prefill(shape, spec, Budget.of(spec))
    specs = [TensorSpec("q", (p.b * p.s, p.h * p.d), "bf16", "input"),
             TensorSpec("kv_cache", (p.b * p.cap, p.w), "bf16", "weight"),
             TensorSpec("w_kv_b", (p.h * (p.n + p.v), p.r), "bf16", "weight"),
             TensorSpec("out", (p.b * p.s, p.h * p.v), "bf16", "output")]
    if not isinstance(plan, _PrefillPlan):
        specs += [TensorSpec("k_nope", (p.b * p.h * p.c, p.n), "bf16", "scratch"),
                  TensorSpec("v", (p.b * p.h * p.c, p.v), "bf16", "scratch")]
    return tuple(specs)


def build_mla_prefill(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """Naive-form causal MLA prefill: ``batch`` sequences, each adding a chunk of ``seq`` tokens
    after ``prior`` tokens already in the latent cache (see the module doc): the emitter with
    every tensor in HBM."""
    p, plan = _plan_mla_prefill(shape, spec, Budget.of(spec))  # refuse before building
    B, S, prior, C, cap, H = p.b, p.s, p.prior, p.c, p.cap, p.h
    small = not isinstance(plan, _PrefillPlan)
    T = plan[0] if small else plan.t
    kb = KernelBuilder(f"mla_prefill_b{B}_s{S}_p{prior}_h{H}" + (f"_cap{cap}" if cap != C else "")
                       + ("_small" if small else ""), chip=spec)
    ctx = EmitCtx.standalone(kb)
    specs = mla_prefill_tensors(shape, spec)
    refs: dict[str, TensorRef] = {}
    for ts in specs:  # q and out head-major, as every binding writes them; the mask before out
        if ts.name == "out":
            refs["mask"] = TensorRef.hbm("causal_mask", ctx.const("causal_mask", _causal_mask(T), "f32"))
        rows = {"q": (B * S * H, p.d), "out": (B * S * H, p.v)}.get(ts.name, ts.shape)
        refs[ts.name] = TensorRef.hbm(ts.name, _reshaped(kb.hbm(ts.name, rows, ts.dtype), *ts.shape))
    run_emitter(emit_mla_prefill(ctx, shape, refs["q"], refs["kv_cache"], refs["w_kv_b"],
                                 out=Out.to(refs["out"]), mask=refs["mask"], k_nope=refs.get("k_nope"),
                                 v=refs.get("v")))
    R, P, N, V = p.r, p.p, p.n, p.v
    ktiles = len(_prefill_key_tiles(prior, S, T))
    if small:
        _, nbuf, tm, kp, _, _ = plan
        notes = {"path": "small-scratchpad", "tile": T, "kv_buffers": nbuf, "gemm_rows": tm, "gemm_panel": kp,
                 "cores": spec.core.count, "items": B * H * -(-S // T), "softmax_scale": p.scale,
                 "prior": prior, "cache_capacity": cap, "key_tiles": ktiles,
                 "scratch_bytes": 2 * B * H * C * (N + V) * 2, "form": "naive (decompressed K/V through HBM)"}
    else:
        notes = {"tile": T, "output_buffers": "per query tile" if plan.stream_out else "per item",
                 "cores": min(spec.core.count, B * H), "items": B * H, "softmax_scale": p.scale,
                 "prior": prior, "cache_capacity": cap, "key_tiles": ktiles,
                 "form": "naive (decompressed K/V)"}
    ref_dims = {"heads": H, "rank": R, "rope": P, "nope": N, "v": V, "scale": p.scale}

    def make_inputs(seed: int) -> dict[str, Any]:
        ins = _inputs(seed, B * S * H, (B, C, cap), H, R, P, N, V)
        ins["causal_mask"] = _causal_mask(T)
        return ins

    def reference(inputs):
        return {"out": mla_prefill_reference(inputs["q"], inputs["kv_cache"], inputs["w_kv_b"],
                                             batch=B, seq=S, prior=prior, capacity=cap, **ref_dims)}

    return KernelBuild(program=kb.build(), make_inputs=make_inputs, reference=reference,
                       outputs={"out": ("bf16", (B * S * H, V))}, tolerance=_TOLERANCE, notes=notes)


def _emit_mla_prefill_kernel(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                             outs: dict[str, Out]) -> Emitter:
    return emit_mla_prefill(ctx, shape, t["q"], t["kv_cache"], t["w_kv_b"], out=outs.get("out"),
                            k_nope=t.get("k_nope"), v=t.get("v"))

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
        "all heads (DeepSeek-R1, Kimi K2.5); split-KV over idle cores at small batch.",
    shape_keys=(
        ShapeKey("batch", int, 2, "sequences (one query token each)", minimum=1),
        ShapeKey("context", int, 96, "cached tokens per sequence, the new token's included; any >= 1 "
                 "(the last 32-token block's padding is masked)", minimum=1),
        ShapeKey("capacity", int, 0, "latent cache rows per sequence (kv_cache [batch*capacity, W]); "
                 "multiple of 32, >= context; 0: context rounded up to 32", minimum=0),
        *_COMMON,
        ShapeKey("kv_splits", int, 0, "context splits per sequence (split-KV, partial softmax states merged "
                 "on chip); 0: automatic (when batch leaves cores idle), 1: none", minimum=0),
    ),
    build=build_mla_decode,
    emit=_emit_mla_decode_kernel,
    tensors_of=mla_decode_tensors,
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
    emit=_emit_mla_prefill_kernel,
    tensors_of=mla_prefill_tensors,
))
