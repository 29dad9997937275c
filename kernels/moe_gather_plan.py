"""The moe kernel's gather program (prefill): its plan.

Stage: kernels (``moe`` family). The program (``moe_gather.py``, whose docstring says what it
computes) in items: token blocks, capacities per (expert, block), expert items dealt to the cores
longest first (``_lpt``), the combine's split; the estimate that picks among the candidates; every
scratchpad tile of a core (``core_layouts``, ``plain_specs``: one source for the sizing here and
the emitter's allocation) and the HBM tensors (``gather_tensors``).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError

from .base import TensorSpec
from .moe_base import MoeLayout, Spec, layout_bytes, mx_specs, slices_of, weight_specs
from .moe_pack import split_layout
from .moe_routing import routing_buffers, routing_dims
from .planning import Budget, DoesNotFit, core_hbm_bytes_per_s, memoised_planner, mxu_cycles_per_step

__all__ = ["GatherItem", "GatherPlan", "core_layouts", "gather_tensors", "item_extents", "plain_specs",
           "plan_gather"]

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
                r_max, i_max = item_extents(p)
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
            r_max, i_max = item_extents(p)
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
    room = budget.sram_bytes - layout_bytes(plain_specs(p)) - 64 * 8
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


def core_layouts(p: GatherPlan, shape: dict[str, Any], r_max: int, i_max: int) -> list[list[Spec]]:
    return [_quant_specs(p.t, p.h, p.quant_step, shape["act_fmt"]), _route_specs(p, shape),
            _expert_specs(p, shape, r_max, i_max), _combine_specs(p)]


def plain_specs(p: GatherPlan) -> list[Spec]:
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
    union = max(layout_bytes(lay) for lay in core_layouts(p, shape, r_max, i_max))
    return union + layout_bytes(plain_specs(p)) + 64 * 8


def _acc_bytes(p: GatherPlan, r_max: int) -> int:
    return 4 * (2 * r_max * 2 * p.slice_max + 2 * r_max * p.hb + p.tb * p.router_cols)


def item_extents(p: GatherPlan) -> tuple[int, int]:
    """The most rows and the widest I range of any item (items share their slice tuples)."""
    widths = {id(it.slices): it.slices for it in p.items}
    return (max(it.rows for it in p.items),
            max(sum(p.slices[j][1] for j in sl) for sl in widths.values()))


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
