"""Multi-head latent attention prefill, naive form (DeepSeek-V3/R1, Kimi K2.5): ``mla-prefill``.

Stage: kernels (the MLA family), on ``mla`` (the cache layout, tensors, references and the
online-softmax engine both MLA kernels share; see its docstring for the tensors).

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

**Emitter.** ``emit_mla_prefill`` plans within ``ctx.budget``, as ``mla_decode.emit_mla_decode``
does; the prefetch part loads the mask and each core's first item's weights and latent tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder, Semaphore
from jalapeno_emu.isa.program import Tile

from .base import KernelBuild, KernelDef, ShapeKey, TensorSpec
from .emit import EmitCtx, Emitter, Out, Piece, Ready, TensorRef, fetch, run_emitter
from .mla import (
    COMMON_SHAPE_KEYS,
    SLACK_BYTES,
    TOLERANCE,
    Flash,
    FlashTile,
    GemmJob,
    GemmSrc,
    LatentDims,
    aligned,
    arena_view,
    check_dims,
    emit_gemm_jobs,
    hbm_scratch,
    latent_cache_capacity,
    make_inputs_of,
    mla_prefill_reference,
    reshaped,
    softmax_scale_of,
    wait_once,
)
from .planning import Budget, DoesNotFit
from .registry import register

__all__ = ["MLA_PREFILL", "build_mla_prefill", "emit_mla_prefill", "mla_prefill_tensors"]

_MAX_PREFILL_TILE = 256  # query/key tile: two 128-row passes; fewer, larger tiles amortise issue


# --- shape and plan ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Pre(LatentDims):
    """A checked mla-prefill shape: ``b`` sequences each adding ``s`` tokens after ``prior``
    cached ones (``c`` = prior + s tokens in ``cap`` rows per sequence), dims as
    ``mla_decode_plan.DecodeDims``."""

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
    check_dims(shape, "seq")
    prior = shape["prior"]
    if prior < 0 or prior % 32:
        raise InvalidArgumentError(
            f"shape key prior={prior} must be a multiple of 32 and >= 0: the cached tokens are the "
            "contraction (K) dimension of P @ V, which runs in 32-token blocks")
    s = shape["seq"]
    c = prior + s
    cap = latent_cache_capacity(c, shape["capacity"], "prior+seq")
    return _Pre(shape["batch"], s, prior, c, cap, shape["q_heads"], shape["kv_lora_rank"], shape["rope_dim"],
                shape["nope_dim"], shape["v_head_dim"], softmax_scale_of(shape))


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
    base = C * (D + V) * 2 + S * D * 2 + (N + V) * R * 2 + SLACK_BYTES
    sram_fixed = base + S * V * 2 * (1 + (items - 1) * keep_out)

    def fits(t: int, stream: bool = False) -> bool:
        out = 2 * t * V * 2 if stream else sram_fixed - base
        sram = base + out + 2 * t * W * 2 + t * t * 4 + Flash.sram_bytes(t, t, V)
        return sram <= cap_s and Flash.acc_bytes(t, t, V) + 2 * t * (N + V) * 4 <= cap_a

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
        r = per[c] = {"mine": mine, "core": kb.core(c), "fl": Flash(kb, c, T, T, V, p.scale)}
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
                    wait_once(dq, cond, waited)
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

                    # A query tile's key tiles read K_h and V_h a key tile further each.
                    tiles.append(FlashTile(nq, nk, i % 2, j == 0, diag, scores, pv, finish,
                                            mask.sub(0, 0, nq, nk) if diag else None, loop=(it, i)))
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
    cap_s, cap_a = budget.sram_bytes, budget.acc_bytes - SLACK_BYTES
    tiles = [override] if override else list(range(min(_MAX_PREFILL_TILE, S) // 32 * 32, 0, -32))
    for t, pvc in ((t, pvc) for t in tiles for pvc in (V, 64, 32) if pvc <= V):
        fl_s = Flash.sram_bytes(t, t, V, 1, pvc) + 16 * 64
        fl_a = Flash.acc_bytes(t, t, V) + 4 * 64
        items = p.b * p.h * -(-S // t)
        kept = -(-items // budget.cores) * aligned(t * V * 2) if keep_out else 0
        for nbuf in (3, 2):
            att = (aligned(t * D * 2) + aligned(t * V * 2) + aligned(t * t * 4)
                   + nbuf * (aligned(t * D * 2) + aligned(t * V * 2)))
            for tm, kp in ((128, R), (128, R // 2), (64, R // 2), (64, R // 4), (32, R // 4), (32, 32)):
                if kp < 32 or kp % 32:
                    continue
                g_s = 2 * (aligned(tm * kp * 2) + aligned(max(N, V) * kp * 2) + aligned(tm * max(N, V) * 2))
                g_a = 2 * aligned(tm * max(N, V) * 4)
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
    kn_h = hbm_scratch(ctx, k_nope, "k_nope", (B * H * C, N))  # phase 1 -> 2
    v_h = hbm_scratch(ctx, v, "v", (B * H * C, V))

    flash, arena, gacc = {}, {}, {}
    n_gemm = max(N, V)
    for c in range(cores):
        flash[c] = Flash(kb, c, T, T, V, p.scale, states=1, pv_cols=pv_cols)
        arena[c] = kb.sram(c, "arena", (1, arena_sram), "u8")
        gacc[c] = [kb.acc(c, f"gemm_acc{i}", (tm, n_gemm)) for i in range(2)]
    half = arena_sram // 2
    a_b, b_b, o_b = tm * kp * 2, n_gemm * kp * 2, tm * n_gemm * 2

    def gemm_bufs(c: int) -> dict[str, list[Tile]]:
        ar = arena[c]
        offs = (0, aligned(a_b), aligned(a_b) + aligned(b_b))
        bufs = {name: [arena_view(ar, "u8", 1, aligned(size), s * half + o) for s in range(2)]
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
                    panels = [(GemmSrc(kv, b * cap + t0, k0, m, min(kp, R - k0)),
                               w_h.sub(w_row, k0, n, min(kp, R - k0))) for k0 in range(0, R, kp)]
                    jobs.append(GemmJob(panels, dst.sub((b * H + h) * C + t0, 0, m, n), transposed=True))
    kv_done = kb.semaphore("kv_done")
    n1 = sum(emit_gemm_jobs(kb, c, jobs[c::cores], gemm_bufs(c), None, kv_done, "p1", waited=waited)
             for c in range(cores))

    # Phase 2: flash attention per (sequence, head, query tile), longest items first.
    for c in range(att_cores):
        _prefill_small_attention(kb, c, items[c::cores], flash[c], arena[c], (kv_done, n1),
                                 (q, kv, kn_h, v_h, mask_h, out), (S, H, T, nbuf, C, cap, n_prior),
                                 (R, P, N, V), ktiles, starts, sems[c], keep.get(c), waited)
    return outs


def _prefill_small_attention(kb: KernelBuilder, c: int, items: list[tuple[int, int, int]], fl: Flash,
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
        t = arena_view(arena, dtype, rows, cols, off)
        off += aligned(t.nbytes)
        return t

    qs, os_, mask = take(T, D, "bf16"), take(T, V, "bf16"), take(T, T, "f32")
    kbuf = [(take(T, D, "bf16"), take(T, V, "bf16")) for _ in range(nbuf)]
    for e in (core.dma[0], core.dma[1], core.dma[3]):  # phase 1 is done with the arena everywhere
        e.wait(*start)
    core.dma[3].load(mask, mask_h)
    core.dma[3].signal(sem["mask"])
    core.vpu.wait(sem["mask"], 1)
    tiles: list[FlashTile] = []
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

            # An item's key tiles rotate over the nbuf KV buffers, a semaphore count further each.
            tiles.append(FlashTile(nq, nk, 0, j == 0, diag, scores, pv, finish,
                                    mask.sub(0, 0, nq, nk) if diag else None, loop=it))
    fl.run(tiles, period=math.lcm(2, nbuf))


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
        refs[ts.name] = TensorRef.hbm(ts.name, reshaped(kb.hbm(ts.name, rows, ts.dtype), *ts.shape))
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
        ins = make_inputs_of(seed, B * S * H, (B, C, cap), H, R, P, N, V)
        ins["causal_mask"] = _causal_mask(T)
        return ins

    def reference(inputs):
        return {"out": mla_prefill_reference(inputs["q"], inputs["kv_cache"], inputs["w_kv_b"],
                                             batch=B, seq=S, prior=prior, capacity=cap, **ref_dims)}

    return KernelBuild(program=kb.build(), make_inputs=make_inputs, reference=reference,
                       outputs={"out": ("bf16", (B * S * H, V))}, tolerance=TOLERANCE, notes=notes)


def _emit_mla_prefill_kernel(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                             outs: dict[str, Out]) -> Emitter:
    return emit_mla_prefill(ctx, shape, t["q"], t["kv_cache"], t["w_kv_b"], out=outs.get("out"),
                            k_nope=t.get("k_nope"), v=t.get("v"))


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
        *COMMON_SHAPE_KEYS,
    ),
    build=build_mla_prefill,
    emit=_emit_mla_prefill_kernel,
    tensors_of=mla_prefill_tensors,
))
