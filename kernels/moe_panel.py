"""The moe kernel's expert-slot program for small scratchpads (GPU shared memory: 64..228 KiB).

Stage: kernels (``moe`` family). ``moe`` builds this program for ``grouping=dense`` shapes when
the dense program (``moe.py``) does not fit: its per-core x [T, H], its [T, H] FP32 partial in the
accumulators and its whole-H weight chunks need MiB where an SM has 228 KiB. The math is the same
(every expert slot computes every token, weighted by its gate weight; shared experts weight 1;
DeepSeek's noaux routing; gpt-oss biases), arranged as two grouped GEMMs through HBM, as fused-MoE
GPU kernels do:

1. x quantised once (``act_fmt``), column panels spread over the cores, into an HBM scratch ``xq``.
   Router (experts > 0): producer core r multiplies x by column panel r of Wr in K panels of ``rk``
   rows (BF16, FP32 logits accumulated in order: bit-identical to one pass). Core 0 pulls the
   panels and routes ``tb`` tokens at a time (``moe_routing.emit_gating``), then one ``vec.group``
   over all T tokens gives the D slots' expert ids (output ``expert_ids``) and the [D, T] gate
   weights (HBM scratch ``slot_weights``).
2. Gate|up items (term u, intermediate slice j): gate|up = xq @ [Wg | Wu][:, slice] in K panels of
   ``hk`` rows (x panels read from the core's resident copy of xq when it fits, else from HBM),
   the weights *gathered* from the packed table by slot u's expert id (the split layout of
   ``moe_pack``, one gather per K panel's codes and scales); + gate/up bias, the activation, times
   each token's gate weight, quantised into the HBM scratch ``acts`` [(S + D) * T, I], stored I
   panel by I panel (``PanelPlan.act_panel``: a panel's T rows are contiguous, so the
   down items of every core, which read the same panel at about the same time, find it spread
   over the HBM channels instead of on the few that a [T, I] row stride maps it to).
3. Down items (term u, H block of ``hb`` columns): out_u[:, hb] = acts_u @ Wd_u[:, hb] in I panels
   of ``ik`` rows (+ the down-bias matmul: the gate weights' three BF16 parts times the bias, as
   the dense program does), FP32 rows into the HBM scratch ``outs`` [(S + D) * T, H].
4. Combine items (H block of ``hc`` columns): y = ((out_0 + out_1) + ...) in term order, FP32,
   rounded to BF16 once. With one term (a dense FFN, ``PanelPlan.direct``) there is nothing to
   add: each down item reads its accumulator out as BF16 (the same single rounding) into y.

Phases 2 and 3 keep ``nbuf`` panels per core in flight (3 to 8, as the scratchpad allows): each
panel's load pays a DMA set-up and the HBM latency, which fewer loads in flight cannot hide
(DeepSeek-R1's dense FFN at 96 tokens on jalapeno-v1, 3 buffers: a load-then-matmul round of
2.6 us per three 0.64 us matmuls). Slice widths and H blocks include ones that spread the items
evenly over the cores (``_even_widths``).

Terms are the shared experts first, then the D slots. Global semaphores separate the phases, so
each core reuses one scratchpad region for the four phases' tiles. The reference
(``panel_reference``) computes each term's rows with ``moe_base.expert_rows_reference`` (the
same operations: per slice gate|up, activation, weight, quantisation; one down matmul; the bias
matmul) and adds the terms in the same order.

Costs against the dense program: acts and outs go through HBM (T * I and 4 * T * H bytes per term),
and each down item re-reads its term's activations per H block (T * I bytes), as each gate|up
item reads all of x; at decode sizes (T <= 64) these are a few to tens of per cent of the weight
bytes, and on jalapeno-v1 they make DeepSeek-R1's dense FFN at 96 tokens HBM-bound (210 MB of
weights, 44 MB of x and 99 MB of activations read by 64 and 56 cores). HBM tensors the caller binds
(x, router, biases, packed tables, y, expert_ids) are those of the dense program; the packed
tables use ``moe_pack``'s split layout, which ``pack_experts`` writes from the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jalapeno_emu.isa.builder import MXTensor
from jalapeno_emu.isa.loops import issue_in_rounds
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import Space

from .emit import EmitCtx, Emitter, Out, Piece, Ready, TensorRef, fetch
from .moe_base import (
    BIAS_PARTS,
    Counter,
    aligned,
    column,
    emit_activation,
    layout_bytes,
    load_mx,
    mx_cols,
    store_mx,
    view,
)
from .moe_panel_plan import NG, PanelPlan, core_layouts, panels, plain_specs, x_pieces
from .moe_routing import emit_gating, emit_route_constants, fill_constant

__all__ = ["emit_panel"]

# --- the program ----------------------------------------------------------------------------------
_CORE_SEMS = ("csrc", "qin", "qdone", "qstored", "rld", "rmm", "pulled", "rvec", "ids", "xres", "xld",
              "wld", "mm", "acc_read", "side", "act", "stored", "dwld", "dxld", "dmm", "ditem", "dside",
              "bias_ready", "oread", "ostored", "gl", "gsum", "y_ready", "y_stored", "ids_kept")


@dataclass(frozen=True)
class _Hbm:
    x: TensorRef
    xq: MXTensor | Tile | None
    acts: MXTensor | Tile
    outs: Tile | None
    router: Tile | None
    router_bias: Tile | None
    score_bias: Tile | None
    experts: Tile | None
    shared: Tile | None
    slot_ids: Tile | None
    slot_w: Tile | None


def _tile(ref: TensorRef | None) -> MXTensor | Tile | None:
    if ref is None:
        return None
    return MXTensor(ref.base, ref.base_scales, ref.mx_axis) if ref.is_mx else ref.base


def _hbm(p: PanelPlan, shape: dict[str, Any], t: dict[str, TensorRef], ids_out: Out) -> _Hbm:
    # The slot ids every core gathers by: the output itself when it goes to HBM, else the scratch.
    ids = (ids_out.ref.base if ids_out.in_hbm else t["slot_ids"].base) if p.e else None
    x = t["x"]
    # bf16 activations: the items read x in place when it is an HBM input ready at the start,
    # else a copy in the scratch xq.
    xq = x.base if shape["act_fmt"] == "bf16" and x.in_hbm and not x.waits() else _tile(t["xq"])
    return _Hbm(x=x, xq=xq, acts=_tile(t["acts"]), outs=t["outs"].base if "outs" in t else None,
                router=_tile(t.get("router")), router_bias=_tile(t.get("router_bias")),
                score_bias=_tile(t.get("score_bias")), experts=_tile(t.get("experts")),
                shared=_tile(t.get("shared")), slot_ids=ids, slot_w=_tile(t.get("slot_weights")))


class _Emitter:
    """Emits the four phases onto every core (module docstring)."""

    def __init__(self, ctx: EmitCtx, p: PanelPlan, shape: dict[str, Any], tensors: dict[str, TensorRef],
                 outs: dict[str, Out]) -> None:
        self.kb, self.p, self.shape = ctx.kb, p, shape
        self.y_out = outs.get("y") or Out.onchip()
        self.ids_out = outs.get("expert_ids") or Out.onchip()
        self.hbm = _hbm(p, shape, tensors, self.ids_out)
        self.nq = ctx.spec.dma.queues_per_core
        self.waited: dict[Any, set[Ready]] = {}
        kb = self.kb
        self.g = Counter(kb, "all", ("xq", "logits", "routed", "gu", "down"))
        self.B = {c: self._alloc(c) for c in range(p.cores)}
        self.S = {c: Counter(kb, f"c{c}", _CORE_SEMS) for c in range(p.cores)}
        if p.e and not self.ids_out.in_hbm:
            self.ids_kept = kb.sram(0, "expert_ids", (p.d, 1), "i32", keep=True)

    def outputs(self) -> dict[str, TensorRef]:
        """The output refs: each combine item's y block (and the slot ids) ready when written or stored."""
        p, out = self.p, {}
        pieces, ref = [], self.y_out.ref
        for c in range(p.cores):
            for ci, (h0, hw) in enumerate(self._y_blocks(c)):
                if self.y_out.in_hbm:
                    ref = ref.with_ready(0, h0, p.t, hw, (self.S[c].sem["y_stored"].id, ci + 1))
                else:
                    pieces.append(Piece(0, h0, p.t, hw, self.B[c][f"y{ci}"], None,
                                        (self.S[c].sem["y_ready"].id, ci + 1)))
        out["y"] = ref if self.y_out.in_hbm else TensorRef.onchip("y", (p.t, p.h), "bf16", pieces)
        if p.e:
            if self.ids_out.in_hbm:
                out["expert_ids"] = self.ids_out.ref.with_ready(0, 0, p.d, 1, (self.g.sem["routed"].id, 1))
            else:
                out["expert_ids"] = TensorRef.onchip("expert_ids", (p.d, 1), "i32", [Piece(
                    0, 0, p.d, 1, self.ids_kept, None, (self.S[0].sem["ids_kept"].id, 1))])
        return out

    def q(self, c: int, i: int) -> Any:
        return self.kb.core(c).dma[i % self.nq]

    def _y_blocks(self, c: int) -> list[tuple[int, int]]:
        """(first column, width) of the y blocks core c writes, in order: its down items' H
        blocks (``direct``), else its combine items."""
        p = self.p
        if p.direct:
            return [p.down_blocks[b] for _, b in p.down_items()[c::p.cores]]
        return p.combine_items()[c::p.cores]

    def _alloc(self, c: int) -> dict[str, Any]:
        p, kb = self.p, self.kb
        layouts = core_layouts(p, self.shape)
        region = kb.sram(c, "phases", (1, max(layout_bytes(lay) for lay in layouts)), "u8")
        B: dict[str, Any] = {}
        for lay in layouts:
            off = 0
            for name, dt, sh in lay:
                B[name] = Tile(region.space, region.core, region.offset + off, dt, *sh)
                off += aligned(dt, sh)
        for name, dt, sh in plain_specs(p):
            B[name] = kb.sram(c, name, sh, dt)
        for name in [n[:-2] for n in list(B) if n.endswith(".c")]:
            B[name] = MXTensor(B.pop(f"{name}.c"), B.pop(f"{name}.s"), 1)
        if not self.y_out.in_hbm:  # kept outputs outlive the phase region: buffers of their own
            for ci, (_, hw) in enumerate(self._y_blocks(c)):
                B[f"y{ci}"] = kb.sram(c, f"y{ci}", (p.t, hw), "bf16", keep=True)
        B["acc_gu"] = [kb.acc(c, f"acc_gu{b}", (p.t, 2 * p.slice_max)) for b in range(2)]
        B["acc_o"] = [kb.acc(c, f"acc_o{b}", (p.t, p.hb)) for b in range(2)]
        if p.e:
            B["acc_r"] = kb.acc(c, "acc_r", (p.t, p.router_cols))
        return B

    def emit(self) -> None:
        p = self.p
        for c in range(p.cores):
            q1 = self.q(c, 1)
            fetch(q1, self.B[c]["csrc"], self.hbm.x, 0, 0, waited=self.waited)
            self.S[c].signal(q1, "csrc")
            self.kb.core(c).vpu.wait(self.S[c].sem["csrc"], 1)
            self.quantise(c)
            if p.e:
                self.router(c)
                if c == 0:
                    self.routing(c)
            self.gate_up(c)
            self.down(c)
            if not p.direct:
                self.combine(c)

    def _engines(self, c: int) -> list[Any]:
        core = self.kb.core(c)
        return [*(self.q(c, i) for i in range(min(3, self.nq))), core.vpu, core.mxu]

    def _gate(self, c: int, waits: list[tuple[str, int]]) -> None:
        """Every engine of core c waits until the earlier phases are over everywhere (their tiles
        are reused)."""
        for eng in self._engines(c):
            for name, count in waits:
                if count:
                    eng.wait(self.g.sem[name], count)

    # --- phase 1 ------------------------------------------------------------------------------
    def quantise(self, c: int) -> None:
        """Core c's column panels of x, quantised into xq (bf16: copied there, or nothing to do
        when x is an HBM input ready at the start: the items read it in place)."""
        p, B, S, v = self.p, self.B[c], self.S[c], self.kb.core(c).vpu
        if not self._quant_count():
            return
        bf16 = self.shape["act_fmt"] == "bf16"
        q1, q2 = self.q(c, 1), self.q(c, 2)
        for n, (c0, cols) in enumerate(p.quant_items()[c::p.cores]):
            xin, xqt = B["xin"].sub(0, 0, p.t, cols), mx_cols(B["xqt"], 0, cols)
            if n:  # the vector unit (or the store) has read the previous panel
                q1.wait(S.sem["qstored" if bf16 else "qdone"], n)
            fetch(q1, xin, self.hbm.x, 0, c0, waited=self.waited)
            S.signal(q1, "qin")
            if bf16:
                q2.wait(S.sem["qin"], n + 1)
                store_mx(q2, mx_cols(self.hbm.xq, c0, cols), xin)
            else:
                v.wait(S.sem["qin"], n + 1)
                if n:  # the previous panel is stored
                    v.wait(S.sem["qstored"], n)
                v.quantize(xqt.codes, xqt.scales, xin)
                S.signal(v, "qdone")
                q2.wait(S.sem["qdone"], n + 1)
                store_mx(q2, mx_cols(self.hbm.xq, c0, cols), xqt)
            S.signal(q2, "qstored")
            self.g.signal(q2, "xq")

    def _quant_count(self) -> int:
        return len(self.p.quant_items()) if self.hbm.xq is not self.hbm.x.base else 0

    def router(self, c: int) -> None:
        """Producer core c: logits panel c = x @ Wr[:, panel c] in K panels, into ``lp``."""
        p, B, S, core = self.p, self.B[c], self.S[c], self.kb.core(c)
        if c >= p.router_parts:
            return
        q1, m, v = self.q(c, 1), core.mxu, core.vpu
        steps = panels(p.h, p.rk)
        for n, (k0, kw) in enumerate(steps):
            if n >= 2:  # the matmul of step n-2 has read these buffers
                q1.wait(S.sem["rmm"], n - 1)
            xr, wr = B[f"xr{n % 2}"].sub(0, 0, p.t, kw), B[f"wr{n % 2}"].sub(0, 0, kw, p.router_cols)
            fetch(q1, xr, self.hbm.x, 0, k0, waited=self.waited)
            q1.load(wr, self.hbm.router.sub(c * p.h + k0, 0, kw, p.router_cols))
            S.signal(q1, "rld")
            m.wait(S.sem["rld"], n + 1)
            m.matmul(B["acc_r"], xr, wr, mode="overwrite" if n == 0 else "accumulate")
            S.signal(m, "rmm")
        steps = len(steps)
        v.wait(S.sem["rmm"], steps)
        v.acc_read(B["lp"], B["acc_r"])
        self.g.signal(v, "logits")

    def routing(self, c: int) -> None:
        """Core 0: every token's top-k and gate weights, block by block, then the slot tables."""
        p, B, S, core = self.p, self.B[c], self.S[c], self.kb.core(c)
        v, q1, q2 = core.vpu, self.q(c, 1), self.q(c, 2)
        rd, tb = p.rd, p.tb
        if self.hbm.router_bias is not None:
            q1.load(B["bias"], self.hbm.router_bias)
        if self.hbm.score_bias is not None:
            q1.load(B["score_bias"], self.hbm.score_bias)
        v.wait(S.sem["pulled"], S.signal(q1, "pulled"))
        emit_route_constants(v, B, rd, B["csrc"])
        q1.wait(self.g.sem["logits"], p.router_parts)
        for n, t0 in enumerate(range(0, p.t, tb)):
            if n:  # the vector unit is done with the previous block's logits
                q1.wait(S.sem["rvec"], n)
            for r in range(p.router_parts):
                q1.copy(B["logits"].sub(0, r * p.router_cols, tb, p.router_cols),
                        self.B[r]["lp"].sub(t0, 0, tb, p.router_cols))
            v.wait(S.sem["pulled"], S.signal(q1, "pulled"))
            blk = {**B, "idx": B["idx_all"].sub(t0, 0, tb, p.k), "gw": B["gw_all"].sub(t0, 0, tb, p.k)}
            emit_gating(v, blk, rd, self.shape["routed_scaling_factor"])
            S.signal(v, "rvec")
        v.group(B["slot_ids"], B["slot_w"], B["idx_all"], B["gw_all"])
        q2.wait(S.sem["rvec"], S.signal(v, "rvec"))
        q2.store(self.hbm.slot_ids, B["slot_ids"])
        q2.store(self.hbm.slot_w, B["slot_w"])
        self.g.signal(q2, "routed")
        if not self.ids_out.in_hbm:  # the output kept on chip: a copy that outlives the phases
            q2.copy(self.ids_kept, B["slot_ids"])
            S.signal(q2, "ids_kept")

    # --- weights by term ----------------------------------------------------------------------
    def _fetch(self, c: int, q: Any, dst: Tile, u: int, off: int, size: int) -> None:
        """Bytes off..off+size of term u's packed expert into dst: loaded (shared expert) or
        gathered by the slot's expert id."""
        p = self.p
        if u < p.s:
            q.load(dst, Tile(Space.HBM, 0, self.hbm.shared.offset + u * p.expert_bytes + off, "u8", 1, size))
            return
        table = Tile(Space.HBM, 0, self.hbm.experts.offset + off, "u8", p.e, size, p.expert_bytes)
        q.gather(dst, table, self.B[c]["ids"].sub(u - p.s, 0, 1, 1))

    def _load_ids(self, c: int) -> None:
        """The slot ids, once per core (queues 0 and 2 gather by them)."""
        p, B, S = self.p, self.B[c], self.S[c]
        if not p.e:
            return
        q0 = self.q(c, 0)
        q0.load(B["ids"], self.hbm.slot_ids)
        n = S.signal(q0, "ids")
        q0.wait(S.sem["ids"], n)
        self.q(c, 2).wait(S.sem["ids"], n)

    # --- phase 2 ------------------------------------------------------------------------------
    def gate_up(self, c: int) -> None:
        """Gate|up items: K-panel matmuls, activation x gate weight, activations to HBM."""
        p, B, S, core = self.p, self.B[c], self.S[c], self.kb.core(c)
        mine = p.gu_items()[c::p.cores]
        self._gate(c, [("xq", self._quant_count()), ("routed", 1 if p.e else 0)])
        if not mine:
            return
        self._load_ids(c)
        q0, q1, m, v = self.q(c, 0), self.q(c, 1), core.mxu, core.vpu
        if self.shape["activation"] == "swiglu_oai":
            fill_constant(v, B["ones"], 1.0, B["csrc"])
        kpanels = panels(p.h, p.hk)
        n_k = len(kpanels)
        # x resident: loaded in pieces, each with its signal, so that the first matmul waits for
        # its own K panel only, not for all of x (64 cores x T x H bytes share HBM meanwhile).
        x_piece = x_pieces(kpanels) if p.x_resident else []
        for k0, kw in dict.fromkeys((a, w) for a, w, _ in x_piece):
            load_mx(q1, mx_cols(B["xres"], k0, kw), mx_cols(self.hbm.xq, k0, kw))
            S.signal(q1, "xres")
        for n, (u, j) in enumerate(mine):  # queue 0: weight panels; queue 1: x panels
            w = p.slices[j][1]

            def load(kk: int, step: int, u: int = u, j: int = j, w: int = w) -> None:
                k0, kw = kpanels[kk]
                b = step % p.nbuf
                if step >= p.nbuf:  # the matmul that read this buffer is done
                    q0.wait(S.sem["mm"], step - p.nbuf + 1)
                    if not p.x_resident:
                        q1.wait(S.sem["mm"], step - p.nbuf + 1)
                buf = B[f"wk{b}"]
                self._fetch(c, q0, view(buf, 0, "u8", 1, kw * w), u, p.chunk_off[j] + k0 * w, kw * w)
                self._fetch(c, q0, view(buf, kw * w, "u8", 1, (kw // 32) * 2 * w), u,
                            p.chunk_off[j] + p.h * w + (k0 // 32) * 2 * w, (kw // 32) * 2 * w)
                q0.signal(S.sem["wld"])
                if not p.x_resident:
                    load_mx(q1, mx_cols(B[f"xk{b}"], 0, kw), mx_cols(self.hbm.xq, k0, kw))
                    q1.signal(S.sem["xld"])

            self._panels_issued(kpanels, n * n_k, load, lambda kk, step: step >= p.nbuf)
        for n, (_u, j) in enumerate(mine):  # matrix unit
            w = p.slices[j][1]
            acc = B["acc_gu"][n % 2].sub(0, 0, p.t, 2 * w)
            if n >= 2:  # the vector unit has read this accumulator's previous item
                m.wait(S.sem["acc_read"], n - 1)

            def multiply(kk: int, step: int, n: int = n, w: int = w, acc: Tile = acc) -> None:
                k0, kw = kpanels[kk]
                buf = B[f"wk{step % p.nbuf}"]
                wv = MXTensor(view(buf, 0, "fp4", kw, 2 * w), view(buf, kw * w, "e8m0", kw // 32, 2 * w), 0)
                m.wait(S.sem["wld"], step + 1)
                if p.x_resident:
                    if n == 0 and (kk == 0 or x_piece[kk][2] != x_piece[kk - 1][2]):
                        m.wait(S.sem["xres"], x_piece[kk][2] + 1)
                    xv = mx_cols(B["xres"], k0, kw)
                else:
                    m.wait(S.sem["xld"], step + 1)
                    xv = mx_cols(B[f"xk{step % p.nbuf}"], 0, kw)
                m.matmul_mx(acc, xv, wv, mode="overwrite" if kk == 0 else "accumulate")
                m.signal(S.sem["mm"])

            self._panels_issued(kpanels, n * n_k, multiply,
                                lambda kk, step, n=n: kk > 0 and not (n == 0 and p.x_resident))
        for name in ("wld", "mm", *(() if p.x_resident else ("xld",))):
            S.count[name] += len(mine) * n_k
        for n in range(len(mine) + 2):  # queue 2: side data of item n, store of item n - 2
            if n < len(mine):
                self._gu_side(c, n, mine[n])
            if n >= 2:
                self._gu_store(c, n - 2, mine[n - 2])
        for n, (u, j) in enumerate(mine):
            self._gu_vector(c, n, u, j, n_k)

    def _panels_issued(self, panels: list[tuple[int, int]], step0: int, issue: Callable[[int, int], None],
                       steady: Callable[[int, int], bool]) -> None:
        """``issue(k, step0 + k)`` for each panel k of one item, in order. Runs of whole rounds of
        ``nbuf`` panels that are ``steady`` (their waits and buffers repeat: past the first round
        of buffers, not an item's first matmul) and full-width go out as hardware loops
        (``KernelBuilder.repeat``): the same instructions, in a program that does not grow with
        the panels (DeepSeek-R1 on b200 at 64 tokens: 4.5M instructions unrolled). ``issue``
        signals with ``EngineHandle.signal``; the caller counts the signals."""
        full = panels[0][1]
        issue_in_rounds(self.kb, 0, len(panels), self.p.nbuf,
                        lambda k, _: panels[k][1] == full and steady(k, step0 + k),
                        lambda k: issue(k, step0 + k))

    def _gu_side(self, c: int, n: int, item: tuple[int, int]) -> None:
        """Queue 2: item n's gate weights (routed) and gate|up bias."""
        p, B, S, q2 = self.p, self.B[c], self.S[c], self.q(c, 2)
        u, j = item
        w, par = p.slices[j][1], n % 2
        if n >= 2:  # item n-2's vector work (which read them) is done
            q2.wait(S.sem["act"], n - 1)
        if u >= p.s:
            q2.load(B[f"wrow{par}"], self.hbm.slot_w.sub(u - p.s, 0, 1, p.t))
        if p.expert_bias:
            self._fetch(c, q2, view(B[f"gub{par}"], 0, "u8", 1, 4 * w), u,
                        p.chunk_off[j] + p.h * w + (p.h // 32) * 2 * w, 4 * w)
        S.signal(q2, "side")

    def _gu_store(self, c: int, n: int, item: tuple[int, int]) -> None:
        p, B, S, q2 = self.p, self.B[c], self.S[c], self.q(c, 2)
        u, j = item
        c0, w = p.slices[j]
        q2.wait(S.sem["act"], n + 1)
        for pi, (k0, kw) in enumerate(p.act_panels):  # the slice's part of each I panel it meets
            a, b = max(c0, k0), min(c0 + w, k0 + kw)
            if a < b:
                store_mx(q2, mx_cols(p.act_panel(self.hbm.acts, u, pi), a - k0, b - a),
                         mx_cols(B[f"aq{n % 2}"], a - c0, b - a))
        S.signal(q2, "stored")
        self.g.signal(q2, "gu")

    def _gu_vector(self, c: int, n: int, u: int, j: int, n_k: int) -> None:
        """Vector unit: gate|up out of the accumulator (+ bias), activation, x gate weight, quantised."""
        p, B, S, v = self.p, self.B[c], self.S[c], self.kb.core(c).vpu
        w, par, t = p.slices[j][1], n % 2, p.t
        gu = B["gu"].sub(0, 0, t, 2 * w)
        g_t, u_t, a_t = B["gu"].sub(0, 0, t, w), B["gu"].sub(0, w, t, w), B["tmp"].sub(0, 0, t, w)
        v.wait(S.sem["mm"], (n + 1) * n_k)
        v.acc_read(gu, B["acc_gu"][n % 2].sub(0, 0, t, 2 * w))
        S.signal(v, "acc_read")
        v.wait(S.sem["side"], n + 1)
        if p.expert_bias:
            v.add(gu, gu, view(B[f"gub{par}"], 0, "bf16", 1, 2 * w))
        emit_activation(v, B.get("ones"), g_t, u_t, a_t, self.shape["activation"])
        if u >= p.s:
            v.mul(a_t, a_t, column(B[f"wrow{par}"]))
        if n >= 2:  # aq[par] of item n-2 is stored
            v.wait(S.sem["stored"], n - 1)
        dst = mx_cols(B[f"aq{par}"], 0, w)
        if isinstance(dst, MXTensor):
            v.quantize(dst.codes, dst.scales, a_t)
        else:
            v.copy(dst, a_t)
        S.signal(v, "act")

    # --- phase 3 ------------------------------------------------------------------------------
    def down(self, c: int) -> None:
        """Down items: I-panel matmuls into an [T, hb] accumulator (+ the down-bias matmul), rows
        to HBM."""
        p, B, S, core = self.p, self.B[c], self.S[c], self.kb.core(c)
        mine = p.down_items()[c::p.cores]
        self._gate(c, [("gu", len(p.gu_items()))])
        if not mine:
            return
        q0, q1, m, v = self.q(c, 0), self.q(c, 1), core.mxu, core.vpu
        if p.expert_bias:
            for name in ("wall0", "wall1", "b2all0", "b2all1"):
                fill_constant(v, B[name], 0.0, B["csrc"])
            fill_constant(v, B["onecol"], 1.0, B["csrc"])
        ipanels = p.act_panels
        n_i = len(ipanels)
        for n, (u, b) in enumerate(mine):  # queue 0: Wd panels; queue 1: activation panels
            off, hw = p.down_off[b], p.down_blocks[b][1]

            def load(pi: int, step: int, u: int = u, off: int = off, hw: int = hw) -> None:
                k0, kw = ipanels[pi]
                nb = step % p.nbuf
                if step >= p.nbuf:
                    q0.wait(S.sem["dmm"], step - p.nbuf + 1)
                    q1.wait(S.sem["dmm"], step - p.nbuf + 1)
                buf = B[f"wd{nb}"]
                codes = kw * hw // 2
                self._fetch(c, q0, view(buf, 0, "u8", 1, codes), u, off + k0 * hw // 2, codes)
                self._fetch(c, q0, view(buf, codes, "u8", 1, (kw // 32) * hw), u,
                            off + p.i * hw // 2 + (k0 // 32) * hw, (kw // 32) * hw)
                q0.signal(S.sem["dwld"])
                load_mx(q1, mx_cols(B[f"ak{nb}"], 0, kw), p.act_panel(self.hbm.acts, u, pi))
                q1.signal(S.sem["dxld"])

            self._panels_issued(ipanels, n * n_i, load, lambda kk, step: step >= p.nbuf)
        for n, (_u, b) in enumerate(mine):  # matrix unit
            hw = p.down_blocks[b][1]
            acc = B["acc_o"][n % 2].sub(0, 0, p.t, hw)
            if n >= 2:  # the vector unit has read this accumulator's item n-2
                m.wait(S.sem["oread"], n - 1)

            def multiply(kk: int, step: int, hw: int = hw, acc: Tile = acc) -> None:
                kw = ipanels[kk][1]
                buf = B[f"wd{step % p.nbuf}"]
                codes = kw * hw // 2
                wv = MXTensor(view(buf, 0, "fp4", kw, hw), view(buf, codes, "e8m0", kw // 32, hw), 0)
                m.wait(S.sem["dwld"], step + 1)
                m.wait(S.sem["dxld"], step + 1)
                ak = mx_cols(B[f"ak{step % p.nbuf}"], 0, kw)
                m.matmul_mx(acc, ak, wv, mode="overwrite" if kk == 0 else "accumulate")
                m.signal(S.sem["dmm"])

            self._panels_issued(ipanels, n * n_i, multiply, lambda kk, step: kk > 0)
            if p.expert_bias:
                m.wait(S.sem["bias_ready"], n + 1)
                m.matmul(acc, B[f"wall{n % 2}"], B[f"b2all{n % 2}"].sub(0, 0, 32, hw), mode="accumulate")
            S.signal(m, "ditem")
        for name in ("dwld", "dxld", "dmm"):
            S.count[name] += len(mine) * n_i
        for n in range(len(mine) + 2):  # queue 2: side data of item n, store of item n - 2
            if n < len(mine) and p.expert_bias:
                self._dn_side(c, n, mine[n])
            if n >= 2:
                self._dn_store(c, n - 2, mine[n - 2])
        for n, (u, b) in enumerate(mine):
            self._dn_vector(c, n, u, b)

    def _dn_side(self, c: int, n: int, item: tuple[int, int]) -> None:
        """Queue 2: item n's gate weights (routed) and its H block of the down bias."""
        p, B, S, q2 = self.p, self.B[c], self.S[c], self.q(c, 2)
        u, b = item
        h0, hw = p.down_blocks[b]
        par = n % 2
        if n >= 2:  # item n-2's bias terms are built
            q2.wait(S.sem["bias_ready"], n - 1)
        if u >= p.s:
            q2.load(B[f"brow{par}"], self.hbm.slot_w.sub(u - p.s, 0, 1, p.t))
        self._fetch(c, q2, view(B[f"db{par}"], 0, "u8", 1, 2 * hw), u,
                    p.expert_bytes - 2 * p.h + 2 * h0, 2 * hw)
        S.signal(q2, "dside")

    def _dn_store(self, c: int, n: int, item: tuple[int, int]) -> None:
        p, B, S, q2 = self.p, self.B[c], self.S[c], self.q(c, 2)
        u, b = item
        h0, hw = p.down_blocks[b]
        q2.wait(S.sem["oread"], n + 1)
        if not p.direct:
            q2.store(self.hbm.outs.sub(u * p.t, h0, p.t, hw), B[f"ot{n % 2}"].sub(0, 0, p.t, hw))
            S.signal(q2, "ostored")
            self.g.signal(q2, "down")
        elif self.y_out.in_hbm:  # y's block, rounded once by the read-out
            q2.store(self.y_out.ref.hbm_view(0, h0, p.t, hw), B[f"ot{n % 2}"].sub(0, 0, p.t, hw))
            S.signal(q2, "ostored")
            S.signal(q2, "y_stored")

    def _dn_vector(self, c: int, n: int, u: int, b: int) -> None:
        """Vector unit: the down-bias operands (the weights' hi/mid/lo BF16 parts, three copies of
        the bias block), then the item's FP32 rows out of the accumulator."""
        p, B, S, v = self.p, self.B[c], self.S[c], self.kb.core(c).vpu
        hw, par, t = p.down_blocks[b][1], n % 2, p.t
        if p.expert_bias:
            v.wait(S.sem["dside"], n + 1)
            if n >= 2:  # the bias matmul of item n-2 (same buffers) is done
                v.wait(S.sem["ditem"], n - 1)
            src = column(B[f"brow{par}"]) if u >= p.s else B["onecol"]
            res, wall, b2all = B["bres"], B[f"wall{par}"], B[f"b2all{par}"]
            for part in range(BIAS_PARTS):  # exact for an FP32 weight
                col = wall.sub(0, part, t, 1)
                v.copy(col, src)
                if part < BIAS_PARTS - 1:
                    v.sub(res, src, col)
                    src = res
                v.copy(b2all.sub(part, 0, 1, hw), view(B[f"db{par}"], 0, "bf16", 1, hw))
            S.signal(v, "bias_ready")
        v.wait(S.sem["ditem"], n + 1)
        keep = p.direct and not self.y_out.in_hbm
        if n >= 2 and not keep:  # ot[par] of item n-2 is stored
            v.wait(S.sem["ostored"], n - 1)
        # One term: the FP32 sum rounded to BF16 once, as the combine would round it.
        dst = B[f"y{n}"] if keep else B[f"ot{par}"].sub(0, 0, t, hw)
        v.acc_read(dst, B["acc_o"][par].sub(0, 0, t, hw))
        S.signal(v, "oread")
        if keep:
            S.signal(v, "y_ready")

    # --- phase 4 ------------------------------------------------------------------------------
    def combine(self, c: int) -> None:
        """Combine items: the terms' rows added in term order (FP32), rounded to BF16 once."""
        p, B, S, core = self.p, self.B[c], self.S[c], self.kb.core(c)
        mine = p.combine_items()[c::p.cores]
        self._gate(c, [("down", len(p.down_items()))])
        if not mine:
            return
        v, q1, q2 = core.vpu, self.q(c, 1), self.q(c, 2)
        ti = 0
        for ci, (h0, hw) in enumerate(mine):
            first = ti
            for u in range(p.terms):
                if ti >= NG:  # the vector unit has added the term that used this buffer
                    q1.wait(S.sem["gsum"], ti - NG + 1)
                q1.load(B[f"g{ti % NG}"].sub(0, 0, p.t, hw), self.hbm.outs.sub(u * p.t, h0, p.t, hw))
                S.signal(q1, "gl")
                ti += 1
            keep = not self.y_out.in_hbm
            ysum = B["ysum"].sub(0, 0, p.t, hw)
            ybuf = B[f"y{ci}"] if keep else B["ybuf"].sub(0, 0, p.t, hw)
            if ci and not keep:  # the previous y block is stored
                v.wait(S.sem["y_stored"], ci)
            for u in range(p.terms):
                g = B[f"g{(first + u) % NG}"].sub(0, 0, p.t, hw)
                v.wait(S.sem["gl"], first + u + 1)
                last = u == p.terms - 1
                if u == 0:
                    v.copy(ybuf if last else ysum, g)
                else:
                    v.add(ybuf if last else ysum, ysum, g)
                S.signal(v, "gsum")
            S.signal(v, "y_ready")
            if not keep:
                q2.wait(S.sem["y_ready"], ci + 1)
                q2.store(self.y_out.ref.hbm_view(0, h0, p.t, hw), ybuf)
                S.signal(q2, "y_stored")


def emit_panel(ctx: EmitCtx, p: PanelPlan, shape: dict[str, Any], tensors: dict[str, TensorRef],
               outs: dict[str, Out]) -> Emitter:
    """Emit the small-scratchpad slot program for plan ``p`` (``plan_panel`` within ``ctx.budget``).

    ``tensors``: a ref for every non-output tensor of ``panel_tensors`` (x in HBM or on chip: its
    panels are fetched); ``outs``: "y" and "expert_ids", ``Out.to`` or ``Out.onchip`` (each combine
    item's y block kept where it is made). The prefetch part is empty: the phases reuse one
    scratchpad region behind global semaphores, so nothing is loaded before the program starts.
    Yields/returns ``{"y": ..., "expert_ids": ...}``.
    """
    prog = _Emitter(ctx, p, shape, tensors, outs)
    refs = prog.outputs()
    yield refs
    prog.emit()
    return refs
