"""mla-decode on small scratchpads (GPU presets): absorption, attention and up-projection as
three phases with the latent query and output staged in HBM.

Stage: kernels (the MLA family), under ``mla_decode`` (which chooses this path when the on-core
plan does not fit: ``mla_decode_plan.decode_small_tiling``).
"""

from __future__ import annotations

import math
from typing import Any

from jalapeno_emu.isa.builder import KernelBuilder, Semaphore
from jalapeno_emu.isa.program import Tile

from .emit import EmitCtx, Emitter, Out, Piece, Ready, TensorRef
from .mla import (
    Flash,
    FlashTile,
    GemmJob,
    GemmSrc,
    aligned,
    arena_view,
    emit_gemm_jobs,
    fetch_heads,
    gemm_sems,
    hbm_scratch,
    rows_of,
)
from .mla_decode_plan import (
    SMALL_PV_COLS,
    DecodeDims,
    DecodeTiling,
)

__all__ = ["emit_decode_small"]


def emit_decode_small(ctx: EmitCtx, d: DecodeDims, til: DecodeTiling, q: TensorRef, kv: TensorRef,
                      w: TensorRef, out: Out, q_lat: TensorRef | None, o_lat: TensorRef | None) -> Emitter:
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
    qlat_h = hbm_scratch(ctx, q_lat, "q_lat", (B * H, R))  # phase 1 -> 2
    olat_h = hbm_scratch(ctx, o_lat, "o_lat", (B * H, R))  # phase 2 -> 3

    # Per core: the flash loop's buffers, then one arena the phases reuse in turn.
    flash, arena, gacc = {}, {}, {}
    for c in range(cores):
        flash[c] = Flash(kb, c, hg, T, R, d.scale, states=1, pv_cols=min(R, SMALL_PV_COLS))
        arena[c] = kb.sram(c, "arena", (1, til.arena_sram), "u8")
        gacc[c] = [kb.acc(c, f"gemm_acc{i}", (1, til.gemm_acc // 8)) for i in range(2)]
    half = til.arena_sram // 2

    def gemm_bufs(c: int, a_bytes: int, b_bytes: int, o_bytes: int) -> dict[str, list[Tile]]:
        offs = [0, aligned(a_bytes), aligned(a_bytes) + aligned(b_bytes)]
        ar = arena[c]
        return {"a": [arena_view(ar, "u8", 1, aligned(a_bytes), s * half + offs[0]) for s in range(2)],
                "b": [arena_view(ar, "u8", 1, aligned(b_bytes), s * half + offs[1]) for s in range(2)],
                "out": [arena_view(ar, "u8", 1, aligned(o_bytes), s * half + offs[2]) for s in range(2)],
                "acc": gacc[c]}

    a_bytes = max(bm * N, bm * til.kp) * 2
    b_bytes = max(N * til.rc, V * til.kp) * 2
    o_bytes = max(bm * til.rc, bm * V) * 2

    # Phase 1 jobs: q_lat = bf16(q_nope @ W_UK[h]), (head, sequences, latent columns).
    def rows(t: Tile, c0: int, cols: int, h: int, b0: int) -> Tile:  # rows (b0.., h) of a [B*H, .] tensor
        return rows_of(t.sub(0, c0, B * H, cols), b0 * H + h, min(bm, B - b0), H)

    p1 = [GemmJob([(GemmSrc(q, b0, h * D, min(bm, B - b0), N),
                     w_h.sub(h * (N + V), r0, N, min(til.rc, R - r0)))],
                   rows(qlat_h, r0, min(til.rc, R - r0), h, b0), transposed=False)
          for h in range(H) for b0 in range(0, B, bm) for r0 in range(0, R, til.rc)]
    # Phase 3 jobs: out = bf16(o_lat @ W_UV[h]^T), K in panels of kp; (head, sequences).
    p3 = [(h, b0, GemmJob([(rows(olat_h, k0, min(til.kp, R - k0), h, b0),
                             w_h.sub(h * (N + V) + N, k0, V, min(til.kp, R - k0)))
                            for k0 in range(0, R, til.kp)],
                           out.ref.hbm_view(b0, h * V, min(bm, B - b0), V) if out.in_hbm else None,
                           transposed=True))
          for h in range(H) for b0 in range(0, B, bm)]
    p3_sems = {c: gemm_sems(kb, c, "p3") for c in range(min(cores, len(p3)))}
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
    n1 = sum(emit_gemm_jobs(kb, c, p1[c::cores], gemm_bufs(c, a_bytes, b_bytes, o_bytes), None,
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
        emit_gemm_jobs(kb, c, [job for _, _, job in p3[c::cores]], gemm_bufs(c, a_bytes, b_bytes, o_bytes),
                        (olat_done, n2), out_done_sem, "p3", sem=p3_sems.get(c), keep=keep.get(c))
    return outs


def _decode_small_attention(kb: KernelBuilder, c: int, items: list[tuple[int, int]], fl: Flash, arena: Tile,
                            start: tuple[Semaphore, int], done: Semaphore, hbm: tuple[Any, ...],
                            sizes: tuple[int, ...], dims: tuple[int, int, int],
                            waited: dict[Any, set[Ready]]) -> None:
    """Core ``c``'s attention items (sequence b, first head h0): [q_lat | q_pe] of the group and
    the context tiles in, o_lat of the group out (see ``emit_decode_small``)."""
    q, kv_h, qlat_h, olat_h = hbm
    H, hg, T, nbuf, span, C, cap = sizes
    R, P, N = dims
    W, D = R + P, N + P
    core = kb.core(c)
    off = 0
    qbuf, obuf, kvb = [], [], []
    for _ in range(2):
        qbuf.append(arena_view(arena, "bf16", hg, W, off))
        off += aligned(hg * W * 2)
    for _ in range(2):
        obuf.append(arena_view(arena, "bf16", hg, R, off))
        off += aligned(hg * R * 2)
    for _ in range(nbuf):
        kvb.append(arena_view(arena, "bf16", T, W, off))
        off += aligned(T * W * 2)
    sem = {n: kb.semaphore(f"c{c}.p2.{n}") for n in ("q", "q_used", "kv", "o_ready", "o_stored")}
    starts = list(range(0, span, T))
    tiles: list[FlashTile] = []
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
        fetch_heads(q1, qb.sub(0, R, nh, P), q, b, h0, nh, N, D, waited)
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

            tiles.append(FlashTile(nh, n, 0, j == 0, last, scores, pv, finish,
                                    pad_cols=span - C if last else 0, loop=it))
    fl.run(tiles, period=math.lcm(2, nbuf))
    core.dma[2].signal(done)
