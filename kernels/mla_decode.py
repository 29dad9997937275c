"""Multi-head latent attention decode, absorbed form (DeepSeek-V3/R1, Kimi K2.5): ``mla-decode``.

Stage: kernels (the MLA family), on ``mla`` (the cache layout, tensors, references and the
online-softmax engine both MLA kernels share; see its docstring for the tensors).

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

**Split-KV** (flash-decoding) when batch leaves cores idle (``mla_decode_plan.decode_splits``; shape key
``kv_splits``): each sequence's span is cut into splits of whole 32-token blocks
(``split_ranges``), one core per (sequence, split). Phase 1 then sends every split core its
sequence's [q_lat | q_pe] for all heads (q_pe comes from the head cores with q_lat); phase 2
ends with the split's unnormalised state [O | l | m] (FP32 output, row sum, row max), which
goes to the head cores scratchpad to scratchpad; phase 3 first merges each head's states in a
fixed pairwise order (``fold_steps``): m = max m_s, O = sum exp(m_s - m) O_s, l likewise,
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
core's heads' columns) or is stored (``Out.to``).

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
"""

from __future__ import annotations

import math
from typing import Any

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import EngineHandle, KernelBuilder
from jalapeno_emu.isa.program import Tile

from .base import KernelBuild, KernelDef, ShapeKey, TensorSpec
from .emit import EmitCtx, Emitter, Out, Piece, Ready, TensorRef, fetch, run_emitter
from .mla import (
    COMMON_SHAPE_KEYS,
    TOLERANCE,
    Flash,
    FlashTile,
    fetch_heads,
    fold_steps,
    make_inputs_of,
    mla_decode_reference,
    reshaped,
    rows_of,
    split_ranges,
    wait_once,
)
from .mla_decode_plan import (
    DecodeDims,
    DecodePlan,
    plan_mla_decode,
)
from .mla_decode_small import emit_decode_small
from .planning import Budget
from .registry import register

__all__ = ["MLA_DECODE", "build_mla_decode", "emit_mla_decode", "mla_decode_tensors"]


# --- decode: the on-core program --------------------------------------------------------------
# Context tiles a core without split-KV loads in the prefetch part; the rest of its first
# buffers wait for the q_lat exchange (see _emit_decode_v1).
_EARLY_TILES = 2


def _emit_decode_v1(ctx: EmitCtx, d: DecodeDims, plan: DecodePlan, q: TensorRef, kv: TensorRef, w: TensorRef,
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
    # A core's DMA port serves its queues' transfers in issue order: without split-KV, context
    # tiles issued before the q_lat copies hold the port while the copies (the whole program's
    # critical path) wait behind them, so only _EARLY_TILES go first and the other buffers fill
    # once the copies have landed (split-KV cores hold one or two tiles: all go first).
    n_early = nbuf if split else min(nbuf, _EARLY_TILES)

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
        ab[a]["fl"] = Flash(kb, a, H, T, R, d.scale, states=1 if split else 2)

    # Prefetch part: the weights, q when it is an HBM tensor ready at start, the cache tiles.
    for c in head_cores:
        core, hs, hd = kb.core(c), heads_of[c], hb[c]
        hd["wq_loaded"], hd["wuv_loaded"] = kb.semaphore(f"c{c}.wq_loaded"), kb.semaphore(f"c{c}.wuv_loaded")
        for hl, h in enumerate(hs):
            core.dma[0].load(hd["wuk"].sub(hl * N, 0, N, R), w_h.sub(h * (N + V), 0, N, R))
            if q_static:
                core.dma[0].load(hd["qn"].sub(hl * B, 0, B, qw), q.hbm_view(0, h * D, B, qw))
        core.dma[0].signal(hd["wq_loaded"])
    for a, us in enumerate(units):
        core, ad = kb.core(a), ab[a]
        ad["qpe_loaded"] = None
        if not qpe_heads and q_static:  # each sequence's q_pe, all heads, from HBM
            ad["qpe_loaded"] = kb.semaphore(f"c{a}.qpe_loaded")
            for bl, (b, _, _) in enumerate(us):
                fetch_heads(core.dma[0], ad["qbuf"].sub(bl * H, R, H, P), q, b, 0, H, N, D, waited)
            core.dma[0].signal(ad["qpe_loaded"])
        # Context tiles, g counting this core's tiles; slot g % nbuf, whose semaphore counts its loads.
        ad["slots"] = [kb.semaphore(f"c{a}.kv_loaded{i}") for i in range(nbuf)]
        ad["tiles"] = [(bl, b, t0, min(T, hi - t0)) for bl, (b, lo, hi) in enumerate(us)
                       for t0 in range(lo, hi, T)]
        ad["early"] = set()
        for g, (_, b, t0, n) in enumerate(ad["tiles"]):
            if g < n_early and not kv.waits(b * cap + t0, 0, n, W):
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
                          rows_of(hd["qlat"], b, len(hs), B))
        core.vpu.signal(read)
        for i, ((b, _), a, bl) in enumerate(remote):
            e = core.dma[(1 + i) % n_copy_q] if n_copy_q == 4 else core.dma[1 + i % n_copy_q]
            if e.engine.queue not in used_q:
                e.wait(read, 1)
                used_q.add(e.engine.queue)
            # rows b, b+B, ... (one per local head) -> rows h0.. of the unit's [q_lat | q_pe]
            e.copy(ab[a]["qbuf"].sub(bl * H + hs[0], 0, len(hs), lw), rows_of(hd["qlat"], b, len(hs), B))
        for qi in sorted(used_q):
            core.dma[qi].signal(qlat_sent)
        qlat_signals += len(used_q)
        # W_UV is needed last: after the copies (so that they go in one round, and W_K's loads
        # before it have the HBM to themselves), on the queue that carries no copy or one copy
        # fewer in each exchange
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
                fetch_heads(core.dma[0], ad["qbuf"].sub(bl * H, R, H, P), q, b, 0, H, N, D, waited)
            core.dma[0].signal(ad["qpe_loaded"])
        if ad["qpe_loaded"] is not None:
            core.mxu.wait(ad["qpe_loaded"], 1)
        core.mxu.wait(qlat_sent, qlat_signals)
        if split and a in hb:  # the rows this core's vector unit copied itself
            core.mxu.wait(hb[a]["read"], 1)
        tiles: list[FlashTile] = []
        gated = False
        for g, (bl, b, t0, n) in enumerate(ad["tiles"]):
            s, use = g % nbuf, g // nbuf
            buf = ad["kv"][s].sub(0, 0, n, W)
            if g not in ad["early"]:
                if g >= nbuf:  # the matrix unit is done with this buffer's previous tile
                    core.dma[0].wait(fl.pv_done, g - nbuf + 1)
                elif not split and not gated:  # a first buffer left out of the prefetch part
                    gated = True
                    core.dma[0].wait(qlat_sent, qlat_signals)
                for r in kv.waits(b * cap + t0, 0, n, W):  # rows another operator writes
                    wait_once(core.dma[0], r, waited)
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
            # A sequence's tiles rotate over the nbuf KV buffers, a semaphore count further each.
            tiles.append(FlashTile(H, n, bl % 2, first, last, scores, pv, finish, pad_cols=pad, loop=bl))
        fl.run(tiles, period=math.lcm(2, nbuf))
        used_q = set()
        for bl, (b, lo, _) in enumerate(us):
            for i, c in enumerate(head_cores):
                hs = heads_of[c]
                if split:  # rows hs of the state -> rows s*K + hl*B + b of the head core's merge
                    dst, src = (rows_of(hb[c]["recv"], split_of[lo] * hb[c]["k"] + b, len(hs), B),
                                ad["state"].sub(hs[0], 0, len(hs), R + 2))
                    if c == a:  # its own heads: the vector unit, which merges them later
                        core.vpu.copy(dst, src)
                        continue
                    j = i - (i > a)
                    e = core.dma[(1 + j) % n_copy_q] if n_copy_q == 4 else core.dma[1 + j % n_copy_q]
                else:
                    j = bl * len(head_cores) + i
                    # every tile has been issued by now: queue 0 takes a share of the copies, so
                    # that 64 of them go in one set-up round (16 in flight per queue)
                    e = core.dma[(1 + j) % len(core.dma)]
                    dst = rows_of(hb[c]["obuf"], b, len(hs), B)
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


def _emit_merge(vpu: EngineHandle, recv: Tile, mx: Tile, alpha: Tile, linv: Tile, obuf: Tile, splits: int,
                k: int, r: int) -> None:
    """Merge ``splits`` partial softmax states of ``k`` rows each (flash-decoding's combine):
    ``recv`` [splits*k, r+2] FP32 holds split s's rows at s*k.., columns [O | l | m]. m = max over
    splits (``fold_steps``), broadcast back to every split's rows by doubling copies; each state
    scaled by exp(m_s - m) and summed (``fold_steps``); then obuf [k, r] = bf16(O * (1 / l))."""
    m_col, ol = recv.sub(0, r + 1, splits * k, 1), recv.sub(0, 0, splits * k, r + 1)
    vpu.copy(mx, m_col)
    for h, lo in fold_steps(splits):
        vpu.max(mx.sub(0, 0, h * k, 1), mx.sub(0, 0, h * k, 1), mx.sub(lo * k, 0, h * k, 1))
    n = 1
    while n < splits:  # mx[0:k] (the global max) to rows n*k .. of every split
        m = min(n, splits - n)
        vpu.copy(mx.sub(n * k, 0, m * k, 1), mx.sub(0, 0, m * k, 1))
        n += m
    vpu.sub(alpha, m_col, mx)
    vpu.exp(alpha, alpha)
    vpu.mul(ol, ol, alpha)
    for h, lo in fold_steps(splits):
        vpu.add(ol.sub(0, 0, h * k, r + 1), ol.sub(0, 0, h * k, r + 1), ol.sub(lo * k, 0, h * k, r + 1))
    vpu.recip(linv, recv.sub(0, r, k, 1))
    vpu.mul(obuf, recv.sub(0, 0, k, r), linv)



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
    d, plan = plan_mla_decode(shape, ctx.spec, ctx.budget, qpe_heads=not q.in_hbm, keep_out=not out.in_hbm)
    want = {"q": (d.b, d.h * d.d), "kv_cache": (d.b * d.cap, d.w), "w_kv_b": (d.h * (d.n + d.v), d.r)}
    for name, ref in (("q", q), ("kv_cache", kv_cache), ("w_kv_b", w_kv_b)):
        if ref.shape != want[name] or ref.dtype != "bf16" or ref.is_mx:
            raise InvalidArgumentError(f"mla-decode: {name} must be bf16 {list(want[name])}, got {ref.name} "
                                       f"{ref.dtype} {list(ref.shape)}")
    if not kv_cache.in_hbm or not w_kv_b.in_hbm:
        raise InvalidArgumentError("mla-decode: kv_cache and w_kv_b must be HBM tensors")
    if out.in_hbm and out.ref.shape != (d.b, d.h * d.v):
        raise InvalidArgumentError(f"mla-decode: out must be [{d.b}, {d.h * d.v}], got {list(out.ref.shape)}")
    if isinstance(plan, DecodePlan):
        return (yield from _emit_decode_v1(ctx, d, plan, q, kv_cache, w_kv_b, out))
    return (yield from emit_decode_small(ctx, d, plan, q, kv_cache, w_kv_b, out, q_lat, o_lat))


def mla_decode_tensors(shape: dict[str, Any], spec: ChipSpec) -> tuple[TensorSpec, ...]:
    """mla-decode's HBM tensors: q (input, token-major [batch, q_heads*(nope+rope)]; the
    stand-alone program allocates it as [batch*q_heads, nope+rope]), kv_cache and w_kv_b
    (weights: the cache is read), out (output, [batch, q_heads*v_head_dim]), and on the
    small-scratchpad tiling the q_lat and o_lat staging (scratch)."""
    d, plan = plan_mla_decode(shape, spec, Budget.of(spec))
    specs = [TensorSpec("q", (d.b, d.h * d.d), "bf16", "input"),
             TensorSpec("kv_cache", (d.b * d.cap, d.w), "bf16", "weight"),
             TensorSpec("w_kv_b", (d.h * (d.n + d.v), d.r), "bf16", "weight"),
             TensorSpec("out", (d.b, d.h * d.v), "bf16", "output")]
    if not isinstance(plan, DecodePlan):
        specs += [TensorSpec("q_lat", (d.b * d.h, d.r), "bf16", "scratch"),
                  TensorSpec("o_lat", (d.b * d.h, d.r), "bf16", "scratch")]
    return tuple(specs)


def build_mla_decode(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """Absorbed MLA decode: ``batch`` sequences, one query token each, ``context`` cached tokens
    (any number >= 1) in a latent cache of ``capacity`` rows per sequence (see the module doc):
    the emitter with every tensor in HBM."""
    d, plan = plan_mla_decode(shape, spec, Budget.of(spec))  # refuse before building
    B, C, cap, H = d.b, d.c, d.cap, d.h
    small = not isinstance(plan, DecodePlan)
    kb = KernelBuilder(f"mla_decode_b{B}_c{C}_h{H}" + (f"_cap{cap}" if cap != C else "")
                       + ("_small" if small else ""), chip=spec)
    refs: dict[str, TensorRef] = {}
    for ts in mla_decode_tensors(shape, spec):  # q and out head-major, the rows every binding writes
        rows = {"q": (B * H, d.d), "out": (B * H, d.v)}.get(ts.name, ts.shape)
        refs[ts.name] = TensorRef.hbm(ts.name, reshaped(kb.hbm(ts.name, rows, ts.dtype), *ts.shape))
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
        return make_inputs_of(seed, B * H, (B, C, cap), H, R, P, N, V)

    def reference(inputs):
        return {"out": mla_decode_reference(inputs["q"], inputs["kv_cache"], inputs["w_kv_b"], batch=B,
                                            context=C, capacity=cap, splits=splits, **ref_dims)}

    return KernelBuild(program=kb.build(), make_inputs=make_inputs, reference=reference,
                       outputs={"out": ("bf16", (B * H, V))}, tolerance=TOLERANCE, notes=notes)


def _emit_mla_decode_kernel(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                            outs: dict[str, Out]) -> Emitter:
    return emit_mla_decode(ctx, shape, t["q"], t["kv_cache"], t["w_kv_b"], out=outs.get("out"),
                           q_lat=t.get("q_lat"), o_lat=t.get("o_lat"))


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
        *COMMON_SHAPE_KEYS,
        ShapeKey("kv_splits", int, 0, "context splits per sequence (split-KV, partial softmax states merged "
                 "on chip); 0: automatic (when batch leaves cores idle), 1: none", minimum=0),
    ),
    build=build_mla_decode,
    emit=_emit_mla_decode_kernel,
    tensors_of=mla_decode_tensors,
))

