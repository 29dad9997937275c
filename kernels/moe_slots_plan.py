"""The moe kernel's expert-slot program (up to 128 tokens: decode batches): its plan.

Stage: kernels (``moe`` family). What the program computes and how it is split and sized: the
items, the cores, each slot's token list, the router's split, and every scratchpad tile of a core
(``core_tiles``, one source for the sizing here and the allocation in the emitter,
``moe_slots.py``). ``moe`` runs this program when the batch fits one matrix-unit row tile of
tokens and a core's scratchpad and accumulators hold its buffers; ``moe_panel`` is its form for
small scratchpads, ``moe_gather`` the prefill program.

**Expert slots.** The program is static, the routing is data: it is built for D expert *slots*
(the distinct experts a batch hits, in increasing order) and gathers each slot's weights by the
expert id the routing computes. The work is a list of items (term, intermediate slice j); terms
are the shared experts first (weight 1, loaded), then the D slots (gathered by ``dma.gather`` of
one row of the packed expert table, ``moe_pack``, so biases travel with their weights).

**Each slot's token list** (its *capacity*, rows): the static program sizes how many tokens each
slot computes. ``routing=any`` (functional runs): every slot may get every token, capacity T.
``routing=uniform`` (timing): the expected counts, T*k tokens spread over the D slots (the first
``T*k mod D`` slots one more), so the expert matmuls' M is the routed rows and the program's
FLOPs are the routed work. A routing with more tokens for a slot than its capacity raises in the
functional pass (never a silent drop), as one that hits more experts than there are slots does.

Two arrangements follow from the capacities:

- **dense** (every capacity is T: routing=any, or a single token): every slot computes every
  token, weighted by its gate weight (0 for the tokens that did not choose it). Items are dealt
  round-robin to the cores; each core accumulates its items' down projections into one FP32
  [T, H] partial (the weighted combine happens in the accumulator) and its down biases through
  one small BF16 matmul (the gate weights' three BF16 parts, exact for FP32, times the bias);
  then each reducing core pulls its column slice of every partial (``dma.copy``), adds them in
  core order and rounds its slice of y to BF16 once. Reducers: every core, or at small batches
  half a consumer's queue slots' worth (``_reducers``), so that y's consumer pulls it in one
  round of DMA set-up even with other operators' transfers in flight.
- **routed** (some capacity below T): after the routing, each slot's list is the C tokens with
  the largest weights for it (``vec.topk`` of its row of the [D, T] weights; a second top-k
  checks that the (C+1)-th is zero, ``vec.group`` of the flags raises otherwise). Items are dealt
  in contiguous runs (each core a run of terms); a core gathers its slots' x rows from the
  quantised x in HBM by the list ids, computes gate|up, activation and gate weight on C rows, and
  accumulates each term's C rows of down projection in its accumulators, then the down biases. A
  term split between cores is completed by its first core (which pulls the other cores' rows and
  adds them in core order) and stored into an HBM row table O = [k zero rows | each slot's C rows
  | each shared expert's T rows]. The combine: ``vec.group`` of the lists' token ids gives a
  [T, k + rows] matrix of each token's weight at the O row that holds it, ``vec.topk`` k of it
  the k rows of each token (decreasing weight; a token with fewer picks takes zero rows); core c
  gathers its tokens' rows (one ``dma.gather``), adds them in that order, then the shared rows,
  and rounds y[tokens of c] to BF16 once.

**Router.** The logits [T, E] are computed by producer cores, one per (column panel of at most
one matrix-unit tile, block of H): with T <= 128 a BF16 matmul costs H/32 steps per column tile
whatever the rows, so at decode the chain is cut by splitting H (``_router_split``; shape key
``router_split``). Every core pulls the pieces and adds a panel's blocks in block order.

**Slice width.** A small cost model (bytes over the core's share of HBM vs matrix-unit steps vs
vector work, per item, times items on the busiest core, plus the pipeline fill), penalised beyond
128 items per core (``_MAX_ITEMS_PER_CORE``) to keep the program small; ``slice=N`` overrides it. The
weight buffers per core (2 to 4) are the most the scratchpad holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError

from .base import TensorSpec
from .moe_base import BIAS_PARTS, MoeLayout, Spec, aligned, layout_bytes, slices_of, weight_specs
from .moe_pack import chunk_bytes
from .moe_routing import routing_buffers, routing_dims
from .planning import Budget, DoesNotFit, core_hbm_bytes_per_s, memoised_planner, mxu_cycles_per_step

__all__ = [
    "LOOKAHEAD",
    "MAX_TOKENS",
    "REDUCE_QUEUES",
    "SHARED_BLOCK",
    "CoreTiles",
    "Item",
    "MoePlan",
    "bias_terms",
    "capacities",
    "core_tiles",
    "item_seconds",
    "plan_slots",
    "slot_tensors",
]

MAX_TOKENS = 128
"""Tokens the slot program takes at most: one matrix-unit row tile (every slot's list fits it)."""
# Items per core beyond which the slice choice is penalised (estimate x (1 + excess / this)): the
# program, and the checker's work, stay small enough to build, check and time a full-size layer in
# seconds to tens of seconds. At 64 it turned down 64-column slices that model a faster kernel for
# little emulator time: Kimi K2.5 at 64 tokens on jalapeno-v1 623.5 -> 535.5 us (156k -> 223k
# instructions, 2.3 -> 2.8 s to build and time), DeepSeek-R1 at 80 tokens 531.8 -> 455.6 us.
_MAX_ITEMS_PER_CORE = 128
_REDUCE_GROUP = 16  # partials pulled per round of the dense reduction (bounds its buffer)
REDUCE_QUEUES = 4  # DMA queues the dense reduction spreads its pulls over (at most)
# Weight loads in flight per core: two keep the DMA latency hidden, and the first item's weights
# land after two chunks' share of HBM instead of nbuf (loads in flight share bandwidth fairly).
LOOKAHEAD = 2
SHARED_BLOCK = 512
"""Routed: H columns per block of a shared item's down projection (its T rows would fill a core's
accumulators at DeepSeek's H = 7168; block by block they accumulate in the scratchpad)."""

Item = tuple[bool, int, int]
"""(shared?, shared index or slot, slice index)."""


@dataclass(frozen=True, kw_only=True)
class MoePlan(MoeLayout):
    """The slot program's split (``MoeLayout`` fields, plus):

    Attributes:
        items: (shared?, expert slot or shared index, slice index), shared items first.
        cores: working cores.
        runs: routed arrangement: [start, end) of each core's contiguous run of items; dense
            (empty): core c runs items c, c + cores, ...
        caps: each slot's list capacity (rows); all T: the dense arrangement.
        red: dense: (start column, width) of y each core reduces and stores.
        group: dense: partials pulled per reduction round.
        nbuf: weight buffers per core.
        bias_cols: K of the per-core down-bias matmul (3 columns per term whose slice 0 the core
            runs, rounded up to 32; 0 without biases).
        router_k: [start, end) rows of H of each producer's block of the router's contraction
            (``_router_split``); one block: no split.
    """

    items: tuple[Item, ...]
    cores: int
    runs: tuple[tuple[int, int], ...]
    caps: tuple[int, ...]
    red: tuple[tuple[int, int], ...]
    group: int
    nbuf: int
    bias_cols: int
    router_k: tuple[tuple[int, int], ...] = ()

    # --- the router's producers -----------------------------------------------------------------
    @property
    def router_split(self) -> int:
        """Blocks the router's contraction (H) is split into (1: none)."""
        return max(1, len(self.router_k))

    @property
    def router_producers(self) -> int:
        """Cores that compute a piece of the logits: one per (column panel, K block)."""
        return self.router_parts * self.router_split if self.e else 0

    def router_piece(self, c: int) -> tuple[int, int, int]:
        """(column panel, first row of H, rows) producer core ``c`` computes."""
        n, r = divmod(c, self.router_split)
        k0, k1 = self.router_k[r] if self.router_k else (0, self.h)
        return n, k0, k1 - k0

    # --- items and terms ------------------------------------------------------------------------
    @property
    def routed(self) -> bool:
        """The routed arrangement: some slot's list is shorter than the batch."""
        return any(c < self.t for c in self.caps)

    def core_items(self, c: int) -> tuple[Item, ...]:
        """The items core ``c`` runs, in order."""
        if self.runs:
            lo, hi = self.runs[c]
            return self.items[lo:hi]
        return self.items[c::self.cores]

    def term(self, item: Item) -> int:
        """Term index of an item: shared experts 0..S-1, then slots S..S+D-1."""
        return item[1] if item[0] else self.s + item[1]

    def term_rows(self, term: int) -> int:
        """Rows a term computes: T for a shared expert, its capacity for a slot."""
        return self.t if term < self.s else self.caps[term - self.s]

    @cached_property
    def _terms(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Routed: per core, (term, first accumulator row) of each term it runs, in order; shared
        terms (T rows) accumulate in the scratchpad instead: row -1."""
        out = []
        for c in range(self.cores):
            terms: list[tuple[int, int]] = []
            row = 0
            for it in self.core_items(c):
                u = self.term(it)
                if terms and terms[-1][0] == u:
                    continue
                terms.append((u, -1 if u < self.s else row))
                if u >= self.s:
                    row += self.term_rows(u)
            out.append(tuple(terms))
        return tuple(out)

    @cached_property
    def _holders(self) -> dict[int, tuple[int, ...]]:
        hold: dict[int, list[int]] = {}
        for c, terms in enumerate(self._terms):
            for u, _ in terms:
                hold.setdefault(u, []).append(c)
        return {u: tuple(cs) for u, cs in hold.items()}

    def core_terms(self, c: int) -> tuple[tuple[int, int], ...]:
        """Routed: (term, first accumulator row; -1 for a shared term) of each term core ``c``
        runs, in order."""
        return self._terms[c]

    def rows_on(self, c: int) -> int:
        """Routed: the slot rows of core ``c``'s partial (its accumulator rows)."""
        return sum(self.term_rows(u) for u, _ in self._terms[c] if u >= self.s)

    def holders(self, term: int) -> tuple[int, ...]:
        """Routed: the cores that run a slice of ``term``, in order (the first owns it)."""
        return self._holders.get(term, ())

    @property
    def r_log(self) -> int:
        """Routed: rows of every slot's list together."""
        return sum(self.caps)

    def o_row(self, term: int) -> int:
        """Routed: first row of a slot term in the HBM row table O (after the k zero rows)."""
        return self.k + sum(self.caps[:term - self.s])

    @property
    def o_rows(self) -> int:
        """Routed: rows of O: k zero rows, then the slots' lists (shared rows never leave the chip)."""
        return self.k + self.r_log

    @property
    def classes(self) -> list[tuple[int, int, int]]:
        """Routed: (first slot, slots, capacity) of the runs of slots with one capacity."""
        out: list[tuple[int, int, int]] = []
        for u, cap in enumerate(self.caps):
            if out and out[-1][2] == cap:
                out[-1] = (out[-1][0], out[-1][1] + 1, cap)
            else:
                out.append((u, 1, cap))
        return out

    @property
    def combine_tokens(self) -> int:
        """Routed: tokens each combining core adds up (cores 0.. take consecutive tokens)."""
        return -(-self.t // self.cores)

    def combine_items(self) -> list[tuple[int, int]]:
        """Routed: (first token, tokens) per combining core."""
        tc = self.combine_tokens
        return [(t0, min(tc, self.t - t0)) for t0 in range(0, self.t, tc)]

    @property
    def cap_max(self) -> int:
        """Most rows any item computes."""
        return self.t if self.s or not self.caps else max(self.caps)

    @cached_property
    def rows_max(self) -> int:
        """Rows of the largest partial in the accumulators (dense: T; routed: at least 1)."""
        return max(1, *(self.rows_on(c) for c in range(self.cores))) if self.routed else self.t

    @cached_property
    def span_rows(self) -> int:
        """Routed: rows of other cores' parts the busiest owner adds (its staging buffer)."""
        best = 0
        for c in range(self.cores):
            terms = self.core_terms(c)
            if terms:
                u = terms[-1][0]
                hold = self.holders(u)
                if hold[0] == c:
                    best = max(best, (len(hold) - 1) * self.term_rows(u))
        return best

    @cached_property
    def routed_terms_max(self) -> int:
        """Routed: most slots (x row tiles) one core gathers."""
        return max((sum(1 for u, _ in self.core_terms(c) if u >= self.s) for c in range(self.cores)),
                   default=0)

    @property
    def sh_block(self) -> int:
        """Routed with shared experts: H columns per down-projection block of a shared item (its
        [T, H] rows accumulate in the scratchpad, block by block through the accumulators)."""
        return min(self.h, SHARED_BLOCK)

    @property
    def chunk_max(self) -> int:
        """Largest chunk (a weight buffer's size)."""
        return max(self.chunk_sizes)


def capacities(t: int, k: int, d: int, routing: str) -> tuple[int, ...]:
    """Each slot's list capacity: T for routing=any (every routing fits); for uniform, the
    expected counts, T*k spread over the d slots (the first T*k mod d get one more)."""
    if routing == "any" or d == 0:
        return (t,) * d
    base, extra = divmod(t * k, d)
    return tuple(min(t, base + (u < extra)) for u in range(d))


def _bias_cols_dense(terms: int, n_slices: int, cores: int) -> int:
    """K of the down-bias matmul on the busiest core: its slice-0 items times 3, rounded up to 32."""
    first = np.arange(terms) * n_slices % cores  # the core of each term's slice-0 item
    per_core = int(np.bincount(first, minlength=cores).max())
    return 32 * -(-BIAS_PARTS * per_core // 32)


def bias_terms(p: MoePlan, c: int) -> list[int]:
    """Indices (into core c's items) of the items whose slice is 0: the core adds those terms' biases
    through the down-bias matmul (routed: slots only; a shared term adds its bias to its rows in
    the scratchpad)."""
    if not p.expert_bias:
        return []
    return [n for n, (sh, _, j) in enumerate(p.core_items(c)) if j == 0 and not (sh and p.routed)]


# --- per-core buffers -------------------------------------------------------------------------
@dataclass(frozen=True)
class CoreTiles:
    """Every scratchpad tile of one core: ``regions`` (name, layouts live at different times),
    ``plain`` tiles and ``mx`` tiles (codes + scales, blocked along columns)."""

    regions: tuple[tuple[str, tuple[tuple[Spec, ...], ...]], ...]
    plain: tuple[Spec, ...]
    mx: tuple[Spec, ...]


def _list_specs(p: MoePlan) -> list[Spec]:
    """Routed: the lists, the combine's row picks and the capacity check's tiles."""
    t, k, d = p.t, p.k, p.d
    rp = k + p.r_log + t
    out: list[Spec] = [("pi", "i32", (1, rp)), ("pw", "f32", (1, rp)), ("ptd", "i32", (t, 1)),
                       ("pt", "f32", (t, rp)), ("cv", "f32", (t, k)), ("crl", "i32", (t, k)),
                       ("lones", "f32", (1, max(t, 2))), ("lscr", "f32", (1, max(t, 2))),
                       ("fz", "f32", (d, 2)), ("fv", "f32", (d, 1)), ("fsrc", "i32", (d + 1, 1)),
                       ("fzero", "f32", (d + 1, 1)), ("fdst", "i32", (1, 1)), ("fdw", "f32", (1, d + 1)),
                       ("zrow", "f32", (1, p.h))]
    for n, (_, rows, cap) in enumerate(p.classes):
        if cap < t:
            out += [(f"probe_v{n}", "f32", (rows, cap + 1)), (f"probe_i{n}", "i32", (rows, cap + 1))]
    return out


def core_tiles(p: MoePlan, act_fmt: str, activation: str, x_in: bool) -> CoreTiles:
    """The tiles ``_alloc_core`` allocates, in order (one source for sizing and allocation)."""
    t, h, e, ew = p.t, p.h, p.e, p.router_cols
    cm, smax = p.cap_max, p.slice_max
    # bf16 activations: shared items read x itself until the end, which must then stay out of
    # the region the shared rows reuse.
    x_plain = act_fmt == "bf16" and p.routed and p.s > 0
    first: list[Spec] = [("x", "bf16", (t, h))] if x_in and not x_plain else []
    if e:
        rows = max(n for _, _, n in map(p.router_piece, range(p.router_producers)))
        first += [("wr", "bf16", (rows, ew)), ("logits_part", "f32", (t, ew))]
        if p.router_split > 1:  # the other K blocks' pieces, pulled before they are added
            first.append(("lstage", "f32", ((p.router_split - 1) * t, e)))
    if p.routed:
        tc = p.combine_tokens
        later: tuple[tuple[Spec, ...], ...] = (
            # the shared experts' [T, H] rows, accumulated here once the routing is done (x and the
            # router's tiles are dead), then the combine's (once every term is stored)
            (*((f"sh_part{s}", "f32", (t, h)) for s in range(p.s)), *((("tmp_sh", "f32", (t, p.sh_block)),)
                                                                         if p.s else ())),
            (("g", "f32", (tc * p.k, h)), ("ysum", "f32", (tc, h)), ("ybuf", "bf16", (tc, h))))
        partial: tuple[Spec, ...] = (("partial", "f32", (p.rows_max, h)),
                                     *((("stage", "f32", (p.span_rows, h)),) if p.span_rows else ()))
    else:
        hk = max(w for _, w in p.red)
        later = ((("red", "f32", (p.group * t, hk)), ("ysum", "f32", (t, hk)), ("ybuf", "bf16", (t, hk))),)
        partial = (("partial", "f32", (t, h)),)
    regions = (
        ("x_then_red", (tuple(first), *later)),
        ("weights_then_partial", (tuple((f"w{b}", "u8", (1, p.chunk_max)) for b in range(p.nbuf)), partial)),
    )
    d_max = min(e, t * p.k)
    plain: list[Spec] = list(routing_buffers(p.rd, d_max)) if p.rd is not None else []
    if x_in and x_plain:
        plain.append(("x", "bf16", (t, h)))
    if p.routed:
        # the shared rows copied for the combine: written while other cores still read this
        # core's shared rows, so outside the region that holds them
        plain += _list_specs(p) + [(f"gs{s}", "f32", (p.combine_tokens, h)) for s in range(p.s)]
    if activation == "swiglu_oai":
        plain.append(("ones", "f32", (1, smax)))
    plain += [("gu", "f32", (cm, 2 * smax)), ("tmp", "f32", (cm, smax))]
    mxs: list[Spec] = []
    n_x = p.routed_terms_max if p.routed else 0
    xrows = max(p.caps) if p.caps else 1
    if act_fmt == "bf16":
        plain += [("aq0", "bf16", (cm, smax)), ("aq1", "bf16", (cm, smax))]
        plain += [(f"xb{q}", "bf16", (xrows, h)) for q in range(n_x)]
    else:
        mxs += [("xq", act_fmt, (t, h)), ("aq0", act_fmt, (cm, smax)), ("aq1", act_fmt, (cm, smax))]
        mxs += [(f"xb{q}", act_fmt, (xrows, h)) for q in range(n_x)]
        plain += [(f"xs{q}", "bf16", (xrows, h)) for q in range(n_x)]  # rows gathered from x, to quantise
    if p.bias_cols:
        plain += [("wall", "bf16", (p.rows_max, p.bias_cols)), ("b2all", "bf16", (p.bias_cols, h)),
                  ("bres", "f32", (cm, 1)), ("onecol", "f32", (t, 1))]
    if p.routed and p.expert_bias:  # a shared term's down bias, copied out of its chunk
        plain += [(f"b2sh{s}", "bf16", (1, h)) for s in range(p.s)]
    return CoreTiles(regions, tuple(plain), tuple(mxs))


def _tiles_bytes(tiles: CoreTiles) -> int:
    """Scratchpad bytes of ``tiles`` with the builder's 64-byte alignment."""
    total = sum(max(layout_bytes(lay) for lay in layouts) for _, layouts in tiles.regions)
    total += layout_bytes(tiles.plain)
    total += sum(aligned(dt, sh) + aligned("e8m0", (sh[0], sh[1] // 32)) for _, dt, sh in tiles.mx)
    return total


def _acc_bytes(p: MoePlan) -> int:
    shared = 2 * p.t * p.sh_block if p.routed and p.s else 0
    return 4 * (p.rows_max * p.h + 2 * p.cap_max * 2 * p.slice_max + p.t * p.router_cols + shared)


# --- plan -------------------------------------------------------------------------------------
def _runs(n_items: int, cores: int) -> tuple[tuple[int, int], ...]:
    """Contiguous runs of items per core, balanced (sizes differ by at most one)."""
    b = np.linspace(0, n_items, cores + 1).round().astype(int).tolist()
    return tuple((b[c], b[c + 1]) for c in range(cores))


def _reducers(t: int, h: int, cores: int, spec: ChipSpec) -> int:
    """Dense arrangement: how many cores reduce y, each a column slice of every core's partial.

    Each reducer pulls ``cores`` slices (FP32) and adds them; y's consumer then pulls one piece
    per reducer. With a piece per core (64 on jalapeno-v1) a consumer's pulls fill its queues'
    ``max_outstanding_per_queue`` exactly, and in a fused program any other operator's transfer
    in flight on a queue (a prefetch, a cache append) pushes a piece into a second round, another
    DMA set-up on the critical path. So: as many reducers as leave half of each queue free for
    others' transfers, when the larger slices they pull and add cost less than that round; all
    cores otherwise (large batches, where the bytes dominate)."""
    dma, clock = spec.dma, spec.core.clock_hz
    port = min(dma.bytes_per_s_per_core, spec.sram.bytes_per_cycle * clock)

    def reduce_s(r: int) -> float:
        cols = -(-h // r)
        return cores * (4 * t * cols / port + (spec.vector.issue_overhead_cycles
                                                + -(-t * cols // spec.vector.lanes)) / clock)

    room = dma.queues_per_core * max(1, dma.max_outstanding_per_queue // 2)
    if cores <= room:
        return cores
    return room if reduce_s(room) < reduce_s(cores) + dma.setup_latency_s else cores


def _router_split(shape: dict[str, Any], spec: ChipSpec,
                  cores: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """(R column panels, E/R columns each, K blocks) of the router matmul [T, H] x [H, E].

    A panel is at most one matrix-unit column tile wide (R the smallest divisor of E that allows
    it): with T <= 128 rows a matmul's steps are one per 32 rows of H per column tile, whatever
    the width, so narrower panels only multiply the same H-long chains. The chain is cut instead
    by splitting H into blocks of whole 32-row steps, one producer core each (R x blocks cores);
    every consumer pulls the pieces and adds a panel's blocks in block order (FP32, one rounding
    per add). Automatic (shape key ``router_split=0``): the split that minimises one producer's
    matmul plus the consumer's pulls and adds, with every block at least one array fill long (a
    shorter matmul is dominated by the fill, so the split would buy less than its adds and pulls
    cost) and at most ``dma.max_outstanding_per_queue`` pieces (the consumer's pulls in one
    round). Small hidden sizes (on jalapeno-v1, H < 512: the tiny models) are therefore never split.
    """
    t, h, e = shape["tokens"], shape["hidden"], shape["experts"]
    mx = spec.matrix
    divisors = [r for r in range(1, min(e, cores) + 1) if e % r == 0]
    narrow = [r for r in divisors if e // r <= mx.tile_n]
    r_parts = min(narrow) if narrow else max(divisors)  # more columns than cores have tiles: wider
    ew = e // r_parts
    steps = -(-h // mx.tile_k)
    most = max(1, min(steps, cores // r_parts, spec.dma.max_outstanding_per_queue // r_parts))
    key = shape.get("router_split", 0)
    if key:
        if key > most:
            raise InvalidArgumentError(
                f"shape key router_split={key}: at most {most} blocks on {spec.name} ({r_parts} router "
                f"panel(s), {cores} cores, {steps} steps of H={h}, {spec.dma.max_outstanding_per_queue} "
                "pulls per queue round)")
        split = key
    else:
        step = mxu_cycles_per_step(spec, "bf16", "bf16")
        add = spec.vector.issue_overhead_cycles + -(-t * e // spec.vector.lanes)
        port = min(spec.dma.bytes_per_s_per_core, spec.sram.bytes_per_cycle * spec.core.clock_hz)
        pull = 4 * t * e / port * spec.core.clock_hz  # one block's FP32 logits [T, E] into a consumer

        def cycles(r: int) -> float:
            return -(-steps // r) * step + (r - 1) * add + r * pull

        ok = [r for r in range(1, most + 1) if r == 1 or steps // r * step >= mx.pipeline_depth_cycles]
        split = min(ok, key=lambda r: (cycles(r), r))
    if split == 1:
        return r_parts, ew, ()
    b = (np.linspace(0, steps, split + 1).round().astype(int) * mx.tile_k).tolist()
    b[-1] = h
    return r_parts, ew, tuple((b[r], b[r + 1]) for r in range(split))


def item_seconds(spec: ChipSpec, act_fmt: str, t: int, h: int, w: int, chunk_bytes: int,
                 cores: int) -> tuple[float, float, float]:
    """(load, matrix unit, vector unit) seconds of one item: a chunk of ``chunk_bytes`` loaded at a
    core's share of HBM when ``cores`` cores stream; the gate|up and down matmuls of ``t`` tokens
    by H=``h`` and a slice of ``w`` columns, pipeline fills included; the activation's passes."""
    mx = spec.matrix
    mt = -(-t // mx.tile_m)
    steps = mt * (-(-2 * w // mx.tile_n) * h // 32 + -(-h // mx.tile_n) * w // 32)
    mxu_cycles = steps * mxu_cycles_per_step(spec, act_fmt, "fp4") + 2 * mx.pipeline_depth_cycles
    mxu = mxu_cycles / spec.core.clock_hz
    vec = 14 * (spec.vector.issue_overhead_cycles + t * w / spec.vector.lanes) / spec.core.clock_hz
    return chunk_bytes / core_hbm_bytes_per_s(spec, cores), mxu, vec


@memoised_planner
def plan_slots(shape: dict[str, Any], spec: ChipSpec, budget: Budget, d: int) -> MoePlan:
    """The slot program's split for a checked ``shape`` with ``d`` expert slots, within ``budget``.

    Raises:
        DoesNotFit: more than ``MAX_TOKENS`` tokens, or no split fits the scratchpad and
            accumulators (the message names the key and the bytes).
    """
    t, h, i, e, k = (shape[n] for n in ("tokens", "hidden", "intermediate", "experts", "top_k"))
    s, act_fmt, bias = shape["shared_experts"], shape["act_fmt"], shape["expert_bias"]
    if t > MAX_TOKENS:
        raise DoesNotFit(f"shape key tokens={t}: the expert-slot program takes at most {MAX_TOKENS} "
                         "tokens (one matrix-unit row tile)")
    rd = routing_dims(t, e, k, shape) if e else None
    caps = capacities(t, k, d, shape["routing"])
    routed = any(c < t for c in caps)
    cores_avail = budget.cores
    r_parts, ew, router_k = _router_split(shape, spec, cores_avail) if e else (0, 0, ())
    acc_cap, sram_cap = budget.acc_bytes, budget.sram_bytes

    def chunks(w: int) -> list[int]:
        return [chunk_bytes(h, sw, bias, j == 0) for j, (_, sw) in enumerate(slices_of(i, w))]

    def make(w: int, nbuf: int, cores: int, group: int) -> MoePlan:
        slices = slices_of(i, w)
        sizes = chunks(w)
        offs = np.cumsum([0, *sizes]).tolist()
        items = tuple((True, si, j) for si in range(s) for j in range(len(slices))) + \
            tuple((False, u, j) for u in range(d) for j in range(len(slices)))
        n_red = _reducers(t, h, cores, spec)
        bounds = np.linspace(0, h, n_red + 1).round().astype(int).tolist()
        red = tuple((bounds[c], bounds[c + 1] - bounds[c]) if c < n_red else (h, 0) for c in range(cores))
        p = MoePlan(t=t, h=h, i=i, e=e, k=k, s=s, d=d, slices=slices, chunk_off=tuple(offs[:-1]),
                    chunk_sizes=tuple(sizes), expert_bytes=offs[-1], expert_bias=bias, router_parts=r_parts,
                    router_cols=ew, rd=rd, items=items, cores=cores,
                    runs=_runs(len(items), cores) if routed else (),
                    caps=caps, red=red, group=group, nbuf=nbuf, bias_cols=0, router_k=router_k)
        if bias:
            if routed:
                most = max(len(bias_terms(p, c)) for c in range(cores))
                cols = 32 * -(-BIAS_PARTS * most // 32)
            else:
                cols = _bias_cols_dense(d + s, len(slices), cores)
            p = replace(p, bias_cols=cols)
        return p

    def sram_need(p: MoePlan) -> int:
        return _tiles_bytes(core_tiles(p, act_fmt, shape["activation"], True))

    def cost(w: int, nbuf: int) -> float:
        """Estimated seconds of the busiest core for slice width w, fixed costs included."""
        n_items = (d + s) * len(slices_of(i, w))
        cores = min(cores_avail, n_items)
        per_core = -(-n_items // cores)
        hbm_rate = core_hbm_bytes_per_s(spec, cores)
        load, mxu, vec = item_seconds(spec, act_fmt, t, h, w, max(chunks(w)), cores)
        latency = spec.dma.setup_latency_s + spec.hbm.latency_s
        # With more than two buffers the loads stream back to back (latency hidden behind the
        # load in flight); with two a load waits for the previous item's matmuls.
        item = max(load, mxu, vec) if nbuf > 2 else load + latency + max(mxu, vec)
        # Pipeline fill: x and the first two chunks share the core's bandwidth before any matmul.
        fill = latency + (2 * t * h + LOOKAHEAD * max(chunks(w))) / hbm_rate
        return per_core * item + fill

    w_key = shape["slice"]
    candidates = [w_key] if w_key else list(range(32, min(i, 1024) + 1, 32))
    fitting = []  # (penalised estimate, -w, plan)
    reasons: list[str] = []
    for w in candidates:
        n_items = (d + s) * len(slices_of(i, w))
        cores = min(cores_avail, n_items)
        per_core = -(-n_items // cores)
        base = make(w, 2, cores, _REDUCE_GROUP)
        if _acc_bytes(base) > acc_cap:
            reasons.append(f"slice={w}: {_acc_bytes(base):,} B of accumulators")
            continue
        for nbuf in (4, 3, 2):
            nb = min(nbuf, max(2, per_core))
            p = make(w, nb, cores, _REDUCE_GROUP)
            if sram_need(p) <= sram_cap:
                over = max(0, per_core - _MAX_ITEMS_PER_CORE) / _MAX_ITEMS_PER_CORE
                fitting.append((cost(w, nb) * (1 + over), -w, p))
                break
        else:
            reasons.append(f"slice={w}: {sram_need(base):,} B of scratchpad")
    if not fitting:
        first = reasons[0] if reasons else "nothing fits"
        raise DoesNotFit(
            f"shape key hidden={h} (tokens={t}): the expert-slot program needs more than {spec.name}'s "
            f"{sram_cap:,} B of scratchpad or {acc_cap:,} B of accumulators per core ({first})",
            hint="split the batch, or use grouping=gather")
    p = min(fitting, key=lambda f: f[:2])[2]
    if not routed:
        # One reduction round when every partial slice fits beside the rest (rounds wait for each other).
        whole = replace(p, group=p.cores)
        p = whole if sram_need(whole) <= sram_cap else replace(p, group=min(p.cores, _REDUCE_GROUP))
    return p


# --- HBM tensors --------------------------------------------------------------------------------
def slot_tensors(p: MoePlan, shape: dict[str, Any]) -> tuple[TensorSpec, ...]:
    """The slot program's HBM tensors, in the order its stand-alone program allocates them: x, y,
    the router panels and biases, the packed tables, expert_ids; routed: the quantised x and the
    row table O (scratch)."""
    t, h, e = p.t, p.h, p.e
    out = [TensorSpec("x", (t, h), "bf16", "input"), TensorSpec("y", (t, h), "bf16", "output")]
    out += weight_specs(p)
    if e:
        out.append(TensorSpec("expert_ids", (p.d, 1), "i32", "output"))
    if p.routed:
        fmt = shape["act_fmt"]
        out += [TensorSpec("xq", (p.cores * t, h), fmt, "scratch", None if fmt == "bf16" else 1),
                TensorSpec("o_rows", (p.o_rows, h), "f32", "scratch")]
    return tuple(out)
