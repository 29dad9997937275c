"""The moe kernel for many tokens (prefill): tokens gathered per expert, outputs gathered back.

Stage: kernels (``moe`` family). ``moe`` builds this program when ``grouping`` resolves to
``gather`` (``auto``: above 128 tokens, or when the dense program's [T, H] FP32 partial does not
fit a core's accumulators). Dense per-slot items (``moe.py``) compute every token for every
expert slot, which at T = 2048 does E/k = 32x (gpt-oss, DeepSeek) the useful work; here each
expert computes only the rows of the tokens that chose it, so FLOPs and HBM traffic scale with
T*k, not T*E.

Phases (one program; semaphores order them across cores):

1. x quantised once (``act_fmt``), row ranges spread over the cores, into an HBM scratch ``xq``.
2. Router: items (token block b of tb <= 128 rows, column panel r of <= 128 experts): x_b @
   Wr[:, panel] on the matrix unit (BF16, FP32 logits). The block's routing core pulls its panels
   and routes the block exactly as the dense kernel routes its tokens (``moe_routing``), giving
   each token's k (expert, weight) pairs.
3. Token lists, per block: ``vec.group`` of the pairs (pad rows hold every expert id with weight
   0) gives the dense weights W^T [E, tb]; ``vec.topk`` k=C of each row gives expert e's
   *sub-list* for block b: the (local) ids and weights of the C tokens of b with the largest
   weights for e (ties: lower token), zero-weight ids filling the rest. C, the capacity per
   (expert, block), is ceil(tb * k / E * capacity_factor), at most tb. The sub-lists go to HBM
   tables [E, nb * C] (ids, weights). **Overflow is an error, never a silent drop**: a second
   ``vec.topk`` k=C+1 reads each row's (C+1)-th weight; ``vec.topk`` k=1 of [0, that weight] is 1
   where it is positive, and ``vec.group`` of those flags (plus a 0) into a single row raises in
   the functional pass when any flag is 1 ("more distinct values than the 1 rows of dst").
4. Experts: items (routed expert e, a run of its blocks) and (shared expert s, a run of token
   rows, an intermediate range); every expert is an item, so weights are loaded by the expert's
   static index (the packed table's split layout, ``moe_pack``), and items are dealt to cores
   longest first. A routed item gathers x rows by its sub-lists' ids (``dma.gather`` from block
   b's rows of ``xq``, codes and scales), computes gate|up slice by slice, the activation times
   each row's weight (0 for padding rows), quantised into an activation tile A [R, I]; then the
   down projection per H block of ``hb`` columns, one matmul with K = I, plus the down-bias
   matmul (as in the dense program); the FP32 rows go to an HBM table O laid out per block: rows
   [k zero rows | expert 0's C rows | expert 1's C rows | ...]. Shared items store [rows, H]
   FP32 partial outputs per intermediate range.
5. Combine, per block b: ``vec.group`` of the sub-lists' ids (weights: the sub-lists' weights;
   pad rows: every token id) gives P [tb, k + E*C], token t's weight at the O row of each (e, p)
   that holds it; ``vec.topk`` k=k of P gives, per token, the O rows to add (the ISA has no
   integer arithmetic: a row index e*C + p is only ever a column position of a top-k). A token
   with fewer than k positive weights picks the k zero rows (the lowest columns). Items (block,
   H range) gather those k rows (``dma.gather``, each DMA queue a share of the rows: a gather
   pays one set-up round per 16 rows), add them in FP32 in top-k order (decreasing weight, ties
   to the lower row), then the shared partials, and round y once to BF16.

The ISA has no scatter and no integer arithmetic, which is why outputs are gathered back rather
than scattered, and why the lists are per (expert, 128-token block): the inverse map above is a
[tb, E*C] matrix per block, which fits a core only for blocks of ~128 tokens. The cost is the
capacity's slack per block: at DeepSeek-R1 / gpt-oss-120b shapes a block expects tb*k/E = 4
tokens per expert, so C = 8 at capacity_factor 2 and each expert computes T/16 rows where T*k/E
would do (still E/k/2 = 16x less than dense items), and O holds 2x the rows it needs.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import MXTensor
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import Space
from jalapeno_emu.lazy import LazyModule

from .base import TensorSpec
from .emit import EmitCtx, Emitter, Out, Piece, Ready, TensorRef, fetch
from .moe_base import (
    BIAS_PARTS,
    Counter,
    MoeLayout,
    Spec,
    aligned,
    emit_activation,
    expert_rows_reference,
    inorder_jit,
    layout_bytes,
    load_mx,
    mx_rows,
    mx_specs,
    quant_reference,
    slices_of,
    view,
    weight_specs,
)
from .moe_pack import router_logical, split_layout, unpack_expert_biases, unpack_experts
from .moe_routing import (
    emit_gating,
    emit_route_constants,
    fill_constant,
    fill_ids,
    flat_rows,
    route_reference,
    routing_buffers,
    routing_dims,
)
from .planning import Budget, DoesNotFit, core_hbm_bytes_per_s, memoised_planner, mxu_cycles_per_step

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

__all__ = ["GatherItem", "GatherPlan", "emit_gather", "gather_reference", "gather_tensors", "plan_gather"]

_BLOCK = 128  # tokens per routing / list / combine block (the matrix unit's row tile)
_ROUTER_PANEL = 512  # router K panel rows at most (x and Wr panels double-buffered)
_DOWN_BUFFERS = (6, 4, 3, 2)  # down weight buffers the planner tries, most first (the first that fits)


@dataclass(frozen=True)
class GatherItem:
    """One expert work item.

    Attributes:
        shared: a shared expert (dense rows) rather than a routed one (gathered rows).
        expert: routed expert id or shared index.
        blocks: routed: the token blocks whose sub-lists it computes (C rows each), in order.
        row0, rows: shared: token rows row0..row0+rows; routed: 0 and len(blocks) * C.
        slices: the intermediate slices it computes (an I range).
        out: shared: index of its partial-output table; routed: -1.
        bias: it adds the expert's down bias (routed: always with expert_bias; shared: the
            range holding slice 0).
    """

    shared: bool
    expert: int
    blocks: tuple[int, ...]
    row0: int
    rows: int
    slices: tuple[int, ...]
    out: int
    bias: bool


@dataclass(frozen=True, kw_only=True)
class GatherPlan(MoeLayout):
    """The gather program's layout (``MoeLayout``'s fields with d = e, the down projection in the
    split layout of ``moe_pack``: chunk_off/chunk_sizes locate the slices' gate|up segments,
    down_blocks/down_off its H blocks; plus):

    Attributes:
        tb: tokens per block; cap: capacity C per (expert, block).
        items: expert items; item_core: the core of each.
        cores: cores used.
        hb: down-projection H block; hc: combine H block.
        n_partials: shared partial-output tables (shared experts x intermediate ranges).
        nbuf: gate|up weight buffers per core.
        nwd: down-projection weight buffers per core: each H block's load waits for the matmul
            ``nwd`` blocks back, so ``nwd - 1`` loads (a DMA set-up and the HBM latency each) are
            in flight ahead of the matrix unit. nwd also counts the FP32 output row buffers, whose
            stores to the output tables are as many in flight behind the vector unit.
        quant_rows: x rows each core quantises; quant_step: rows per quantisation step.
        rk: router K panel rows.
        ng: combine buffers (terms in flight per combine item).
    """

    tb: int
    cap: int
    items: tuple[GatherItem, ...]
    item_core: tuple[int, ...]
    cores: int
    hb: int
    hc: int
    n_partials: int
    nbuf: int
    quant_rows: int
    quant_step: int
    rk: int
    ng: int
    nwd: int = 2

    @property
    def nb(self) -> int:
        """Token blocks."""
        return self.t // self.tb

    @property
    def o_rows(self) -> int:
        """Rows of one block's routed output table: k zero rows, then C per expert."""
        return self.k + self.e * self.cap

    def core_items(self, c: int) -> list[int]:
        """Indices of the items core ``c`` runs, in order."""
        return [n for n, cc in enumerate(self.item_core) if cc == c]

    def router_items(self) -> list[tuple[int, int]]:
        """(block, panel) of every router item; item n runs on core n % cores."""
        return [(b, r) for b in range(self.nb) for r in range(self.router_parts)]

    def routing_core(self, b: int) -> int:
        """The core that routes block b (the one that computed its first panel)."""
        return (b * self.router_parts) % self.cores

    def combine_items(self) -> list[tuple[int, int, int]]:
        """(block, first column, width) of every combine item; item n runs on core n % cores."""
        return [(b, h0, min(self.hc, self.h - h0))
                for b in range(self.nb) for h0 in range(0, self.h, self.hc)]


# --- plan -------------------------------------------------------------------------------------
def _capacity(tb: int, e: int, k: int, factor: float) -> int:
    return max(1, min(tb, math.ceil(tb * k / e * factor - 1e-9)))


def _items(t: int, e: int, s: int, nb: int, cap: int, slices: tuple[tuple[int, int], ...],
           bias: bool, shared_rows: int, ranges: list[tuple[int, ...]], max_rows: int) -> list[GatherItem]:
    per_item = max(1, max_rows // cap) if e else 0  # blocks per routed item
    all_slices = tuple(range(len(slices)))
    out = []
    for ex in range(e):
        for b0 in range(0, nb, per_item):
            blocks = tuple(range(b0, min(nb, b0 + per_item)))
            out.append(GatherItem(False, ex, blocks, 0, len(blocks) * cap, all_slices, -1, bias))
    for sh in range(s):
        for q, rng in enumerate(ranges):
            for r0 in range(0, t, shared_rows):
                out.append(GatherItem(True, sh, (), r0, min(shared_rows, t - r0), rng, sh * len(ranges) + q,
                                      bias and q == 0))
    return out


def _item_cost(it: GatherItem, h: int, slices, down_blocks, spec: ChipSpec, act_fmt: str,
               cores: int) -> float:
    """Estimated seconds of one item on one core, all cores busy: max(its bytes over a core's share
    of HBM, its matrix-unit steps: 128 x 128 x 32 tiles, partial tiles priced whole)."""
    mx_ = spec.matrix
    w_cols = sum(slices[j][1] for j in it.slices)
    item_bytes = 51 * h * w_cols // 32 + it.rows * h * (4 + 1)  # weights, x rows in, FP32 rows out
    mt = -(-it.rows // mx_.tile_m)
    gu = sum(-(-2 * slices[j][1] // mx_.tile_n) for j in it.slices) * -(-h // mx_.tile_k)
    down = sum(-(-hw // mx_.tile_n) for _, hw in down_blocks) * -(-w_cols // mx_.tile_k)
    mxu_s = mt * (gu + down) * mxu_cycles_per_step(spec, act_fmt, "fp4") / spec.core.clock_hz
    return max(item_bytes / core_hbm_bytes_per_s(spec, cores), mxu_s)


def _item_costs(p: GatherPlan, spec: ChipSpec, act_fmt: str) -> list[float]:
    """``_item_cost`` of each of ``p.items``, each kind priced once: items repeat (every expert's
    token blocks have the same rows and slices), and a sweep plans thousands of candidates."""
    kinds: dict[tuple[int, int], float] = {}  # (rows, id of the slice tuple): items share them
    out = []
    for it in p.items:
        cost = kinds.get((it.rows, id(it.slices)))
        if cost is None:
            cost = kinds[it.rows, id(it.slices)] = _item_cost(it, p.h, p.slices, p.down_blocks, spec, act_fmt,
                                                          p.cores)
        out.append(cost)
    return out


def _estimate(p: GatherPlan, spec: ChipSpec, act_fmt: str) -> float:
    """Estimated seconds: the busiest core's items or HBM overall, whichever is longer, then the
    combine; penalised beyond ~150k instructions (build and check time)."""
    core_s = _lpt(_item_costs(p, spec, act_fmt), p.cores)[1]
    widths: dict[int, int] = {}  # by id of the slice tuple, as _item_costs
    weights = 0
    for it in p.items:
        w = widths.get(id(it.slices))
        if w is None:
            w = widths[id(it.slices)] = sum(p.slices[j][1] for j in it.slices)
        weights += 51 * p.h * w // 32
    out_rows = p.nb * p.o_rows if p.e else 0
    combine_bytes = 4 * p.h * (p.t * p.k * (1 if p.e else 0) + p.n_partials * p.t) + 2 * p.t * p.h
    hbm_bytes = weights + 4 * p.h * (out_rows + p.n_partials * p.t) + combine_bytes
    bw = spec.derived()["hbm_achievable_bytes_per_s"]
    est = max(core_s, hbm_bytes / bw) + combine_bytes / bw
    n_hb = len(p.down_blocks)
    instr = sum(14 * len(it.slices) + n_hb * (8 + len(it.blocks)) + 2 * len(it.blocks) for it in p.items)
    return est * (1 + max(0, instr - 150_000) / 150_000)


def _block_sizes(t: int) -> list[int]:
    """Token block sizes to try, largest first: T itself up to 128, else the divisors of T in
    [32, 128] (a smaller block has smaller routing tiles, and more capacity slack)."""
    if t <= _BLOCK:
        return [t]
    sizes = [tb for tb in range(_BLOCK, 31, -1) if t % tb == 0]
    if not sizes:
        raise InvalidArgumentError(f"shape key tokens={t}: grouping=gather cuts the tokens into equal blocks "
                                   "of 32..128; pad the batch to a multiple of 32 (e.g. 128)")
    return sizes


@memoised_planner
def plan_gather(shape: dict[str, Any], spec: ChipSpec, budget: Budget) -> GatherPlan:
    """The gather layout for a checked ``shape`` within ``budget``: per token block size (largest
    first), the fitting split with the lowest estimate (``_estimate``); x's quantisation steps,
    the router's K panels and the combine's columns are sized to what the scratchpad leaves.

    Raises:
        InvalidArgumentError: distinct_experts set, or no block size divides the tokens.
        DoesNotFit: no split of the expert work fits (naming the key and the bytes).
    """
    t, h, i, e, k = (shape[n] for n in ("tokens", "hidden", "intermediate", "experts", "top_k"))
    s, act_fmt, bias = shape["shared_experts"], shape["act_fmt"], shape["expert_bias"]
    if shape["distinct_experts"]:
        raise InvalidArgumentError(f"shape key distinct_experts={shape['distinct_experts']} applies to "
                                   "grouping=dense (the gather program runs every expert's tokens)")
    if shape["capacity_factor"] <= 0:
        raise InvalidArgumentError(f"shape key capacity_factor={shape['capacity_factor']} must be positive")
    sram_cap, acc_cap = budget.sram_bytes, budget.acc_bytes
    r_parts = -(-e // 128) if e else 0
    while r_parts and e % r_parts:
        r_parts += 1
    ew = e // r_parts if e else 0
    why = "no split fits"
    for tb in _block_sizes(t):
        nb = t // tb
        rd = routing_dims(tb, e, k, shape) if e else None
        cap = _capacity(tb, e, k, shape["capacity_factor"]) if e else 0
        best: tuple[float, int, GatherPlan] | None = None
        made: dict[tuple[int, int, int, int], list[GatherItem]] = {}
        n = 0
        for w, hb, shared_rows, i_range, fallbacks in _candidates(shape):
            slices = slices_of(i, w)
            ranges = _ranges(len(slices), w, i_range)
            for nbuf, max_rows in fallbacks:  # the first that fits is the best of these
                n += 1
                key = (w, shared_rows, i_range, max_rows)  # the items do not depend on hb
                items = made.get(key)
                if items is None:
                    items = made[key] = _items(t, e, s, nb, cap, slices, bias, shared_rows, ranges, max_rows)
                p = _make_plan(shape, budget, tb, cap, slices, bias, r_parts, ew, rd, items, hb,
                               (k if e else 0) + s * len(ranges), s * len(ranges), nbuf)
                if p is None:
                    why = f"tokens per block={tb}: x, the router panels or the routing do not fit"
                    break
                r_max, i_max = _r_i_max(p)
                need, acc = _sram_bytes(p, shape, r_max, i_max), _acc_bytes(p, r_max)
                if need > sram_cap or acc > acc_cap:
                    why = f"{max(need, sram_cap):,} B of scratchpad, {acc:,} B of accumulators"
                    continue
                est = _estimate(p, spec, act_fmt)
                if best is None or est < best[0]:
                    best = (est, n, p)
                break
        if best is not None:
            p = best[2]
            r_max, i_max = _r_i_max(p)
            # A dense FFN: as many down buffers as the scratchpad holds (DeepSeek-R1's at 256
            # tokens on jalapeno-v1: 207.8 us with 2, 175.2 with 3, 133.4 with 6). Routed experts
            # keep 2: their down loads share queue 0 with the next items' gate|up segments, and
            # more of them in flight was mixed at 256 tokens (gpt-oss-120b 175.8 -> 172.4 with 3,
            # 184.2 with 6; DeepSeek-R1 549.4 -> 585.0 with 4; Kimi K2.5 816.7 -> 773.9 with 4).
            for nwd in _DOWN_BUFFERS if not e else ():
                q = GatherPlan(**{**p.__dict__, "nwd": nwd})
                if _sram_bytes(q, shape, r_max, i_max) <= sram_cap:
                    p = q
                    break
            return GatherPlan(**{**p.__dict__, "item_core": tuple(_assign(p, spec, act_fmt))})
    raise DoesNotFit(
        f"shape key hidden={h} (tokens={t}, grouping=gather): no split of the expert work fits the "
        f"{sram_cap:,} B of scratchpad and {acc_cap:,} B of accumulators {spec.name} plans with ({why})")


def _ranges(n_slices: int, w: int, i_range: int) -> list[tuple[int, ...]]:
    per = max(1, i_range // w)
    return [tuple(range(j, min(n_slices, j + per))) for j in range(0, n_slices, per)]


def _combine_split(h: int, tb: int, nb: int, terms: int, cores: int, room: int) -> tuple[int, int]:
    """(columns per combine item, buffers): up to 4 terms in flight; narrow enough that every core
    gets an item when there are few blocks, wide enough to fit ``room`` bytes (multiples of 128)."""
    ng = min(terms, 4)
    fit = room // (4 * tb * (ng + 1) + 2 * tb + 1) // 128 * 128
    spread = h // -(-cores // nb) // 128 * 128
    return min(h, max(128, min(fit, max(128, spread)))), ng


def _candidates(shape: dict[str, Any]):
    """(slice width, down H block, shared rows per item, shared I range, [(gate|up buffers, routed
    rows per item at most), best first]) to try. Rows per item and H blocks trade SRAM and
    accumulators for fewer weight re-reads and instructions; the small ones exist for small chips."""
    h, i = shape["hidden"], shape["intermediate"]
    w_key = shape["slice"]
    widths = [w_key] if w_key else sorted({min(w, i) for w in (64, 128, 256, 512)})
    blocks = sorted({min(hb, h) for hb in (64, 256, 512, 1024, 2048)})
    shared = [(rows, min(rng, i)) for rows in (32, 128, 256, 512) for rng in (512, 1152, 2304, 4608)] if \
        shape["shared_experts"] else [(128, i)]
    fallbacks = [(nbuf, rows) for rows in ((256, 128, 64) if shape["experts"] else (256,)) for nbuf in (3, 2)]
    for w in widths:
        for hb in blocks:
            for rows, rng in sorted(set(shared)):
                yield w, hb, rows, rng, fallbacks


def _make_plan(shape, budget: Budget, tb, cap, slices, bias, r_parts, ew, rd, items, hb, terms, n_partials,
               nbuf) -> GatherPlan | None:
    """The plan with the combine columns, x's quantisation step and the router's K panel sized to
    the scratchpad the plain tiles leave; None when x's rows or the routing do not fit at all."""
    t, h, i, e, k = (shape[n] for n in ("tokens", "hidden", "intermediate", "experts", "top_k"))
    down_blocks = tuple((h0, min(hb, h - h0)) for h0 in range(0, h, hb))
    gu_off, gu_sizes, down_off, expert_bytes = split_layout(h, i, tuple(slices), down_blocks, bias)
    cores = budget.cores
    quant_rows = -(-t // cores)
    p = GatherPlan(t=t, h=h, i=i, e=e, k=k, s=shape["shared_experts"], d=e, slices=tuple(slices),
                   chunk_off=tuple(gu_off), chunk_sizes=tuple(gu_sizes), expert_bytes=expert_bytes,
                   expert_bias=bias, router_parts=r_parts, router_cols=ew, rd=rd, down_blocks=down_blocks,
                   down_off=tuple(down_off), tb=tb, cap=cap, items=tuple(items), item_core=(0,) * len(items),
                   cores=cores, hb=hb, hc=128, n_partials=n_partials, nbuf=nbuf, quant_rows=quant_rows,
                   quant_step=quant_rows, rk=min(h, _ROUTER_PANEL), ng=min(terms, 4))
    room = budget.sram_bytes - layout_bytes(_plain_specs(p)) - 64 * 8
    hc, ng = _combine_split(h, tb, t // tb, terms, cores, room)
    fmt = shape["act_fmt"]
    step = quant_rows
    while step > 1 and layout_bytes(_quant_specs(p.t, h, step, fmt)) > room:
        step = -(-step // 2)
    if layout_bytes(_quant_specs(p.t, h, step, fmt)) > room:
        return None
    rk = min(h, _ROUTER_PANEL)
    while True:
        q = GatherPlan(**{**p.__dict__, "hc": hc, "ng": ng, "quant_step": step, "rk": rk})
        if layout_bytes(_route_specs(q, shape)) <= room:
            return q
        if rk <= 32:
            return None
        rk = max(32, rk // 2 // 32 * 32)


def _lpt(costs: list[float], cores: int) -> tuple[list[int], float]:
    """Longest item first onto the least-loaded core (ties: lower core): (core of each, makespan)."""
    heap = [(0.0, c) for c in range(cores)]
    out = [0] * len(costs)
    for n in sorted(range(len(costs)), key=lambda n: (-costs[n], n)):
        load, c = heapq.heappop(heap)
        out[n] = c
        heapq.heappush(heap, (load + costs[n], c))
    return out, max(load for load, _ in heap)


def _assign(p: GatherPlan, spec: ChipSpec, act_fmt: str) -> list[int]:
    """The items' cores (``_lpt`` of their estimated times)."""
    return _lpt(_item_costs(p, spec, act_fmt), p.cores)[0]


# --- per-core buffers -------------------------------------------------------------------------
def _quant_specs(t: int, h: int, step: int, fmt: str) -> list[Spec]:
    """Phase 1 (x quantised, ``step`` rows at a time): dead once the core's rows are stored."""
    return [("xin", "bf16", (min(t, step), h)), *mx_specs("xqt", fmt, min(t, step), h)]


def _route_specs(p: GatherPlan, shape: dict[str, Any]) -> list[Spec]:
    """Phases 2-3 (router in K panels, routing, lists): dead once every list is stored."""
    h, tb, e, k = p.h, p.tb, p.e, p.k
    if not e:
        return []
    rd = p.rd
    n_router = -(-len(p.router_items()) // p.cores)
    out: list[Spec] = [(f"xr{b}", "bf16", (tb, p.rk)) for b in range(2)]
    out += [(f"wr{b}", "bf16", (p.rk, p.router_cols)) for b in range(2)]
    out += [(f"lp{n}", "f32", (tb, p.router_cols)) for n in range(n_router)]
    out += [spec for spec in routing_buffers(rd, 0) if spec[0] not in ("idx", "gw", "slot_ids", "slot_w")]
    rows_w = tb + rd.pad_e
    cols_p = p.o_rows + tb
    out += [("gones", "f32", (1, max(e, tb, 2))), ("gscr", "f32", (1, max(e, tb, 2)))]
    out += [("wsrc", "i32", (rows_w, k)), ("ww", "f32", (rows_w, k)), ("wids", "i32", (e, 1)),
            ("wt", "f32", (e, rows_w)), ("pts", "i32", (cols_p, 1)), ("ptw", "f32", (cols_p, 1)),
            ("ptd", "i32", (tb, 1)), ("pt", "f32", (tb, cols_p)), ("cv", "f32", (tb, k)),
            ("zrow", "f32", (k, h))]
    if p.cap < tb:
        out += [("probe_v", "f32", (e, p.cap + 1)), ("probe_i", "i32", (e, p.cap + 1)), ("fz", "f32", (e, 2)),
                ("fv", "f32", (e, 1)), ("fsrc", "i32", (e + 1, 1)), ("fzero", "f32", (e + 1, 1)),
                ("fdst", "i32", (1, 1)), ("fdw", "f32", (1, e + 1))]
    return out


def _expert_specs(p: GatherPlan, shape: dict[str, Any], r_max: int, i_max: int) -> list[Spec]:
    """Phase 4 (expert items)."""
    h, smax, fmt = p.h, p.slice_max, shape["act_fmt"]
    gu_max = max(p.chunk_sizes)
    wd_bytes = i_max * p.hb // 2 + (i_max // 32) * p.hb
    out: list[Spec] = []
    for par in range(2):
        out += mx_specs(f"X{par}", fmt, r_max, h) + mx_specs(f"A{par}", fmt, r_max, i_max)
        out += [(f"lid{par}", "i32", (1, r_max)), (f"lw{par}", "f32", (1, r_max))]
    out += [(f"wd{b}", "u8", (1, wd_bytes)) for b in range(p.nwd)]
    out += [(f"ot{b}", "f32", (r_max, p.hb)) for b in range(p.nwd)]
    out += [(f"wgu{b}", "u8", (1, gu_max)) for b in range(p.nbuf)]
    out += [("gu", "f32", (r_max, 2 * smax)), ("tmp", "f32", (r_max, smax))]
    if shape["activation"] == "swiglu_oai":
        out.append(("ones", "f32", (1, smax)))
    if p.expert_bias:
        out += [("b2", "bf16", (1, h)), ("wall", "bf16", (r_max, 32)), ("bres", "f32", (r_max, 1)),
                ("onecol", "f32", (r_max, 1)), ("b2all0", "bf16", (32, p.hb)), ("b2all1", "bf16", (32, p.hb))]
    return out


def _combine_specs(p: GatherPlan) -> list[Spec]:
    """Phase 5 (combine)."""
    tb, hc = p.tb, p.hc
    return [*((f"g{n}", "f32", (tb, hc)) for n in range(p.ng)), ("ysum", "f32", (tb, hc)),
            ("ybuf", "bf16", (tb, hc)), ("crl", "i32", (tb, max(p.k, 1)))]


def _layouts(p: GatherPlan, shape: dict[str, Any], r_max: int, i_max: int) -> list[list[Spec]]:
    return [_quant_specs(p.t, p.h, p.quant_step, shape["act_fmt"]), _route_specs(p, shape),
            _expert_specs(p, shape, r_max, i_max), _combine_specs(p)]


def _plain_specs(p: GatherPlan) -> list[Spec]:
    """Tiles live across phases: a slice of x that constants are clamped from (the ISA has no
    immediate fill), and each routed block's combine rows (read by the combine items)."""
    out: list[Spec] = [("csrc", "bf16", (min(p.t, 32), min(p.h, 512)))]
    if p.e:
        per_core: dict[int, int] = {}  # blocks each core routes
        for c in map(p.routing_core, range(p.nb)):
            per_core[c] = per_core.get(c, 0) + 1
        n_route = max(per_core.values(), default=0)
        out += [(f"cr{n}", "i32", (p.tb, p.k)) for n in range(max(1, n_route))]
    return out


def _sram_bytes(p: GatherPlan, shape: dict[str, Any], r_max: int, i_max: int) -> int:
    union = max(layout_bytes(lay) for lay in _layouts(p, shape, r_max, i_max))
    return union + layout_bytes(_plain_specs(p)) + 64 * 8


def _acc_bytes(p: GatherPlan, r_max: int) -> int:
    return 4 * (2 * r_max * 2 * p.slice_max + 2 * r_max * p.hb + p.tb * p.router_cols)


def _r_i_max(p: GatherPlan) -> tuple[int, int]:
    """The most rows and the widest I range of any item (items share their slice tuples)."""
    widths = {id(it.slices): it.slices for it in p.items}
    return (max(it.rows for it in p.items),
            max(sum(p.slices[j][1] for j in sl) for sl in widths.values()))


def _alloc(kb: Any, c: int, p: GatherPlan, shape: dict[str, Any], keep_y: bool) -> dict[str, Any]:
    """Core c's tiles: one region for the four phase layouts (each dead before the next starts:
    the semaphores that order the phases order the reuse; the checker verifies it), plus the
    combine rows of the blocks it routes; ``keep_y``: each combine item's y block in a buffer of
    its own (an output kept on chip outlives the region)."""
    r_max, i_max = _r_i_max(p)
    layouts = _layouts(p, shape, r_max, i_max)
    region = kb.sram(c, "phases", (1, max(layout_bytes(lay) for lay in layouts)), "u8")
    B: dict[str, Any] = {}
    for lay in layouts:
        off = 0
        for name, dt, sh in lay:
            B[name] = view(region, off, dt, *sh)
            off += aligned(dt, sh)
    for name, dt, sh in _plain_specs(p):
        B[name] = kb.sram(c, name, sh, dt)
    for name in [n[:-2] for n in list(B) if n.endswith(".c")]:
        B[name] = MXTensor(B.pop(f"{name}.c"), B.pop(f"{name}.s"), 1)
    if p.e:  # the routing's per-token ids and weights are the token rows of the lists' vec.group
        B["idx"], B["gw"] = B["wsrc"].sub(0, 0, p.tb, p.k), B["ww"].sub(0, 0, p.tb, p.k)
    if keep_y:
        for ci, (_, _, hw) in enumerate(p.combine_items()[c::p.cores]):
            B[f"y{ci}"] = kb.sram(c, f"y{ci}", (p.tb, hw), "bf16", keep=True)
    B["acc_gu"] = [kb.acc(c, f"acc_gu{b}", (r_max, 2 * p.slice_max)) for b in range(2)]
    B["acc_o"] = [kb.acc(c, f"acc_o{b}", (r_max, p.hb)) for b in range(2)]
    if p.e:
        B["acc_r"] = kb.acc(c, "acc_r", (p.tb, p.router_cols))
    return B


# --- the program ------------------------------------------------------------------------------
def gather_tensors(p: GatherPlan, shape: dict[str, Any]) -> tuple[TensorSpec, ...]:
    """The gather program's HBM tensors, in the order its stand-alone program allocates them: x, y,
    the scratch xq, the router panels and biases, the packed tables, the scratch token lists and
    output row tables."""
    t, h, e, fmt = p.t, p.h, p.e, shape["act_fmt"]
    out = [TensorSpec("x", (t, h), "bf16", "input"), TensorSpec("y", (t, h), "bf16", "output"),
           TensorSpec("xq", (t, h), fmt, "scratch", None if fmt == "bf16" else 1)]
    out += weight_specs(p)
    if e:
        out += [TensorSpec("list_ids", (e, p.nb * p.cap), "i32", "scratch"),
                TensorSpec("list_weights", (e, p.nb * p.cap), "f32", "scratch"),
                TensorSpec("routed_out", (p.nb * p.o_rows, h), "f32", "scratch")]
    if p.n_partials:
        out.append(TensorSpec("shared_out", (p.n_partials * t, h), "f32", "scratch"))
    return tuple(out)


@dataclass(frozen=True)
class _Hbm:
    x: TensorRef
    xq: MXTensor | Tile
    router: Tile | None
    router_bias: Tile | None
    score_bias: Tile | None
    experts: Tile | None
    shared: Tile | None
    lid: Tile | None
    lw: Tile | None
    o_blk: Tile | None
    o_sh: Tile | None


def _hbm(shape: dict[str, Any], t: dict[str, TensorRef]) -> _Hbm:
    def tile(name: str) -> Any:
        ref = t.get(name)
        if ref is None:
            return None
        return MXTensor(ref.base, ref.base_scales, ref.mx_axis) if ref.is_mx else ref.base

    x = t["x"]
    # bf16 activations: the items gather x's rows in place when it is an HBM input ready at the
    # start, else from a copy in the scratch xq.
    xq = x.base if shape["act_fmt"] == "bf16" and x.in_hbm and not x.waits() else tile("xq")
    return _Hbm(x=x, xq=xq, router=tile("router"), router_bias=tile("router_bias"),
                score_bias=tile("score_bias"), experts=tile("experts"), shared=tile("shared"),
                lid=tile("list_ids"), lw=tile("list_weights"), o_blk=tile("routed_out"),
                o_sh=tile("shared_out"))


_QUEUE_SEMS = tuple(f"g_loaded{q}" for q in range(8))
_CORE_SEMS = (*_QUEUE_SEMS, "qin", "qdone", "qstored", "rload", "rmm", "rread", "pulled", "lists_vpu",
              "lists_stored", "lidl", "x_ready", "gu_loaded", "gu_done", "gu_read", "acts_done", "wd_loaded",
              "down_done", "ot_read", "ot_stored", "b2_loaded", "b2_used", "b2all_ready", "crl_ready", "gsum",
              "y_ready", "y_stored", "consts", "csrc")


class _Emitter:
    """Emits the five phases onto every core (module docstring)."""

    def __init__(self, ctx: EmitCtx, p: GatherPlan, shape: dict[str, Any], tensors: dict[str, TensorRef],
                 outs: dict[str, Out]) -> None:
        kb = self.kb = ctx.kb
        self.p, self.shape = p, shape
        self.y_out = outs.get("y") or Out.onchip()
        self.hbm = _hbm(shape, tensors)
        self.nq = ctx.spec.dma.queues_per_core
        self.waited: dict[Any, set[Ready]] = {}
        self.g = Counter(kb, "all", ("xq_ready", "lists_ready", "experts_done"))
        self.logits_sem = [kb.semaphore(f"logits{b}") for b in range(p.nb)] if p.e else []
        self.quant_cores = [c for c in range(p.cores) if c * p.quant_rows < p.t] \
            if self.hbm.xq is not self.hbm.x.base else []
        self.B = {c: _alloc(kb, c, p, shape, not self.y_out.in_hbm) for c in range(p.cores)}
        self.S = {c: Counter(kb, f"c{c}", _CORE_SEMS) for c in range(p.cores)}
        # where each router item's logits panel lives: (core, buffer index on that core)
        self.panel_at: dict[tuple[int, int], tuple[int, int]] = {}
        per_core: dict[int, int] = {}
        for n, (b, r) in enumerate(p.router_items()):
            c = n % p.cores
            self.panel_at[(b, r)] = (c, per_core.get(c, 0))
            per_core[c] = per_core.get(c, 0) + 1
        self.cr_at: dict[int, tuple[int, int]] = {}
        per_core = {}
        for b in range(p.nb if p.e else 0):
            c = p.routing_core(b)
            self.cr_at[b] = (c, per_core.get(c, 0))
            per_core[c] = per_core.get(c, 0) + 1

    def q(self, c: int, i: int) -> Any:
        return self.kb.core(c).dma[i % self.nq]

    def outputs(self) -> dict[str, TensorRef]:
        """y: each combine item's block ready when stored (HBM) or written (kept on chip)."""
        p = self.p
        pieces, ref = [], self.y_out.ref
        for c in range(p.cores):
            for ci, (b, h0, hw) in enumerate(p.combine_items()[c::p.cores]):
                if self.y_out.in_hbm:
                    ref = ref.with_ready(b * p.tb, h0, p.tb, hw, (self.S[c].sem["y_stored"].id, ci + 1))
                else:
                    pieces.append(Piece(b * p.tb, h0, p.tb, hw, self.B[c][f"y{ci}"], None,
                                        (self.S[c].sem["y_ready"].id, ci + 1)))
        return {"y": ref if self.y_out.in_hbm else TensorRef.onchip("y", (p.t, p.h), "bf16", pieces)}

    def emit(self) -> None:
        p = self.p
        for c in range(p.cores):
            q1 = self.q(c, 1)
            fetch(q1, self.B[c]["csrc"], self.hbm.x, 0, 0, waited=self.waited)
            self.S[c].signal(q1, "csrc")
            self.kb.core(c).vpu.wait(self.S[c].sem["csrc"], 1)
            steps = self.quantise(c)
            if steps:  # the phase-1 tiles are reused by the router and the routing
                for eng in (q1, self.kb.core(c).vpu):
                    eng.wait(self.S[c].sem["qstored"], steps)
            if self.p.e:
                self.router(c)
                self.routing(c)
            self.experts(c)
            self.combine(c)

    # --- phase 1: x quantised once ------------------------------------------------------------
    def quantise(self, c: int) -> int:
        """Core c's rows of x, ``quant_step`` at a time, quantised (bf16: copied) into xq; returns
        the steps."""
        if c not in self.quant_cores:
            return 0
        p, B, S, v = self.p, self.B[c], self.S[c], self.kb.core(c).vpu
        bf16 = self.shape["act_fmt"] == "bf16"
        q1, q2 = self.q(c, 1), self.q(c, 2)
        lo, hi = c * p.quant_rows, min(p.t, (c + 1) * p.quant_rows)
        steps = 0
        for n, r0 in enumerate(range(lo, hi, p.quant_step)):
            rows = min(p.quant_step, hi - r0)
            xin, xqt = B["xin"].sub(0, 0, rows, p.h), mx_rows(B["xqt"], 0, rows)
            if n:  # the previous step's rows are stored (bf16: their store has read xin)
                q1.wait(S.sem["qstored"], n)
            fetch(q1, xin, self.hbm.x, r0, 0, waited=self.waited)
            S.signal(q1, "qin")
            dst = mx_rows(self.hbm.xq, r0, rows)
            if bf16:
                q2.wait(S.sem["qin"], n + 1)
                q2.store(dst, xin)
            else:
                v.wait(S.sem["qin"], n + 1)
                if n:  # the previous step's store has read xqt
                    v.wait(S.sem["qstored"], n)
                v.quantize(xqt.codes, xqt.scales, xin)
                S.signal(v, "qdone")
                q2.wait(S.sem["qdone"], n + 1)
                q2.store(dst.codes, xqt.codes)
                q2.store(dst.scales, xqt.scales)
            S.signal(q2, "qstored")
            steps += 1
        self.g.signal(q2, "xq_ready")
        return steps

    # --- phase 2: router panels ---------------------------------------------------------------
    def router(self, c: int) -> None:
        """Core c's router items (block, column panel): x_b @ Wr[:, panel] in K panels of ``rk``
        rows (double-buffered; FP32 sums in K order, as one pass), the logits into an ``lp``."""
        p, B, S, core = self.p, self.B[c], self.S[c], self.kb.core(c)
        mine = [(n, b, r) for n, (b, r) in enumerate(p.router_items()) if n % p.cores == c]
        q1, m, v = self.q(c, 1), core.mxu, core.vpu
        panels = [(k0, min(p.rk, p.h - k0)) for k0 in range(0, p.h, p.rk)]
        step = 0
        for k_, (_, b, r) in enumerate(mine):
            for kk, (k0, kw) in enumerate(panels):
                buf = step % 2
                if step >= 2:  # the matmul of step - 2 has read these buffers
                    q1.wait(S.sem["rmm"], step - 1)
                xr, wr = B[f"xr{buf}"].sub(0, 0, p.tb, kw), B[f"wr{buf}"].sub(0, 0, kw, p.router_cols)
                fetch(q1, xr, self.hbm.x, b * p.tb, k0, waited=self.waited)
                q1.load(wr, self.hbm.router.sub(r * p.h + k0, 0, kw, p.router_cols))
                S.signal(q1, "rload")
                m.wait(S.sem["rload"], step + 1)
                if kk == 0 and k_:  # the vector unit has read the accumulators
                    m.wait(S.sem["rread"], k_)
                m.matmul(B["acc_r"], xr, wr, mode="overwrite" if kk == 0 else "accumulate")
                S.signal(m, "rmm")
                step += 1
            v.wait(S.sem["rmm"], step)
            v.acc_read(B[f"lp{self.panel_at[(b, r)][1]}"], B["acc_r"])
            S.signal(v, "rread")
            v.signal(self.logits_sem[b])

    # --- phase 3: routing and token lists -------------------------------------------------------
    def routing(self, c: int) -> None:
        p, B, S, core = self.p, self.B[c], self.S[c], self.kb.core(c)
        blocks = [b for b in range(p.nb) if p.routing_core(b) == c]
        if not blocks:
            return
        v, q1, q2 = core.vpu, self.q(c, 1), self.q(c, 2)
        tb, e, k, cap = p.tb, p.e, p.k, p.cap
        rd = p.rd
        if self.hbm.router_bias is not None:
            q1.load(B["bias"], self.hbm.router_bias)
        if self.hbm.score_bias is not None:
            q1.load(B["score_bias"], self.hbm.score_bias)
        S.signal(q1, "consts")
        v.wait(S.sem["consts"], 1)
        self.routing_constants(c)
        views = self.list_views(B)
        for n, b in enumerate(blocks):
            q1.wait(self.logits_sem[b], p.router_parts)
            if n:  # the vector unit is done with the previous block's logits
                q1.wait(S.sem["lists_vpu"], n)
            for r in range(p.router_parts):
                pc, pi = self.panel_at[(b, r)]
                q1.copy(B["logits"].sub(0, r * p.router_cols, tb, p.router_cols), self.B[pc][f"lp{pi}"])
            S.signal(q1, "pulled")
            v.wait(S.sem["pulled"], n + 1)
            if n:  # the previous block's lists are stored
                v.wait(S.sem["lists_stored"], n)
            emit_gating(v, B, rd, self.shape["routed_scaling_factor"])
            v.group(B["wids"], B["wt"], B["wsrc"], B["ww"])
            dense = B["wt"].sub(0, 0, e, tb)  # W^T [E, tb]: token weights per expert
            v.topk(views["vals"], views["lid"], dense)  # the sub-lists: C best tokens per expert
            if cap < tb:
                self.overflow_check(v, B, dense)
            v.group(B["ptd"], B["pt"], B["pts"], B["ptw"])  # P [tb, k + E*C (+ pad)]
            v.topk(B["cv"], B[f"cr{self.cr_at[b][1]}"], B["pt"].sub(0, 0, tb, p.o_rows))
            S.signal(v, "lists_vpu")
            q2.wait(S.sem["lists_vpu"], n + 1)
            q2.store(self.hbm.lid.sub(0, b * cap, e, cap), views["lid"])
            q2.store(self.hbm.lw.sub(0, b * cap, e, cap), views["vals"])
            q2.store(self.hbm.o_blk.sub(b * p.o_rows, 0, k, p.h), B["zrow"])
            S.signal(q2, "lists_stored")
            self.g.signal(q2, "lists_ready")

    def list_views(self, B: dict[str, Any]) -> dict[str, Tile]:
        """The sub-lists [E, C], written where the combine's vec.group reads them: rows k..k+E*C
        of its [k + E*C + tb, 1] id and weight columns."""
        p = self.p
        pts, ptw = B["pts"], B["ptw"]
        return {"lid": view(pts, p.k * 4, "i32", p.e, p.cap), "vals": view(ptw, p.k * 4, "f32", p.e, p.cap)}

    def routing_constants(self, c: int) -> None:
        """Made once per routing core (no immediates): the pad rows of every vec.group (each id
        with weight 0), the combine's k reserved rows (weight 0), the flags' zeros."""
        p, B = self.p, self.B[c]
        v, src = self.kb.core(c).vpu, B["csrc"]
        tb, e, k = p.tb, p.e, p.k
        emit_route_constants(v, B, p.rd, src)
        ones, scratch = B["gones"], B["gscr"]
        fill_constant(v, ones, 1.0, src)
        fill_ids(v, flat_rows(B["wsrc"], tb, p.rd.pad_e), e, ones, scratch)
        fill_constant(v, flat_rows(B["ww"], tb, p.rd.pad_e), 0.0, src)
        pts, ptw = B["pts"], B["ptw"]
        fill_ids(v, flat_rows(pts, 0, k), tb, ones, scratch)  # reserved rows: any token, weight 0
        fill_constant(v, flat_rows(ptw, 0, k), 0.0, src)
        fill_ids(v, flat_rows(pts, p.o_rows, tb), tb, ones, scratch)  # pad rows: every token, weight 0
        fill_constant(v, flat_rows(ptw, p.o_rows, tb), 0.0, src)
        fill_constant(v, B["zrow"], 0.0, src)
        if p.cap < tb:
            fill_constant(v, B["fz"], 0.0, src)
            fill_constant(v, B["fzero"], 0.0, src)
            fill_ids(v, flat_rows(B["fsrc"], e, 1), 1, ones, scratch)  # the extra 0 flag

    def overflow_check(self, v: Any, B: dict[str, Any], dense: Tile) -> None:
        """Raise in the functional pass when some expert's (C+1)-th best weight in the block is
        positive: more than C tokens of the block chose it (capacity_factor too small)."""
        p = self.p
        v.topk(B["probe_v"], B["probe_i"], dense)
        v.copy(B["fz"].sub(0, 1, p.e, 1), B["probe_v"].sub(0, p.cap, p.e, 1))
        v.topk(B["fv"], B["fsrc"].sub(0, 0, p.e, 1), B["fz"])  # 1 where that weight > 0, else 0
        # capacity overflow: a flag of 1 beside the extra 0 is a second distinct value, which a
        # one-row vec.group refuses ("more distinct values than the 1 rows of dst")
        v.group(B["fdst"], B["fdw"], B["fsrc"], B["fzero"])

    # --- phase 4: experts ------------------------------------------------------------------------
    def _gate(self, engines: list[Any], done: bool = False) -> None:
        """Make engines wait until every earlier phase is over on every core (the phase tiles of
        this core are reused), or with ``done`` until every expert item is."""
        p, waits = self.p, []
        if done:
            waits.append(("experts_done", len(p.items)))
        else:
            if p.e:
                waits.append(("lists_ready", p.nb))
            if self.quant_cores:
                waits.append(("xq_ready", len(self.quant_cores)))
        for eng in engines:
            for name, count in waits:
                eng.wait(self.g.sem[name], count)

    def experts(self, c: int) -> None:
        p, B, core = self.p, self.B[c], self.kb.core(c)
        mine = [p.items[n] for n in p.core_items(c)]
        if not mine:
            return
        v, m = core.vpu, core.mxu
        q0, q1, q2 = self.q(c, 0), self.q(c, 1), self.q(c, 2)
        self._gate([q0, q1, q2, v, m])
        if self.shape["activation"] == "swiglu_oai":
            fill_constant(v, B["ones"], 1.0, B["csrc"])
        if p.expert_bias:
            for name in ("wall", "b2all0", "b2all1"):
                fill_constant(v, B[name], 0.0, B["csrc"])
            fill_constant(v, B["onecol"], 1.0, B["csrc"])
        hblocks = list(p.down_blocks)
        ctr = {"gi": 0, "mi": 0, "bias_items": 0, "bias_blocks": 0}
        for n, it in enumerate(mine):
            self._item_x(c, n, it, q1)
            self._item_weights(c, it, q0, ctr)
        ctr = {"gi": 0, "mi": 0, "bias_items": 0, "bias_blocks": 0}
        for n, it in enumerate(mine):
            self._item_matmuls(c, n, it, hblocks, m, ctr)
        ctr = {"gi": 0, "mi": 0, "bias_items": 0, "bias_blocks": 0}
        for n, it in enumerate(mine):
            self._item_vector(c, n, it, hblocks, v, ctr)
            self._item_stores(c, it, hblocks, q2, ctr)

    def _item_x(self, c: int, n: int, it: GatherItem, q1: Any) -> None:
        """Queue 1: the item's x rows, gathered by its sub-lists' ids (routed) or loaded (shared)."""
        p, B, S = self.p, self.B[c], self.S[c]
        par, rows = n % 2, it.rows
        X = B[f"X{par}"]
        if n >= 2:  # item n-2's activations are done: its x rows, ids and weights are free
            q1.wait(S.sem["acts_done"], n - 1)
        if it.shared:
            load_mx(q1, mx_rows(X, 0, rows), mx_rows(self.hbm.xq, it.row0, rows))
        else:
            col0 = it.blocks[0] * p.cap
            q1.load(B[f"lid{par}"].sub(0, 0, 1, rows), self.hbm.lid.sub(it.expert, col0, 1, rows))
            q1.load(B[f"lw{par}"].sub(0, 0, 1, rows), self.hbm.lw.sub(it.expert, col0, 1, rows))
            q1.wait(S.sem["lidl"], S.signal(q1, "lidl"))  # the gathers read the ids just loaded
            ids = view(B[f"lid{par}"], 0, "i32", rows, 1)
            for i, b in enumerate(it.blocks):
                src = mx_rows(self.hbm.xq, b * p.tb, p.tb)
                dst = mx_rows(X, i * p.cap, p.cap)
                idx = ids.sub(i * p.cap, 0, p.cap, 1)
                if isinstance(dst, MXTensor):
                    q1.gather(dst.codes, src.codes, idx)
                    q1.gather(dst.scales, src.scales, idx)
                else:
                    q1.gather(dst, src, idx)
        S.signal(q1, "x_ready")

    def _ebase(self, it: GatherItem) -> int:
        table = self.hbm.shared if it.shared else self.hbm.experts
        return table.offset + it.expert * self.p.expert_bytes

    def _gu_view(self, buf: Tile, w: int) -> tuple[MXTensor, Tile | None]:
        h = self.p.h
        gu = MXTensor(view(buf, 0, "fp4", h, 2 * w), view(buf, h * w, "e8m0", h // 32, 2 * w), 0)
        gub = view(buf, h * w + (h // 32) * 2 * w, "bf16", 1, 2 * w) if self.p.expert_bias else None
        return gu, gub

    def _wd_view(self, buf: Tile, i_rows: int, hw: int) -> MXTensor:
        scales = view(buf, i_rows * hw // 2, "e8m0", i_rows // 32, hw)
        return MXTensor(view(buf, 0, "fp4", i_rows, hw), scales, 0)

    def _item_weights(self, c: int, it: GatherItem, q0: Any, ctr: dict[str, int]) -> None:
        """Queue 0: each slice's gate|up segment (with its bias), the down bias, then the down
        projection's H blocks (the item's rows of each, codes and scales)."""
        p, B, S, h = self.p, self.B[c], self.S[c], self.p.h
        base = self._ebase(it)
        for j in it.slices:
            gi = ctr["gi"]
            buf = B[f"wgu{gi % p.nbuf}"]
            if gi >= p.nbuf:  # its previous gate|up matmul is done
                q0.wait(S.sem["gu_done"], gi - p.nbuf + 1)
            if gi >= 2:  # two loads in flight
                q0.wait(S.sem["gu_loaded"], gi - 1)
            size = p.chunk_sizes[j]
            q0.load(view(buf, 0, "u8", 1, size), Tile(Space.HBM, 0, base + p.chunk_off[j], "u8", 1, size))
            S.signal(q0, "gu_loaded")
            ctr["gi"] += 1
        if it.bias:
            if ctr["bias_items"]:  # the previous bias item has copied its down bias out
                q0.wait(S.sem["b2_used"], ctr["bias_items"])
            q0.load(B["b2"], Tile(Space.HBM, 0, base + p.expert_bytes - 2 * h, "bf16", 1, h))
            S.signal(q0, "b2_loaded")
            ctr["bias_items"] += 1
        i0 = p.slices[it.slices[0]][0]
        i_rows = sum(p.slices[j][1] for j in it.slices)
        for (_, hw), off in zip(p.down_blocks, p.down_off, strict=True):
            mi = ctr["mi"]
            if mi >= p.nwd:  # the down matmul that read this buffer is done
                q0.wait(S.sem["down_done"], mi - p.nwd + 1)
            wd = self._wd_view(B[f"wd{mi % p.nwd}"], i_rows, hw)
            q0.load(wd.codes, Tile(Space.HBM, 0, base + off + i0 * hw // 2, "fp4", i_rows, hw))
            q0.load(wd.scales, Tile(Space.HBM, 0, base + off + p.i * hw // 2 + (i0 // 32) * hw, "e8m0",
                                    i_rows // 32, hw))
            S.signal(q0, "wd_loaded")
            ctr["mi"] += 1

    def _item_matmuls(self, c: int, n: int, it: GatherItem, hblocks: list[tuple[int, int]], m: Any,
                      ctr: dict[str, int]) -> None:
        """Matrix unit: gate|up slice by slice, then each H block of the down projection (+ the
        down-bias matmul)."""
        p, B, S = self.p, self.B[c], self.S[c]
        par, rows = n % 2, it.rows
        X, A = mx_rows(B[f"X{par}"], 0, rows), B[f"A{par}"]
        m.wait(S.sem["x_ready"], n + 1)
        for j in it.slices:
            w, gi = p.slices[j][1], ctr["gi"]
            m.wait(S.sem["gu_loaded"], gi + 1)
            if gi >= 2:  # the vector unit has read this accumulator's previous slice
                m.wait(S.sem["gu_read"], gi - 1)
            gu, _ = self._gu_view(B[f"wgu{gi % p.nbuf}"], w)
            m.matmul_mx(B["acc_gu"][gi % 2].sub(0, 0, rows, 2 * w), X, gu, mode="overwrite")
            S.signal(m, "gu_done")
            ctr["gi"] += 1
        i_rows = sum(p.slices[j][1] for j in it.slices)
        a = A.sub(0, 0, rows, i_rows)
        m.wait(S.sem["acts_done"], n + 1)
        for _, hw in hblocks:
            mi = ctr["mi"]
            m.wait(S.sem["wd_loaded"], mi + 1)
            if mi >= 2:  # the vector unit has read this accumulator's previous block
                m.wait(S.sem["ot_read"], mi - 1)
            acc = B["acc_o"][mi % 2].sub(0, 0, rows, hw)
            m.matmul_mx(acc, a, self._wd_view(B[f"wd{mi % p.nwd}"], i_rows, hw), mode="overwrite")
            if it.bias:
                ctr["bias_blocks"] += 1
                m.wait(S.sem["b2all_ready"], ctr["bias_blocks"])
                m.matmul(acc, B["wall"].sub(0, 0, rows, 32), B[f"b2all{mi % 2}"].sub(0, 0, 32, hw),
                         mode="accumulate")
            S.signal(m, "down_done")
            ctr["mi"] += 1

    def _item_vector(self, c: int, n: int, it: GatherItem, hblocks: list[tuple[int, int]], v: Any,
                     ctr: dict[str, int]) -> None:
        """Vector unit: each slice's activation (+ gate/up bias, x the row's gate weight) quantised
        into A; the down bias terms; each H block's FP32 rows out of the accumulator."""
        p, B, S, shape = self.p, self.B[c], self.S[c], self.shape
        par, rows, nh = n % 2, it.rows, len(hblocks)
        gu, tmp, A = B["gu"], B["tmp"], B[f"A{par}"]
        weight = None if it.shared else view(B[f"lw{par}"], 0, "f32", rows, 1)
        loc = 0
        for j in it.slices:
            w, gi = p.slices[j][1], ctr["gi"]
            g_t, u_t, a_t = gu.sub(0, 0, rows, w), gu.sub(0, w, rows, w), tmp.sub(0, 0, rows, w)
            v.wait(S.sem["gu_done"], gi + 1)
            v.acc_read(gu.sub(0, 0, rows, 2 * w), B["acc_gu"][gi % 2].sub(0, 0, rows, 2 * w))
            S.signal(v, "gu_read")
            if p.expert_bias:
                _, gub = self._gu_view(B[f"wgu{gi % p.nbuf}"], w)
                v.add(gu.sub(0, 0, rows, 2 * w), gu.sub(0, 0, rows, 2 * w), gub)
            emit_activation(v, B.get("ones"), g_t, u_t, a_t, shape["activation"])
            if weight is not None:
                v.mul(a_t, a_t, weight)
            if loc == 0 and n >= 2:  # item n-2's down matmuls have read A
                v.wait(S.sem["down_done"], (n - 1) * nh)
            if isinstance(A, MXTensor):
                dst = A.sub(0, loc, rows, w)
                v.quantize(dst.codes, dst.scales, a_t)
            else:
                v.copy(A.sub(0, loc, rows, w), a_t)
            loc += w
            ctr["gi"] += 1
        if it.bias:  # the down-bias matmul's left operand: the weights' BF16 parts
            v.wait(S.sem["b2_loaded"], ctr["bias_items"] + 1)
            if n:  # every earlier down-bias matmul has read wall
                v.wait(S.sem["down_done"], n * nh)
            src = weight if weight is not None else B["onecol"].sub(0, 0, rows, 1)
            res = B["bres"].sub(0, 0, rows, 1)
            for part in range(BIAS_PARTS):  # hi, mid, lo BF16 parts: exact for an FP32 weight
                col = B["wall"].sub(0, part, rows, 1)
                v.copy(col, src)
                if part < BIAS_PARTS - 1:
                    v.sub(res, src, col)
                    src = res
        S.signal(v, "acts_done")  # A is complete, and the item's x rows, ids and weights are free
        for h0, hw in hblocks:
            mi = ctr["mi"]
            if it.bias:
                b2all = B[f"b2all{mi % 2}"]
                for part in range(BIAS_PARTS):
                    v.copy(b2all.sub(part, 0, 1, hw), B["b2"].sub(0, h0, 1, hw))
                S.signal(v, "b2all_ready")
            v.wait(S.sem["down_done"], mi + 1)
            if mi >= p.nwd:  # the rows that used this buffer last are stored
                v.wait(S.sem["ot_stored"], mi - p.nwd + 1)
            v.acc_read(B[f"ot{mi % p.nwd}"].sub(0, 0, rows, hw), B["acc_o"][mi % 2].sub(0, 0, rows, hw))
            S.signal(v, "ot_read")
            ctr["mi"] += 1
        if it.bias:
            S.signal(v, "b2_used")
            ctr["bias_items"] += 1

    def _item_stores(self, c: int, it: GatherItem, hblocks: list[tuple[int, int]], q2: Any,
                     ctr: dict[str, int]) -> None:
        """Queue 2: each H block's rows into the output tables."""
        p, B, S = self.p, self.B[c], self.S[c]
        mi0 = ctr["mi"] - len(hblocks)
        for hi, (h0, hw) in enumerate(hblocks):
            mi = mi0 + hi
            ot = B[f"ot{mi % p.nwd}"]
            q2.wait(S.sem["ot_read"], mi + 1)
            if it.shared:
                dst = self.hbm.o_sh.sub(it.out * p.t + it.row0, h0, it.rows, hw)
                q2.store(dst, ot.sub(0, 0, it.rows, hw))
            else:
                for i, b in enumerate(it.blocks):
                    row = b * p.o_rows + p.k + it.expert * p.cap
                    q2.store(self.hbm.o_blk.sub(row, h0, p.cap, hw), ot.sub(i * p.cap, 0, p.cap, hw))
            S.signal(q2, "ot_stored")
        self.g.signal(q2, "experts_done")

    # --- phase 5: combine ----------------------------------------------------------------------
    def combine(self, c: int) -> None:
        """Per item (block, H range): the k routed rows of each token gathered by the rows top-k
        picked (every DMA queue takes a share of the rows), then the shared partials, added in
        FP32 in that order and rounded to BF16 once."""
        p, B, S, core = self.p, self.B[c], self.S[c], self.kb.core(c)
        mine = [it for n, it in enumerate(p.combine_items()) if n % p.cores == c]
        if not mine:
            return
        v, q2 = core.vpu, self.q(c, 2)
        queues = [self.q(c, qi) for qi in range(self.nq)]
        parts = [(r0, min(r0 + -(-p.tb // self.nq), p.tb) - r0) for r0 in range(0, p.tb, -(-p.tb // self.nq))]
        self._gate([*queues, v], done=True)
        routed = p.k if p.e else 0
        terms = routed + p.n_partials
        ti = 0
        for ci, (b, h0, hw) in enumerate(mine):
            if p.e:
                copier = queues[-1]
                if ci:  # every queue's gathers of the previous item, which read crl, have landed
                    for qi in range(len(parts)):
                        copier.wait(S.sem[f"g_loaded{qi}"], ti)
                rc, ri = self.cr_at[b]
                copier.copy(B["crl"], self.B[rc][f"cr{ri}"])
                n_copy = S.signal(copier, "crl_ready")
                for qi in range(len(parts)):
                    queues[qi].wait(S.sem["crl_ready"], n_copy)
            first_ti = ti
            for term in range(terms):
                g = B[f"g{ti % p.ng}"]
                for qi, (r0, nr) in enumerate(parts):
                    q = queues[qi]
                    if ti >= p.ng:  # the vector unit has added the term that used this buffer
                        q.wait(S.sem["gsum"], ti - p.ng + 1)
                    if term < routed:
                        base = self.hbm.o_blk.offset + (b * p.o_rows * p.h + h0) * 4
                        table = Tile(Space.HBM, 0, base, "f32", p.o_rows, hw, p.h * 4)
                        idx = view(B["crl"], (r0 * p.k + term) * 4, "i32", nr, 1, p.k * 4)
                        q.gather(g.sub(r0, 0, nr, hw), table, idx)
                    else:
                        src = self.hbm.o_sh.sub((term - routed) * p.t + b * p.tb + r0, h0, nr, hw)
                        q.load(g.sub(r0, 0, nr, hw), src)
                    S.signal(q, f"g_loaded{qi}")
                ti += 1
            keep = not self.y_out.in_hbm
            ysum = B["ysum"].sub(0, 0, p.tb, hw)
            ybuf = B[f"y{ci}"] if keep else B["ybuf"].sub(0, 0, p.tb, hw)
            if ci and not keep:  # the previous y block is stored
                v.wait(S.sem["y_stored"], ci)
            for term in range(terms):
                t_i = first_ti + term
                g = B[f"g{t_i % p.ng}"].sub(0, 0, p.tb, hw)
                for qi in range(len(parts)):
                    v.wait(S.sem[f"g_loaded{qi}"], t_i + 1)
                last = term == terms - 1
                if term == 0:
                    v.copy(ybuf if last else ysum, g)
                else:  # FP32 sums in order; the last one rounded to BF16 once
                    v.add(ybuf if last else ysum, ysum, g)
                S.signal(v, "gsum")
            S.signal(v, "y_ready")
            if not keep:
                q2.wait(S.sem["y_ready"], ci + 1)
                q2.store(self.y_out.ref.hbm_view(b * p.tb, h0, p.tb, hw), ybuf)
                S.signal(q2, "y_stored")


# --- reference ------------------------------------------------------------------------------------
def _rows(xq: Any, rows: np.ndarray) -> Any:
    if isinstance(xq, mx.MXArray):
        return mx.MXArray(codes=np.asarray(xq.codes)[rows], scales=np.asarray(xq.scales)[rows], fmt=xq.fmt,
                          axis=1, block_size=32)
    return xq[rows]


def _block_lists(p: GatherPlan, shape: dict[str, Any], inputs: dict[str, Any], x: jax.Array):
    """Per block: the sub-lists (ids [E, C], weights [E, C]); raises on a capacity overflow."""
    wr = jnp.asarray(router_logical(np.asarray(inputs["router"]), p), jnp.float32)
    logits = inorder_jit(x, wr)
    lids, lws = [], []
    for b in range(p.nb):
        block = logits[b * p.tb:(b + 1) * p.tb]
        ids, w = route_reference(block, inputs, p.rd, shape["routed_scaling_factor"])
        dense = _dense_weights(ids, w, p.e)
        vals, lid = jax.lax.top_k(jnp.asarray(dense), p.cap)
        if p.cap < p.tb:
            over = np.asarray(jax.lax.top_k(jnp.asarray(dense), p.cap + 1)[0])[:, p.cap]
            if (over > 0).any():
                ex = int(np.argmax(over > 0))
                raise InvalidArgumentError(
                    f"more than capacity={p.cap} tokens of block {b} chose expert {ex} (shape key "
                    f"capacity_factor={shape['capacity_factor']}: raise it)")
        lids.append(np.asarray(lid))
        lws.append(np.asarray(vals, np.float32))
    return lids, lws


def _dense_weights(ids: np.ndarray, w: np.ndarray, e: int) -> np.ndarray:
    """vec.group's [E, T] weights with every expert present: w[t, j] at (ids[t, j], t)."""
    out = np.zeros((e, ids.shape[0]), np.float32)
    for j in range(ids.shape[1]):
        out[ids[:, j], np.arange(ids.shape[0])] += w[:, j]
    return out


def gather_reference(inputs: dict[str, Any], p: GatherPlan, shape: dict[str, Any]) -> dict[str, np.ndarray]:
    """Pure-JAX MoE with the gather program's numerics and orders; {"y": bf16 [T, H]}."""
    x = jnp.asarray(np.asarray(inputs["x"]).astype(np.float32))
    xq = quant_reference(x, shape["act_fmt"])
    terms: list[list[jax.Array]] = [[] for _ in range(p.nb)]
    if p.e:
        lids, lws = _block_lists(p, shape, inputs, x)
        routed = unpack_experts(inputs["experts"], p)
        routed_b = unpack_expert_biases(inputs["experts"], p) if p.expert_bias else [None] * p.e
        o_blk = np.zeros((p.nb, p.o_rows, p.h), np.float32)
        all_slices = tuple(range(len(p.slices)))
        for ex in range(p.e):
            rows = np.concatenate([b * p.tb + lids[b][ex] for b in range(p.nb)])
            gate_w = np.concatenate([lws[b][ex] for b in range(p.nb)])
            out = np.asarray(expert_rows_reference(p, shape, _rows(xq, rows), routed[ex], routed_b[ex],
                                                   gate_w,
                                          all_slices, p.expert_bias))
            for b in range(p.nb):
                o_blk[b, p.k + ex * p.cap:p.k + (ex + 1) * p.cap] = out[b * p.cap:(b + 1) * p.cap]
        for b in range(p.nb):
            pt = np.zeros((p.tb, p.o_rows), np.float32)
            for ex in range(p.e):
                pt[lids[b][ex], p.k + ex * p.cap + np.arange(p.cap)] = lws[b][ex]
            cr = np.asarray(jax.lax.top_k(jnp.asarray(pt), p.k)[1])
            terms[b] += [o_blk[b][cr[:, j]] for j in range(p.k)]
    if p.s:
        shared = unpack_experts(inputs["shared"], p)
        shared_b = unpack_expert_biases(inputs["shared"], p) if p.expert_bias else [None] * p.s
        ranges = sorted({(it.out, it.slices, it.bias, it.expert) for it in p.items if it.shared})
        for _, slices, bias, sh in ranges:
            out = np.asarray(expert_rows_reference(p, shape, xq, shared[sh], shared_b[sh], None, slices,
                                                   bias))
            for b in range(p.nb):
                terms[b].append(out[b * p.tb:(b + 1) * p.tb])
    y = []
    for b in range(p.nb):
        acc = jnp.asarray(terms[b][0])
        for term in terms[b][1:]:
            acc = acc + jnp.asarray(term)
        y.append(acc)
    return {"y": np.asarray(jnp.concatenate(y).astype(jnp.bfloat16))}


def emit_gather(ctx: EmitCtx, p: GatherPlan, shape: dict[str, Any], tensors: dict[str, TensorRef],
                outs: dict[str, Out]) -> Emitter:
    """Emit the gather program for plan ``p`` (``plan_gather`` within ``ctx.budget``).

    ``tensors``: a ref for every non-output tensor of ``gather_tensors`` (x in HBM, with readiness
    regions, or on chip: its rows and panels are fetched); ``outs["y"]``: ``Out.to`` or
    ``Out.onchip`` (each combine item's block kept where it is made). The prefetch part is empty:
    the phases reuse one scratchpad region behind global semaphores. Yields/returns ``{"y": ...}``.
    """
    prog = _Emitter(ctx, p, shape, tensors, outs)
    refs = prog.outputs()
    yield refs
    prog.emit()
    return refs
