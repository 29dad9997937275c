"""GEMM family: ``gemm`` (y = x @ W + bias) and ``logits`` (``embedding`` is in ``embedding.py``).

``gemm``: y[m, n] (BF16) = x[m, k] @ W[k, n] + bias[n].

- W lives in HBM as MXFP4 or MXFP8 (E4M3) blocked by 32 along K (``kb.hbm_mx("w", (k, n), fmt,
  axis=0)``: the checkpoint layout) or as BF16.
- x is BF16, or MX (``act_fmt`` fp8e4 / fp4) **pre-quantised** along K: ``x`` holds the element
  codes and ``x.scales`` the E8M0 scales, as ``mx.quantize(x, fmt, axis=1)`` makes them. The
  kernel does not quantise: re-reading a BF16 panel for every output block would double the bytes
  of the large GEMM, while the producer of x (the previous kernel's epilogue: ``vec.quantize`` is
  exactly ``mx.quantize``) writes it once.
- The output is BF16; bias (BF16) is added in FP32 to the FP32 accumulators, then rounded (RNE).

Tiling. The output is cut into blocks of Mb x Nb (Mb <= 512 rows, Nb a multiple of 64 columns
sized so that there are at least as many blocks as cores and the accumulators hold one block, or
two for double buffering), dealt to the cores in contiguous runs (neighbouring blocks share their
rows of x); a core's run within one row block starts at its row-block index mod the run's length
(see below). A core keeps its x row block [Mb, k] in SRAM (if it fits in a third of it; else x is
streamed beside W) and streams W in K chunks (<= 512 deep) through 2-8 SRAM slots, slot s on
DMA queue s % load_queues. A DMA-queue ``sem.signal`` does not stall its queue, so every queue
issues its first descriptors (up to 16) at once and the queues take turns: the n-th descriptor of
every queue of every core reaches the pseudo-channel FIFOs before any (n+1)-th. The kernel
therefore issues what is needed first first: an MX operand's scales go before its codes (a few
KB spread over every channel, which would otherwise land behind the whole first wave of codes
and hold up the first matmul by ~3 us), the first chunk before later ones. The matrix unit
accumulates the chunks in increasing K order (hence bit-exact with ``mx.matmul``); the vector
unit moves a finished FP32 block to SRAM (adding the bias through an FP32 slab) and the last
queue stores it. The last block's K range ends in a half and two quarter chunks (512 -> 256,
128, 128) so that little matmul is left after the final bytes land (a 256 MiB GEMV: 0.3 us
between the last byte and the store, 0.5 us with one half chunk).

What the HBM address map taught us (jalapeno-v1, power-of-two shapes):
- x[:, k0:k1] of every row block lives on the same few pseudo-channels (rows are k/2 bytes
  apart, a multiple of the interleave round), so 64 cores streaming x chunks in lockstep hit a
  hot spot. Decode: each core loads its few KB of x once. Prefill: the cores sharing a row block
  (groups of <= 4) load each part of the 2 MiB panel once from HBM and relay it to each other
  with ``dma.copy``; part 0 is one chunk wide so the matmuls start early. Decode GEMVs whose
  weight stream is long: x's few KB sit on a few channels too, and 64 cores reading them put
  16 KB more on each (0.4 us more than the others at 36 GB/s, which the cores streaming W from
  those channels then finish late). One core in 16 reads x, its codes and scales as the first
  descriptors of two queues, and the others copy it from that core's SRAM once it has landed
  (after W's scales, on the last queue): per-channel bytes within 0.1 % instead of 2 %.
- Several blocks per core: if every core took its blocks in the same column order, the cores would
  load the same W columns and store the same y columns at the same time; W rows (n = 8192: 4 KiB
  apart) and y rows (16 KiB apart) are multiples of the interleave round's divisors, so one
  column block sits on 1/8 of the channels. Rotating each core's run by its row-block index puts
  the cores on different column blocks at any moment (8192^3: the last wave of stores had only
  half of the channels, a 12 us tail instead of 7; m = 32768, where every core owns a whole row
  block, ran at 38 % of peak instead of 92 %).
- Decode: W's scales for a core's whole K range are loaded first, once: streamed beside each
  chunk they sit on other cores' channels and hold up every chunk's signal.

Fused decode GEMVs (output kept on chip, one block per core, x resident) that stream at least
twice what their slots hold: a DMA queue's signal lands only once everything issued before it on
that queue has, and in a fused program the next operators' prefetch parts are issued ahead of this
operator's rest. So the chunks of the prefetch part go on queue 1 (``FUSED_PREFETCH_QUEUE``), the
chunks streamed slot by slot afterwards on the last queue, and x from the other operators on the
last two; not on queue 0, where the MoE/FFN program streams its weights and the appends load
their rows. Neither this GEMV's rest nor those signals then wait behind each other's prefetch
(DeepSeek-R1 layer 0 at batch 1: 74.8 -> 69.2 us; o_proj's chunks had waited behind the FFN's
prefetched weights, the MLA append's signal behind o_proj's). The chunks, their order and the
arithmetic are the stand-alone kernel's; a stand-alone launch (output in HBM), and a GEMV whose
stream is barely longer than its slots (gpt-oss-120b's projections: 0.2-1 us slower with their
few later chunks on one queue), keep slot s on queue s % load_queues.

Two regimes on jalapeno-v1:

- Decode GEMV (m = 1..64): each core streams an Nb-column slice of W; HBM-bound when W is large
  and the matrix unit keeps up. The matrix unit prices a step of 128 rows whatever m is, so its
  time is n*k/(128*32*cores) steps of 8 (fp4 x fp4), 16 (fp8 x fp4) or 32 (bf16) cycles: fp4 x fp4
  has 2x headroom over HBM, fp8e4 x fp4 just about keeps pace, bf16 x fp4 is compute-bound at
  half of HBM speed. Fixed costs cap a 256 MiB GEMV (20.6 us of transfer): 285 MB (MXFP4 codes
  and scales, 16384 x 32768, fp8 x) takes 28.4 us, 72.5 % of achievable bandwidth: launch 2 us;
  3.5 us until the first matmul (every core's prefetch burst, about 0.93 MB, passes its DMA port
  in FIFO order, the first chunk behind the resident W scales); then one 64 KB chunk per 0.32 us,
  the matrix unit at m = 1 pacing it against 0.30 us of the core's HBM share; the store 1.9 us.
  Loading the first chunk's scales on their own made it later (28.9 us: the second chunk then
  waits for the rest). At real layer sizes
  (gpt-oss k=2880, n=5760: 8.8 MB, 0.6 us of HBM time) the kernel is latency-bound at ~7-9 us.
- Prefill GEMM (m, n, k >= 4096): 512 x 1024 output blocks (the whole 2 MiB accumulator) give
  4*512*1024/(512+1024) = 1365 FLOP per MXFP4 byte, above the ~970 a core needs to stay
  compute-bound at its share of HBM. Only fp4 x fp4 runs at the MXFP4 rate and can reach 80 % of
  peak MXFP4 FLOP/s (8192^3: 83 %, m = 16384: 89 %, m = 32768: 92 %; warm-up ~7 us, tail ~6 us of
  stores); fp8e4 x fp4 runs at the MXFP8 rate, half of it (41 %).

No split-K: with 64-column slices every core streams weights as long as n >= 64 * cores (4096
on v1); narrower layers (routers, n = 128) use fewer cores, which on v1 still saturate HBM while
at least half of them stream (each core's DMA port is 2x its share of HBM), and are latency-bound
anyway.

``logits``: the final projection hidden -> vocab, the ``gemm`` builder with logits-shaped keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu.unit_math import inorder_block_matmul
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder, MXTensor
from jalapeno_emu.isa.table import DTYPES
from jalapeno_emu.lazy import LazyModule, lazy_jit

from .base import KernelBuild, KernelDef, ShapeKey, TensorSpec, Tolerance
from .emit import EmitCtx, Emitter, Out, Piece, TensorRef, fetch, run_emitter
from .gemm_plan import (
    ACT_FMTS,
    BROADCAST_MIN_BYTES,
    WEIGHT_FMTS,
    GemmPlan,
    check_gemm_shape,
    k_chunks,
    operand_bytes,
    plan_gemm,
)
from .registry import register

ml_dtypes = LazyModule("ml_dtypes")  # loaded on first use: importing it costs 0.5 s

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

__all__ = ["GEMM", "LOGITS", "GemmPlan", "build_gemm", "emit_gemm", "gemm_reference",
           "inorder_block_matmul", "plan_gemm"]

LOOP_MIN_ROUNDS = 4  # rounds of the slots below which a K loop is issued unrolled (repeat's own floor)
RELAY_GROUP = 4  # cores that share one HBM read of an x panel
FUSED_PREFETCH_QUEUE = 1  # a fused decode GEMV's prefetched chunks (module docstring)

# --- numerics -------------------------------------------------------------------------------
_inorder_jit = lazy_jit(inorder_block_matmul)


def gemm_reference(x: Any, w: Any, bias: Any | None) -> np.ndarray:
    """bf16[m, n]: the kernel's result in pure JAX.

    Args:
        x: [m, k] MXArray blocked along K (axis 1) or bfloat16 array.
        w: [k, n] MXArray blocked along K (axis 0) or bfloat16 array.
        bias: bfloat16[1, n] or None.

    MX x MX is ``mx.matmul`` (bit for bit what the K chunks accumulate in order); anything with a
    BF16 side is ``inorder_block_matmul`` on the exact float32 values. Then FP32 + bias, one RNE
    rounding to BF16.
    """
    if isinstance(x, mx.MXArray) and isinstance(w, mx.MXArray):
        acc = mx.matmul(x, w)
    else:
        def vals(v):
            return mx.dequantize(v) if isinstance(v, mx.MXArray) else jnp.asarray(v, jnp.float32)
        acc = _inorder_jit(vals(x), vals(w))
    if bias is not None:
        acc = acc + jnp.asarray(bias, jnp.float32)
    return np.asarray(acc.astype(jnp.bfloat16))


# --- gemm -----------------------------------------------------------------------------------
def emit_gemm(ctx: EmitCtx, x: TensorRef, w: TensorRef, bias: TensorRef | None = None, *,
              y_out: Out | None = None, plan: GemmPlan | None = None,
              key_names: dict[str, str] | None = None) -> Emitter:
    """Emit y = x @ w (+ bias) (see the module docstring).

    Args:
        ctx: the emit context (its budget's cores and scratchpad bound the plan).
        x: [m, k] activations: BF16, or MX blocked along K (axis 1); in HBM or on chip. Pieces on
            a core's own scratchpad that hold its whole row block are read in place (a decode
            step's replicated norm output); anything else is fetched.
        w: [k, n] weights in HBM: MX blocked along K (axis 0) or BF16.
        bias: [1, n] BF16 in HBM, or None.
        y_out: where y goes: ``Out.to(ref)`` stores each output block into the HBM tensor;
            ``Out.onchip()`` (default) keeps each block in its core's scratchpad.
        plan: a plan from :func:`plan_gemm` (default: planned here).
        key_names: shape-key names for error messages (logits).

    The prefetch part loads what is ready at the start: W's scales, the bias, the weight chunks
    that fit the slots without waiting, and x when it is an HBM tensor ready at start (its decode
    relay included). Yields/returns ``{"y": ...}``.
    """
    kb, spec = ctx.kb, ctx.spec
    (m, k), n = x.shape, w.shape[1]
    weight_fmt, act_fmt = w.dtype, x.dtype
    names = {"m": "m", "n": "n", "k": "k"} | (key_names or {})
    check_gemm_shape(m, n, k, weight_fmt, act_fmt, names)
    if w.shape[0] != k or not w.in_hbm:
        raise InvalidArgumentError(f"gemm: w must be an HBM tensor [{k}, n], got {w.name} {list(w.shape)}")
    plan = plan or plan_gemm(m, n, k, weight_fmt, act_fmt, bias is not None, spec, ctx.budget)
    y_out = y_out or Out.onchip()
    x_mx, w_mx = act_fmt != "bf16", weight_fmt != "bf16"
    x_static = x.in_hbm and not x.waits()
    # A streamed x (one K chunk per weight chunk) that other operators produce is fetched in the
    # rest, not beside the prefetched weights: a fetch waits for its producer, and in the prefetch
    # part it would sit on a DMA queue ahead of the producer's own later loads (a deadlock).
    defer_x = not plan.x_resident and not x_static
    mb, nb, kc = plan.mb, plan.nb, plan.kc

    def loads(q, dst, m0, k0) -> None:
        fetch(q, dst, x, m0, k0, waited=waited)

    def w_view(k0, n0, rows, cols):
        return w.hbm_view(k0, n0, rows, cols)

    waited: dict[Any, set] = {}
    # Prologue for every core first, so that x, W's scales and the bias are issued (and queue
    # on their pseudo-channels) ahead of every core's weight stream.
    per_core: dict[int, dict[str, Any]] = {}
    for c, items in enumerate(plan.items):
        if not items:
            continue
        a_shape = (mb, k) if plan.x_resident else (mb, kc)
        row_blocks = {it[0] for it in items}
        local = None
        if plan.x_resident and len(row_blocks) == 1:
            m0, rows = items[0][0], items[0][1]
            local = x.local(c, m0, 0, rows, k)
        per_core[c] = {
            "core": kb.core(c),
            "local_x": local,  # (tile, ready): the row block already in this core's scratchpad
            "a_buf": [] if local is not None else
                     [kb.sram_mx(c, f"a{s}", a_shape, act_fmt, axis=1) if x_mx
                      else kb.sram(c, f"a{s}", a_shape, "bf16")
                      for s in range(1 if plan.x_resident else plan.slots)],
            "x_in_prologue": plan.x_resident and len(row_blocks) == 1,
            "x_parts": [],  # (k0, width, semaphore, value): x panel pieces the matmuls wait for
            "loaded": [kb.semaphore(f"c{c}.loaded{s}") for s in range(plan.slots)],
        }
        if local is not None:
            per_core[c]["a_buf"] = [local[0]]

    def emit_x_prologue() -> None:
        """x panels that stay for the whole kernel (see below); for a static x in the prefetch
        part, else at the start of the rest."""
        groups: dict[int, list[int]] = {}
        for c, r in per_core.items():
            if r["x_in_prologue"] and r["local_x"] is None:
                groups.setdefault(plan.items[c][0][0], []).append(c)
        x_from: dict[int, tuple[int, list[Any]]] = {}
        if operand_bytes(act_fmt, mb, k, 1) < min(BROADCAST_MIN_BYTES, spec.sram.scratchpad_bytes // 16):
            cores_x = [c for members in groups.values() for c in members]
            relay = plan.x_relay if x_static else 1
            for i in range(0, len(cores_x) if relay > 1 else 0, relay):
                lead, *peers = cores_x[i:i + relay]
                r = per_core[lead]
                m0, rows = plan.items[lead][0][0], plan.items[lead][0][1]
                own, src = r["a_buf"][0].sub(0, 0, rows, k), x.hbm_view(m0, 0, rows, k)
                pairs = [(own.codes, src.codes), (own.scales, src.scales)] if x_mx else [(own, src)]
                landed = []
                for q, (dst, part) in enumerate(pairs):
                    dq = r["core"].dma[q % len(r["core"].dma)]
                    dq.load(dst, part)
                    landed.append(kb.semaphore(f"c{lead}.x_landed{q}"))
                    dq.signal(landed[-1])
                    r["x_parts"].append((0, k, landed[-1], 1))
                x_from.update((p, (lead, landed)) for p in peers)
            groups = {c: [c] for c in cores_x if c not in x_from and not per_core[c]["x_parts"]}
        else:  # relay within groups of at most RELAY_GROUP cores: few copies per part, short chains
            groups = {members[i]: members[i:i + RELAY_GROUP] for members in groups.values()
                      for i in range(0, len(members), RELAY_GROUP)}
        for members in groups.values():
            m0, rows = plan.items[members[0]][0][0], plan.items[members[0]][0][1]
            if len(members) == 1:
                r = per_core[members[0]]
                if x_static:
                    loads(r["core"].dma[0], r["a_buf"][0].sub(0, 0, rows, k), m0, 0)
                    r["x_parts"].append((0, k, r["loaded"][0], 1))
                else:  # x from other operators: spread over the queues, with its own semaphore
                    got = kb.semaphore(f"c{members[0]}.x_in")
                    xq = [r["core"].dma[q] for q in r["x_queues"]] if "x_queues" in r else r["core"].dma
                    used = fetch(xq, r["a_buf"][0].sub(0, 0, rows, k), x, m0, 0, waited=waited)
                    for q in used:
                        q.signal(got)
                    r["x_parts"].append((0, k, got, len(used)))
                continue
            first = min(kc, k)
            per = -(-((k - first) // 32) // len(members)) * 32 or 32
            parts = [(0, first)] + [(pk0, min(per, k - pk0)) for pk0 in range(first, k, per)]
            for i, (pk0, pw) in enumerate(parts):
                owner_id = members[i % len(members)]
                owner = per_core[owner_id]
                q = owner["core"].dma[-1]
                own = owner["a_buf"][0].sub(0, pk0, rows, pw)
                landed = kb.semaphore(f"c{owner_id}.x{i}.landed")
                sent = kb.semaphore(f"c{owner_id}.x{i}.sent")
                used = fetch(q if x.in_hbm else _exchange_queues(owner["core"], x, m0, pk0, rows, pw, spec),
                             own, x, m0, pk0, waited=waited)
                for uq in used:
                    uq.signal(landed)
                q.wait(landed, len(used))
                for peer in members:
                    if peer != owner_id:
                        dst = per_core[peer]["a_buf"][0].sub(0, pk0, rows, pw)
                        if x_mx:
                            q.copy(dst.codes, own.codes)
                            q.copy(dst.scales, own.scales)
                        else:
                            q.copy(dst, own)
                q.signal(sent)
                for c in members:
                    per_core[c]["x_parts"].append((pk0, pw, landed, len(used)) if c == owner_id
                                                  else (pk0, pw, sent, 1))
        return x_from

    # x panels that stay for the whole kernel. Large ones (prefill) are shared by the G cores
    # of a row block: each part is loaded from HBM by one member and relayed to the others over
    # the on-die network, so HBM serves each panel once instead of G times. All row blocks'
    # first K columns sit on the same few pseudo-channels (the row stride is k/2 bytes), so
    # 64 cores each fetching them would delay the first matmul by ~10 us on jalapeno-v1;
    # part 0 is one chunk wide so that the matmuls start early. Small panels (decode: a few KB)
    # are loaded whole by every core, on queue 0 with the first weight chunk (whose signal
    # covers both). Decode relay (plan.x_relay > 1, x ready at start): the leader of each group
    # reads x, its codes and scales as the first descriptors of two queues (so they are not
    # queued behind every core's first wave of weights); the others copy it from the leader's
    # SRAM (below, after W's scales).
    x_from = emit_x_prologue() if x_static else {}

    for c, r in per_core.items():
        items, core = plan.items[c], r["core"]
        bq = core.dma[-1]
        if plan.w_scales_resident:  # W's scales for the whole K range
            r["ws_sem"] = kb.semaphore(f"c{c}.w_scales")
            n0, cols = items[0][2], items[0][3]
            r["w_scales"] = kb.sram(c, "w_scales", (k // 32, nb), "e8m0")
            bq.load(r["w_scales"].sub(0, 0, k // 32, cols), w.base_scales.sub(0, n0, k // 32, cols))
            bq.signal(r["ws_sem"])
        if bias is not None:  # every bias slice this core needs
            r["tmp"] = kb.sram(c, "tmp", (plan.slab, nb), "f32")
            r["b_bufs"] = [kb.sram(c, f"bias{t}", (1, nb), "bf16") for t in range(len(items))]
            r["bias_sem"] = kb.semaphore(f"c{c}.bias")
            for t, (_, _, n0, cols) in enumerate(items):
                bq.load(r["b_bufs"][t].sub(0, 0, 1, cols), bias.hbm_view(0, n0, 1, cols))
            bq.signal(r["bias_sem"])
        if c in x_from:  # copy x from the group leader's SRAM once it has landed there
            lead, landed = x_from[c]
            got = kb.semaphore(f"c{c}.x_copied")
            for sem in landed:
                bq.wait(sem, 1)
            m_rows = plan.items[c][0][1]
            src, dst = per_core[lead]["a_buf"][0].sub(0, 0, m_rows, k), r["a_buf"][0].sub(0, 0, m_rows, k)
            for d, s_ in ((dst.scales, src.scales), (dst.codes, src.codes)) if x_mx else ((dst, src),):
                bq.copy(d, s_)
            bq.signal(got)
            r["x_parts"].append((0, k, got, 1))

    def emit_panel(r: dict[str, Any], t: int, panel_sems: list[Any], count: int) -> list[tuple]:
        """Load item t's x row block (whole K, split over the load queues) when the core's row
        block changes; returns the pieces its matmuls wait for."""
        core, items = r["core"], plan.items[r["c"]]
        m0, rows = items[t][0], items[t][1]
        per = -(-(k // 32) // plan.load_queues) * 32
        out = []
        for p, pk0 in enumerate(range(0, k, per)):
            q, pw = core.dma[p], min(per, k - pk0)
            if t:  # every matmul on the previous panel is done
                q.wait(r["acc_done"], t)
            loads(q, r["a_buf"][0].sub(0, pk0, rows, pw), m0, pk0)
            q.signal(panel_sems[p])
            out.append((pk0, pw, panel_sems[p], count))
        return out

    # Buffers, and the weight chunks each slot takes first (no wait: the slots are fresh).
    for c, r in per_core.items():
        items = plan.items[c]
        r["c"] = c
        r["acc_done"] = kb.semaphore(f"c{c}.acc_done")
        r["panel_sems"] = [kb.semaphore(f"c{c}.panel{p}") for p in range(plan.load_queues)]
        r["panel0"] = []
        if x_static and plan.x_resident and not r["x_in_prologue"]:
            r["panel0"] = emit_panel(r, 0, r["panel_sems"], 1)  # what the first matmul needs first
        r["b_buf"] = [kb.sram_mx(c, f"b{s}", (kc, nb), weight_fmt, axis=0)
                      if w_mx and not plan.w_scales_resident
                      else kb.sram(c, f"b{s}", (kc, nb), weight_fmt) for s in range(plan.slots)]
        r["accs"] = [kb.acc(c, f"acc{i}", (mb, nb)) for i in range(plan.accs)]
        r["out"] = None if not y_out.in_hbm else kb.sram(c, "out", (mb, nb), "bf16")
        r["outs"] = [] if y_out.in_hbm else [kb.sram(c, f"y{t}", (rows, cols), "bf16", keep=True)
                                             for t, (_, rows, _, cols) in enumerate(items)]
        r["steps"] = [(t, ci, k0, kw) for t, it in enumerate(items)
                      for ci, (k0, kw) in enumerate(k_chunks(k, kc, tail=t == len(items) - 1))]
        nq = len(r["core"].dma)
        streams_on = len(r["steps"]) >= 2 * plan.slots
        if not y_out.in_hbm and plan.x_resident and plan.load_queues == nq >= 4 and streams_on:
            # A fused decode GEMV that streams well past its prefetch part (module docstring):
            # its prefetched chunks on queue 1, the rest on the last queue, x from the other
            # operators on the last two.
            r["chunk_queues"] = ([FUSED_PREFETCH_QUEUE], [nq - 1])
            r["x_queues"] = [nq - 2, nq - 1]
        for step, (t, _, k0, kw) in enumerate(r["steps"][:plan.slots]):
            emit_chunk_load(r, plan, step, plan.items[c][t], k0, kw, w_view, x, loads, with_x=not defer_x)
        r["fin"] = kb.semaphore(f"c{c}.fin")
        r["stored"] = kb.semaphore(f"c{c}.stored")

    outs = {"y": _gemm_output(y_out, plan, per_core, m, n)}
    yield outs

    if not x_static:
        emit_x_prologue()
    # The K loop's steady state becomes hardware loops where each chunk's x is resident or read
    # from a static HBM tensor: an x streamed from other operators is fetched with waits of
    # its own that differ from chunk to chunk.
    loops_ok = plan.x_resident or x_static
    for c, r in per_core.items():
        items, core = plan.items[c], r["core"]
        # Slot s loads on queue s % load_queues, so several queues keep chunks in flight.
        # The last queue stores the results (and streams too when the core has one block).
        st = core.dma[-1]
        mxu, vpu = core.mxu, core.vpu
        if "ws_sem" in r:
            mxu.wait(r["ws_sem"], 1)
        if "bias_sem" in r:
            vpu.wait(r["bias_sem"], 1)
        if r["local_x"] is not None and r["local_x"][1] is not None:
            mxu.wait(*r["local_x"][1])  # the row block in this core's scratchpad is ready
        a_buf, tmp, b_bufs, b_buf = r["a_buf"], r.get("tmp"), r.get("b_bufs"), r["b_buf"]
        accs, out = r["accs"], r["out"]
        loaded = r["loaded"]
        x_first = []  # deferred x chunks of the slots' first weight chunks
        if defer_x:
            for step0, (t0, _, k0, kw) in enumerate(r["steps"][:plan.slots]):
                s = step0 % plan.slots
                ld = core.dma[s % plan.load_queues]
                m0, rows = items[t0][0], items[t0][1]
                loads(ld, a_buf[s].sub(0, 0, rows, kw), m0, k0)
                x_first.append(kb.semaphore(f"c{c}.x_first{s}"))
                ld.signal(x_first[-1])
        freed = [kb.semaphore(f"c{c}.freed{s}") for s in range(plan.slots)]
        acc_done, acc_free = r["acc_done"], kb.semaphore(f"c{c}.acc_free")
        stored = r["stored"]
        step = 0
        panel_loads = 1 if r["panel0"] else 0
        for t, (m0, rows, n0, cols) in enumerate(items):
            acc = accs[t % plan.accs].sub(0, 0, rows, cols)
            # x panel pieces this item's matmuls must wait for: (k0, width, semaphore, value)
            pieces: list[tuple[int, int, Any, int]] = list(r["x_parts"]) + r["panel0"] if t == 0 else []
            if plan.x_resident and not r["x_in_prologue"] and (t == 0 or items[t - 1][0] != m0) \
                    and not (t == 0 and r["panel0"]):
                panel_loads += 1
                pieces += emit_panel(r, t, r["panel_sems"], panel_loads)
            chunks = k_chunks(k, kc, tail=t == len(items) - 1)

            def emit_chunk(ci: int, step: int, t: int = t, rows: int = rows, cols: int = cols,
                           acc: Any = acc, pieces: list = pieces, chunks: list = chunks, r: dict = r,
                           core: Any = core, mxu: Any = mxu, items: list = items, freed: list = freed,
                           loaded: list = loaded, x_first: list = x_first, acc_free: Any = acc_free,
                           a_buf: list = a_buf, b_buf: list = b_buf) -> None:
                """Weight chunk ``ci`` of item t (the core's ``step``-th): its slot's reload
                once the matrix unit is done with the slot, then the matmul."""
                k0, kw = chunks[ci]
                s, use = step % plan.slots, step // plan.slots
                if use:  # the matrix unit must be done with this slot's previous chunk
                    core.dma[_chunk_queue(r, plan, step)].wait(freed[s], use)
                    emit_chunk_load(r, plan, step, items[t], k0, kw, w_view, x, loads)
                b_t = b_buf[s].sub(0, 0, kw, cols)
                if plan.w_scales_resident:
                    b_t = MXTensor(b_t, r["w_scales"].sub(k0 // 32, 0, kw // 32, cols), axis=0)
                a_t = a_buf[0].sub(0, k0, rows, kw) if plan.x_resident else a_buf[s].sub(0, 0, rows, kw)
                for piece in [pc for pc in pieces if pc[0] < k0 + kw and k0 < pc[0] + pc[1]]:
                    mxu.wait(piece[2], piece[3])  # the x panel piece this chunk reads has landed
                    pieces.remove(piece)
                if ci == 0 and t >= plan.accs:  # this accumulator's previous block was read out
                    mxu.wait(acc_free, t - plan.accs + 1)
                mxu.wait(loaded[s], use + 1)
                if use == 0 and x_first:
                    mxu.wait(x_first[s], 1)
                mxu.matmul_mx(acc, a_t, b_t, mode="overwrite" if ci == 0 else "accumulate")
                mxu.signal(freed[s])

            ci = 0
            while ci < len(chunks):
                run = _steady_chunks(chunks, ci, step, plan, pieces, kc, loops_ok)
                if run:
                    # Whole rounds of the slots, each the same up to its K offset and its
                    # semaphore counts: one hardware loop per engine (``KernelBuilder.repeat``).
                    ci0, step0, per = ci, step, plan.slots
                    kb.repeat(run // per, lambda i, ci0=ci0, step0=step0, per=per, ec=emit_chunk: [
                        ec(ci0 + i * per + u, step0 + i * per + u) for u in range(per)])
                    ci, step = ci + run, step + run
                    continue
                emit_chunk(ci, step)
                ci += 1
                step += 1
            mxu.signal(acc_done)
            # Epilogue: accumulators -> BF16 in SRAM (plus bias in FP32) -> HBM (or kept).
            vpu.wait(acc_done, t + 1)
            if t and out is not None:  # the previous block's store has left ``out``
                vpu.wait(stored, t)
            o = out.sub(0, 0, rows, cols) if out is not None else r["outs"][t]
            if bias is not None:
                for r0 in range(0, rows, plan.slab):
                    nr = min(plan.slab, rows - r0)
                    vpu.acc_read(tmp.sub(0, 0, nr, cols), acc.sub(r0, 0, nr, cols))
                    vpu.add(o.sub(r0, 0, nr, cols), tmp.sub(0, 0, nr, cols), b_bufs[t].sub(0, 0, 1, cols))
            else:
                vpu.acc_read(o, acc)
            vpu.signal(acc_free)
            if out is not None:
                st.wait(acc_free, t + 1)
                st.store(y_out.ref.hbm_view(m0, n0, rows, cols), o)
                st.signal(stored)
            else:
                vpu.signal(r["fin"])
    return outs


def _steady_chunks(chunks: list[tuple[int, int]], ci: int, step: int, plan: GemmPlan,
                   pieces: list[tuple[int, int, Any, int]], kc: int, loops_ok: bool) -> int:
    """How many chunks from ``ci`` on (the core's ``step``-th) one K loop can take: whole rounds of
    ``plan.slots`` chunks (so that slots and queues repeat), at least ``LOOP_MIN_ROUNDS`` of them,
    each chunk full-width and ``kc`` after the previous one, reloading its slot (not one of the
    first ``slots`` chunks, which the prefetch loads), accumulating (not an item's first), with
    no x panel piece left to wait for. 0 when there is no such run."""
    if not loops_ok or ci == 0 or step < plan.slots:
        return 0
    k_first = chunks[ci][0]
    n = 0
    while ci + n < len(chunks) and chunks[ci + n] == (k_first + n * kc, kc):
        n += 1
    if n and any(pc[0] < k_first + n * kc and k_first < pc[0] + pc[1] for pc in pieces):
        return 0
    rounds = n // plan.slots
    return rounds * plan.slots if rounds >= LOOP_MIN_ROUNDS else 0


def _exchange_queues(core: Any, x: TensorRef, r0: int, c0: int, rows: int, cols: int,
                     spec: ChipSpec) -> list[Any]:
    """The queues of ``core`` that copy region [r0:r0+rows, c0:c0+cols] of the on-chip ``x``:
    the last queue, and one more (from the end) per ``max_outstanding_per_queue`` pieces beyond
    it. A queue keeps only that many copies in flight, so many pieces on one queue pay a DMA
    set-up per round; but a queue's signal also waits for whatever it carries before (the next
    operators' prefetches), so no more queues than the rounds need."""
    pieces = len(x.sources(r0, c0, rows, cols, near=core.dma[-1].engine.core))
    n = min(len(core.dma), max(1, -(-pieces // spec.dma.max_outstanding_per_queue)))
    return [core.dma[-1 - i] for i in range(n)]


def _chunk_queue(r: dict[str, Any], plan: GemmPlan, step: int) -> int:
    """The DMA queue of weight chunk ``step``: slot s's queue, s % load_queues; a fused decode
    GEMV's (``r["chunk_queues"]``) first chunks (its prefetch part) on its prefetch queues, the
    later ones on its rest queues. A slot's loads may change queue: the next load into a slot
    waits for the matmul that read the previous one, which waited for that load's signal."""
    s = step % plan.slots
    qs = r.get("chunk_queues")
    if qs is None:
        return s % plan.load_queues
    pre, rest = qs
    return pre[s % len(pre)] if step < plan.slots else rest[s % len(rest)]


def emit_chunk_load(r: dict[str, Any], plan: GemmPlan, step: int, item: tuple[int, int, int, int],
                    k0: int, kw: int, w_view: Any, x: TensorRef, loads: Any, *, with_x: bool = True) -> None:
    """Load weight chunk ``step`` (K rows k0..k0+kw of the item's columns) into its slot, with x's
    chunk when x is streamed (unless ``with_x`` is False: the caller loads it), and signal the
    slot's semaphore."""
    s = step % plan.slots
    core = r["core"]
    ld = core.dma[_chunk_queue(r, plan, step)]
    m0, rows, n0, cols = item
    b_t = r["b_buf"][s].sub(0, 0, kw, cols)
    w_src = w_view(k0, n0, kw, cols)
    if plan.w_scales_resident:
        ld.load(b_t, w_src.codes)
    elif hasattr(b_t, "scales"):
        ld.load(b_t.scales, w_src.scales)
        ld.load(b_t.codes, w_src.codes)
    else:
        ld.load(b_t, w_src)
    if not plan.x_resident and with_x:
        loads(ld, r["a_buf"][s].sub(0, 0, rows, kw), m0, k0)
    ld.signal(r["loaded"][s])


def _gemm_output(y_out: Out, plan: GemmPlan, per_core: dict[int, dict[str, Any]], m: int,
                 n: int) -> TensorRef:
    """The output's ref: blocks kept on their cores (ready when the vector unit has written
    them), or the HBM tensor with each block ready when its store has landed."""
    if y_out.in_hbm:
        ref = y_out.ref
        for c, r in per_core.items():
            for t, (m0, rows, n0, cols) in enumerate(plan.items[c]):
                ref = ref.with_ready(m0, n0, rows, cols, (r["stored"].id, t + 1))
        return ref
    pieces = [Piece(m0, n0, rows, cols, r["outs"][t], None, (r["fin"].id, t + 1))
              for c, r in per_core.items() for t, (m0, rows, n0, cols) in enumerate(plan.items[c])]
    return TensorRef.onchip("y", (m, n), "bf16", pieces)


def build_gemm(m: int, n: int, k: int, weight_fmt: str, act_fmt: str, bias: bool,
               spec: ChipSpec, *, name: str = "gemm",
               key_names: dict[str, str] | None = None) -> KernelBuild:
    """The gemm program and its check: HBM tensors ``x``, ``w``, ``bias`` (if any), output ``y``.

    Args:
        m, n, k: y[m, n] = x[m, k] @ w[k, n] (+ bias[1, n]).
        weight_fmt: "fp4", "fp8e4" or "bf16"; act_fmt: "bf16", "fp8e4" or "fp4" (pre-quantised).
        bias: add a BF16 bias row.
        spec: the chip.
        name: program name prefix; key_names: shape-key names for error messages (logits).
    """
    names = {"m": "m", "n": "n", "k": "k"} | (key_names or {})
    check_gemm_shape(m, n, k, weight_fmt, act_fmt, names)
    plan = plan_gemm(m, n, k, weight_fmt, act_fmt, bias, spec)
    kb = KernelBuilder(f"{name}_{m}x{n}x{k}_{weight_fmt}w_{act_fmt}a", chip=spec)
    x_mx, w_mx = act_fmt != "bf16", weight_fmt != "bf16"
    x_h = kb.hbm_mx("x", (m, k), act_fmt, axis=1) if x_mx else kb.hbm("x", (m, k), "bf16")
    w_h = kb.hbm_mx("w", (k, n), weight_fmt, axis=0) if w_mx else kb.hbm("w", (k, n), "bf16")
    b_h = kb.hbm("bias", (1, n), "bf16") if bias else None
    y_h = kb.hbm("y", (m, n), "bf16")
    run_emitter(emit_gemm(EmitCtx.standalone(kb), TensorRef.hbm("x", x_h), TensorRef.hbm("w", w_h),
                          TensorRef.hbm("bias", b_h) if bias else None,
                          y_out=Out.to(TensorRef.hbm("y", y_h)), plan=plan, key_names=key_names))

    def make_inputs(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        w = (rng.standard_normal((k, n)) * 0.05).astype(ml_dtypes.bfloat16)
        out: dict[str, Any] = {
            "x": mx.quantize(x, DTYPES[act_fmt].mx_fmt, axis=1) if x_mx else x,
            "w": mx.quantize(w, DTYPES[weight_fmt].mx_fmt, axis=0) if w_mx else w,
        }
        if bias:
            out["bias"] = rng.standard_normal((1, n)).astype(ml_dtypes.bfloat16)
        return out

    def reference(inputs):
        return {"y": gemm_reference(inputs["x"], inputs["w"], inputs.get("bias"))}

    exact = x_mx and w_mx
    tol = Tolerance(0.0, 0.0, "bit-exact: K chunks accumulate in order, so the matrix unit's FP32 "
                    "accumulators equal mx.matmul" if exact else
                    "bit-exact: the reference sums each 32-block in order in FP32 as the matrix "
                    "unit does (products of BF16 and MX values are exact in FP32)")
    return KernelBuild(
        program=kb.build(), make_inputs=make_inputs, reference=reference,
        outputs={"y": ("bf16", (m, n))}, tolerance=tol,
        notes={"block": [plan.mb, plan.nb], "k_chunk": plan.kc, "slots": plan.slots,
               "accumulators": plan.accs, "cores": sum(1 for i in plan.items if i),
               "blocks": sum(len(i) for i in plan.items), "output": "bf16", "x_relay": plan.x_relay,
               "activations": "pre-quantised" if x_mx else "bf16"},
    )


def _build_gemm_kernel(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    return build_gemm(shape["m"], shape["n"], shape["k"], shape["weight_fmt"], shape["act_fmt"],
                      shape["bias"], spec)


def gemm_tensors(m: int, n: int, k: int, weight_fmt: str, act_fmt: str, bias: bool) -> tuple[TensorSpec, ...]:
    """The gemm HBM tensors: x (MX along K unless bf16), w (MX along K unless bf16), bias, y."""
    specs = [TensorSpec("x", (m, k), act_fmt, "input", 1 if act_fmt != "bf16" else None),
             TensorSpec("w", (k, n), weight_fmt, "weight", 0 if weight_fmt != "bf16" else None)]
    if bias:
        specs.append(TensorSpec("bias", (1, n), "bf16", "weight"))
    return (*specs, TensorSpec("y", (m, n), "bf16", "output"))


def _emit_gemm_kernel(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                      outs: dict[str, Out]) -> Emitter:
    return emit_gemm(ctx, t["x"], t["w"], t.get("bias"), y_out=outs.get("y"))


def _emit_logits_kernel(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                        outs: dict[str, Out]) -> Emitter:
    return emit_gemm(ctx, t["x"], t["w"], None, y_out=outs.get("y"),
                     key_names={"m": "tokens", "n": "vocab", "k": "hidden"})


GEMM = register(KernelDef(
    name="gemm",
    doc="y[m, n] (bf16) = x[m, k] @ W[k, n] + bias: MXFP4/MXFP8/BF16 weights blocked along K, "
        "BF16 or pre-quantised MX activations; output blocks over all cores, multi-buffered "
        "weight stream.",
    shape_keys=(
        ShapeKey("m", int, 16, "rows of x (tokens; 1..64 is the decode GEMV)", minimum=1),
        ShapeKey("n", int, 256, "output features (columns of W)", minimum=1),
        ShapeKey("k", int, 512, "contraction length, a multiple of 32", minimum=1),
        ShapeKey("weight_fmt", str, "fp4", "W in HBM: MXFP4, MXFP8 (E4M3) or BF16",
                 choices=WEIGHT_FMTS),
        ShapeKey("act_fmt", str, "fp8e4", "x: BF16, or MX blocked along K (pre-quantised); the "
                 "MXFP4 rate needs fp4 here and in weight_fmt", choices=ACT_FMTS),
        ShapeKey("bias", bool, True, "add a BF16 bias row"),
    ),
    build=_build_gemm_kernel,
    emit=_emit_gemm_kernel,
    tensors_of=lambda shape, spec: gemm_tensors(shape["m"], shape["n"], shape["k"], shape["weight_fmt"],
                                                shape["act_fmt"], shape["bias"]),
))


# --- logits ---------------------------------------------------------------------------------
def _build_logits(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    return build_gemm(shape["tokens"], shape["vocab"], shape["hidden"], shape["weight_fmt"],
                      shape["act_fmt"], False, spec, name="logits",
                      key_names={"m": "tokens", "n": "vocab", "k": "hidden"})


LOGITS = register(KernelDef(
    name="logits",
    doc="logits[tokens, vocab] (bf16) = h[tokens, hidden] @ W_unembed[hidden, vocab]: the gemm "
        "builder without bias (tensors x, w, y).",
    shape_keys=(
        ShapeKey("tokens", int, 4, "rows (1 per sequence in decode)", minimum=1),
        ShapeKey("hidden", int, 256, "hidden size (gpt-oss-120b: 2880), a multiple of 32", minimum=1),
        ShapeKey("vocab", int, 1000, "vocabulary (gpt-oss: 201088)", minimum=1),
        ShapeKey("weight_fmt", str, "bf16", "unembedding in HBM (gpt-oss ships it in BF16)",
                 choices=WEIGHT_FMTS),
        ShapeKey("act_fmt", str, "bf16", "hidden states: BF16 or pre-quantised MX", choices=ACT_FMTS),
    ),
    build=_build_logits,
    emit=_emit_logits_kernel,
    tensors_of=lambda shape, spec: gemm_tensors(shape["tokens"], shape["vocab"], shape["hidden"],
                                                shape["weight_fmt"], shape["act_fmt"], False),
))
