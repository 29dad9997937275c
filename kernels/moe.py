"""Mixture-of-experts FFN of one layer: router, top-k gating, MXFP4 experts, weighted combine.

    logits = x @ Wr (+ b)                          x [T, H] bf16, Wr [H, E] bf16, FP32 logits
    ids, w = route(logits)                         [T, k] expert ids and gate weights (moe_routing)
    gpt-oss  (router=softmax_topk):  top-k of logits + router bias, w = softmax over the k
    DeepSeek/Kimi (router=sigmoid_topk): scores = sigmoid(logits), top-k (DeepSeek-V3's noaux_tc:
        on scores + score_bias, within the topk_group best of n_group groups), w = chosen scores
        / (sum + 1e-20) * routed_scaling_factor
    y[t] = sum_j w[t, j] * FFN_{ids[t, j]}(x[t]) + sum_s FFN_shared_s(x[t])        y [T, H] bf16
    FFN_e(x) = act(x @ Wg_e + bg_e, x @ Wu_e + bu_e) @ Wd_e + bd_e
                                                   Wg, Wu [H, I], Wd [I, H]: MXFP4, blocks along K;
                                                   biases (expert_bias, gpt-oss) BF16, else none
    swiglu_oai (gpt-oss): g = min(gate, 7); u = clamp(up, -7, 7); act = g * sigmoid(1.702 g) * (u + 1)
    silu (DeepSeek/Kimi): act = silu(gate) * up

**Only the experts some token chose are read from HBM.** The program is static, the routing is
data, so the kernel is built for a number of *expert slots* D and gathers each slot's weights by
an index the device computes:

1. Router: cores 0..R-1 each multiply x by a column panel of Wr (BF16 on the matrix unit); every
   working core pulls the R logit panels into its own scratchpad (``dma.copy``) and computes the
   routing redundantly (cheap vector work, no second exchange; ``moe_routing``): the top-k, the
   gating, and ``vec.group`` (this family's instruction, opcode 0x60), which turns the [T, k]
   expert ids and weights into the D distinct experts hit, in increasing order, and a dense
   [D, T] matrix of each token's weight for each of them (0 where the token did not choose it).
2. Experts: the work is a list of items (slot u, intermediate slice j of width ``slice``); items
   are dealt round-robin to the cores. An item is one ``dma.gather`` of one row of the packed
   expert table (``moe_pack``) indexed by slot u's expert id, so its bytes (biases included)
   come from the expert the routing chose. The core computes gate|up = xq @ [Wg | Wu][:, slice]
   for **all T tokens** (dense per slot: with T <= 128 every token row shares the matrix unit's
   128-row tile, so computing the tokens that did not choose the expert costs no extra time),
   adds the gate/up bias, the activation, multiplies each token row by its weight (0 for tokens
   that did not pick the expert), quantises it (``act_fmt``) and accumulates act @ Wd[slice, :]
   into a per-core FP32 [T, H] accumulator: the weighted combine happens in the accumulator.
   Shared experts are extra items with weight 1, loaded (not gathered) from their own table.
3. Down biases (``expert_bias``): y needs w[t, e] * bd_e once per expert, outside the slices'
   sum. The core that runs an expert's slice 0 writes the token weights as three BF16 parts
   (hi, mid, lo: exact for an FP32 weight) into 3 columns of a [T, 32n] matrix and the bias into
   3 rows of a [32n, H] one, and after its last item adds their product to its accumulator (one
   small BF16 matmul: the products are exact, each 32-block summed in order).
4. Combine across cores: each core's [T, H] partial goes to its scratchpad; core c pulls column
   slice c of every partial (``dma.copy``, in one round when the scratchpad holds every slice,
   else rounds of 16), adds them in core order and stores y[:, slice c].

**Dense FFN** (``experts=0``, ``shared_experts >= 1``: DeepSeek-R1's first three layers, Kimi's
first): no router, no routing, no gathers; the items are the shared experts' slices, and the HBM
bytes are the shared weights, x (once per working core) and y.

**Two programs** (``grouping``). ``dense`` is the program described here: every expert slot
computes all T tokens, which costs nothing extra while T fits one 128-row tile of the matrix unit,
and the [T, H] FP32 partial must fit a core's accumulators. ``gather`` (``moe_gather``) is the
prefill program: per 128-token block each expert gets a list of the tokens that chose it (static
capacity ``ceil(128 * top_k / experts * capacity_factor)``; more is an error of the functional
pass, never a silent drop), computes only those rows, and the outputs are gathered back per token
-- work and bytes scale with T * top_k, and any T (a multiple of a block of 32..128 tokens)
fits. ``auto`` picks dense up to 128 tokens when its partial fits, else gather. Dense FFNs at
large T use the gather program's row-block items (no routing).

Weights are double- to quadruple-buffered per core (as the scratchpad allows), two loads in
flight (loads in flight share HBM fairly, so fewer of them land the first item's weights
sooner); the matrix unit runs gate|up of item i+1 while the vector unit computes item i's
activation. The slice width is chosen from a small cost model (bytes over the core's share of
HBM vs matrix-unit steps vs vector work, per item, times items on the busiest core, plus the
pipeline fill), penalised beyond 64 items per core to keep the program small; ``slice=N``
overrides it. Two scratchpad regions are reused over time (x/router panel, then the reduction
buffers; weight buffers, then the partial), so one core holds DeepSeek's 64-token step. The ISA
has no immediate fill: the constants the kernel needs (ones, zeros, 1e-20, id sequences) are
made from x with ``vec.clamp`` lo = hi (see ``moe_routing``), so the only inputs are x, the
weights and the biases.

**The number of slots D** (the HBM bytes) is fixed when the program is built. ``routing=any``
(default) builds D = min(E, T*k) slots, enough for every routing; slots past the number of
distinct experts hit repeat the last expert with zero weights (correct, but those bytes are
moved). ``routing=uniform`` builds D = ceil(E * (1 - (1 - k/E)^T)), the expected number of
distinct experts when each token picks k of E experts uniformly at random (the chance that no
token picks a given expert is (1 - k/E)^T) -- the figure to time real batches with.
``distinct_experts=N`` builds exactly N slots (a runtime that reads the router's distinct count
and launches the matching variant). A batch that hits more distinct experts than the program
has slots is not silently wrong: ``vec.group`` raises in the functional pass. HBM bytes are
D x the bytes of one expert (``notes["expert_bytes"]``), plus x, the router and the output.

Inputs (HBM): ``x`` [T, H] bf16; ``router`` [R*H, E/R] bf16 (R column panels,
``moe_pack.router_panels``); ``router_bias`` [1, E] bf16 (softmax_topk); ``score_bias`` [1, E]
f32 (score_bias); ``experts`` [E, expert_bytes] and ``shared`` [S, expert_bytes] u8 (the packed
tables, ``pack_experts``, whose layout depends on the plan). Outputs: ``y`` [T, H] bf16 and,
for grouping=dense, ``expert_ids`` [D, 1] i32. The gather program's other HBM tensors (``xq``,
``list_ids``, ``list_weights``, ``routed_out``, ``shared_out``) are scratch it writes itself.

Numerics (the reference does the same operations in the same order, see ``moe_reference``):
router as BF16 x BF16 on the matrix unit (exact products, 32-element blocks summed in order);
logits, gating and activations in FP32, one rounding per vector instruction; x and the
activations quantised to ``act_fmt`` (MXFP8 E4M3 by default, scale mode floor, RNE); expert
matmuls exactly ``mx.matmul``; each core accumulates its items in order, then its down biases,
partials are added in core order, y rounded once to BF16.

Not implemented (say so when comparing with the models): gpt-oss's even/odd interleaving of
gate and up columns (a layout choice; the math is the same); gpt-oss rounds router logits and
activations to BF16 between operations, this kernel keeps them in FP32. The gather program's
capacity is per (expert, 128-token block), so its slack is paid per block (see ``moe_gather``:
at DeepSeek/gpt-oss shapes each expert computes 2x the rows its tokens need at the default
capacity_factor 2), and it reads every expert whether or not a token chose it (at prefill sizes
they all are).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu.functional import inorder_block_matmul
from jalapeno_emu.emu.program import Tile
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.table import DTYPES, Space

from .base import KernelBuild, KernelDef, ShapeKey, Tolerance
from .moe_gather import GatherPlan, build_gather, gather_reference, plan_gather
from .moe_pack import (
    chunk_bytes,
    chunk_views,
    pack_experts,
    router_logical,
    router_panels,
    unpack_expert_biases,
    unpack_experts,
)
from .moe_panel import PanelPlan, build_panel, panel_reference, plan_panel
from .moe_routing import (
    RoutingDims,
    check_routing_keys,
    emit_route_constants,
    emit_routing,
    fill_constant,
    group_reference,
    route_reference,
    routing_buffers,
    routing_dims,
)
from .registry import register

__all__ = ["MOE", "GatherPlan", "MoePlan", "expected_distinct_experts", "grouping_of", "moe_reference",
           "pack_experts", "plan_moe", "unpack_expert_biases", "unpack_experts"]

SWIGLU_ALPHA = 1.702  # gpt-oss swiglu: glu * sigmoid(alpha * glu)
SWIGLU_LIMIT = 7.0  # gpt-oss swiglu_limit (config): glu <= 7, -7 <= linear <= 7
_MX_FMT = {"fp8e4": "e4m3", "fp4": "e2m1"}  # act_fmt -> mx element format ("bf16": no quantisation)
_SRAM_SHARE = 0.95  # leave a little scratchpad spare
# Items per core beyond which the slice choice is penalised (estimate x (1 + excess / this)): the
# program, and the checker's work, which grows faster than linearly with it, stay small enough to
# build, check and time a full-size layer in seconds to tens of seconds.
_MAX_ITEMS_PER_CORE = 64
_REDUCE_GROUP = 16  # partials pulled per round of the cross-core reduction (bounds its buffer)
# Weight loads in flight per core: two keep the DMA latency hidden, and the first item's weights
# land after two chunks' share of HBM instead of nbuf (loads in flight share bandwidth fairly).
_LOOKAHEAD = 2
_BIAS_PARTS = 3  # a gate weight as hi + mid + lo BF16 parts: exact for FP32 (3 x 8 significand bits)
_DENSE_TOKENS = 128  # grouping=auto: dense items up to one matrix-unit row tile of tokens


def expected_distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """E * (1 - (1 - k/E)^T): distinct experts hit when each of T tokens picks k of E uniformly."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


@dataclass(frozen=True)
class MoePlan:
    """How a MoE shape is laid out and split (shared by the builder, the reference and the packers).

    Attributes:
        t, h, i, e, k, s: tokens, hidden, intermediate, experts (0: dense FFN), top_k, shared experts.
        d: expert slots (distinct experts the program serves; 0 for a dense FFN).
        slices: (start column, width) of each intermediate slice; widths multiples of 32.
        chunk_off: byte offset of each slice's chunk inside one packed expert.
        chunk_sizes: bytes of each slice's chunk.
        expert_bytes: bytes of one packed expert.
        expert_bias: the packed chunks carry gpt-oss's gate/up and down biases.
        items: (shared?, expert slot or shared index, slice index), shared items first.
        cores: working cores; core c runs items c, c + cores, ...
        router_parts, router_cols: R producer cores, E/R logit columns each (0, 0: no router).
        red: (start column, width) of y each core reduces and stores (width 0: none).
        group: partials pulled per reduction round.
        nbuf: weight buffers per core.
        bias_cols: K of the per-core down-bias matmul (3 columns per expert whose slice 0 the core
            runs, rounded up to 32; 0 without biases).
        rd: the routing's static shape (None for a dense FFN).
    """

    t: int
    h: int
    i: int
    e: int
    k: int
    s: int
    d: int
    slices: tuple[tuple[int, int], ...]
    chunk_off: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    expert_bytes: int
    expert_bias: bool
    items: tuple[tuple[bool, int, int], ...]
    cores: int
    router_parts: int
    router_cols: int
    red: tuple[tuple[int, int], ...]
    group: int
    nbuf: int
    bias_cols: int
    rd: RoutingDims | None

    def core_items(self, c: int) -> tuple[tuple[bool, int, int], ...]:
        """The items core ``c`` runs, in order."""
        return self.items[c::self.cores]

    @property
    def slice_max(self) -> int:
        """Widest slice."""
        return max(w for _, w in self.slices)

    @property
    def chunk_max(self) -> int:
        """Largest chunk (a weight buffer's size)."""
        return max(self.chunk_sizes)


def _slices(i: int, w: int) -> tuple[tuple[int, int], ...]:
    return tuple((c0, min(w, i - c0)) for c0 in range(0, i, w))


def _bias_cols(experts: int, n_slices: int, cores: int) -> int:
    """K of the down-bias matmul on the busiest core: its slice-0 items times 3, rounded up to 32."""
    first = np.arange(experts) * n_slices % cores  # the core of each expert's slice-0 item
    per_core = int(np.bincount(first, minlength=cores).max())
    return 32 * -(-_BIAS_PARTS * per_core // 32)


# --- per-core buffers -------------------------------------------------------------------------
_Spec = tuple[str, str, tuple[int, int]]


@dataclass(frozen=True)
class _CoreTiles:
    """Every scratchpad tile of one core: ``regions`` (name, layouts live at different times),
    ``plain`` tiles and ``mx`` tiles (codes + scales, blocked along columns)."""

    regions: tuple[tuple[str, tuple[tuple[_Spec, ...], ...]], ...]
    plain: tuple[_Spec, ...]
    mx: tuple[_Spec, ...]


def _core_tiles(t: int, h: int, e: int, d_max: int, ew: int, smax: int, chunk: int, nbuf: int,
                group: int, hk_max: int, act_fmt: str, activation: str, rd: RoutingDims | None,
                bias_cols: int) -> _CoreTiles:
    """The tiles ``_alloc_core`` allocates, in order (one source for sizing and allocation)."""
    router: tuple[_Spec, ...] = (("wr", "bf16", (h, ew)), ("logits_part", "f32", (t, ew))) if e else ()
    regions = (
        ("x_then_red", ((("x", "bf16", (t, h)), *router),
                        (("red", "f32", (group * t, hk_max)), ("ysum", "f32", (t, hk_max)),
                         ("ybuf", "bf16", (t, hk_max))))),
        ("weights_then_partial", (tuple((f"w{b}", "u8", (1, chunk)) for b in range(nbuf)),
                                  (("partial", "f32", (t, h)),))),
    )
    plain: list[_Spec] = list(routing_buffers(rd, d_max)) if rd is not None else []
    if activation == "swiglu_oai":
        plain.append(("ones", "f32", (1, smax)))
    plain += [("gu", "f32", (t, 2 * smax)), ("tmp", "f32", (t, smax))]
    mxs: list[_Spec] = []
    if act_fmt == "bf16":
        plain += [("aq0", "bf16", (t, smax)), ("aq1", "bf16", (t, smax))]
    else:
        mxs += [("xq", act_fmt, (t, h)), ("aq0", act_fmt, (t, smax)), ("aq1", act_fmt, (t, smax))]
    if bias_cols:
        plain += [("wall", "bf16", (t, bias_cols)), ("b2all", "bf16", (bias_cols, h)),
                  ("bres", "f32", (t, 1)), ("onecol", "f32", (t, 1))]
    return _CoreTiles(regions, tuple(plain), tuple(mxs))


def _aligned(dtype: str, shape: tuple[int, int]) -> int:
    return -(-shape[0] * DTYPES[dtype].row_bytes(shape[1]) // 64) * 64


def _tiles_bytes(tiles: _CoreTiles) -> int:
    """Scratchpad bytes of ``tiles`` with the builder's 64-byte alignment."""
    total = sum(max(sum(_aligned(dt, sh) for _, dt, sh in lay) for lay in layouts)
                for _, layouts in tiles.regions)
    total += sum(_aligned(dt, sh) for _, dt, sh in tiles.plain)
    total += sum(_aligned(dt, sh) + _aligned("e8m0", (sh[0], sh[1] // 32)) for _, dt, sh in tiles.mx)
    return total


# --- plan -------------------------------------------------------------------------------------
def _check_shape(shape: dict[str, Any]) -> None:
    """Refuse impossible shapes (InvalidArgumentError naming the key)."""
    i, e, k, s = shape["intermediate"], shape["experts"], shape["top_k"], shape["shared_experts"]
    for name in ("tokens", "hidden", "intermediate"):
        if shape[name] < 1:
            raise InvalidArgumentError(f"shape key {name}={shape[name]} must be >= 1")
    if s < 0:
        raise InvalidArgumentError(f"shape key shared_experts={s} must be >= 0")
    if e < 0 or (e == 0 and s < 1):
        raise InvalidArgumentError(f"shape key experts={e} must be >= 1, or 0 (a dense FFN) with "
                                   f"shared_experts >= 1 (got shared_experts={s})")
    if e and not 1 <= k <= e:
        raise InvalidArgumentError(f"shape key top_k={k} must be in [1, experts={e}]")
    for name in ("hidden", "intermediate"):  # MXFP4 blocks of 32 along both contraction axes
        if shape[name] % 32:
            raise InvalidArgumentError(f"shape key {name}={shape[name]} must be a multiple of 32 "
                                       "(MXFP4 weights are blocked by 32 along it)")
    if shape["routed_scaling_factor"] <= 0:
        raise InvalidArgumentError(
            f"shape key routed_scaling_factor={shape['routed_scaling_factor']} must be positive")
    if e:
        check_routing_keys(shape)
    if e == 0 and shape["distinct_experts"]:
        raise InvalidArgumentError(f"shape key distinct_experts={shape['distinct_experts']} must be 0 "
                                   "when experts=0 (a dense FFN has no routed experts)")
    w_key = shape["slice"]
    if w_key and (w_key % 32 or w_key > i):
        raise InvalidArgumentError(f"shape key slice={w_key} must be a multiple of 32 and at most "
                                   f"intermediate={i} (0: automatic)")


def _slots(shape: dict[str, Any]) -> int:
    """D, the expert slots (checked against the routing's bounds)."""
    t, e, k = shape["tokens"], shape["experts"], shape["top_k"]
    if e == 0:
        return 0
    d_max = min(e, t * k)
    d = shape["distinct_experts"]
    if d == 0:
        d = d_max if shape["routing"] == "any" else min(d_max, math.ceil(
            expected_distinct_experts(e, k, t) - 1e-9))
    if not k <= d <= d_max:
        raise InvalidArgumentError(
            f"shape key distinct_experts={d} must be in [top_k={k}, min(experts, tokens*top_k)={d_max}]"
            " (0: from routing)")
    return d


def grouping_of(shape: dict[str, Any], spec: ChipSpec) -> str:
    """"dense" (every slot computes every token) or "gather" (each expert its own tokens); auto:
    dense up to 128 tokens when the [tokens, hidden] FP32 partial fits a core's accumulators."""
    g = shape["grouping"]
    if g != "auto":
        return g
    t, h = shape["tokens"], shape["hidden"]
    fits = 4 * t * h + 2 * 4 * t * 2 * 32 + 4 * t * 128 <= spec.sram.accumulator_bytes
    if t > _DENSE_TOKENS:
        return "gather"
    if fits:
        return "dense"
    # A small scratchpad (GPU shared memory) that the gather program does not fit either: the
    # slot program's panel form (``moe_panel``) keeps the partial in HBM.
    if _gather_fits(shape, spec) or not _panel_fits(shape, spec):
        return "gather"
    return "dense"


def _gather_fits(shape: dict[str, Any], spec: ChipSpec) -> bool:
    try:
        plan_gather(shape, spec)
    except InvalidArgumentError:
        return False
    return True


def _panel_fits(shape: dict[str, Any], spec: ChipSpec) -> bool:
    try:
        _check_shape(shape)
        plan_panel(shape, spec, _slots(shape))
    except InvalidArgumentError:
        return False
    return True


def plan_moe(shape: dict[str, Any], spec: ChipSpec) -> MoePlan | GatherPlan | PanelPlan:
    """Validate ``shape`` and choose the program and its split (``MoePlan`` for grouping=dense,
    ``PanelPlan`` for grouping=dense when that does not fit the chip's scratchpad or accumulators,
    ``GatherPlan`` for grouping=gather); InvalidArgumentError naming the key otherwise."""
    _check_shape(shape)
    if grouping_of(shape, spec) == "gather":
        return plan_gather(shape, spec)
    try:
        return _plan_dense(shape, spec)
    except InvalidArgumentError as exc:
        if shape["tokens"] > _DENSE_TOKENS:
            raise
        try:  # small scratchpads: the same slots, through HBM in panels
            return plan_panel(shape, spec, _slots(shape))
        except InvalidArgumentError as panel_exc:
            raise InvalidArgumentError(
                f"{exc.message}; nor does the panel form for small scratchpads: {panel_exc.message}",
                hint=panel_exc.hint or exc.hint) from None


def _plan_dense(shape: dict[str, Any], spec: ChipSpec) -> MoePlan:
    """The dense program's split (InvalidArgumentError when it does not fit)."""
    t, h, i, e, k = (shape[n] for n in ("tokens", "hidden", "intermediate", "experts", "top_k"))
    s, act_fmt, bias = shape["shared_experts"], shape["act_fmt"], shape["expert_bias"]
    d = _slots(shape)
    rd = routing_dims(t, e, k, shape) if e else None
    d_max = min(e, t * k)
    cores_avail = spec.core.count
    # Router panels: R producers, each E/R columns (R divides E, at most one per 32 columns).
    r_parts = max(r for r in range(1, min(cores_avail, max(1, e // 32)) + 1) if e % r == 0) if e else 0
    ew = e // r_parts if e else 0
    acc_cap, sram_cap = spec.sram.accumulator_bytes, int(spec.sram.scratchpad_bytes * _SRAM_SHARE)

    def chunks(w: int) -> list[int]:
        return [chunk_bytes(h, sw, bias, j == 0) for j, (_, sw) in enumerate(_slices(i, w))]

    def sram_need(w: int, nbuf: int, cores: int, group: int) -> int:
        hk = -(-h // cores)
        bias_cols = _bias_cols(d + s, len(_slices(i, w)), cores) if bias else 0
        return _tiles_bytes(_core_tiles(t, h, e, d_max, ew, w, max(chunks(w)), nbuf, group, hk, act_fmt,
                                        shape["activation"], rd, bias_cols))

    def cost(w: int, nbuf: int) -> float:
        """Estimated seconds of the busiest core for slice width w, fixed costs included."""
        n_items = (d + s) * len(_slices(i, w))
        cores = min(cores_avail, n_items)
        per_core = -(-n_items // cores)
        hbm_rate = min(spec.dma.bytes_per_s_per_core,
                       spec.hbm.bytes_per_s_per_pseudo_channel * spec.hbm.pseudo_channels
                       * spec.hbm.efficiency / cores)
        macs = {"fp4": spec.matrix.mxfp4_macs_per_cycle, "fp8e4": spec.matrix.mxfp8_macs_per_cycle,
                "bf16": spec.matrix.bf16_macs_per_cycle}[act_fmt]
        mt, tile = -(-t // spec.matrix.tile_m), spec.matrix.tile_m * spec.matrix.tile_n * spec.matrix.tile_k
        steps = mt * (-(-2 * w // spec.matrix.tile_n) * h // 32 + -(-h // spec.matrix.tile_n) * w // 32)
        mxu = (steps * tile / macs + 2 * spec.matrix.pipeline_depth_cycles) / spec.core.clock_hz
        vec = 14 * (spec.vector.issue_overhead_cycles + t * w / spec.vector.lanes) / spec.core.clock_hz
        latency = spec.dma.setup_latency_s + spec.hbm.latency_s
        load = max(chunks(w)) / hbm_rate
        # With more than two buffers the loads stream back to back (latency hidden behind the
        # load in flight); with two a load waits for the previous item's matmuls.
        item = max(load, mxu, vec) if nbuf > 2 else load + latency + max(mxu, vec)
        # Pipeline fill: x and the first two chunks share the core's bandwidth before any matmul.
        fill = latency + (2 * t * h + _LOOKAHEAD * max(chunks(w))) / hbm_rate
        return per_core * item + fill

    w_key = shape["slice"]
    candidates = [w_key] if w_key else list(range(32, min(i, 1024) + 1, 32))

    def acc_need(w: int) -> int:
        return 4 * t * h + 2 * 4 * t * 2 * w + 4 * t * ew

    if acc_need(min(candidates)) > acc_cap:
        raise InvalidArgumentError(
            f"shape key tokens={t}: the [tokens, hidden] FP32 partial output and the gate|up "
            f"accumulators need {acc_need(min(candidates)):,} B of accumulator memory; {spec.name} "
            f"has {acc_cap:,} B per core (split the batch)")
    fitting = []  # (penalised estimate, -w, w, buffers, cores)
    for w in candidates:
        if acc_need(w) > acc_cap:
            continue
        n_items = (d + s) * len(_slices(i, w))
        cores = min(cores_avail, n_items)
        per_core = -(-n_items // cores)
        for nbuf in (4, 3, 2):
            nb = min(nbuf, max(2, per_core))
            if sram_need(w, nb, cores, _REDUCE_GROUP) <= sram_cap:
                over = max(0, per_core - _MAX_ITEMS_PER_CORE) / _MAX_ITEMS_PER_CORE
                fitting.append((cost(w, nb) * (1 + over), -w, w, nb, cores))
                break
    if not fitting:
        w = candidates[0]
        need = sram_need(w, 2, cores_avail, _REDUCE_GROUP)
        raise InvalidArgumentError(
            f"shape key hidden={h} (tokens={t}, slice={w}): one core needs {need:,} B of scratchpad "
            f"with double-buffered weights; {spec.name} has {spec.sram.scratchpad_bytes:,} B")
    w, nbuf, cores = min(fitting)[2:]
    slices = _slices(i, w)
    sizes = chunks(w)
    offs = np.cumsum([0, *sizes]).tolist()
    items = tuple((True, si, j) for si in range(s) for j in range(len(slices))) + \
        tuple((False, u, j) for u in range(d) for j in range(len(slices)))
    bounds = np.linspace(0, h, cores + 1).round().astype(int).tolist()
    red = tuple((bounds[c], bounds[c + 1] - bounds[c]) for c in range(cores))
    # One reduction round when every partial slice fits beside the rest (rounds wait for each other).
    group = cores if sram_need(w, nbuf, cores, cores) <= sram_cap else min(cores, _REDUCE_GROUP)
    return MoePlan(t, h, i, e, k, s, d, slices, tuple(offs[:-1]), tuple(sizes), offs[-1], bias, items,
                   cores, r_parts, ew, red, group, nbuf,
                   _bias_cols(d + s, len(slices), cores) if bias else 0, rd)


# --- reference --------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("activation",))
def _activation(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    if activation == "swiglu_oai":
        g = jnp.minimum(gate, jnp.float32(SWIGLU_LIMIT))
        u = jnp.clip(up, jnp.float32(-SWIGLU_LIMIT), jnp.float32(SWIGLU_LIMIT))
        glu = g * jax.nn.sigmoid(g * jnp.float32(SWIGLU_ALPHA))
        return glu * (u + jnp.float32(1))
    return (gate * jax.nn.sigmoid(gate)) * up


def _bias_parts(w: np.ndarray) -> list[np.ndarray]:
    """FP32 weights [T] -> their hi, mid, lo BF16 parts (as float32), each remainder exact."""
    parts, rest = [], np.asarray(w, np.float32)
    for _ in range(_BIAS_PARTS):
        part = rest.astype(ml_dtypes.bfloat16).astype(np.float32)
        parts.append(part)
        rest = (rest - part).astype(np.float32)
    return parts


def moe_reference(inputs: dict[str, Any], plan: MoePlan | GatherPlan | PanelPlan,
                  shape: dict[str, Any]) -> dict[str, np.ndarray]:
    """Pure-JAX MoE with the kernel's numerics and summation order; {"y": bf16 [T, H]} plus, for
    grouping=dense, "expert_ids": int32 [D, 1]."""
    if isinstance(plan, GatherPlan):
        return gather_reference(inputs, plan, shape)
    if isinstance(plan, PanelPlan):
        return panel_reference(inputs, plan, shape)
    act_fmt, activation = shape["act_fmt"], shape["activation"]
    x = jnp.asarray(np.asarray(inputs["x"]).astype(np.float32))
    slots, slot_w, routed, routed_b = np.zeros(0, np.int32), np.zeros((0, plan.t), np.float32), [], []
    if plan.e:
        wr = jnp.asarray(router_logical(np.asarray(inputs["router"]), plan), jnp.float32)
        ids, w = route_reference(_inorder_jit(x, wr), inputs, plan.rd, shape["routed_scaling_factor"])
        slots, slot_w = group_reference(ids, w, plan.d)
        routed = unpack_experts(inputs["experts"], plan)
        routed_b = unpack_expert_biases(inputs["experts"], plan) if plan.expert_bias else []
    shared = unpack_experts(inputs["shared"], plan) if plan.s else []
    shared_b = unpack_expert_biases(inputs["shared"], plan) if plan.s and plan.expert_bias else []

    def quant(v):
        return v.astype(jnp.bfloat16) if act_fmt == "bf16" else mx.quantize(v, _MX_FMT[act_fmt], axis=1)

    def mm(acc, a, b):
        return _bf16_accumulate(acc, a, b) if act_fmt == "bf16" else mx.matmul_accumulate(acc, a, b)

    xq = quant(x)
    y = None
    for c in range(plan.cores):
        acc = jnp.zeros((plan.t, plan.h), jnp.float32)
        wall, b2all = [], []
        for n, (is_shared, slot, j) in enumerate(plan.core_items(c)):
            ex = int(slot) if is_shared else int(slots[slot])
            g, u, dn = (shared if is_shared else routed)[ex]
            c0, wd = plan.slices[j]
            gu = mm(jnp.zeros((plan.t, 2 * wd), jnp.float32), xq, _mx_cols(g, u, c0, wd))
            weight = np.ones(plan.t, np.float32) if is_shared else slot_w[slot]
            if plan.expert_bias:
                gb, ub, db = (shared_b if is_shared else routed_b)[ex]
                gu = gu + jnp.asarray(np.concatenate([gb[c0:c0 + wd], ub[c0:c0 + wd]]))[None]
                if j == 0:  # this core adds weight * down_bias for the expert, once
                    wall += _bias_parts(weight)
                    b2all += [db] * _BIAS_PARTS
            a = _activation(gu[:, :wd], gu[:, wd:], activation)
            if not is_shared:
                a = a * jnp.asarray(weight)[:, None]
            d_w = mx.MXArray(codes=np.asarray(dn.codes)[c0:c0 + wd], scales=np.asarray(dn.scales)[
                c0 // 32:(c0 + wd) // 32], fmt="e2m1", axis=0, block_size=32)
            acc = mm(jnp.zeros_like(acc) if n == 0 else acc, quant(a), d_w)
        if wall:
            a_b = np.zeros((plan.t, plan.bias_cols), np.float32)
            a_b[:, :len(wall)] = np.stack(wall, axis=1)
            b_b = np.zeros((plan.bias_cols, plan.h), np.float32)
            b_b[:len(b2all)] = np.stack(b2all)
            acc = _inorder_jit(jnp.asarray(a_b), jnp.asarray(b_b), acc)
        y = acc if y is None else y + acc
    return {"y": np.asarray(y.astype(jnp.bfloat16)), "expert_ids": slots[:, None]}


def _mx_cols(g: mx.MXArray, u: mx.MXArray, c0: int, w: int) -> mx.MXArray:
    """[Wg[:, c0:c0+w] | Wu[:, c0:c0+w]] as one MXArray blocked along rows."""
    codes = np.concatenate([np.asarray(g.codes)[:, c0:c0 + w], np.asarray(u.codes)[:, c0:c0 + w]], axis=1)
    scales = np.concatenate([np.asarray(g.scales)[:, c0:c0 + w], np.asarray(u.scales)[:, c0:c0 + w]],
                            axis=1)
    return mx.MXArray(codes=codes, scales=scales, fmt="e2m1", axis=0, block_size=32)


_inorder_jit = jax.jit(inorder_block_matmul)


def _bf16_accumulate(acc: jax.Array, a: jax.Array, b: mx.MXArray) -> jax.Array:
    """acc + BF16 a @ MXFP4 b with the matrix unit's BF16 path (per-block sums, in order)."""
    return _inorder_jit(a.astype(jnp.float32), mx.dequantize(b, jnp.float32), acc)


# --- the kernel ------------------------------------------------------------------------------
def _view(t: Tile, off: int, dtype: str, rows: int, cols: int, stride: int = -1) -> Tile:
    """Another view of the bytes of tile ``t`` starting ``off`` bytes in."""
    return Tile(t.space, t.core, t.offset + off, dtype, rows, cols, stride)


def _layout(parts: tuple[_Spec, ...]) -> tuple[list[tuple[str, int, str, tuple]], int]:
    """64-byte aligned offsets of consecutive tiles in one region: ([(name, offset, dtype, shape)], bytes)."""
    out, off = [], 0
    for name, dtype, shape in parts:
        out.append((name, off, dtype, shape))
        off += _aligned(dtype, shape)
    return out, off


def _union(kb: KernelBuilder, c: int, name: str, layouts: tuple[tuple[_Spec, ...], ...]) -> dict[str, Tile]:
    """One scratchpad region shared by several sets of tiles that are live at different times
    (the semaphores that order their uses also order the reuse; the checker verifies it)."""
    laid = [_layout(parts) for parts in layouts]
    region = kb.sram(c, name, (1, max(n for _, n in laid)), "u8")
    return {tn: _view(region, off, dt, *shape) for parts, _ in laid for tn, off, dt, shape in parts}


def _plan_tiles(p: MoePlan, shape: dict[str, Any]) -> _CoreTiles:
    return _core_tiles(p.t, p.h, p.e, min(p.e, p.t * p.k), p.router_cols, p.slice_max, p.chunk_max, p.nbuf,
                       p.group, max(w for _, w in p.red), shape["act_fmt"], shape["activation"], p.rd,
                       p.bias_cols)


def _alloc_core(kb: KernelBuilder, c: int, p: MoePlan, shape: dict[str, Any]) -> dict[str, Any]:
    """Every buffer of core ``c``. All cores allocate the same buffers in the same order (router
    panel and slot tables at their largest size included), so their scratchpads have the same
    layout and the functional pass compiles each instruction shape once for all of them.

    Two regions are reused: x and the router panel (done once routing is) later hold the
    cross-core reduction; the weight buffers (done after the last item) later hold the partial.
    """
    t, h = p.t, p.h
    tiles = _plan_tiles(p, shape)
    B: dict[str, Any] = {}
    for name, layouts in tiles.regions:
        B.update(_union(kb, c, name, layouts))
    B["wbuf"] = [B.pop(f"w{b}") for b in range(p.nbuf)]
    for name, dtype, sh in tiles.plain:
        B[name] = kb.sram(c, name, sh, dtype)
    for name, fmt, sh in tiles.mx:
        B[name] = kb.sram_mx(c, name, sh, fmt, axis=1)
    if shape["act_fmt"] == "bf16":
        B["xq"] = B["x"]  # the matrix unit takes x as it is
    B["aq"] = [B.pop("aq0"), B.pop("aq1")]
    B["acc_gu"] = [kb.acc(c, f"acc_gu{b}", (t, 2 * p.slice_max)) for b in range(2)]
    B["acc_out"] = kb.acc(c, "acc_out", (t, h))
    if p.e:
        B["acc_r"] = kb.acc(c, "acc_r", (t, p.router_cols))
    B["sem"] = {n: kb.semaphore(f"c{c}.{n}") for n in (
        "x_loaded", "consts", "wr_loaded", "r_done", "pulled", "xq_ready", "routed", "loaded",
        "gu_done", "gu_read", "act_ready", "freed", "bias_ready", "bias_done", "red_loaded0",
        "red_loaded1", "red_free", "y_ready")}
    return B


@dataclass(frozen=True)
class _Hbm:
    """The kernel's HBM tensors (None where the shape has none)."""

    x: Tile
    y: Tile
    router: Tile | None
    router_bias: Tile | None
    score_bias: Tile | None
    experts: Tile | None
    shared: Tile | None
    expert_ids: Tile | None


def _hbm_tensors(kb: KernelBuilder, p: MoePlan, shape: dict[str, Any]) -> _Hbm:
    e, rd = p.e, p.rd
    return _Hbm(
        x=kb.hbm("x", (p.t, p.h), "bf16"), y=kb.hbm("y", (p.t, p.h), "bf16"),
        router=kb.hbm("router", (p.router_parts * p.h, p.router_cols), "bf16") if e else None,
        router_bias=kb.hbm("router_bias", (1, e), "bf16") if e and rd.router == "softmax_topk" else None,
        score_bias=kb.hbm("score_bias", (1, e), "f32") if e and rd.score_bias else None,
        experts=kb.hbm("experts", (e, p.expert_bytes), "u8") if e else None,
        shared=kb.hbm("shared", (p.s, p.expert_bytes), "u8") if p.s else None,
        expert_ids=kb.hbm("expert_ids", (p.d, 1), "i32") if e else None)


def _emit_router(kb: KernelBuilder, c: int, B: dict[str, Any], p: MoePlan, hbm: _Hbm) -> None:
    """Producer core ``c``: its column panel of the logits, FP32 in its scratchpad."""
    core, sem = kb.core(c), B["sem"]
    m, q1 = core.mxu, core.dma[1 % kb.chip.dma.queues_per_core]
    q1.load(B["wr"], hbm.router.sub(c * p.h, 0, p.h, p.router_cols))
    q1.signal(sem["wr_loaded"])
    m.wait(sem["x_loaded"], 1)
    m.wait(sem["wr_loaded"], 1)
    m.matmul(B["acc_r"], B["x"], B["wr"], mode="overwrite")
    m.signal(sem["r_done"])


def _emit_core_setup(kb: KernelBuilder, c: int, B: dict[str, Any], p: MoePlan, shape: dict[str, Any],
                     has_shared_bias: bool) -> None:
    """Vector unit, once x is in: x quantised, and the constants made from it (no immediates)."""
    v, sem, x = kb.core(c).vpu, B["sem"], B["x"]
    v.wait(sem["x_loaded"], 1)
    if shape["act_fmt"] != "bf16":
        v.quantize(B["xq"].codes, B["xq"].scales, x)
    v.signal(sem["xq_ready"])
    if shape["activation"] == "swiglu_oai":
        fill_constant(v, B["ones"], 1.0, x)
    if p.rd is not None:
        emit_route_constants(v, B, p.rd, x)
    if p.bias_cols:
        fill_constant(v, B["wall"], 0.0, x)
        fill_constant(v, B["b2all"], 0.0, x)
        if has_shared_bias:
            fill_constant(v, B["onecol"], 1.0, x)


def _emit_routing(kb: KernelBuilder, c: int, B: dict[str, Any], bufs: dict[int, dict[str, Any]], p: MoePlan,
                  shape: dict[str, Any], hbm: _Hbm, logits_ready: Any) -> None:
    """Core ``c`` pulls the R logit panels and routes every token into its slot tables; core 0
    also stores the slot ids."""
    t, sem, v = p.t, B["sem"], kb.core(c).vpu
    q1 = kb.core(c).dma[1 % kb.chip.dma.queues_per_core]
    if hbm.router_bias is not None:
        q1.load(B["bias"], hbm.router_bias)
    if hbm.score_bias is not None:
        q1.load(B["score_bias"], hbm.score_bias)
    q1.signal(sem["consts"])
    q1.wait(logits_ready, p.router_parts)
    for r in range(p.router_parts):
        q1.copy(B["logits"].sub(0, r * p.router_cols, t, p.router_cols), bufs[r]["logits_part"])
    q1.signal(sem["pulled"])
    v.wait(sem["consts"], 1)
    v.wait(sem["pulled"], 1)
    emit_routing(v, B, p.rd, shape["routed_scaling_factor"], p.d)
    v.signal(sem["routed"])
    if c == 0:
        q1.wait(sem["routed"], 1)
        q1.store(hbm.expert_ids, B["slot_ids"].sub(0, 0, p.d, 1))


def _emit_loads(kb: KernelBuilder, c: int, B: dict[str, Any], p: MoePlan, hbm: _Hbm) -> None:
    """DMA queue 0: each item's chunk, loaded (shared) or gathered by its slot's expert id."""
    q0, sem = kb.core(c).dma[0], B["sem"]
    routed_waited = False
    for n, (is_shared, slot, j) in enumerate(p.core_items(c)):
        size = p.chunk_sizes[j]
        dst = B["wbuf"][n % p.nbuf].sub(0, 0, 1, size)
        if n >= p.nbuf:  # the buffer's previous item must be done on the matrix unit
            q0.wait(sem["freed"], n - p.nbuf + 1)
        if n >= _LOOKAHEAD:
            q0.wait(sem["loaded"], n - _LOOKAHEAD + 1)
        if is_shared:
            q0.load(dst, Tile(Space.HBM, 0, hbm.shared.offset + slot * p.expert_bytes + p.chunk_off[j],
                              "u8", 1, size))
        else:
            if not routed_waited:
                q0.wait(sem["routed"], 1)
                routed_waited = True
            table = Tile(Space.HBM, 0, hbm.experts.offset + p.chunk_off[j], "u8", p.e, size, p.expert_bytes)
            q0.gather(dst, table, B["slot_ids"].sub(slot, 0, 1, 1))
        q0.signal(sem["loaded"])


def _views(B: dict[str, Any], p: MoePlan, n: int, j: int):
    return chunk_views(B["wbuf"][n % p.nbuf], p.h, p.slices[j][1], p.expert_bias, j == 0)


def _emit_matmuls(kb: KernelBuilder, c: int, B: dict[str, Any], p: MoePlan, has_bias_items: bool) -> None:
    """Matrix unit: gate|up of item n while the vector unit activates item n - 1, then its down
    projection into the core's [T, H] accumulator; the down-bias matmul last."""
    m, sem, t = kb.core(c).mxu, B["sem"], p.t
    items = p.core_items(c)

    def gate_up(n: int) -> None:
        j = items[n][2]
        w = p.slices[j][1]
        if n == 0:
            m.wait(sem["xq_ready"], 1)
        m.wait(sem["loaded"], n + 1)
        if n >= 2:  # the vector unit has read this accumulator's previous item
            m.wait(sem["gu_read"], n - 1)
        m.matmul_mx(B["acc_gu"][n % 2].sub(0, 0, t, 2 * w), B["xq"], _views(B, p, n, j).gu, mode="overwrite")
        m.signal(sem["gu_done"])

    def down(n: int) -> None:
        j = items[n][2]
        w = p.slices[j][1]
        m.wait(sem["act_ready"], n + 1)
        m.matmul_mx(B["acc_out"], B["aq"][n % 2].sub(0, 0, t, w), _views(B, p, n, j).down,
                    mode="overwrite" if n == 0 else "accumulate")
        m.signal(sem["freed"])

    for n in range(len(items)):
        gate_up(n)
        if n:
            down(n - 1)
    down(len(items) - 1)
    if has_bias_items:  # acc += [w_hi w_mid w_lo ...] @ [b2; b2; b2; ...] for this core's experts
        m.wait(sem["bias_ready"], 1)
        m.matmul(B["acc_out"], B["wall"], B["b2all"], mode="accumulate")
        m.signal(sem["bias_done"])


def _emit_bias_terms(v: Any, B: dict[str, Any], q: int, weight: Tile, down_bias: Tile) -> None:
    """Columns/rows 3q..3q+2 of the down-bias matmul: the weight's BF16 parts and three copies of
    the expert's down bias (copied out of its chunk before the buffer is reused)."""
    wall, res = B["wall"], B["bres"]
    t = weight.rows
    src = weight
    for part in range(_BIAS_PARTS):
        col = wall.sub(0, _BIAS_PARTS * q + part, t, 1)
        v.copy(col, src)  # rounds to BF16
        if part < _BIAS_PARTS - 1:
            v.sub(res, src, col)  # the remainder, exact in FP32
            src = res
        v.copy(B["b2all"].sub(_BIAS_PARTS * q + part, 0, 1, down_bias.cols), down_bias)


def _emit_activations(kb: KernelBuilder, c: int, B: dict[str, Any], p: MoePlan,
                      shape: dict[str, Any]) -> None:
    """Vector unit: per item, gate|up out of the accumulator (+ biases), the activation, times
    each token's gate weight, quantised for the down projection."""
    v, sem, t = kb.core(c).vpu, B["sem"], p.t
    items = p.core_items(c)
    gu, tmp, aq = B["gu"], B["tmp"], B["aq"]
    bias_items = [n for n, (_, _, j) in enumerate(items) if j == 0] if p.expert_bias else []
    for n, (is_shared, slot, j) in enumerate(items):
        w = p.slices[j][1]
        g_t, u_t, a_t = gu.sub(0, 0, t, w), gu.sub(0, w, t, w), tmp.sub(0, 0, t, w)
        views = _views(B, p, n, j)
        v.wait(sem["gu_done"], n + 1)
        v.acc_read(gu.sub(0, 0, t, 2 * w), B["acc_gu"][n % 2].sub(0, 0, t, 2 * w))
        v.signal(sem["gu_read"])
        # the token's gate weight for this slot's expert: column `slot` of the [D, T] table
        wcol = None if is_shared else _view(B["slot_w"], slot * t * 4, "f32", t, 1, 4)
        if p.expert_bias:
            v.add(gu.sub(0, 0, t, 2 * w), gu.sub(0, 0, t, 2 * w), views.gu_bias)
            if j == 0:
                _emit_bias_terms(v, B, bias_items.index(n), B["onecol"] if is_shared else wcol,
                                 views.down_bias)
                if n == bias_items[-1]:
                    v.signal(sem["bias_ready"])
        if shape["activation"] == "swiglu_oai":
            v.clamp(g_t, g_t, float("-inf"), SWIGLU_LIMIT)
            v.clamp(u_t, u_t, -SWIGLU_LIMIT, SWIGLU_LIMIT)
            v.scale(a_t, g_t, SWIGLU_ALPHA)
            v.sigmoid(a_t, a_t)
            v.mul(a_t, g_t, a_t)
            v.add(u_t, u_t, B["ones"].sub(0, 0, 1, w))
            v.mul(a_t, a_t, u_t)
        else:
            v.silu(a_t, g_t)
            v.mul(a_t, a_t, u_t)
        if n >= 2:  # aq[n % 2] is free once the down matmul of item n - 2 is done
            v.wait(sem["freed"], n - 1)
        dst = aq[n % 2].sub(0, 0, t, w)
        if shape["act_fmt"] == "bf16":
            if wcol is None:
                v.copy(dst, a_t)
            else:
                v.mul(dst, a_t, wcol)
        else:
            if wcol is not None:
                v.mul(a_t, a_t, wcol)
            v.quantize(dst.codes, dst.scales, a_t)
        v.signal(sem["act_ready"])
    # --- partial out to scratchpad, for the other cores to pull ---
    v.wait(sem["freed"], len(items))
    if bias_items:
        v.wait(sem["bias_done"], 1)
    v.acc_read(B["partial"], B["acc_out"])


def _emit_reduction(kb: KernelBuilder, c: int, bufs: dict[int, dict[str, Any]], p: MoePlan, y_h: Tile,
                    partials_ready: Any) -> None:
    """Core c adds column slice c of every core's partial, in core order, and stores y[:, slice]."""
    h0, hk = p.red[c]
    if hk == 0:
        return
    t, nq = p.t, kb.chip.dma.queues_per_core
    B, core, v = bufs[c], kb.core(c), kb.core(c).vpu
    sem, red, ybuf, ysum = B["sem"], B["red"], B["ybuf"].sub(0, 0, t, hk), B["ysum"].sub(0, 0, t, hk)
    queues = [core.dma[q] for q in range(2 % nq, nq)][:2] or [core.dma[0]]
    for q in queues:
        q.wait(partials_ready, p.cores)
    # Rounds of `group` partials (the buffer holds one round): y = ((p0 + p1) + p2) + ...
    for r, c_lo in enumerate(range(0, p.cores, p.group)):
        for q in queues:
            if r:
                q.wait(sem["red_free"], r)
        for c2 in range(c_lo, min(p.cores, c_lo + p.group)):
            queues[c2 % len(queues)].copy(red.sub((c2 - c_lo) * t, 0, t, hk),
                                          bufs[c2]["partial"].sub(0, h0, t, hk))
        for qi, q in enumerate(queues):  # one semaphore per queue: each wait names its signaller
            q.signal(sem[f"red_loaded{qi}"])
            v.wait(sem[f"red_loaded{qi}"], r + 1)
        for c2 in range(c_lo, min(p.cores, c_lo + p.group)):
            part = red.sub((c2 - c_lo) * t, 0, t, hk)
            last = c2 == p.cores - 1
            if c2 == 0:
                v.copy(ybuf if last else ysum, part)
            else:  # the last sum is rounded to bf16 once
                v.add(ybuf if last else ysum, ysum, part)
        v.signal(sem["red_free"])
    v.signal(sem["y_ready"])
    queues[0].wait(sem["y_ready"], 1)
    queues[0].store(y_h.sub(0, h0, t, hk), ybuf)


def build_moe(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """The MoE layer step for ``shape`` (keys in ``MOE``) on chip ``spec``."""
    p = plan_moe(shape, spec)
    if isinstance(p, GatherPlan):
        return _build_gather_kernel(shape, spec, p)
    if isinstance(p, PanelPlan):
        return _build_panel_kernel(shape, spec, p)
    t, h, e, k = p.t, p.h, p.e, p.k
    kb = KernelBuilder(f"moe_t{t}_h{h}_i{p.i}_e{e}_k{k}_d{p.d}", chip=spec)
    hbm = _hbm_tensors(kb, p, shape)
    logits_ready = kb.semaphore("logits_ready")
    partials_ready = kb.semaphore("partials_ready")
    workers, producers = range(p.cores), range(p.router_parts)
    bufs = {c: _alloc_core(kb, c, p, shape) for c in range(max(p.cores, p.router_parts))}

    for c, B in bufs.items():
        core, sem, v = kb.core(c), B["sem"], kb.core(c).vpu
        core.dma[0].load(B["x"], hbm.x)
        core.dma[0].signal(sem["x_loaded"])
        if c in producers:
            _emit_router(kb, c, B, p, hbm)
        if c not in workers:
            v.wait(sem["r_done"], 1)
            v.acc_read(B["logits_part"], B["acc_r"])
            v.signal(logits_ready)
            continue
        items = p.core_items(c)
        has_bias = p.expert_bias and any(j == 0 for _, _, j in items)
        _emit_core_setup(kb, c, B, p, shape, has_bias and any(sh and j == 0 for sh, _, j in items))
        if c in producers:
            v.wait(sem["r_done"], 1)
            v.acc_read(B["logits_part"], B["acc_r"])
            v.signal(logits_ready)
        if e:
            _emit_routing(kb, c, B, bufs, p, shape, hbm, logits_ready)
        _emit_loads(kb, c, B, p, hbm)
        _emit_matmuls(kb, c, B, p, has_bias)
        _emit_activations(kb, c, B, p, shape)
        v.signal(partials_ready)
    for c in workers:
        _emit_reduction(kb, c, bufs, p, hbm.y, partials_ready)

    return KernelBuild(
        program=kb.build(), make_inputs=lambda seed: make_moe_inputs(p, shape, seed),
        reference=lambda inputs: {"y": moe_reference(inputs, p, shape)["y"]},
        outputs={"y": ("bf16", (t, h))},
        tolerance=Tolerance(
            atol=1e-6, rtol=2.0**-7,
            why="same operations in the same order as the reference (MX matmuls bit-exact, FP32 "
                "vector steps, per-core then cross-core sums in the kernel's order); exp and sigmoid "
                "may differ in the last FP32 bit between XLA's code paths, which can move y by one "
                "BF16 ulp (or an activation by one MX rounding step)"),
        notes={"distinct_experts": p.d,
               "distinct_experts_uniform": round(expected_distinct_experts(e, k, t), 2) if e else 0.0,
               "expert_bytes": p.expert_bytes, "routed_expert_bytes": p.d * p.expert_bytes,
               "shared_expert_bytes": p.s * p.expert_bytes, "slice": p.slice_max, "items": len(p.items),
               "cores": p.cores, "weight_buffers": p.nbuf, "router_parts": p.router_parts},
    )


def _build_gather_kernel(shape: dict[str, Any], spec: ChipSpec, p: GatherPlan) -> KernelBuild:
    kb = build_gather(shape, spec, p)
    rows = sum(it.rows for it in p.items if not it.shared)
    return KernelBuild(
        program=kb.build(), make_inputs=lambda seed: make_moe_inputs(p, shape, seed),
        reference=lambda inputs: gather_reference(inputs, p, shape), outputs={"y": ("bf16", (p.t, p.h))},
        tolerance=Tolerance(
            atol=1e-6, rtol=2.0**-7,
            why="same operations in the same order as the reference (MX matmuls bit-exact, FP32 vector "
                "steps, the k routed rows then the shared partials added in the kernel's order); exp and "
                "sigmoid may differ in the last FP32 bit between XLA's code paths"),
        notes={"grouping": "gather", "block_tokens": p.tb, "capacity": p.cap,
               "routed_rows": rows, "routed_rows_ideal": p.t * p.k, "distinct_experts": p.e,
               "expert_bytes": p.expert_bytes, "routed_expert_bytes": p.e * p.expert_bytes,
               "shared_expert_bytes": p.s * p.expert_bytes, "slice": p.slice_max, "items": len(p.items),
               "cores": p.cores, "down_block": p.hb, "router_parts": p.router_parts},
    )


def _build_panel_kernel(shape: dict[str, Any], spec: ChipSpec, p: PanelPlan) -> KernelBuild:
    kb = build_panel(shape, spec, p)
    return KernelBuild(
        program=kb.build(), make_inputs=lambda seed: make_moe_inputs(p, shape, seed),
        reference=lambda inputs: {"y": panel_reference(inputs, p, shape)["y"]},
        outputs={"y": ("bf16", (p.t, p.h))},
        tolerance=Tolerance(
            atol=1e-6, rtol=2.0**-7,
            why="same operations in the same order as the reference (MX matmuls bit-exact in K panels, "
                "FP32 vector steps, the terms' rows added in term order); exp and sigmoid may differ in "
                "the last FP32 bit between XLA's code paths"),
        notes={"grouping": "dense", "program": "panel", "distinct_experts": p.d,
               "distinct_experts_uniform": round(expected_distinct_experts(p.e, p.k, p.t), 2) if p.e else 0.0,
               "expert_bytes": p.expert_bytes, "routed_expert_bytes": p.d * p.expert_bytes,
               "shared_expert_bytes": p.s * p.expert_bytes, "slice": p.slice_max, "down_block": p.hb,
               "k_panel": p.hk, "i_panel": p.ik, "x_resident": p.x_resident,
               "items": len(p.gu_items()) + len(p.down_items()), "cores": p.cores,
               "router_parts": p.router_parts, "route_block": p.tb},
    )


def make_moe_inputs(p: MoePlan | GatherPlan | PanelPlan, shape: dict[str, Any], seed: int) -> dict[str, Any]:
    """Random inputs for plan ``p``: x ~ N(0, 1), weights scaled to keep activations O(1); gate
    and up scaled up so that gpt-oss's clamp (7) is reached now and then."""
    rng = np.random.default_rng(seed)
    bf = ml_dtypes.bfloat16
    t, h, i, e = p.t, p.h, p.i, p.e

    def mxq(rows: int, cols: int, scale: float) -> mx.MXArray:
        return mx.quantize(scale * rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(rows),
                           "e2m1", axis=0)

    def experts(n: int) -> np.ndarray:
        g, u, d = [mxq(h, i, 3.0) for _ in range(n)], [mxq(h, i, 3.0) for _ in range(n)], \
            [mxq(i, h, 1.0) for _ in range(n)]
        if not p.expert_bias:
            return pack_experts(g, u, d, p)
        biases = [[(0.5 * rng.standard_normal(size)).astype(bf) for _ in range(n)] for size in (i, i, h)]
        return pack_experts(g, u, d, p, *biases)

    out: dict[str, Any] = {"x": rng.standard_normal((t, h)).astype(bf)}
    if e:
        wr = (rng.standard_normal((h, e)) / np.sqrt(h)).astype(bf)
        out.update(router=router_panels(wr, p), experts=experts(e))
        if p.rd.router == "softmax_topk":
            out["router_bias"] = (0.5 * rng.standard_normal((1, e))).astype(bf)
        if p.rd.score_bias:
            out["score_bias"] = (0.1 * rng.standard_normal((1, e))).astype(np.float32)
    if p.s:
        out["shared"] = experts(p.s)
    return out


MOE = register(KernelDef(
    name="moe",
    doc=__doc__.strip().splitlines()[0],
    shape_keys=(
        ShapeKey("tokens", int, 4, "tokens in the batch (decode: the batch size)", minimum=1),
        ShapeKey("hidden", int, 64, "hidden size, multiple of 32 (gpt-oss-120b 2880, DeepSeek-R1 7168)",
                 minimum=32),
        ShapeKey("intermediate", int, 64, "expert intermediate size, multiple of 32 (gpt-oss 2880, "
                 "DeepSeek moe_intermediate 2048)", minimum=32),
        ShapeKey("experts", int, 8, "routed experts (gpt-oss-120b 128, DeepSeek-R1 256, Kimi K2 384); "
                 "0: a dense FFN of the shared experts only (DeepSeek's first layers)", minimum=0),
        ShapeKey("top_k", int, 2, "experts per token (gpt-oss 4, DeepSeek/Kimi 8)", minimum=1),
        ShapeKey("shared_experts", int, 0, "always-on experts of the same size (DeepSeek/Kimi 1)",
                 minimum=0),
        ShapeKey("activation", str, "swiglu_oai", "expert activation: gpt-oss clamped SwiGLU or SiLU*up",
                 choices=("swiglu_oai", "silu")),
        ShapeKey("router", str, "softmax_topk", "gpt-oss: softmax over the top-k logits (router "
                 "has a bias); DeepSeek/Kimi: normalised sigmoid of the top-k",
                 choices=("softmax_topk", "sigmoid_topk")),
        ShapeKey("routed_scaling_factor", float, 1.0, "sigmoid_topk weight scale (DeepSeek-R1 2.5, "
                 "Kimi K2 2.827)"),
        ShapeKey("act_fmt", str, "fp8e4", "format of x and the activations on the matrix unit",
                 choices=("fp8e4", "fp4", "bf16")),
        ShapeKey("routing", str, "any", "grouping=dense: expert slots when distinct_experts=0: any = "
                 "min(E, T*k), enough for every routing; uniform = expected distinct experts under uniform "
                 "routing (grouping=gather runs every expert)", choices=("any", "uniform")),
        ShapeKey("distinct_experts", int, 0, "grouping=dense: expert slots the program gathers (0: from "
                 "routing)", minimum=0),
        ShapeKey("slice", int, 0, "intermediate columns per work item, multiple of 32 (0: automatic)",
                 minimum=0),
        ShapeKey("grouping", str, "auto", "dense: every expert slot computes every token (T <= 128); "
                 "gather: each expert computes the tokens that chose it, gathered in and out (prefill); "
                 "auto: gather above 128 tokens", choices=("auto", "dense", "gather")),
        ShapeKey("capacity_factor", float, 2.0, "gather: tokens each expert takes per 128-token block, "
                 "as a multiple of the expected tb*top_k/experts (more is an error, never a drop)"),
        ShapeKey("expert_bias", bool, False, "gpt-oss: experts have gate/up (mlp1) and down (mlp2) "
                 "biases, BF16, packed with their weights"),
        ShapeKey("n_group", int, 1, "sigmoid_topk: expert groups for DeepSeek's group-limited "
                 "selection (DeepSeek-R1 8, Kimi K2 1)", minimum=1),
        ShapeKey("topk_group", int, 1, "sigmoid_topk: groups kept per token (DeepSeek-R1 4)", minimum=1),
        ShapeKey("score_bias", bool, False, "sigmoid_topk: DeepSeek's e_score_correction_bias (F32 "
                 "[E], input score_bias) added to the scores for selection only (DeepSeek-R1, Kimi K2)"),
    ),
    build=build_moe,
))
