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

from dataclasses import dataclass
from typing import Any

from jalapeno_emu.isa.builder import MXTensor
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import Space

from .emit import EmitCtx, Emitter, Out, Piece, Ready, TensorRef, fetch
from .moe_base import BIAS_PARTS, Counter, aligned, emit_activation, layout_bytes, load_mx, mx_rows, view
from .moe_gather_plan import GatherItem, GatherPlan, core_layouts, item_extents, plain_specs
from .moe_routing import emit_gating, emit_route_constants, fill_constant, fill_ids, flat_rows

__all__ = ["emit_gather"]


def _alloc(kb: Any, c: int, p: GatherPlan, shape: dict[str, Any], keep_y: bool) -> dict[str, Any]:
    """Core c's tiles: one region for the four phase layouts (each dead before the next starts:
    the semaphores that order the phases order the reuse; the checker verifies it), plus the
    combine rows of the blocks it routes; ``keep_y``: each combine item's y block in a buffer of
    its own (an output kept on chip outlives the region)."""
    r_max, i_max = item_extents(p)
    layouts = core_layouts(p, shape, r_max, i_max)
    region = kb.sram(c, "phases", (1, max(layout_bytes(lay) for lay in layouts)), "u8")
    B: dict[str, Any] = {}
    for lay in layouts:
        off = 0
        for name, dt, sh in lay:
            B[name] = view(region, off, dt, *sh)
            off += aligned(dt, sh)
    for name, dt, sh in plain_specs(p):
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
