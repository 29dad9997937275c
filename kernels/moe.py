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

**Expert FFNs compute the routed (token, expert) pairs.** The program is static, the routing is
data; every program gathers only the experts' weights it needs and multiplies each expert by the
rows of the tokens that chose it (a grouped GEMM over each expert's token list). Three programs,
chosen by ``planning.first_fitting`` in this order (``grouping``):

- ``slots`` (``moe_slots``; up to 128 tokens, the decode batches): D *expert slots*, the distinct
  experts hit, each with a token list of a static capacity: ``routing=any`` every token (enough
  for every routing: the functional runs), ``routing=uniform`` the expected counts (T*k over the
  slots: the routed rows, what to time real batches with), ``distinct_experts=N`` N slots. The
  matrix unit prices a matmul by 128 x 128 x 32 tile steps whatever its M, so an expert with few
  tokens costs its weight stream and one row tile: the FLOPs are the routed work, the time the
  weights'.
- ``panel`` (``moe_panel``): the slot program through HBM in K panels, for small scratchpads
  (GPU shared memory) where the slot program's per-core buffers do not fit.
- ``gather`` (``moe_gather``; prefill): per token block each expert computes the tokens that chose
  it (capacity ``ceil(tb * top_k / experts * capacity_factor)``), x and the router tiled by rows
  and K panels so that any token count plans.

``grouping=auto``: slots, then (when the [T, H] FP32 partial does not fit a core's accumulators)
gather, then panel, except for a dense FFN (panel first: without routing, gather only adds its
staging); past the accumulators a slot plan left with two weight buffers or 32-column slices
gives way to gather (it streams its weights worse), and runs only when gather does not fit;
above 128 tokens gather. ``grouping=dense``: slots, then panel;
``grouping=gather``: gather only. A routing that exceeds a list's capacity, or hits more distinct
experts than the program has slots, raises in the functional pass: never a silent drop.

**Dense FFN** (``experts=0``, ``shared_experts >= 1``: DeepSeek-R1's first three layers, Kimi's
first): no router, no routing, no gathers; the work is the shared experts' slices.

**HBM bytes** are the distinct experts' weights (D x ``notes["expert_bytes"]``; the gather program:
every expert's), the shared experts', x, the router and the output, plus the programs' staging.

Tensors (``moe_tensors``): ``x`` [T, H] bf16 (input: HBM or on chip); ``router`` [R*H, E/R]
bf16 (R column panels, ``moe_pack.router_panels``); ``router_bias`` [1, E] bf16 (softmax_topk);
``score_bias`` [1, E] f32 (score_bias); ``experts`` [E, expert_bytes] and ``shared``
[S, expert_bytes] u8 (the packed tables, ``pack_experts``, whose layout depends on the plan); the
outputs ``y`` [T, H] bf16 and, for the slot programs, ``expert_ids`` [D, 1] i32; each program's HBM
staging (role scratch).

Numerics (each program's reference does the same operations in the same order): router as BF16 x
BF16 on the matrix unit (exact products, 32-element blocks summed in order); logits, gating and
activations in FP32, one rounding per vector instruction; x and the activations quantised to
``act_fmt`` (MXFP8 E4M3 by default, scale mode floor, RNE); expert matmuls exactly ``mx.matmul``;
sums in each program's order, y rounded once to BF16.

Not implemented (say so when comparing with the models): gpt-oss's even/odd interleaving of
gate and up columns (a layout choice; the math is the same); gpt-oss rounds router logits and
activations to BF16 between operations, this kernel keeps them in FP32. The gather program's
capacity is per (expert, 128-token block), so its slack is paid per block (at DeepSeek/gpt-oss
shapes each expert computes 2x the rows its tokens need at the default capacity_factor 2), and it
reads every expert whether or not a token chose it (at prefill sizes they all are).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.lazy import LazyModule

from .base import KernelBuild, KernelDef, ShapeKey, TensorSpec, Tolerance
from .emit import EmitCtx, Emitter, Out, TensorRef, run_emitter
from .moe_base import SWIGLU_ALPHA, SWIGLU_LIMIT, MoeLayout, expected_distinct_experts
from .moe_gather import emit_gather
from .moe_gather_plan import GatherPlan, gather_tensors, plan_gather
from .moe_gather_ref import gather_reference
from .moe_pack import pack_experts, router_panels, unpack_expert_biases, unpack_experts
from .moe_panel import emit_panel
from .moe_panel_plan import PanelPlan, panel_tensors, plan_panel
from .moe_panel_ref import panel_reference
from .moe_routing import check_routing_keys
from .moe_slots import emit_slots
from .moe_slots_plan import MAX_TOKENS, MoePlan, plan_slots, slot_tensors
from .moe_slots_ref import slots_reference
from .planning import Budget, DoesNotFit, first_fitting
from .registry import register

ml_dtypes = LazyModule("ml_dtypes")  # loaded on first use: importing it costs 0.5 s

__all__ = ["MOE", "SWIGLU_ALPHA", "SWIGLU_LIMIT", "GatherPlan", "MoePlan", "PanelPlan", "emit_moe",
           "expected_distinct_experts", "grouping_of", "make_moe_inputs", "moe_reference", "moe_tensors",
           "pack_experts", "plan_moe", "router_panels", "unpack_expert_biases", "unpack_experts"]

Plan = MoePlan | PanelPlan | GatherPlan


# --- shape ------------------------------------------------------------------------------------
def check_shape(shape: dict[str, Any]) -> None:
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
    if shape["grouping"] == "gather" and shape["distinct_experts"]:
        raise InvalidArgumentError(f"shape key distinct_experts={shape['distinct_experts']} applies to "
                                   "grouping=dense (the gather program runs every expert's tokens)")
    if shape["capacity_factor"] <= 0:
        raise InvalidArgumentError(f"shape key capacity_factor={shape['capacity_factor']} must be positive")


def slot_count(shape: dict[str, Any]) -> int:
    """D, the expert slots of the slot programs (checked against the routing's bounds)."""
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


# --- the choice between programs ----------------------------------------------------------------
def _partial_fits(shape: dict[str, Any], budget: Budget) -> bool:
    """The slot program's dense arrangement fits: its [T, H] FP32 partial and two gate|up tiles."""
    t, h = shape["tokens"], shape["hidden"]
    return 4 * t * h + 2 * 4 * t * 2 * 32 + 4 * t * 128 <= budget.acc_bytes


def _planners(shape: dict[str, Any], spec: ChipSpec, budget: Budget,
              gather_shape: dict[str, Any] | None = None) -> list[tuple[str, Any]]:
    """The (name, planner) list ``first_fitting`` runs for ``shape`` (module docstring)."""
    gshape = gather_shape or shape

    def slots() -> MoePlan:
        return plan_slots(shape, spec, budget, slot_count(shape))

    def streaming_slots() -> MoePlan:
        # Past the accumulators the slot program's buffers compete with its routed rows: with
        # two weight buffers each item's load waits for the previous item's matmuls, and with
        # 32-column slices per-item costs double. Gather then wins (on jalapeno-v1: Kimi K2.5 at
        # 96 tokens 1,083 -> 800 us, DeepSeek-R1 at 112 825 -> 535 us), so such plans give way
        # to it; where gather does not fit either, they still run.
        p = slots()
        narrowest = min(w for _, w in p.slices)
        if p.nbuf < 3 or narrowest < 64:
            raise DoesNotFit(f"the slot program keeps {p.nbuf} weight buffers of {narrowest}-column "
                             "slices here: the gather program streams better")
        return p

    def panel() -> PanelPlan:
        return plan_panel(shape, spec, budget, slot_count(shape))

    def gather() -> GatherPlan:
        if g == "auto" and gather_shape is None and shape["distinct_experts"]:
            # A slot count is the slot programs' (the rack's launch at a batch the kernel serves
            # with slots): gather has none, so auto passes it over like a program that does not
            # fit and goes on to panel (GPU scratchpads), where it raised and refused the batch.
            raise DoesNotFit(f"distinct_experts={shape['distinct_experts']} sets expert slots, which the "
                             "gather program does not have")
        return plan_gather(gshape, spec, budget)

    g = shape["grouping"]
    if g == "gather" or (g == "auto" and shape["tokens"] > MAX_TOKENS):
        return [("gather", gather)]
    if g == "dense":
        return [("slots", slots), ("panel", panel)]
    if _partial_fits(shape, budget):
        return [("slots", slots), ("panel", panel)]
    if not shape["experts"]:
        # A dense FFN has no routing for gather's per-block tables to exploit: DeepSeek-R1's at
        # 128 tokens on jalapeno-v1 takes 46.6 us as panel, 163 us as gather.
        return [("slots", slots), ("panel", panel), ("gather", gather)]
    return [("slots", streaming_slots), ("gather", gather), ("slots", slots), ("panel", panel)]


def plan_moe(shape: dict[str, Any], spec: ChipSpec, budget: Budget | None = None, *,
             given: Collection[str] | None = None) -> Plan:
    """Validate ``shape`` and choose the program and its split within ``budget`` (default: the
    stand-alone one): ``MoePlan`` (slots), ``PanelPlan`` or ``GatherPlan``.

    Args:
        given: the HBM tensors an operator has (a fused operator re-planned within a smaller
            budget): a program that needs another is passed over like one that does not fit.

    Raises:
        InvalidArgumentError: a bad shape (naming the key). DoesNotFit: no program fits (each
            one's reason).
    """
    check_shape(shape)
    budget = budget or Budget.of(spec)
    planners = _planners(shape, spec, budget)
    if given is not None:
        planners = [(name, _needing_only(planner, shape, set(given))) for name, planner in planners]
    _, plan = first_fitting(planners, f"kernel moe on {spec.name}")
    return plan


def _needing_only(planner: Callable[[], Plan], shape: dict[str, Any], given: set[str]) -> Callable[[], Plan]:
    """``planner``, raising DoesNotFit when its program needs an HBM tensor not in ``given``."""
    def run() -> Plan:
        p = planner()
        missing = sorted({ts.name for ts in _tensors(p, shape) if ts.role != "output"} - given)
        if missing:
            raise DoesNotFit(f"the {type(p).__name__} program that fits needs HBM tensors "
                             f"{', '.join(missing)} this operator was not given")
        return p
    return run


def grouping_of(shape: dict[str, Any], spec: ChipSpec) -> str:
    """"dense" when ``shape`` runs a slot program (slots or panel: expert slots, ``distinct_experts``
    applies) or "gather" (every expert's tokens gathered; also when nothing fits: the launch then
    fails with the reason). Remembered per shape and spec: the rack asks it for every grid point
    of every mapping, and mappings that split a chip alike ask the same questions."""
    return _grouping_of(tuple(sorted(shape.items())), spec)


@functools.lru_cache(maxsize=4096)
def _grouping_of(items: tuple[tuple[str, Any], ...], spec: ChipSpec) -> str:
    shape = dict(items)
    check_shape(dict(shape, distinct_experts=0) if shape["grouping"] == "gather" else shape)
    budget = Budget.of(spec)
    try:
        name, _ = first_fitting(_planners(shape, spec, budget, dict(shape, distinct_experts=0)), "moe")
    except DoesNotFit:
        return "gather"
    return "gather" if name == "gather" else "dense"


def moe_tensors(shape: dict[str, Any], spec: ChipSpec) -> tuple[TensorSpec, ...]:
    """The kernel's HBM tensors for ``shape`` on ``spec`` (the program the stand-alone budget picks)."""
    return _tensors(plan_moe(shape, spec), shape)


def _tensors(p: Plan, shape: dict[str, Any]) -> tuple[TensorSpec, ...]:
    if isinstance(p, GatherPlan):
        return gather_tensors(p, shape)
    if isinstance(p, PanelPlan):
        return panel_tensors(p, shape)
    return slot_tensors(p, shape)


def emit_moe(ctx: EmitCtx, shape: dict[str, Any], tensors: dict[str, TensorRef], outs: dict[str, Out],
             plan: Plan | None = None) -> Emitter:
    """Emit the MoE layer for ``shape`` (``KernelDef.emit``): the program ``plan_moe`` picks within
    ``ctx.budget``, reading ``tensors`` (every non-output tensor of ``moe_tensors``) and writing
    ``outs`` ("y", "expert_ids" for the slot programs). Yields/returns the output refs."""
    if plan is None:  # re-planned within ctx.budget in a fused program, with these tensors
        plan = plan_moe(shape, ctx.spec, ctx.budget, given=tensors)
    p = plan
    # Re-planned into the same program with another split, its scratch tables can outgrow the ones
    # sized for the stand-alone plan (the gather program's shared partials: one table per
    # intermediate range).
    short = [f"{ts.name} [{ts.shape[0]}, {ts.shape[1]}] (given [{tensors[ts.name].shape[0]}, "
             f"{tensors[ts.name].shape[1]}])" for ts in _tensors(p, shape)
             if ts.role == "scratch" and (tensors[ts.name].shape[0] < ts.shape[0]
                                          or tensors[ts.name].shape[1] != ts.shape[1])]
    if short:
        raise DoesNotFit(f"moe: the {type(p).__name__} program that fits this budget needs larger "
                         f"scratch tables than this operator was given: {', '.join(short)}")
    if isinstance(p, GatherPlan):
        return emit_gather(ctx, p, shape, tensors, outs)
    if isinstance(p, PanelPlan):
        return emit_panel(ctx, p, shape, tensors, outs)
    return emit_slots(ctx, p, shape, tensors, outs)


# --- stand-alone build -----------------------------------------------------------------------------
def moe_reference(inputs: dict[str, Any], plan: Plan, shape: dict[str, Any]) -> dict[str, np.ndarray]:
    """Pure-JAX MoE with the chosen program's numerics and summation order; {"y": bf16 [T, H]}
    plus, for the slot programs, "expert_ids": int32 [D, 1]."""
    if isinstance(plan, GatherPlan):
        return gather_reference(inputs, plan, shape)
    if isinstance(plan, PanelPlan):
        return panel_reference(inputs, plan, shape)
    return slots_reference(inputs, plan, shape)


def make_moe_inputs(p: MoeLayout, shape: dict[str, Any], seed: int) -> dict[str, Any]:
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


def _notes(p: Plan, shape: dict[str, Any]) -> dict[str, Any]:
    """What a report says about the program: its choice, its split and the bytes it reads."""
    e, k, t = p.e, p.k, p.t
    common = {"expert_bytes": p.expert_bytes, "shared_expert_bytes": p.s * p.expert_bytes,
              "slice": p.slice_max, "router_parts": p.router_parts, "routed_rows_ideal": t * k if e else 0}
    if isinstance(p, GatherPlan):
        rows = sum(it.rows for it in p.items if not it.shared)
        return {**common, "grouping": "gather", "program": "gather", "block_tokens": p.tb, "capacity": p.cap,
                "routed_rows": rows, "distinct_experts": p.e, "routed_expert_bytes": p.e * p.expert_bytes,
                "items": len(p.items), "cores": p.cores, "down_block": p.hb}
    uniform = round(expected_distinct_experts(e, k, t), 2) if e else 0.0
    common |= {"grouping": "dense", "distinct_experts": p.d, "distinct_experts_uniform": uniform,
               "routed_expert_bytes": p.d * p.expert_bytes, "cores": p.cores}
    if isinstance(p, PanelPlan):
        return {**common, "program": "panel", "down_block": p.hb, "k_panel": p.hk, "i_panel": p.ik,
                "x_resident": p.x_resident, "items": len(p.gu_items()) + len(p.down_items()),
                "route_block": p.tb, "routed_rows": p.d * t}
    return {**common, "program": "slots", "router_split": p.router_split,
            "arrangement": "routed" if p.routed else "dense",
            "capacities": sorted(set(p.caps)), "routed_rows": sum(p.caps), "items": len(p.items),
            "weight_buffers": p.nbuf}


def build_moe(shape: dict[str, Any], spec: ChipSpec) -> KernelBuild:
    """The MoE layer step for ``shape`` (keys in ``MOE``) on chip ``spec``: the emitter with every
    tensor in HBM."""
    p = plan_moe(shape, spec)
    specs = _tensors(p, shape)
    kb = KernelBuilder(_program_name(p), chip=spec)
    refs: dict[str, TensorRef] = {}
    for ts in specs:
        tile = kb.hbm_mx(ts.name, ts.shape, ts.dtype, ts.mx_axis) if ts.mx_axis is not None else \
            kb.hbm(ts.name, ts.shape, ts.dtype)
        refs[ts.name] = TensorRef.hbm(ts.name, tile)
    outs = {ts.name: Out.to(refs[ts.name]) for ts in specs if ts.role == "output"}
    tensors = {ts.name: refs[ts.name] for ts in specs if ts.role != "output"}
    run_emitter(emit_moe(EmitCtx.standalone(kb), shape, tensors, outs, plan=p))
    outputs = {"y": ("bf16", (p.t, p.h))}
    return KernelBuild(
        program=kb.build(), make_inputs=lambda seed: make_moe_inputs(p, shape, seed),
        reference=lambda inputs: {"y": moe_reference(inputs, p, shape)["y"]},
        outputs=outputs,
        tolerance=Tolerance(
            atol=1e-6, rtol=2.0**-7,
            why="same operations in the same order as the reference (MX matmuls bit-exact, FP32 vector "
                "steps, sums in the program's order); exp and sigmoid may differ in the last FP32 bit "
                "between XLA's code paths, which can move y by one BF16 ulp (or an activation by one MX "
                "rounding step)"),
        notes=_notes(p, shape),
    )


def _program_name(p: Plan) -> str:
    if isinstance(p, GatherPlan):
        return f"moe_gather_t{p.t}_h{p.h}_i{p.i}_e{p.e}_k{p.k}_c{p.cap}"
    if isinstance(p, PanelPlan):
        return f"moe_panel_t{p.t}_h{p.h}_i{p.i}_e{p.e}_k{p.k}_d{p.d}"
    return f"moe_t{p.t}_h{p.h}_i{p.i}_e{p.e}_k{p.k}_d{p.d}"


def _emit_kernel(ctx: EmitCtx, shape: dict[str, Any], t: dict[str, TensorRef],
                 outs: dict[str, Out]) -> Emitter:
    return emit_moe(ctx, shape, t, outs)


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
        ShapeKey("routing", str, "any", "slot programs: any = min(E, T*k) slots (when distinct_experts=0), "
                 "each listing every token: enough for every routing; uniform = the expected distinct "
                 "experts and token counts under uniform routing (the routed rows: for timing)",
                 choices=("any", "uniform")),
        ShapeKey("distinct_experts", int, 0, "slot programs: expert slots the program gathers (0: from "
                 "routing)", minimum=0),
        ShapeKey("slice", int, 0, "intermediate columns per work item, multiple of 32 (0: automatic)",
                 minimum=0),
        ShapeKey("router_split", int, 0, "slot program: blocks of H the router matmul is split into, "
                 "one producer core each, added in order by every consumer (0: automatic)", minimum=0),
        ShapeKey("grouping", str, "auto", "dense: the expert-slot programs (T <= 128); gather: each expert "
                 "computes the tokens of each 128-token block that chose it (prefill); auto: slots, then "
                 "gather", choices=("auto", "dense", "gather")),
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
    emit=_emit_kernel,
    tensors_of=moe_tensors,
    # Timed alone, a batch is what the model runner times: the expected routed rows, not every
    # token in every slot (which only a functional run on unknown data needs).
    timing_defaults={"routing": "uniform"},
))
