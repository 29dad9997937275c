"""The moe kernel's expert-slot program for small scratchpads: its plan.

Stage: kernels (``moe`` family). The program (``moe_panel.py``, whose docstring says what it
computes) in numbers: token blocks, panel widths and H blocks, weight buffers per core, the
estimate that picks among the candidates, every scratchpad tile of a core (``core_layouts``,
``plain_specs``: one source for the sizing here and the emitter's allocation), the panels of a
range (``panels``, ``x_pieces``) and the HBM tensors (``panel_tensors``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.isa.builder import MXTensor
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import DTYPES

from .base import TensorSpec
from .moe_base import MoeLayout, Spec, layout_bytes, mx_specs, slices_of, weight_specs, widest
from .moe_pack import split_layout
from .moe_routing import routing_buffers, routing_dims
from .planning import Budget, DoesNotFit, core_hbm_bytes_per_s, memoised_planner, mxu_cycles_per_step

__all__ = ["NG", "PanelPlan", "core_layouts", "panel_tensors", "panels", "plain_specs", "plan_panel",
           "x_pieces"]

_NBUFS = (3, 4, 6, 8)  # weight panels per core the planner tries (nbuf - 1 loads ahead of the matrix unit)
NG = 4  # combine terms in flight per core
_MAX_TOKENS = 128  # one matrix-unit row tile: every slot computes every token
_MAX_INSTRUCTIONS = 300_000  # beyond this the estimate is penalised (build and timing time)
# Each this many instructions add 1 % to the estimate: of two splits within a few per cent, the
# one with larger panels (a program quicker to build and time) wins.
_INSTRUCTIONS_PER_PERCENT = 50_000


@dataclass(frozen=True, kw_only=True)
class PanelPlan(MoeLayout):
    """The small-scratchpad slot program's layout (see the module docstring; ``MoeLayout``'s
    fields, chunk_off/chunk_sizes locating the split layout's gate|up segments, plus):

    Attributes:
        cores: cores used. hk: gate|up K panel rows. ik: down I panel rows. rk: router K panel rows.
        tb: tokens routed per block. qc: x columns quantised per item. hc: combine columns per item.
        x_resident: each core keeps all of xq in its scratchpad (else K panels come from HBM).
        nbuf: weight (and x or activation) panels per core in phases 2 and 3: a panel's load
            waits for the matmul that read its buffer ``nbuf`` panels earlier, so ``nbuf - 1``
            loads are in flight ahead of the matrix unit, each paying a DMA set-up and the HBM
            latency.
    """

    cores: int
    hk: int
    ik: int
    rk: int
    tb: int
    qc: int
    hc: int
    x_resident: bool
    nbuf: int = 3

    @property
    def terms(self) -> int:
        """Shared experts plus expert slots."""
        return self.s + self.d

    @property
    def hb(self) -> int:
        """Widest H block of the down projection."""
        return widest(self.down_blocks)

    @property
    def direct(self) -> bool:
        """One term (a dense FFN: one shared expert, no routing): each down item rounds its rows
        to BF16 and writes them to y itself; there is nothing to combine and no ``outs`` scratch."""
        return self.terms == 1

    @property
    def act_panels(self) -> list[tuple[int, int]]:
        """(first column, width) of the down projection's I panels: the HBM scratch ``acts``
        holds each term's panel as T contiguous rows of ``ik`` columns."""
        return panels(self.i, self.ik)

    def act_panel(self, acts: MXTensor | Tile, u: int, panel: int) -> MXTensor | Tile:
        """Term u's I panel ``panel`` in the HBM scratch ``acts``: its T rows of ``width`` columns
        stored one after another from element ``(u * I + first column) * T`` of the [(S + D) * T,
        I] allocation (and likewise in the MX scales), so that the scratch's shape does not
        depend on ``ik``."""
        k0, kw = self.act_panels[panel]
        base = (u * self.i + k0) * self.t

        def part(tile: Tile, per: int) -> Tile:
            bytes_at = DTYPES[tile.dtype].row_bytes
            return Tile(tile.space, tile.core, tile.offset + bytes_at(base // per), tile.dtype,
                        self.t, kw // per, bytes_at(kw // per))
        if isinstance(acts, MXTensor):
            return MXTensor(part(acts.codes, 1), part(acts.scales, 32), acts.axis)
        return part(acts, 1)

    def gu_items(self) -> list[tuple[int, int]]:
        """(term, slice) of every gate|up item; item n runs on core n % cores."""
        return [(u, j) for u in range(self.terms) for j in range(len(self.slices))]

    def down_items(self) -> list[tuple[int, int]]:
        """(term, H block) of every down item; item n runs on core n % cores."""
        return [(u, b) for u in range(self.terms) for b in range(len(self.down_blocks))]

    def quant_items(self) -> list[tuple[int, int]]:
        """(first column, width) of x's quantisation items."""
        return [(c0, min(self.qc, self.h - c0)) for c0 in range(0, self.h, self.qc)]

    def combine_items(self) -> list[tuple[int, int]]:
        """(first column, width) of y's combine items."""
        return [(c0, min(self.hc, self.h - c0)) for c0 in range(0, self.h, self.hc)]


# --- sizes ----------------------------------------------------------------------------------------
def _route_specs(p: PanelPlan, fmt: str) -> list[Spec]:
    """Phase 1: quantisation, router panels, routing (core 0)."""
    out = [("xin", "bf16", (p.t, p.qc)), *mx_specs("xqt", fmt, p.t, p.qc)]
    if not p.e:
        return out
    out += [(f"xr{b}", "bf16", (p.t, p.rk)) for b in range(2)]
    out += [(f"wr{b}", "bf16", (p.rk, p.router_cols)) for b in range(2)]
    tiles = [spec for spec in routing_buffers(p.rd, 0) if spec[0] not in ("idx", "gw", "slot_ids", "slot_w")]
    out += [*tiles, ("idx_all", "i32", (p.t, p.k)), ("gw_all", "f32", (p.t, p.k)),
            ("slot_ids", "i32", (p.d, 1)), ("slot_w", "f32", (p.d, p.t))]
    return out


def _gu_bytes(p: PanelPlan, w: int) -> int:
    return p.hk * w + (p.hk // 32) * 2 * w


def _dn_bytes(p: PanelPlan, hw: int) -> int:
    return p.ik * hw // 2 + (p.ik // 32) * hw


def _gu_specs(p: PanelPlan, fmt: str, activation: str) -> list[Spec]:
    """Phase 2: gate|up items."""
    w = p.slice_max
    out = mx_specs("xres", fmt, p.t, p.h) if p.x_resident else \
        [spec for b in range(p.nbuf) for spec in mx_specs(f"xk{b}", fmt, p.t, p.hk)]
    out += [(f"wk{b}", "u8", (1, _gu_bytes(p, w))) for b in range(p.nbuf)]
    out += [(f"gub{b}", "bf16", (1, 2 * w)) for b in range(2)] if p.expert_bias else []
    out += [(f"wrow{b}", "f32", (1, p.t)) for b in range(2)]
    out += [("gu", "f32", (p.t, 2 * w)), ("tmp", "f32", (p.t, w))]
    out += [("ones", "f32", (1, w))] if activation == "swiglu_oai" else []
    out += [spec for b in range(2) for spec in mx_specs(f"aq{b}", fmt, p.t, w)]
    return out


def _dn_specs(p: PanelPlan, fmt: str) -> list[Spec]:
    """Phase 3: down items."""
    out = [spec for b in range(p.nbuf) for spec in mx_specs(f"ak{b}", fmt, p.t, p.ik)]
    out += [(f"wd{b}", "u8", (1, _dn_bytes(p, p.hb))) for b in range(p.nbuf)]
    out += [(f"ot{b}", "bf16" if p.direct else "f32", (p.t, p.hb)) for b in range(2)]
    if p.expert_bias:
        out += [(f"brow{b}", "f32", (1, p.t)) for b in range(2)]
        out += [(f"db{b}", "bf16", (1, p.hb)) for b in range(2)]
        out += [(f"wall{b}", "bf16", (p.t, 32)) for b in range(2)]
        out += [(f"b2all{b}", "bf16", (32, p.hb)) for b in range(2)]
        out += [("bres", "f32", (p.t, 1)), ("onecol", "f32", (p.t, 1))]
    return out


def _combine_specs(p: PanelPlan) -> list[Spec]:
    """Phase 4: combine items."""
    return [*((f"g{n}", "f32", (p.t, p.hc)) for n in range(NG)), ("ysum", "f32", (p.t, p.hc)),
            ("ybuf", "bf16", (p.t, p.hc))]


def plain_specs(p: PanelPlan) -> list[Spec]:
    """Tiles live across phases: x's first rows (constants are clamped from them), the slot ids
    (gather indices) and a producer's logits panel (read by core 0's routing)."""
    out: list[Spec] = [("csrc", "bf16", (min(p.t, 8), min(p.h, 128)))]
    if p.e:
        out += [("ids", "i32", (p.d, 1)), ("lp", "f32", (p.t, p.router_cols))]
    return out


def core_layouts(p: PanelPlan, shape: dict[str, Any]) -> list[list[Spec]]:
    fmt = shape["act_fmt"]
    return [_route_specs(p, fmt), _gu_specs(p, fmt, shape["activation"]), _dn_specs(p, fmt),
            *([] if p.direct else [_combine_specs(p)])]


def _sram_bytes(p: PanelPlan, shape: dict[str, Any]) -> int:
    return max(layout_bytes(lay) for lay in core_layouts(p, shape)) + layout_bytes(plain_specs(p)) + 64 * 8


def _acc_bytes(p: PanelPlan) -> int:
    return 4 * p.t * (2 * 2 * p.slice_max + 2 * p.hb + (p.router_cols if p.e else 0))


# --- plan -----------------------------------------------------------------------------------------
def _router_split(e: int, cores: int) -> tuple[int, int]:
    """(R producer cores, E/R columns each): as the dense program, R divides E, <= one per 32."""
    r = max(r for r in range(1, min(cores, max(1, e // 32)) + 1) if e % r == 0)
    return r, e // r


def _tb(t: int, e: int, k: int, shape: dict[str, Any], room: int) -> int:
    """Tokens per routing block: the largest divisor of T whose routing tiles fit ``room`` bytes."""
    for tb in range(t, 0, -1):
        if t % tb == 0:
            rd = routing_dims(tb, e, k, shape)
            if layout_bytes([spec for spec in routing_buffers(rd, 0)]) <= room:
                return tb
    return 0


def _even_widths(n: int, terms: int, cores: int) -> list[int]:
    """Widths (multiples of 32) that cut ``n`` columns of ``terms`` terms into about 1, 2, 3 or 4
    items per core: DeepSeek-R1's 18,432 intermediate columns in slices of 288 are 64 items on
    64 cores, where slices of 256 are 72 (8 cores doing two, the rest waiting for them)."""
    out = []
    for per_core in (1, 2, 3, 4):
        items = max(1, cores * per_core // max(1, terms))
        out.append(max(32, -(-n // (items * 32)) * 32))
    return out


def _phase_s(steps: int, step_bytes: int, mm_s: float, nbuf: int, per_core: float, spec: ChipSpec) -> float:
    """Seconds for one core's ``steps`` panels of a phase: each panel's load (``step_bytes``, a DMA
    set-up and the HBM latency) waits for the matmul ``nbuf`` panels back, so the steady step is
    the longest of the matmul, the bytes at the core's HBM share, and one load-then-matmul round
    shared by the ``nbuf`` buffers; plus the first load."""
    if not steps:
        return 0.0
    fixed = spec.dma.setup_latency_s + spec.hbm.latency_s
    port = step_bytes / spec.dma.bytes_per_s_per_core
    step = max(mm_s, step_bytes / per_core, (fixed + port + mm_s) / nbuf)
    return steps * step + fixed + port


def _estimate_s(p: PanelPlan, spec: ChipSpec, act_fmt: str) -> float:
    """Seconds: phases 2 and 3 as the busiest core's panels (``_phase_s``: matrix-unit steps of
    ``act_fmt`` x MXFP4, bytes at the core's share of HBM, loads in flight per ``nbuf``), or every
    byte over HBM, whichever is longer; plus the scratch traffic and a penalty on programs past
    ``_MAX_INSTRUCTIONS``."""
    bw = spec.derived()["hbm_achievable_bytes_per_s"]
    per_core = core_hbm_bytes_per_s(spec, p.cores)
    mx = spec.matrix
    step_s = (mxu_cycles_per_step(spec, act_fmt, "fp4") + mx.issue_overhead_cycles) / spec.core.clock_hz
    row_tiles = -(-p.t // mx.tile_m)
    x_panel = 0 if p.x_resident else p.t * p.hk * 33 // 32
    kpanels, ipanels = panels(p.h, p.hk), panels(p.i, p.ik)
    out_s = 0.0
    n_gu, n_down = p.terms * len(p.slices), p.terms * len(p.down_blocks)  # len of gu_items(), down_items()
    phases = (
        (n_gu, len(kpanels), p.hk * 2 * p.slice_max * 17 // 32 + x_panel,
         row_tiles * -(-2 * p.slice_max // mx.tile_n) * (p.hk // mx.tile_k) * step_s,
         p.h * 2 * p.i * 17 // 32 // max(1, len(p.slices)) + p.t * p.slice_max),
        (n_down, len(ipanels), p.ik * p.hb * 17 // 32 + p.t * p.ik * 33 // 32,
         row_tiles * -(-p.hb // mx.tile_n) * (p.ik // mx.tile_k) * step_s,
         p.i * p.hb * 17 // 32 + p.t * p.i + 4 * p.t * p.hb),
    )
    for n_items, n_panels, panel_bytes, mm_s, item_bytes in phases:
        busiest = -(-n_items // p.cores)
        out_s += max(_phase_s(busiest * n_panels, panel_bytes, mm_s, p.nbuf, per_core, spec),
                     n_items * item_bytes / bw)
    outs_bytes = 0 if p.direct else 8 * p.terms * p.t * p.h  # FP32 rows stored, then read to combine
    out_s += (outs_bytes + (p.h if p.x_resident else 0) * p.t * p.cores) / bw
    # About six instructions per panel: small panels make a program slow to build, check and time.
    gu_steps = n_gu * len(kpanels)
    dn_steps = n_down * len(ipanels)
    instructions = 6 * (gu_steps + dn_steps)
    return out_s * (1 + instructions / _INSTRUCTIONS_PER_PERCENT / 100
                    + max(0, instructions - _MAX_INSTRUCTIONS) / _MAX_INSTRUCTIONS)


@memoised_planner
def plan_panel(shape: dict[str, Any], spec: ChipSpec, budget: Budget, d: int) -> PanelPlan:
    """The fitting split with the lowest estimate within ``budget``, for a checked shape with ``d``
    expert slots.

    Raises:
        DoesNotFit: more than 128 tokens, or no split fits (naming the key and the bytes).
    """
    t, h, i, e, k = (shape[n] for n in ("tokens", "hidden", "intermediate", "experts", "top_k"))
    s, bias = shape["shared_experts"], shape["expert_bias"]
    if t > _MAX_TOKENS:
        raise DoesNotFit(f"shape key tokens={t}: the expert-slot program computes every token "
                         f"per slot, at most {_MAX_TOKENS} (one matrix-unit row tile)")
    sram_cap, acc_cap, cores_avail = budget.sram_bytes, budget.acc_bytes, budget.cores
    r_parts, ew = _router_split(e, cores_avail) if e else (0, 0)
    tb = _tb(t, e, k, shape, sram_cap // 2) if e else 0
    if e and not tb:
        raise DoesNotFit(f"shape key experts={e}: routing one token needs more than half of the "
                         f"{sram_cap:,} B of scratchpad {spec.name} plans with")
    rd = routing_dims(tb, e, k, shape) if e else None
    w_key = shape["slice"]
    widths = [w_key] if w_key else \
        sorted({min(w, i) for w in (32, 64, 128, 256, *_even_widths(i, d + s, cores_avail))})
    hbs = sorted({min(b, h) for b in (32, 64, 128, 256, 512, *_even_widths(h, d + s, cores_avail))})
    panels = (512, 256, 128, 64, 32)
    best: tuple[float, PanelPlan] | None = None
    for w in widths:
        slices = slices_of(i, w)
        for hb in hbs:
            down_blocks = tuple((h0, min(hb, h - h0)) for h0 in range(0, h, hb))
            gu_off, gu_sizes, down_off, expert_bytes = split_layout(h, i, slices, down_blocks, bias)
            for x_res in (True, False):
                for hk in sorted({min(pk, h) for pk in panels}, reverse=True):
                    ik = min(panels[0], i)
                    n_items = (s + d) * max(len(slices), len(down_blocks))
                    p = PanelPlan(t=t, h=h, i=i, e=e, k=k, s=s, d=d, slices=slices, chunk_off=tuple(gu_off),
                                  chunk_sizes=tuple(gu_sizes), expert_bytes=expert_bytes, expert_bias=bias,
                                  router_parts=r_parts, router_cols=ew, rd=rd, down_blocks=down_blocks,
                                  down_off=tuple(down_off), cores=min(cores_avail, max(n_items, r_parts, 1)),
                                  hk=hk, ik=ik, rk=min(panels[0], h), tb=tb, qc=_qc(h, t, sram_cap),
                                  hc=_hc(h, t, sram_cap), x_resident=x_res)
                    p = _shrink(p, shape, sram_cap)
                    if p is None or _acc_bytes(p) > acc_cap:
                        continue
                    # Most buffers among equal estimates: the estimate takes a load's latency as
                    # its fixed cost, where loads queued in busy HBM channels take longer, which
                    # more loads in flight hide (gpt-oss on b200 at 16 tokens: 183.1 us with 3
                    # buffers, 173.7 with 4, both estimated 143.4).
                    for nbuf in sorted(_NBUFS, reverse=True):
                        q = p if nbuf == p.nbuf else PanelPlan(**{**p.__dict__, "nbuf": nbuf})
                        if _sram_bytes(q, shape) > sram_cap:
                            continue
                        est = _estimate_s(q, spec, shape["act_fmt"])
                        if best is None or est < best[0]:
                            best = (est, q)
    if best is None:
        raise DoesNotFit(
            f"shape key hidden={h} (tokens={t}, intermediate={i}): no panel split of the expert-slot "
            f"program fits the {sram_cap:,} B of scratchpad and {acc_cap:,} B of accumulators {spec.name} "
            "plans with")
    return best[1]


def panels(n: int, width: int) -> list[tuple[int, int]]:
    """(first row, rows) of the panels of ``width`` rows (the last may be narrower) over n rows."""
    return [(r0, min(width, n - r0)) for r0 in range(0, n, width)]


def x_pieces(kpanels: list[tuple[int, int]], min_cols: int = 1024) -> list[tuple[int, int, int]]:
    """Per K panel, (first column, width, index) of the resident-x piece that holds it: the first
    panel alone (the first matmul starts once it lands), then runs of panels of at least
    ``min_cols`` columns (fewer DMA set-ups)."""
    out: list[tuple[int, int, int]] = []
    k = 0
    while k < len(kpanels):
        end = k + 1
        if k:
            while end < len(kpanels) and kpanels[end - 1][0] + kpanels[end - 1][1] - kpanels[k][0] < min_cols:
                end += 1
        a = kpanels[k][0]
        width = kpanels[end - 1][0] + kpanels[end - 1][1] - a
        index = out[-1][2] + 1 if out else 0
        out += [(a, width, index)] * (end - k)
        k = end
    return out


def _qc(h: int, t: int, sram_cap: int) -> int:
    """x columns per quantisation item (bf16 in + MX out), multiples of 32."""
    fit = sram_cap // 2 // (t * 4) // 32 * 32
    return max(32, min(h, fit, 512))


def _hc(h: int, t: int, sram_cap: int) -> int:
    """y columns per combine item (NG + 1 FP32 buffers and a BF16 one), multiples of 32."""
    fit = sram_cap // (t * (4 * (NG + 1) + 2)) // 32 * 32
    return max(32, min(h, fit, 512))


def _shrink(p: PanelPlan, shape: dict[str, Any], sram_cap: int) -> PanelPlan | None:
    """The plan with the largest phase's panels halved until it fits (None if it never does):
    quantisation columns and router K panels (phase 1), down I panels (phase 3), combine columns
    (phase 4); phase 2's K panel is the caller's loop."""
    def halve(q: PanelPlan, key: str, total: int) -> PanelPlan | None:
        now = getattr(q, key)
        half = max(32, now // 2 // 32 * 32)
        if half >= now:
            return None
        return PanelPlan(**{**q.__dict__, key: half})

    fmt = shape["act_fmt"]
    phase_specs = (lambda q: _route_specs(q, fmt), None, lambda q: _dn_specs(q, fmt), _combine_specs)
    sizes = [layout_bytes(lay) for lay in core_layouts(p, shape)]
    while max(sizes) + layout_bytes(plain_specs(p)) + 64 * 8 > sram_cap:  # _sram_bytes, from sizes
        phase = sizes.index(max(sizes))
        options = {0: [("qc", p.h), ("rk", p.h)], 1: [], 2: [("ik", p.i)], 3: [("hc", p.h)]}[phase]
        q = None
        for key, total in options:
            q = halve(p, key, total)
            if q is not None and layout_bytes(phase_specs[phase](q)) < sizes[phase]:
                break
            q = None
        if q is None:
            return None
        p = q
        sizes = [layout_bytes(lay) for lay in core_layouts(p, shape)]
    return p

def panel_tensors(p: PanelPlan, shape: dict[str, Any]) -> tuple[TensorSpec, ...]:
    """The panel program's HBM tensors, in the order its stand-alone program allocates them: x, y,
    the scratch xq / acts / outs, the router panels and biases, the packed tables, expert_ids, the
    scratch slot weights and slot ids (each core's gather indices)."""
    t, h, e, fmt = p.t, p.h, p.e, shape["act_fmt"]
    mx_axis = None if fmt == "bf16" else 1
    out = [TensorSpec("x", (t, h), "bf16", "input"), TensorSpec("y", (t, h), "bf16", "output")]
    out += [TensorSpec("xq", (t, h), fmt, "scratch", mx_axis),
            TensorSpec("acts", (p.terms * t, p.i), fmt, "scratch", mx_axis)]
    out += [] if p.direct else [TensorSpec("outs", (p.terms * t, h), "f32", "scratch")]
    out += weight_specs(p)
    if e:
        out += [TensorSpec("expert_ids", (p.d, 1), "i32", "output"),
                TensorSpec("slot_weights", (p.d, t), "f32", "scratch"),
                TensorSpec("slot_ids", (p.d, 1), "i32", "scratch")]
    return tuple(out)
