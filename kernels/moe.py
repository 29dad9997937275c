"""Mixture-of-experts FFN of one layer: router, top-k gating, MXFP4 experts, weighted combine.

    logits = x @ Wr (+ b)                          x [T, H] bf16, Wr [H, E] bf16, FP32 logits
    vals, ids = top_k(logits)                      [T, k], ties to the lower index
    gpt-oss  (router=softmax_topk):  w = softmax(vals) over the k selected logits
    DeepSeek/Kimi (router=sigmoid_topk): w = sigmoid(vals) / sum_k sigmoid(vals) * routed_scaling_factor
    y[t] = sum_j w[t, j] * FFN_{ids[t, j]}(x[t]) + sum_s FFN_shared_s(x[t])        y [T, H] bf16
    FFN_e(x) = act(x @ Wg_e, x @ Wu_e) @ Wd_e      Wg, Wu [H, I], Wd [I, H]: MXFP4, blocks along K
    swiglu_oai (gpt-oss): g = min(gate, 7); u = clamp(up, -7, 7); act = g * sigmoid(1.702 g) * (u + 1)
    silu (DeepSeek/Kimi): act = silu(gate) * up

**Only the experts some token chose are read from HBM.** The program is static, the routing is
data, so the kernel is built for a number of *expert slots* D and gathers each slot's weights by
an index the device computes:

1. Router: cores 0..R-1 each multiply x by a column panel of Wr (BF16 on the matrix unit); every
   working core pulls the R logit panels into its own scratchpad (``dma.copy``) and computes the
   routing redundantly (cheap vector work, no second exchange): ``vec.topk``, the gating, and
   ``vec.group`` (this family's instruction, opcode 0x60), which turns the [T, k] expert ids and
   weights into the D distinct experts hit, in increasing order, and a dense [D, T] matrix of
   each token's weight for each of them (0 where the token did not choose the expert).
2. Experts: the work is a list of items (slot u, intermediate slice j of width ``slice``); items
   are dealt round-robin to the cores. An item is one ``dma.gather`` of one row of the packed
   expert table (below) indexed by slot u's expert id, so its bytes come from the expert the
   routing chose. The core computes gate|up = xq @ [Wg | Wu][:, slice] for **all T tokens**
   (dense per slot: with T <= 128 every token row shares the matrix unit's 128-row tile, so
   computing the tokens that did not choose the expert costs no extra time), the activation,
   multiplies each token row by its weight (0 for tokens that did not pick the expert), quantises
   it (``act_fmt``) and accumulates act @ Wd[slice, :] into a per-core FP32 [T, H] accumulator:
   the weighted combine happens in the accumulator. Shared experts are extra items with weight 1,
   loaded (not gathered) from their own table.
3. Combine across cores: each core's [T, H] partial goes to its scratchpad; core c pulls column
   slice c of every partial (``dma.copy``, in rounds of up to 16 partials when they do not fit
   at once), adds them in core order and stores y[:, slice c].

**Dense FFN** (``experts=0``, ``shared_experts >= 1``: DeepSeek-R1's first three layers, Kimi's
first): no router, no routing, no gathers; the items are the shared experts' slices, and the HBM
bytes are the shared weights, x (once per working core) and y.

Weights are double- to quadruple-buffered per core (as the scratchpad allows), two loads in
flight (loads in flight share HBM fairly, so fewer of them land the first item's weights sooner);
the matrix unit runs gate|up of item i+1 while the vector unit computes item i's activation.
The slice width is chosen from a small cost model (bytes over the core's share of HBM vs
matrix-unit steps vs vector work, per item, times items on the busiest core, plus the pipeline
fill), penalised beyond 32 items per core to
keep the program small; ``slice=N`` overrides it. Two scratchpad regions are reused over time
(x/router panel, then the reduction buffers; weight buffers, then the partial), so one core
holds DeepSeek's 64-token step.

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

**Packed expert table** ("experts" [E, expert_bytes] u8, "shared" [S, expert_bytes] u8): for
each expert, for each intermediate slice j (columns c0..c0+w of I) one contiguous chunk:
[H, 2w] fp4 codes of [Wg[:, c0:c0+w] | Wu[:, c0:c0+w]] (row-major, two codes per byte, low
nibble first), their [H/32, 2w] E8M0 scales, [w, H] fp4 codes of Wd[c0:c0+w, :], their [w/32, H]
scales. 1.59375 * H * I bytes per expert (4.25 bits per weight). The router is stored as R
column panels ("router" [R*H, E/R] bf16, panel r = Wr[:, r*E/R:(r+1)*E/R]).
``pack_experts``/``unpack_experts`` convert.

Numerics (the reference does the same operations in the same order, see ``moe_reference``):
router as BF16 x BF16 on the matrix unit (exact products, 32-element blocks summed in order);
logits, gating and activations in FP32, one rounding per vector instruction; x and the
activations quantised to ``act_fmt`` (MXFP8 E4M3 by default, scale mode floor, RNE); expert
matmuls exactly ``mx.matmul``; each core accumulates its items in order, partials are added in
core order, y rounded once to BF16.

Not implemented (say so when comparing with the models): DeepSeek's group-limited selection
(n_group 8 / topk_group 4; Kimi K2 has 1 group, so it is unaffected) and its
e_score_correction_bias (selection here is a plain top-k of the logits, which equals top-k of
the sigmoid scores when they do not saturate into ties); the 1e-20 DeepSeek adds to the weight
sum; gpt-oss's expert biases (mlp1/mlp2 bias) and its even/odd interleaving of gate and up
columns (a layout choice; the math is the same); gpt-oss rounds router logits and activations
to BF16 between operations, this kernel keeps them in FP32. Tokens beyond 128 are computed
densely per slot too, which wastes matrix-unit work (prefill wants a token-gathering variant),
and the [T, H] FP32 partial must fit in a core's accumulator memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jalapeno_emu import mx
from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu.functional import inorder_block_matmul, sequential_row_sum
from jalapeno_emu.emu.program import Tile
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder, MXTensor
from jalapeno_emu.isa.table import DTYPES, Space

from .base import KernelBuild, KernelDef, ShapeKey, Tolerance
from .registry import register

__all__ = ["MOE", "MoePlan", "expected_distinct_experts", "moe_reference", "pack_experts", "plan_moe",
           "unpack_experts"]

SWIGLU_ALPHA = 1.702  # gpt-oss swiglu: glu * sigmoid(alpha * glu)
SWIGLU_LIMIT = 7.0  # gpt-oss swiglu_limit (config): glu <= 7, -7 <= linear <= 7
_MX_FMT = {"fp8e4": "e4m3", "fp4": "e2m1"}  # act_fmt -> mx element format ("bf16": no quantisation)
_SRAM_SHARE = 0.95  # leave a little scratchpad spare
# Items per core beyond which the slice choice is penalised (estimate x (1 + excess / this)): the
# program, and the checker's work, which grows faster than linearly with it, stay small enough to
# build, check and time a full-size layer in seconds to tens of seconds.
_MAX_ITEMS_PER_CORE = 32
_REDUCE_GROUP = 16
# Weight loads in flight per core: two keep the DMA latency hidden, and the first item's weights
# land after two chunks' share of HBM instead of nbuf (loads in flight share bandwidth fairly).
_LOOKAHEAD = 2  # partials pulled per round of the cross-core reduction (bounds its buffer)


def expected_distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """E * (1 - (1 - k/E)^T): distinct experts hit when each of T tokens picks k of E uniformly."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def _chunk_bytes(h: int, w: int) -> int:
    """Bytes of one packed (expert, slice) chunk: gate|up [h, 2w] fp4 + scales, down [w, h] + scales."""
    return h * w + (h // 32) * 2 * w + w * h // 2 + (w // 32) * h


@dataclass(frozen=True)
class MoePlan:
    """How a MoE shape is laid out and split (shared by the builder and the reference).

    Attributes:
        t, h, i, e, k, s: tokens, hidden, intermediate, experts, top_k, shared experts.
        d: expert slots (distinct experts the program serves).
        slices: (start column, width) of each intermediate slice; widths multiples of 32.
        chunk_off: byte offset of each slice's chunk inside one packed expert.
        expert_bytes: bytes of one packed expert.
        items: (shared?, expert slot or shared index, slice index), shared items first.
        cores: working cores; core c runs items c, c + cores, ...
        router_parts, router_cols: R producer cores, E/R logit columns each.
        red: (start column, width) of y each core reduces and stores (width 0: none).
        group: partials pulled per reduction round.
        nbuf: weight buffers per core.
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
    expert_bytes: int
    items: tuple[tuple[bool, int, int], ...]
    cores: int
    router_parts: int
    router_cols: int
    red: tuple[tuple[int, int], ...]
    group: int
    nbuf: int

    def core_items(self, c: int) -> tuple[tuple[bool, int, int], ...]:
        """The items core ``c`` runs, in order."""
        return self.items[c::self.cores]

    @property
    def slice_max(self) -> int:
        """Widest slice."""
        return max(w for _, w in self.slices)


def _slices(i: int, w: int) -> tuple[tuple[int, int], ...]:
    return tuple((c0, min(w, i - c0)) for c0 in range(0, i, w))


def _sram_bytes(t: int, h: int, e: int, k: int, d: int, w: int, nbuf: int, cores: int, ew: int,
                act_fmt: str, group: int = _REDUCE_GROUP) -> int:
    """Scratchpad bytes one core needs (the builder's allocations, 64-byte alignment aside);
    ``group``: partials per reduction round."""
    act_b = {"fp8e4": 1.0, "fp4": 0.5, "bf16": 2.0}[act_fmt]
    scales = 0 if act_fmt == "bf16" else 1 / 32
    hk = -(-h // cores)
    d_max = min(e, t * k)
    return int(
        max(2 * t * h + 2 * h * ew + 4 * t * ew,  # x and router panel | reduction buffers
            4 * min(cores, group) * t * hk + 6 * t * hk)
        + max(nbuf * _chunk_bytes(h, w), 4 * t * h)  # weight buffers | partial
        + (t * h * (act_b + scales) if act_fmt != "bf16" else 2 * t * h)  # xq
        + ((4 * t * e + 2 * e + 12 * t * k + 4 * t + 4 * d_max + 4 * d_max * t) if e else 0)  # routing
        + 4 * w  # ones
        + 4 * t * 2 * w + 4 * t * w + 2 * t * w * (act_b + scales)  # gu, temp, aq x2
        + 64 * 40)  # alignment slack


def plan_moe(shape: dict[str, Any], spec: ChipSpec) -> MoePlan:
    """Validate ``shape`` and choose the split; InvalidArgumentError naming the key otherwise."""
    t, h, i, e, k = (shape[n] for n in ("tokens", "hidden", "intermediate", "experts", "top_k"))
    s, act_fmt = shape["shared_experts"], shape["act_fmt"]
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
    d_max = min(e, t * k)
    d = shape["distinct_experts"]
    if e == 0 and d:
        raise InvalidArgumentError(f"shape key distinct_experts={d} must be 0 when experts=0 (a dense "
                                   "FFN has no routed experts)")
    if d == 0 and e:
        d = d_max if shape["routing"] == "any" else min(d_max, math.ceil(
            expected_distinct_experts(e, k, t) - 1e-9))
    if e and not k <= d <= d_max:
        raise InvalidArgumentError(
            f"shape key distinct_experts={d} must be in [top_k={k}, min(experts, tokens*top_k)={d_max}]"
            " (0: from routing)")
    w_key = shape["slice"]
    if w_key and (w_key % 32 or w_key > i):
        raise InvalidArgumentError(f"shape key slice={w_key} must be a multiple of 32 and at most "
                                   f"intermediate={i} (0: automatic)")
    cores_avail = spec.core.count
    # Router panels: R producers, each E/R columns (R divides E, at most one per 32 columns).
    r_parts = max(r for r in range(1, min(cores_avail, max(1, e // 32)) + 1) if e % r == 0) if e else 0
    ew = e // r_parts if e else 0
    acc_cap, sram_cap = spec.sram.accumulator_bytes, int(spec.sram.scratchpad_bytes * _SRAM_SHARE)

    def cost(w: int, nbuf: int) -> float:
        """Estimated seconds of the busiest core for slice width w, fixed costs included. With two
        buffers a load waits for the previous item's matmuls, so load and compute add up."""
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
        load = _chunk_bytes(h, w) / hbm_rate
        # With more than two buffers the loads stream back to back (latency hidden behind the
        # load in flight); with two a load waits for the previous item's matmuls.
        item = max(load, mxu, vec) if nbuf > 2 else load + latency + max(mxu, vec)
        # Pipeline fill: x and the first two chunks share the core's bandwidth before any matmul.
        fill = latency + (2 * t * h + _LOOKAHEAD * _chunk_bytes(h, w)) / hbm_rate
        return per_core * item + fill

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
            if _sram_bytes(t, h, e, k, d, w, nb, cores, ew, act_fmt) <= sram_cap:
                over = max(0, per_core - _MAX_ITEMS_PER_CORE) / _MAX_ITEMS_PER_CORE
                fitting.append((cost(w, nb) * (1 + over), -w, w, nb, cores))
                break
    best = min(fitting)[2:] if fitting else None
    if best is None:
        w = candidates[0]
        need = _sram_bytes(t, h, e, k, d, w, 2, cores_avail, ew, act_fmt)
        raise InvalidArgumentError(
            f"shape key hidden={h} (tokens={t}, slice={w}): one core needs {need:,} B of scratchpad "
            f"with double-buffered weights; {spec.name} has {spec.sram.scratchpad_bytes:,} B")
    w, nbuf, cores = best
    slices = _slices(i, w)
    offs = np.cumsum([0] + [_chunk_bytes(h, sw) for _, sw in slices]).tolist()
    items = tuple((True, si, j) for si in range(s) for j in range(len(slices))) + \
        tuple((False, u, j) for u in range(d) for j in range(len(slices)))
    bounds = np.linspace(0, h, cores + 1).round().astype(int).tolist()
    red = tuple((bounds[c], bounds[c + 1] - bounds[c]) for c in range(cores))
    # One reduction round when every partial slice fits beside the rest (rounds wait for each other).
    group = cores if _sram_bytes(t, h, e, k, d, w, nbuf, cores, ew, act_fmt, cores) <= sram_cap else \
        min(cores, _REDUCE_GROUP)
    return MoePlan(t, h, i, e, k, s, d, slices, tuple(offs[:-1]), offs[-1], items, cores, r_parts, ew,
                   red, group, nbuf)


# --- packed weights -------------------------------------------------------------------------
def _fp4_bytes(codes: np.ndarray) -> np.ndarray:
    """Row-major fp4 codes [R, C] -> bytes [R * C / 2], two per byte, low nibble first."""
    c = np.asarray(codes, np.uint8)
    return ((c[:, 0::2] & 0xF) | ((c[:, 1::2] & 0xF) << 4)).reshape(-1)


def _fp4_codes(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    raw = np.asarray(raw, np.uint8).reshape(rows, cols // 2)
    return np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(rows, cols)


def pack_experts(gate: list[mx.MXArray], up: list[mx.MXArray], down: list[mx.MXArray],
                 plan: MoePlan) -> np.ndarray:
    """Experts' MXFP4 weights -> the packed table, uint8 [n, expert_bytes] (layout in the docstring).

    Args:
        gate, up: per expert an MXArray [H, I] blocked along H (axis 0).
        down: per expert an MXArray [I, H] blocked along I (axis 0).
    """
    out = np.zeros((len(gate), plan.expert_bytes), np.uint8)
    for n, (g, u, dn) in enumerate(zip(gate, up, down, strict=True)):
        gc, gs, uc, us = (np.asarray(a) for a in (g.codes, g.scales, u.codes, u.scales))
        dc, ds = np.asarray(dn.codes), np.asarray(dn.scales)
        parts = []
        for c0, w in plan.slices:
            parts += [_fp4_bytes(np.concatenate([gc[:, c0:c0 + w], uc[:, c0:c0 + w]], axis=1)),
                      np.concatenate([gs[:, c0:c0 + w], us[:, c0:c0 + w]], axis=1).reshape(-1),
                      _fp4_bytes(dc[c0:c0 + w]), ds[c0 // 32:(c0 + w) // 32].reshape(-1)]
        out[n] = np.concatenate(parts)
    return out


def unpack_experts(table: np.ndarray, plan: MoePlan) -> list[tuple[mx.MXArray, mx.MXArray, mx.MXArray]]:
    """The packed table -> per expert (gate [H, I], up [H, I], down [I, H]) MXFP4 MXArrays."""
    h, i = plan.h, plan.i
    out = []
    for row in np.asarray(table, np.uint8).reshape(-1, plan.expert_bytes):
        gc, gs = np.zeros((h, i), np.uint8), np.zeros((h // 32, i), np.uint8)
        uc, us = np.zeros_like(gc), np.zeros_like(gs)
        dc, ds = np.zeros((i, h), np.uint8), np.zeros((i // 32, h), np.uint8)
        for (c0, w), off in zip(plan.slices, plan.chunk_off, strict=True):
            o = off
            gu = _fp4_codes(row[o:o + h * w], h, 2 * w)
            o += h * w
            gus = row[o:o + (h // 32) * 2 * w].reshape(h // 32, 2 * w)
            o += (h // 32) * 2 * w
            gc[:, c0:c0 + w], uc[:, c0:c0 + w] = gu[:, :w], gu[:, w:]
            gs[:, c0:c0 + w], us[:, c0:c0 + w] = gus[:, :w], gus[:, w:]
            dc[c0:c0 + w] = _fp4_codes(row[o:o + w * h // 2], w, h)
            o += w * h // 2
            ds[c0 // 32:(c0 + w) // 32] = row[o:o + (w // 32) * h].reshape(w // 32, h)
        out.append(tuple(mx.MXArray(codes=c, scales=sc, fmt="e2m1", axis=0, block_size=32)
                         for c, sc in ((gc, gs), (uc, us), (dc, ds))))
    return out


def _router_panels(wr: np.ndarray, plan: MoePlan) -> np.ndarray:
    """Wr [H, E] -> the HBM layout [R*H, E/R] (column panels stacked)."""
    ew = plan.router_cols
    return np.concatenate([wr[:, r * ew:(r + 1) * ew] for r in range(plan.router_parts)], axis=0)


def _router_logical(panels: np.ndarray, plan: MoePlan) -> np.ndarray:
    h = plan.h
    return np.concatenate([panels[r * h:(r + 1) * h] for r in range(plan.router_parts)], axis=1)


# --- reference --------------------------------------------------------------------------------
def _bf16_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """The matrix unit on BF16 operands from +0 (the emulator's documented semantics)."""
    return inorder_block_matmul(a, b)


def _group(ids: np.ndarray, w: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """``vec.group``'s semantics in numpy: (distinct ids padded to d, [d, T] weights)."""
    uniq = np.unique(ids)
    if len(uniq) > d:
        raise InvalidArgumentError(f"the routing hits {len(uniq)} distinct experts; the program "
                                   f"was built for distinct_experts={d}")
    slots = np.concatenate([uniq, np.full(d - len(uniq), uniq[-1])]).astype(np.int32)
    sw = np.zeros((d, ids.shape[0]), np.float32)
    for u, ex in enumerate(uniq):
        for j in range(ids.shape[1]):
            sw[u] = sw[u] + np.where(ids[:, j] == ex, w[:, j], np.float32(0))
    return slots, sw


def _route(x: jax.Array, inputs: dict[str, Any], plan: MoePlan, shape: dict[str, Any]):
    """(top-k ids [T, k], weights [T, k]) exactly as the kernel computes them."""
    wr = jnp.asarray(_router_logical(np.asarray(inputs["router"]), plan), jnp.float32)
    logits = _bf16_matmul(x, wr)
    if shape["router"] == "softmax_topk":
        logits = logits + jnp.asarray(inputs["router_bias"], jnp.float32)
        vals, ids = lax.top_k(logits, plan.k)
        e = jnp.exp(vals - vals[:, :1])
        w = e * (jnp.float32(1) / sequential_row_sum(e))
    else:
        vals, ids = lax.top_k(logits, plan.k)
        sg = jax.nn.sigmoid(vals)
        w = (sg * (jnp.float32(1) / sequential_row_sum(sg))) * jnp.float32(shape["routed_scaling_factor"])
    return np.asarray(ids, np.int32), np.asarray(w, np.float32)


def _activation(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    if activation == "swiglu_oai":
        g = jnp.minimum(gate, jnp.float32(SWIGLU_LIMIT))
        u = jnp.clip(up, jnp.float32(-SWIGLU_LIMIT), jnp.float32(SWIGLU_LIMIT))
        glu = g * jax.nn.sigmoid(g * jnp.float32(SWIGLU_ALPHA))
        return glu * (u + jnp.float32(1))
    return (gate * jax.nn.sigmoid(gate)) * up


def moe_reference(inputs: dict[str, Any], plan: MoePlan, shape: dict[str, Any]) -> dict[str, np.ndarray]:
    """Pure-JAX MoE with the kernel's numerics and summation order; {"y": bf16 [T, H],
    "expert_ids": int32 [D, 1]}."""
    act_fmt, activation = shape["act_fmt"], shape["activation"]
    x = jnp.asarray(np.asarray(inputs["x"]).astype(np.float32))
    slots, slot_w, routed = np.zeros(0, np.int32), np.zeros((0, plan.t), np.float32), []
    if plan.e:
        ids, w = _route(x, inputs, plan, shape)
        slots, slot_w = _group(ids, w, plan.d)
        routed = unpack_experts(inputs["experts"], plan)
    shared = unpack_experts(inputs["shared"], plan) if plan.s else []

    def quant(v):
        return v.astype(jnp.bfloat16) if act_fmt == "bf16" else mx.quantize(v, _MX_FMT[act_fmt], axis=1)

    def mm(acc, a, b):
        return _bf16_accumulate(acc, a, b) if act_fmt == "bf16" else mx.matmul_accumulate(acc, a, b)

    xq = quant(x)
    partials = []
    for c in range(plan.cores):
        acc = jnp.zeros((plan.t, plan.h), jnp.float32)
        for n, (is_shared, slot, j) in enumerate(plan.core_items(c)):
            g, u, dn = shared[slot] if is_shared else routed[int(slots[slot])]
            c0, wd = plan.slices[j]
            gu_w = _mx_cols(g, u, c0, wd)
            gu = mm(jnp.zeros((plan.t, 2 * wd), jnp.float32), xq, gu_w)
            a = _activation(gu[:, :wd], gu[:, wd:], activation)
            if not is_shared:
                a = a * jnp.asarray(slot_w[slot])[:, None]
            d_w = mx.MXArray(codes=np.asarray(dn.codes)[c0:c0 + wd], scales=np.asarray(dn.scales)[
                c0 // 32:(c0 + wd) // 32], fmt="e2m1", axis=0, block_size=32)
            acc = mm(jnp.zeros_like(acc) if n == 0 else acc, quant(a), d_w)
        partials.append(acc)
    y = partials[0]
    for p in partials[1:]:
        y = y + p
    return {"y": np.asarray(y.astype(jnp.bfloat16)), "expert_ids": slots[:, None]}


def _mx_cols(g: mx.MXArray, u: mx.MXArray, c0: int, w: int) -> mx.MXArray:
    """[Wg[:, c0:c0+w] | Wu[:, c0:c0+w]] as one MXArray blocked along rows."""
    codes = np.concatenate([np.asarray(g.codes)[:, c0:c0 + w], np.asarray(u.codes)[:, c0:c0 + w]], axis=1)
    scales = np.concatenate([np.asarray(g.scales)[:, c0:c0 + w], np.asarray(u.scales)[:, c0:c0 + w]],
                            axis=1)
    return mx.MXArray(codes=codes, scales=scales, fmt="e2m1", axis=0, block_size=32)


def _bf16_accumulate(acc: jax.Array, a: jax.Array, b: mx.MXArray) -> jax.Array:
    """acc + BF16 a @ MXFP4 b with the matrix unit's BF16 path (per-block sums, in order)."""
    return inorder_block_matmul(a.astype(jnp.float32), mx.dequantize(b, jnp.float32), acc)


# --- the kernel ------------------------------------------------------------------------------
def _view(t: Tile, off: int, dtype: str, rows: int, cols: int, stride: int = -1) -> Tile:
    """Another view of the bytes of tile ``t`` starting ``off`` bytes in."""
    return Tile(t.space, t.core, t.offset + off, dtype, rows, cols, stride)


def _chunk_views(buf: Tile, h: int, w: int) -> tuple[MXTensor, MXTensor]:
    """(gate|up [h, 2w], down [w, h]) MXTensors over one packed chunk in SRAM."""
    o1 = h * w
    o2 = o1 + (h // 32) * 2 * w
    o3 = o2 + w * h // 2
    gu = MXTensor(_view(buf, 0, "fp4", h, 2 * w), _view(buf, o1, "e8m0", h // 32, 2 * w), 0)
    dn = MXTensor(_view(buf, o2, "fp4", w, h), _view(buf, o3, "e8m0", w // 32, h), 0)
    return gu, dn


def _layout(parts: list[tuple[str, str, tuple[int, int]]]) -> tuple[list[tuple[str, int, str, tuple]], int]:
    """64-byte aligned offsets of consecutive tiles in one region: ([(name, offset, dtype, shape)], bytes)."""
    out, off = [], 0
    for name, dtype, (rows, cols) in parts:
        out.append((name, off, dtype, (rows, cols)))
        off += -(-rows * DTYPES[dtype].row_bytes(cols) // 64) * 64
    return out, off


def _union(kb: KernelBuilder, c: int, name: str, *layouts: list) -> dict[str, Tile]:
    """One scratchpad region shared by several sets of tiles that are live at different times
    (the semaphores that order their uses also order the reuse; the checker verifies it)."""
    laid = [_layout(parts) for parts in layouts]
    region = kb.sram(c, name, (1, max(n for _, n in laid)), "u8")
    return {tn: _view(region, off, dt, *shape) for parts, _ in laid for tn, off, dt, shape in parts}


def _alloc_core(kb: KernelBuilder, c: int, p: MoePlan, act_fmt: str) -> dict[str, Any]:
    """Every buffer of core ``c``. All cores allocate the same buffers in the same order (router
    panel and slot tables at their largest size included), so their scratchpads have the same
    layout and the functional pass compiles each instruction shape once for all of them.

    Two regions are reused: x and the router panel (done once routing is) later hold the
    cross-core reduction; the weight buffers (done after the last item) later hold the partial.
    """
    t, h, e, k, smax = p.t, p.h, p.e, p.k, p.slice_max
    d_max = min(e, t * k)
    hk_max = max(w for _, w in p.red)
    chunk = _chunk_bytes(h, smax)
    router = [("wr", "bf16", (h, p.router_cols)), ("logits_part", "f32", (t, p.router_cols))] if e else []
    B: dict[str, Any] = _union(
        kb, c, "x_then_red", [("x", "bf16", (t, h)), *router],
        [("red", "f32", (p.group * t, hk_max)), ("ysum", "f32", (t, hk_max)), ("ybuf", "bf16", (t, hk_max))])
    B.update(_union(kb, c, "weights_then_partial", [(f"w{b}", "u8", (1, chunk)) for b in range(p.nbuf)],
                    [("partial", "f32", (t, h))]))
    B["wbuf"] = [B.pop(f"w{b}") for b in range(p.nbuf)]
    if e:
        B.update({
            "logits": kb.sram(c, "logits", (t, e), "f32"),
            "bias": kb.sram(c, "bias", (1, e), "bf16"),
            "vals": kb.sram(c, "vals", (t, k), "f32"),
            "idx": kb.sram(c, "idx", (t, k), "i32"),
            "gw": kb.sram(c, "gw", (t, k), "f32"),
            "col": kb.sram(c, "col", (t, 1), "f32"),
            "slot_ids": kb.sram(c, "slot_ids", (d_max, 1), "i32").sub(0, 0, p.d, 1),
            "slot_w": kb.sram(c, "slot_w", (d_max, t), "f32").sub(0, 0, p.d, t),
        })
    B.update({
        "ones": kb.sram(c, "ones", (1, smax), "f32"),
        "xq": kb.sram(c, "xq16", (t, h), "bf16") if act_fmt == "bf16"
        else kb.sram_mx(c, "xq", (t, h), act_fmt, axis=1),
        "gu": kb.sram(c, "gu", (t, 2 * smax), "f32"),
        "tmp": kb.sram(c, "tmp", (t, smax), "f32"),
        "aq": [kb.sram(c, f"aq{b}", (t, smax), "bf16") if act_fmt == "bf16"
               else kb.sram_mx(c, f"aq{b}", (t, smax), act_fmt, axis=1) for b in range(2)],
        "acc_gu": [kb.acc(c, f"acc_gu{b}", (t, 2 * smax)) for b in range(2)],
        "acc_out": kb.acc(c, "acc_out", (t, h)),
    })
    if e:
        B["acc_r"] = kb.acc(c, "acc_r", (t, p.router_cols))
    if act_fmt == "bf16":
        B["xq"] = B["x"]  # the matrix unit takes x as it is (xq16 keeps the layout uniform)
    B["sem"] = {n: kb.semaphore(f"c{c}.{n}") for n in (
        "x_loaded", "consts", "wr_loaded", "r_done", "pulled", "xq_ready", "routed", "loaded",
        "gu_done", "gu_read", "act_ready", "freed", "red_loaded0", "red_loaded1", "red_free", "y_ready")}
    return B


def _route_on_core(kb: KernelBuilder, c: int, B: dict[str, Any], bufs: dict[int, dict[str, Any]],
                   p: MoePlan, shape: dict[str, Any], bias_h: Tile | None, ids_h: Tile,
                   logits_ready: Any) -> None:
    """Core ``c`` pulls the R logit panels and routes every token: top-k, gating, vec.group into
    the slot tables (``slot_ids`` [D, 1], ``slot_w`` [D, T]); core 0 also stores the slot ids."""
    t = p.t
    core, sem, v = kb.core(c), B["sem"], kb.core(c).vpu
    q1 = core.dma[1 % kb.chip.dma.queues_per_core]
    logits, vals, idx, gw, col = (B[n] for n in ("logits", "vals", "idx", "gw", "col"))
    slot_ids, slot_w = B["slot_ids"], B["slot_w"]
    if bias_h is not None:
        q1.load(B["bias"], bias_h)
    q1.signal(sem["consts"])
    q1.wait(logits_ready, p.router_parts)
    for r in range(p.router_parts):
        q1.copy(logits.sub(0, r * p.router_cols, t, p.router_cols), bufs[r]["logits_part"])
    q1.signal(sem["pulled"])
    v.wait(sem["consts"], 1)
    v.wait(sem["pulled"], 1)
    if shape["router"] == "softmax_topk":
        v.add(logits, logits, B["bias"])
        v.topk(vals, idx, logits)
        v.copy(col, vals.sub(0, 0, t, 1))
        v.sub(gw, vals, col)
        v.exp(gw, gw)
    else:
        v.topk(vals, idx, logits)
        v.sigmoid(gw, vals)
    v.reduce("sum", col, gw)
    v.recip(col, col)
    v.mul(gw, gw, col)
    if shape["router"] == "sigmoid_topk":
        v.scale(gw, gw, shape["routed_scaling_factor"])
    v.group(slot_ids, slot_w, idx, gw)
    v.signal(sem["routed"])
    if c == 0:
        q1.wait(sem["routed"], 1)
        q1.store(ids_h, slot_ids)


def build_moe(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """The MoE layer step for ``shape`` (keys in ``MOE``) on chip ``spec``."""
    p = plan_moe(shape, spec)
    t, h, e, k = p.t, p.h, p.e, p.k
    act_fmt, activation, router = shape["act_fmt"], shape["activation"], shape["router"]
    smax, nq = p.slice_max, spec.dma.queues_per_core
    kb = KernelBuilder(f"moe_t{t}_h{h}_i{p.i}_e{e}_k{k}_d{p.d}", chip=spec)
    x_h = kb.hbm("x", (t, h), "bf16")
    wr_h = kb.hbm("router", (p.router_parts * h, p.router_cols), "bf16") if e else None
    bias_h = kb.hbm("router_bias", (1, e), "bf16") if e and router == "softmax_topk" else None
    ones_h = kb.hbm("ones", (1, smax), "f32") if activation == "swiglu_oai" else None
    exp_h = kb.hbm("experts", (e, p.expert_bytes), "u8") if e else None
    sh_h = kb.hbm("shared", (p.s, p.expert_bytes), "u8") if p.s else None
    y_h = kb.hbm("y", (t, h), "bf16")
    ids_h = kb.hbm("expert_ids", (p.d, 1), "i32") if e else None
    logits_ready = kb.semaphore("logits_ready")
    partials_ready = kb.semaphore("partials_ready")
    workers, producers = range(p.cores), range(p.router_parts)
    bufs = {c: _alloc_core(kb, c, p, act_fmt) for c in range(max(p.cores, p.router_parts))}

    for c, B in bufs.items():
        core, sem, v, m = kb.core(c), B["sem"], kb.core(c).vpu, kb.core(c).mxu
        q0, q1 = core.dma[0], core.dma[1 % nq]
        q0.load(B["x"], x_h)
        q0.signal(sem["x_loaded"])
        # --- router: one column panel of the logits per producer core ---
        if c in producers:
            q1.load(B["wr"], wr_h.sub(c * h, 0, h, p.router_cols))
            q1.signal(sem["wr_loaded"])
            m.wait(sem["x_loaded"], 1)
            m.wait(sem["wr_loaded"], 1)
            m.matmul(B["acc_r"], B["x"], B["wr"], mode="overwrite")
            m.signal(sem["r_done"])
        if c not in workers:
            v.wait(sem["r_done"], 1)
            v.acc_read(B["logits_part"], B["acc_r"])
            v.signal(logits_ready)
            continue
        items = p.core_items(c)
        # --- x in the matrix unit's activation format ---
        xq = B["xq"]
        v.wait(sem["x_loaded"], 1)
        if act_fmt != "bf16":
            v.quantize(xq.codes, xq.scales, B["x"])
        v.signal(sem["xq_ready"])
        if c in producers:
            v.wait(sem["r_done"], 1)
            v.acc_read(B["logits_part"], B["acc_r"])
            v.signal(logits_ready)
        if ones_h is not None:
            q1.load(B["ones"], ones_h)
        if e:
            _route_on_core(kb, c, B, bufs, p, shape, bias_h, ids_h, logits_ready)
        else:
            q1.signal(sem["consts"])
            v.wait(sem["consts"], 1)
        slot_ids, slot_w = B.get("slot_ids"), B.get("slot_w")
        # --- expert items: weights in (dma0), gate|up and down (mxu), activation (vpu) ---
        wbuf, acc_gu, acc_out, gu, tmp, aq = (B[n] for n in ("wbuf", "acc_gu", "acc_out", "gu", "tmp", "aq"))
        routed_waited = False
        for n, (is_shared, slot, j) in enumerate(items):
            w = p.slices[j][1]
            chunk = _chunk_bytes(h, w)
            dst = wbuf[n % p.nbuf].sub(0, 0, 1, chunk)
            if n >= p.nbuf:  # the buffer's previous item must be done on the matrix unit
                q0.wait(sem["freed"], n - p.nbuf + 1)
            if n >= _LOOKAHEAD:
                q0.wait(sem["loaded"], n - _LOOKAHEAD + 1)
            if is_shared:
                q0.load(dst, Tile(Space.HBM, 0, sh_h.offset + slot * p.expert_bytes + p.chunk_off[j],
                                  "u8", 1, chunk))
            else:
                if not routed_waited:
                    q0.wait(sem["routed"], 1)
                    routed_waited = True
                table = Tile(Space.HBM, 0, exp_h.offset + p.chunk_off[j], "u8", e, chunk, p.expert_bytes)
                q0.gather(dst, table, slot_ids.sub(slot, 0, 1, 1))
            q0.signal(sem["loaded"])

        def gate_up(n: int, m=m, sem=sem, items=items, wbuf=wbuf, acc_gu=acc_gu, xq=xq) -> None:
            w = p.slices[items[n][2]][1]
            wgu, _ = _chunk_views(wbuf[n % p.nbuf], h, w)
            if n == 0:
                m.wait(sem["xq_ready"], 1)
            m.wait(sem["loaded"], n + 1)
            if n >= 2:  # the vector unit has read this accumulator's previous item
                m.wait(sem["gu_read"], n - 1)
            m.matmul_mx(acc_gu[n % 2].sub(0, 0, t, 2 * w), xq, wgu, mode="overwrite")
            m.signal(sem["gu_done"])

        def down(n: int, m=m, sem=sem, items=items, wbuf=wbuf, aq=aq, acc_out=acc_out) -> None:
            w = p.slices[items[n][2]][1]
            _, wd = _chunk_views(wbuf[n % p.nbuf], h, w)
            m.wait(sem["act_ready"], n + 1)
            m.matmul_mx(acc_out, aq[n % 2].sub(0, 0, t, w), wd, mode="overwrite" if n == 0 else "accumulate")
            m.signal(sem["freed"])

        for n in range(len(items)):  # gate|up of item n runs while the vpu activates item n - 1
            gate_up(n)
            if n:
                down(n - 1)
        down(len(items) - 1)

        for n, (is_shared, slot, j) in enumerate(items):
            w = p.slices[j][1]
            g_t, u_t, a_t = gu.sub(0, 0, t, w), gu.sub(0, w, t, w), tmp.sub(0, 0, t, w)
            v.wait(sem["gu_done"], n + 1)
            v.acc_read(gu.sub(0, 0, t, 2 * w), acc_gu[n % 2].sub(0, 0, t, 2 * w))
            v.signal(sem["gu_read"])
            if activation == "swiglu_oai":
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
            # the token's gate weight for this slot's expert: column `slot` of the [D, T] table
            wcol = None if is_shared else _view(slot_w, slot * t * 4, "f32", t, 1, 4)
            if act_fmt == "bf16":
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
        v.acc_read(B["partial"], acc_out)
        v.signal(partials_ready)

    # --- reduce column slices across cores and store y ---
    for c in workers:
        h0, hk = p.red[c]
        if hk == 0:
            continue
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

    expected = expected_distinct_experts(e, k, t) if e else 0.0

    def make_inputs(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        bf = ml_dtypes.bfloat16
        x = rng.standard_normal((t, h)).astype(bf)
        wr = (rng.standard_normal((h, e)) / np.sqrt(h)).astype(bf)

        def experts(n: int):
            g = [mx.quantize(3 * rng.standard_normal((h, p.i)).astype(np.float32) / np.sqrt(h), "e2m1",
                             axis=0) for _ in range(n)]
            u = [mx.quantize(3 * rng.standard_normal((h, p.i)).astype(np.float32) / np.sqrt(h), "e2m1",
                             axis=0) for _ in range(n)]
            d = [mx.quantize(rng.standard_normal((p.i, h)).astype(np.float32) / np.sqrt(p.i), "e2m1",
                             axis=0) for _ in range(n)]
            return pack_experts(g, u, d, p)

        out = {"x": x}
        if e:
            out.update(router=_router_panels(wr, p), experts=experts(e))
        if bias_h is not None:
            out["router_bias"] = (0.5 * rng.standard_normal((1, e))).astype(bf)
        if ones_h is not None:
            out["ones"] = np.ones((1, smax), np.float32)
        if p.s:
            out["shared"] = experts(p.s)
        return out

    def reference(inputs: dict[str, Any]) -> dict[str, Any]:
        return {"y": moe_reference(inputs, p, shape)["y"]}

    return KernelBuild(
        program=kb.build(), make_inputs=make_inputs, reference=reference,
        outputs={"y": ("bf16", (t, h))},
        tolerance=Tolerance(
            atol=1e-6, rtol=2.0**-7,
            why="same operations in the same order as the reference (MX matmuls bit-exact, FP32 "
                "vector steps, per-core then cross-core sums in the kernel's order); exp and sigmoid "
                "may differ in the last FP32 bit between XLA's code paths, which can move y by one "
                "BF16 ulp (or an activation by one MX rounding step)"),
        notes={"distinct_experts": p.d, "distinct_experts_uniform": round(expected, 2),
               "expert_bytes": p.expert_bytes, "routed_expert_bytes": p.d * p.expert_bytes,
               "shared_expert_bytes": p.s * p.expert_bytes, "slice": p.slice_max, "items": len(p.items),
               "cores": p.cores, "weight_buffers": p.nbuf, "router_parts": p.router_parts},
    )


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
        ShapeKey("routing", str, "any", "expert slots when distinct_experts=0: any = min(E, T*k), "
                 "enough for every routing; uniform = expected distinct experts under uniform routing",
                 choices=("any", "uniform")),
        ShapeKey("distinct_experts", int, 0, "expert slots the program gathers (0: from routing)",
                 minimum=0),
        ShapeKey("slice", int, 0, "intermediate columns per work item, multiple of 32 (0: automatic)",
                 minimum=0),
    ),
    build=build_moe,
))
