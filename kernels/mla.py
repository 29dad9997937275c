"""Multi-head latent attention (DeepSeek-V3/R1, Kimi K2.5): what mla-decode and mla-prefill share.

Stage: kernels (the MLA family), below ``mla_decode`` (``mla-decode``, absorbed form) and
``mla_prefill`` (``mla-prefill``, naive form), which hold the two kernels and their plans; the
cache append is ``mla_append``. A helper both kernels use lives here under a public name, so
neither imports the other's private names (as ``moe_base`` does for the MoE family): the cache
layout and capacity, the pure-JAX references, the online-softmax engine ``Flash``, the
small-scratchpad GEMM jobs and the shape keys both take.

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

Softmax scale: shape key ``softmax_scale``; 0 means the plain 1/sqrt(nope_dim + rope_dim).
DeepSeek-V3/R1 with YaRN (factor 40, mscale_all_dim 1) use ``yarn_softmax_scale()`` = that times
mscale^2 = (0.1*ln(40) + 1)^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import EngineHandle, KernelBuilder, Semaphore
from jalapeno_emu.isa.loops import issue_in_rounds
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import DTYPES
from jalapeno_emu.lazy import LazyModule

from .attention_ref import MASK_VALUE
from .base import ShapeKey, Tolerance
from .emit import EmitCtx, Ready, TensorRef, fetch
from .planning import DoesNotFit

ml_dtypes = LazyModule("ml_dtypes")  # loaded on first use: importing it costs 0.5 s

jnp = LazyModule("jax.numpy")

__all__ = ["BLOCK_TOKENS", "COMMON_SHAPE_KEYS", "SLACK_BYTES", "TOLERANCE", "Flash", "FlashTile", "GemmJob",
           "GemmSrc", "LatentDims", "latent_cache_capacity", "mla_decode_reference", "mla_prefill_reference",
           "split_ranges", "yarn_softmax_scale"]

SLACK_BYTES = 8192  # bytes kept free for allocation alignment (64 B per allocation)
BLOCK_TOKENS = 32  # tokens per matrix-unit contraction block: cache capacities and key tiles come in these
_PAD_GARBAGE = 1e4  # magnitude of the test inputs' padding rows: large, finite, random signs


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
        return -(-tokens // BLOCK_TOKENS) * BLOCK_TOKENS
    if capacity < 0 or capacity % BLOCK_TOKENS or capacity < tokens:
        raise InvalidArgumentError(
            f"shape key capacity={capacity} must be a multiple of 32 and >= {what}={tokens} (0: {what} "
            "rounded up to 32): the kernels read the cache in 32-token blocks")
    return capacity


def yarn_softmax_scale(qk_head_dim: int = 192, factor: float = 40.0, mscale_all_dim: float = 1.0) -> float:
    """DeepSeek-V3's softmax scale under YaRN: qk_head_dim^-0.5 * (0.1*mscale_all_dim*ln(factor) + 1)^2."""
    m = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
    return qk_head_dim ** -0.5 * m * m


def softmax_scale_of(shape: dict[str, Any]) -> float:
    s = shape["softmax_scale"]
    if s < 0 or not math.isfinite(s):
        raise InvalidArgumentError(f"shape key softmax_scale={s} must be a finite value >= 0 (0: default)")
    return s if s > 0 else 1.0 / math.sqrt(shape["nope_dim"] + shape["rope_dim"])


def check_dims(shape: dict[str, Any], length_key: str | None) -> None:
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
    O_i = P_i @ vals; merged in the kernel's fixed pairwise order (``fold_steps``): m = max m_i,
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
    for h, lo in fold_steps(len(ranges)):
        mx = mx.at[:h].set(jnp.maximum(mx[:h], mx[lo:lo + h]))
    st = st * jnp.exp(m_all - mx[0])
    for h, lo in fold_steps(len(ranges)):
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
        span = -(-context // BLOCK_TOKENS) * BLOCK_TOKENS
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


def make_inputs_of(seed: int, q_rows: int, cache: tuple[int, int, int], heads: int, rank: int, rope: int,
            nope: int, v: int) -> dict[str, np.ndarray]:
    """Random inputs; ``cache`` = (batch, tokens, cap): rows b*cap + t, t >= tokens, are padding
    filled with +-_PAD_GARBAGE, which wrecks the result unless the kernel ignores them."""
    rng = np.random.default_rng(seed)
    batch, tokens, cap = cache
    q = rng.standard_normal((q_rows, nope + rope)).astype(ml_dtypes.bfloat16)
    kv = rng.standard_normal((batch, cap, rank + rope))
    # Weights ~ N(0, 1/rank) so decompressed keys and values are O(1), like a trained layer's.
    w = (rng.standard_normal((heads * (nope + v), rank)) / math.sqrt(rank)).astype(ml_dtypes.bfloat16)
    # The padding's own generator: a full cache draws exactly the values it always did.
    signs = np.random.default_rng([seed, 1]).choice((-1.0, 1.0), size=kv[:, tokens:].shape)
    kv[:, tokens:] = _PAD_GARBAGE * signs
    return {"q": q, "kv_cache": kv.reshape(batch * cap, rank + rope).astype(ml_dtypes.bfloat16), "w_kv_b": w}


TOLERANCE = Tolerance(
    atol=2e-3, rtol=2.0**-5,
    why="the kernel's online softmax rounds P to BF16 relative to the running maximum and sums "
        "products in 32-element blocks in K order, the reference relative to the final maximum "
        "in XLA's order: P differs by up to one BF16 ulp (2^-8), which moves the BF16 latent "
        "output o_lat by an ulp in places and the BF16 result by a few ulps")


# --- the flash loop shared by decode and prefill --------------------------------------------
@dataclass
class FlashTile:
    """One scores/softmax/PV step of the flash loop.

    rows: query rows (heads in decode, queries in prefill); cols: keys in this tile.
    state: which of the two softmax states (m, l, o) this tile's query block uses.
    first/last: first/last key tile of its query block. mask: [rows, cols] f32 tile added to
    the scores (causal diagonal), or None. pad_cols: the tile's last pad_cols keys are padding
    (decode's context rounded up to 32): their scores are set to MASK_VALUE. scores(acc)/pv(acc,
    p): issue the two matmuls (after whatever waits they need) on the matrix unit.
    finish(o_f32, l): issue the normalisation on the vector unit (after ``last``).
    loop: a key the caller gives tiles whose callbacks issue the same instructions up to operands
    that move by a constant step from one tile to the next (None: no such promise). ``Flash.run``
    issues runs of such tiles as hardware loops.
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
    loop: Any = None


class Flash:
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

    def run(self, tiles: list[FlashTile], period: int = 2) -> None:
        """Issue ``tiles`` in order; the matrix unit runs scores(j+1) before pv(j).

        Runs of steady tiles (``_steady``) go out in whole rounds of ``period`` tiles as one
        hardware loop per engine (``isa.loops.issue_in_rounds``): ``period`` is a
        multiple of 2 (this loop's own buffers alternate) and of whatever the callers' callbacks
        rotate (their KV buffers)."""
        base, n = self.g, len(tiles)
        # Steps 0..n: step n is the PV and update of the last tile.
        issue_in_rounds(self.kb, 0, n + 1, period, lambda j, j0: j < n and self._steady(tiles, j, j0),
                        lambda j: self._step(base, tiles, j))
        self.g = base + n

    @staticmethod
    def _steady(tiles: list[FlashTile], j: int, j0: int) -> bool:
        """Step j (scores and softmax of tile j, PV and update of tile j-1) issues what step j0
        does up to affine operands: both tiles carry j0's loop key, neither is a first or last
        tile, and tile j is unmasked, unpadded and shaped like tile j0."""
        t, prev, t0 = tiles[j], tiles[j - 1] if j else None, tiles[j0]
        return (prev is not None and t.loop is not None and t.loop == prev.loop == t0.loop
                and not (t.first or t.last or prev.first or prev.last) and t.mask is None
                and not t.pad_cols and (t.rows, t.cols, t.state) == (t0.rows, t0.cols, t0.state)
                == (prev.rows, prev.cols, prev.state))

    def _step(self, base: int, tiles: list[FlashTile], j: int) -> None:
        mxu, vpu = self.core.mxu, self.core.vpu
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

    def _scores(self, g: int, t: FlashTile, mxu) -> None:
        if g >= 2:  # the vector unit has read acc_s[g % 2] of tile g-2
            mxu.wait(self.s_free, g - 1)
        t.scores(self.acc_s[g % 2].sub(0, 0, t.rows, t.cols))
        mxu.signal(self.s_ready)

    def _pv(self, g: int, t: FlashTile, mxu) -> None:
        mxu.wait(self.p_ready, g + 1)
        if g >= 2:
            mxu.wait(self.pv_free, g - 1)
        t.pv(self.acc_pv[g % 2].sub(0, 0, t.rows, self.acc_pv[0].cols),
             self.p[g % 2].sub(0, 0, t.rows, t.cols))
        mxu.signal(self.pv_done)

    def _softmax(self, g: int, t: FlashTile, v) -> None:
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

    def _update(self, g: int, t: FlashTile, v) -> None:
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
def rows_of(t: Tile, first: int, count: int, every: int) -> Tile:
    """``count`` rows of HBM/SRAM tile ``t`` starting at ``first``, taking every ``every``-th row."""
    return Tile(t.space, t.core, t.offset + first * t.stride, t.dtype, count, t.cols, t.stride * every)


def reshaped(t: Tile, rows: int, cols: int) -> Tile:
    """The packed tile ``t`` seen as [rows, cols] (the same bytes: a stand-alone program's
    head-major [tokens*heads, width] tensor as the token-major [tokens, heads*width] it is)."""
    if not t.contiguous or rows * DTYPES[t.dtype].row_bytes(cols) != t.nbytes:
        raise AssertionError(f"{t} cannot be viewed as [{rows}, {cols}]")  # a kernel bug
    return Tile(t.space, t.core, t.offset, t.dtype, rows, cols)


def _heads_of_row(t: Tile, nh: int, head_w: int) -> Tile:
    """Of a one-row tile ``t`` that starts inside a head of a token-major row ([.., heads*head_w]),
    the same columns of ``nh`` consecutive heads as an [nh, t.cols] tile (row stride: one head)."""
    return Tile(t.space, t.core, t.offset, t.dtype, nh, t.cols, DTYPES[t.dtype].row_bytes(head_w))


def wait_once(q: EngineHandle, ready: Ready | None, waited: dict[Any, set[Ready]]) -> None:
    """``q`` waits for ``ready`` unless it already has (``waited`` per engine, updated)."""
    done = waited.setdefault(q.engine, set())
    if ready is not None and ready not in done:
        q.wait(*ready)
        done.add(ready)


def fetch_heads(q: EngineHandle, dst: Tile, src: TensorRef, row: int, h0: int, nh: int, col: int,
                 head_w: int, waited: dict[Any, set[Ready]]) -> None:
    """Copy columns col..col+dst.cols of heads h0..h0+nh of token ``row`` of the token-major
    ``src`` ([tokens, heads*head_w]) into ``dst`` [nh, width] on queue ``q``: from HBM one
    strided load (after the readiness regions of that row); on chip one strided copy per piece
    holding whole heads of the row (a head split between pieces: one copy per part)."""
    width = dst.cols
    if src.in_hbm:
        for r in src.waits(row, h0 * head_w, 1, nh * head_w):
            wait_once(q, r, waited)
        q.load(dst, _heads_of_row(src.hbm_view(row, h0 * head_w + col, 1, width), nh, head_w))
        return
    h = h0
    while h < h0 + nh:
        parts = src.sources(row, h * head_w + col, 1, width, near=q.engine.core)
        if len(parts) > 1:  # this head's columns lie in several pieces
            for piece, _, b0, _, nc in parts:
                wait_once(q, piece.ready, waited)
                off = b0 - (h * head_w + col)
                q.copy(dst.sub(h - h0, off, 1, nc), piece.tile.sub(row - piece.r0, b0 - piece.c0, 1, nc))
            h += 1
            continue
        piece = parts[0][0]
        k = 1  # further heads whose columns lie in the same piece
        while h + k < h0 + nh and (h + k) * head_w + col + width <= piece.c0 + piece.cols:
            k += 1
        wait_once(q, piece.ready, waited)
        first = piece.tile.sub(row - piece.r0, h * head_w + col - piece.c0, 1, width)
        q.copy(dst.sub(h - h0, 0, k, width), _heads_of_row(first, k, head_w))
        h += k


def pick_tile(limit: int, length: int, fixed: int, per: int, cap: int, what: str, override: int) -> int:
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


def arena_view(arena: Tile, dtype: str, rows: int, cols: int, byte_off: int = 0) -> Tile:
    """A packed [rows, cols] tile of ``dtype`` inside ``arena`` (a byte region reused over phases)."""
    t = Tile(arena.space, arena.core, arena.offset + byte_off, dtype, rows, cols)
    if t.end > arena.offset + arena.nbytes:
        raise AssertionError(f"{t} is not inside {arena}")  # a kernel bug, not bad input
    return t


def aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def hbm_scratch(ctx: EmitCtx, ref: TensorRef | None, name: str, shape: tuple[int, int]) -> Tile:
    """The HBM staging tensor ``name`` (role scratch): the given one, or allocated here when the
    caller planned a tiling that needs none (a fused operator re-planned into a smaller budget)."""
    if ref is not None:
        if ref.shape != shape or not ref.in_hbm:
            raise InvalidArgumentError(f"scratch {name} must be an HBM tensor {list(shape)}, got "
                                       f"{ref.name} {list(ref.shape)}")
        return ref.base
    return ctx.kb.hbm(name, shape, "bf16")


class LatentDims:
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


def split_ranges(span: int, splits: int) -> list[tuple[int, int]]:
    """[lo, hi) token ranges of a sequence's ``splits`` context splits over ``span`` tokens (a
    multiple of 32), in whole 32-token blocks, the later splits taking the extra blocks."""
    blocks, b = span // BLOCK_TOKENS, BLOCK_TOKENS
    return [(s * blocks // splits * b, (s + 1) * blocks // splits * b) for s in range(splits)]


def fold_steps(n: int) -> list[tuple[int, int]]:
    """The fixed pairwise order in which the split-KV merge reduces ``n`` partial states: (h, lo)
    steps, each combining rows [0, h) with rows [lo, lo + h) into [0, h), until one is left
    (the kernel and ``mla_decode_reference`` follow the same steps)."""
    steps = []
    while n > 1:
        h = n // 2
        steps.append((h, n - h))
        n -= h
    return steps


# --- small scratchpads (GPU presets): GEMM jobs through HBM, for both kernels ----------------------

@dataclass(frozen=True)
class GemmSrc:
    """Region [r0:r0+rows, c0:c0+cols] of a tensor (HBM or on chip) that a GEMM job fetches."""

    ref: TensorRef
    r0: int
    c0: int
    rows: int
    cols: int


@dataclass
class GemmJob:
    """One output tile of a small per-head GEMM: acc = sum over K panels of a @ b (or a @ b^T),
    rounded to BF16 and stored to ``dst`` (or kept: ``emit_gemm_jobs``). panels: (a [m, k],
    b HBM [k, n] or [n, k]); a is an HBM tile or a ``GemmSrc`` (fetched after its readiness)."""

    panels: list[tuple[Tile | GemmSrc, Tile]]
    dst: Tile | None
    transposed: bool


def gemm_sems(kb: KernelBuilder, c: int, tag: str) -> dict[str, Semaphore]:
    """The semaphores of core ``c``'s GEMM jobs (``read`` counts jobs read out of the accumulators)."""
    return {n: kb.semaphore(f"c{c}.{tag}.{n}") for n in
            ("loaded0", "loaded1", "used0", "used1", "acc", "read", "stored")}


def emit_gemm_jobs(kb: KernelBuilder, c: int, jobs: list[GemmJob], bufs: dict[str, list[Tile]],
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
    sem = sem or gemm_sems(kb, c, tag)
    waited = {} if waited is None else waited
    step = 0
    for j, job in enumerate(jobs):
        m = job.panels[0][0].rows
        n = job.panels[0][1].rows if job.transposed else job.panels[0][1].cols
        acc = arena_view(bufs["acc"][j % 2], "f32", m, n)
        for k, (a_src, b_src) in enumerate(job.panels):
            s = step % 2
            q = core.dma[s]
            if start is not None and step < 2:
                q.wait(*start)
            if step >= 2:  # the matrix unit is done with this slot's previous panels
                q.wait(sem[f"used{s}"], step // 2)
            a = arena_view(bufs["a"][s], "bf16", a_src.rows, a_src.cols)
            b = arena_view(bufs["b"][s], "bf16", b_src.rows, b_src.cols)
            if isinstance(a_src, GemmSrc):
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
        out = arena_view(bufs["out"][j % 2], "bf16", m, n)
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


COMMON_SHAPE_KEYS = (
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
