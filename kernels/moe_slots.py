"""The moe kernel's expert-slot program (up to 128 tokens: decode batches), as an emitter.

Stage: kernels (``moe`` family). The program that ``moe_slots_plan`` plans: what it computes (expert
slots, each slot's token list, the dense and routed arrangements, the router's split) is described
there; this module emits it.

**Emitter** (``emit_slots``). x [T, H] BF16 from HBM or on chip: a core that holds the whole of x
in its scratchpad (a replicated norm output) reads it in place, otherwise it is fetched. y goes to
HBM (``Out.to``) or stays on chip (``Out.onchip``: each core's column slice, routed: its token
rows); ``expert_ids`` [D, 1] likewise (core 0's slot ids). The prefetch part loads what does not
depend on the routing: x when it is an HBM input ready at the start, the router panels, the router
or score biases and the leading shared-expert chunks; routed experts' weights are gathered after
the routing.

Weights are double- to quadruple-buffered per core (as the scratchpad allows), two chunks in
flight, each loaded in two pieces: its gate|up segment, which the gate|up matmul waits for, then
the down projection and biases. After each core's first routed gate|up segment the queue waits
until every core has routed, so all of the chip's first segments reach the HBM channels before
any core's later pieces. The matrix unit runs gate|up of item i+1 while the vector unit computes
item i's activation. Two scratchpad regions are reused over time (x and the router panel, then
the reduction or combine buffers; weight buffers, then the partial). The constants the kernel
needs (ones, zeros, 1e-20, id sequences) are made from x with ``vec.clamp`` lo = hi
(``moe_routing``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jalapeno_emu.isa.builder import KernelBuilder, MXTensor
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import Space

from .emit import EmitCtx, Emitter, Out, Piece, Ready, TensorRef, fetch
from .moe_base import BIAS_PARTS, Spec, aligned, column, emit_activation, view
from .moe_pack import chunk_views, gu_bytes
from .moe_routing import emit_route_constants, emit_routing, fill_constant, fill_ids, flat_rows
from .moe_slots_plan import LOOKAHEAD, REDUCE_QUEUES, MoePlan, bias_terms, core_tiles, item_seconds

__all__ = ["emit_slots"]

# --- the program ---------------------------------------------------------------------------------
_SEMS = ("x_loaded", "consts", "wr_loaded", "r_done", "pulled", "xq_ready", "routed", "loaded", "loaded_gu",
         "gu_done", "gu_read", "act_ready", "freed", "bias_ready", "bias_done", "red_free",
         "y_ready", "y_stored", "x_rows", "x_rows0", "x_quant", "xq_stored", "sh_block", "sh_drained",
         "sh_done", "crl_ready", "partial_ready", "staged", "owned_ready", "zero_ready", "c_loaded",
         "ids_stored", *(f"red_loaded{q}" for q in range(REDUCE_QUEUES)))


class _Program:
    """Emits the slot program (see the module docstring); ``prefetch`` then ``rest``."""

    def __init__(self, ctx: EmitCtx, p: MoePlan, shape: dict[str, Any], tensors: dict[str, TensorRef],
                 outs: dict[str, Out]) -> None:
        self.kb, self.p, self.shape = ctx.kb, p, shape
        self.x: TensorRef = tensors["x"]
        self.t = tensors
        self.y_out = outs.get("y") or Out.onchip()
        self.ids_out = outs.get("expert_ids") or Out.onchip()
        self.nq = ctx.spec.dma.queues_per_core
        self.workers = range(p.cores)
        self.producers = range(p.router_producers)
        kb = self.kb
        self.g = {n: kb.semaphore(n) for n in ("logits_ready", "partials_ready", "o_stored", "pulled_all",
                                                 "sh_copied", "routed_all")}
        self.x_static = self.x.in_hbm and not self.x.waits()
        # Routed: x's rows for each slot are gathered from x itself when it is an HBM input (and
        # quantised here), else from each core's copy of the quantised x in the scratch.
        self._quantise_rows = p.routed and self.x_static and shape["act_fmt"] != "bf16"
        # Each item's gate|up ahead of the rest before it only where the matrix unit, not the
        # loads, paces a core (``_emit_loads``); where the loads do, the order only moves work
        # past the last load.
        load_s, mxu_s, _ = item_seconds(ctx.spec, shape["act_fmt"], p.t, p.h, max(w for _, w in p.slices),
                                        max(p.chunk_sizes), p.cores)
        self._gate_up_first = mxu_s > load_s
        self.waited: dict[Any, set[Ready]] = {}
        self.B: dict[int, dict[str, Any]] = {}
        for c in range(max(p.cores, p.router_producers)):
            self.B[c] = self._alloc_core(c)

    def q(self, c: int, i: int) -> Any:
        return self.kb.core(c).dma[i % self.nq]

    # --- buffers ----------------------------------------------------------------------------
    def _alloc_core(self, c: int) -> dict[str, Any]:
        """Every buffer of core ``c``. All cores allocate the same buffers in the same order, so
        their scratchpads have the same layout and the functional pass compiles each instruction
        shape once for all of them. Two regions are reused: x and the router panel (done once the
        routing is) later hold the reduction or combine buffers; the weight buffers (done after
        the last item) later hold the partial."""
        kb, p, shape = self.kb, self.p, self.shape
        local = self.x.local(c) if not self.x.in_hbm else None
        tiles = core_tiles(p, shape["act_fmt"], shape["activation"], local is None)
        keep_y = not self.y_out.in_hbm
        B: dict[str, Any] = {"x_local": local}
        for name, layouts in tiles.regions:
            if keep_y:  # a kept output outlives the program's regions: a buffer of its own
                layouts = tuple(tuple(sp for sp in lay if sp[0] != "ybuf") for lay in layouts)
            B.update(_union(kb, c, name, layouts))
        B["wbuf"] = [B.pop(f"w{b}") for b in range(p.nbuf)]
        keep_ids = c == 0 and p.e and not self.ids_out.in_hbm
        for name, dtype, sh in tiles.plain:
            B[name] = kb.sram(c, name, sh, dtype, keep=bool(keep_ids and name == "slot_ids"))
        for name, fmt, sh in tiles.mx:
            B[name] = kb.sram_mx(c, name, sh, fmt, axis=1)
        if local is not None:
            B["x"] = local[0]
        if shape["act_fmt"] == "bf16":
            B["xq"] = B["x"]  # the matrix unit takes x as it is
        B["aq"] = [B.pop("aq0"), B.pop("aq1")]
        n_x = p.routed_terms_max if p.routed else 0
        B["xb"] = [B.pop(f"xb{q}") for q in range(n_x)]
        B["xs"] = [B.pop(f"xs{q}") for q in range(n_x)] if shape["act_fmt"] != "bf16" else B["xb"]
        if keep_y and c in self._y_cores():
            rows, cols = self._y_block(c)[2:]
            B["ybuf"] = kb.sram(c, "y", (rows, cols), "bf16", keep=True)
        B["acc_gu"] = [kb.acc(c, f"acc_gu{b}", (p.cap_max, 2 * p.slice_max)) for b in range(2)]
        B["acc_out"] = kb.acc(c, "acc_out", (p.rows_max, p.h))
        if p.routed and p.s:
            B["acc_sh"] = [kb.acc(c, f"acc_sh{b}", (p.t, p.sh_block)) for b in range(2)]
        if p.e:
            B["acc_r"] = kb.acc(c, "acc_r", (p.t, p.router_cols))
        B["sem"] = {n: kb.semaphore(f"c{c}.{n}") for n in _SEMS}
        return B

    def _y_cores(self) -> list[int]:
        p = self.p
        if p.routed:
            return list(range(len(p.combine_items())))
        return [c for c in self.workers if p.red[c][1]]

    def _y_block(self, c: int) -> tuple[int, int, int, int]:
        """(first row, first column, rows, columns) of y that core c produces."""
        p = self.p
        if p.routed:
            t0, n = p.combine_items()[c]
            return t0, 0, n, p.h
        h0, hk = p.red[c]
        return 0, h0, p.t, hk

    # --- outputs ----------------------------------------------------------------------------
    def outputs(self) -> dict[str, TensorRef]:
        """The output refs, with each block ready when it is written (on chip) or stored (HBM)."""
        p, out = self.p, {}
        if self.y_out.in_hbm:
            ref = self.y_out.ref
            for c in self._y_cores():
                r0, c0, rows, cols = self._y_block(c)
                ref = ref.with_ready(r0, c0, rows, cols, (self.B[c]["sem"]["y_stored"].id, 1))
            out["y"] = ref
        else:
            pieces = []
            for c in self._y_cores():
                r0, c0, rows, cols = self._y_block(c)
                pieces.append(Piece(r0, c0, rows, cols, self.B[c]["ybuf"].sub(0, 0, rows, cols), None,
                                    (self.B[c]["sem"]["y_ready"].id, 1)))
            out["y"] = TensorRef.onchip("y", (p.t, p.h), "bf16", pieces)
        if p.e:
            sem = self.B[0]["sem"]
            if self.ids_out.in_hbm:
                out["expert_ids"] = self.ids_out.ref.with_ready(0, 0, p.d, 1, (sem["ids_stored"].id, 1))
            else:
                tile = self.B[0]["slot_ids"].sub(0, 0, p.d, 1)
                out["expert_ids"] = TensorRef.onchip("expert_ids", (p.d, 1), "i32",
                                                     [Piece(0, 0, p.d, 1, tile, None, (sem["routed"].id, 1))])
        return out

    # --- prefetch part ----------------------------------------------------------------------
    def prefetch(self) -> None:
        """What does not depend on the routing or on other operators: x (an HBM input ready at the
        start), router panels, router / score biases, the leading shared chunks."""
        p = self.p
        for c, B in self.B.items():
            sem = B["sem"]
            if B["x_local"] is None and self.x_static:
                q0 = self.q(c, 0)
                q0.load(B["x"], self.x.hbm_view(0, 0, p.t, p.h))
                q0.signal(sem["x_loaded"])
                B["x_wait"] = [(sem["x_loaded"].id, 1)]
            if c in self.producers:
                q1 = self.q(c, 1)
                n, k0, rows = p.router_piece(c)
                q1.load(B["wr"].sub(0, 0, rows, p.router_cols),
                        self.t["router"].hbm_view(n * p.h + k0, 0, rows, p.router_cols))
                q1.signal(sem["wr_loaded"])
            if c in self.workers and p.e:
                q1 = self.q(c, 1)
                if p.rd.router == "softmax_topk":
                    q1.load(B["bias"], self.t["router_bias"].hbm_view(0, 0, 1, p.e))
                if p.rd.score_bias:
                    q1.load(B["score_bias"], self.t["score_bias"].hbm_view(0, 0, 1, p.e))
                q1.signal(sem["consts"])
            if c in self.workers:
                B["loads_done"] = self._emit_loads(c, prefetch=True)

    # --- the rest ---------------------------------------------------------------------------
    def rest(self) -> None:
        p = self.p
        for c, B in self.B.items():
            core, sem, v = self.kb.core(c), B["sem"], self.kb.core(c).vpu
            if B["x_local"] is not None:
                ready = B["x_local"][1]
                B["x_wait"] = [ready] if ready is not None else []
            elif not self.x_static:
                used = fetch(core.dma, B["x"], self.x, waited=self.waited)
                for q in used:
                    q.signal(sem["x_loaded"])
                B["x_wait"] = [(sem["x_loaded"].id, len(used))]
            if c in self.producers:
                self._emit_router(c)
            if c not in self.workers:
                v.wait(sem["r_done"], 1)
                v.acc_read(B["logits_part"], B["acc_r"])
                v.signal(self.g["logits_ready"])
                continue
            items = p.core_items(c)
            shared_bias = any(sh and j == 0 for sh, _, j in items) and p.expert_bias
            self._emit_core_setup(c, shared_bias)
            if p.routed and c == 0:
                self._emit_zero_rows()
            if c in self.producers:
                v.wait(sem["r_done"], 1)
                v.acc_read(B["logits_part"], B["acc_r"])
                v.signal(self.g["logits_ready"])
            if p.routed and not self.x_static and any(u >= p.s for u, _ in p.core_terms(c)):
                self._emit_xq_store(c)
            if p.e:
                self._emit_routing(c)
            self._emit_loads(c, prefetch=False)
            self._emit_matmuls(c)
            self._emit_activations(c)
            if p.routed:
                v.signal(sem["partial_ready"])
            else:
                v.signal(self.g["partials_ready"])
        for c in self.workers:
            if p.routed:
                self._emit_owner(c)
            else:
                self._emit_reduction(c)
        if p.routed:
            for c in range(len(p.combine_items())):
                self._emit_combine(c)

    def _emit_router(self, c: int) -> None:
        """Producer core ``c``: its piece of the logits (a column panel over a block of H), FP32 in
        its accumulators."""
        p, B = self.p, self.B[c]
        m, sem = self.kb.core(c).mxu, B["sem"]
        for cond in B["x_wait"]:
            m.wait(*cond)
        m.wait(sem["wr_loaded"], 1)
        _, k0, rows = p.router_piece(c)
        m.matmul(B["acc_r"], B["x"].sub(0, k0, p.t, rows), B["wr"].sub(0, 0, rows, p.router_cols),
                 mode="overwrite")
        m.signal(sem["r_done"])

    def _emit_core_setup(self, c: int, has_shared_bias: bool) -> None:
        """Vector unit, once x is in: x quantised, and the constants made from it (no immediates)."""
        p, B, shape = self.p, self.B[c], self.shape
        v, sem, x = self.kb.core(c).vpu, B["sem"], B["x"]
        for cond in B["x_wait"]:
            v.wait(*cond)
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
        if p.routed:
            self._list_constants(c)

    def _list_constants(self, c: int) -> None:
        """Routed: the lists' reserved and pad entries (token ids with weight 0), the check's zeros."""
        p, B = self.p, self.B[c]
        v, x = self.kb.core(c).vpu, B["x"]
        t, k = p.t, p.k
        ones, scratch = B["lones"], B["lscr"]
        fill_constant(v, ones, 1.0, x)
        tail = k + p.r_log
        for lo, n in ((0, k), (tail, t)):  # reserved rows (zero rows of O) and every token once
            fill_ids(v, B["pi"].sub(0, lo, 1, n), t, ones, scratch)
            fill_constant(v, B["pw"].sub(0, lo, 1, n), 0.0, x)
        fill_constant(v, B["fz"], 0.0, x)
        fill_constant(v, B["fzero"], 0.0, x)
        fill_ids(v, flat_rows(B["fsrc"], p.d, 1), 1, ones, scratch)  # the extra 0 flag
        fill_constant(v, B["zrow"], 0.0, x)

    def _emit_xq_store(self, c: int) -> None:
        """Routed: core ``c`` stores its quantised x into its own rows of the HBM scratch, which it
        gathers its slots' rows from once the lists are known (while the weights do not stream yet:
        a copy per core keeps the gathers of every core off the same few HBM channels)."""
        B, q2 = self.B[c], self.q(c, 2)
        q2.wait(B["sem"]["xq_ready"], 1)
        xq = self._xq_hbm(c)
        if isinstance(xq, MXTensor):
            q2.store(xq.codes, B["xq"].codes)
            q2.store(xq.scales, B["xq"].scales)
        else:
            q2.store(xq, B["xq"])
        q2.signal(B["sem"]["xq_stored"])

    def _xq_hbm(self, c: int) -> MXTensor | Tile:
        """Core c's copy of the quantised x in the HBM scratch (rows c*T .. (c+1)*T)."""
        ref = self.t["xq"]
        t = self.p.t
        if ref.is_mx:
            return MXTensor(ref.base, ref.base_scales, 1).sub(c * t, 0, t, self.p.h)
        return ref.base.sub(c * t, 0, t, self.p.h)

    def _emit_routing(self, c: int) -> None:
        """Core ``c`` pulls the R logit panels and routes every token into its slot tables (and,
        routed, the lists); core 0 also stores or keeps the slot ids."""
        p, B = self.p, self.B[c]
        t, sem, v = p.t, B["sem"], self.kb.core(c).vpu
        q1 = self.q(c, 1)
        q1.wait(self.g["logits_ready"], p.router_producers)
        ew = p.router_cols
        for pc in self.producers:
            n, _, _ = p.router_piece(pc)
            r = pc % p.router_split
            dst = B["logits"] if r == 0 else B["lstage"].sub((r - 1) * t, 0, t, p.e)
            q1.copy(dst.sub(0, n * ew, t, ew), self.B[pc]["logits_part"])
        q1.signal(sem["pulled"])
        if p.routed and p.s:
            q1.signal(self.g["pulled_all"])
        v.wait(sem["consts"], 1)
        v.wait(sem["pulled"], 1)
        for r in range(1, p.router_split):  # the K blocks in order: ((b0 + b1) + b2) + ...
            v.add(B["logits"], B["logits"], B["lstage"].sub((r - 1) * t, 0, t, p.e))
        emit_routing(v, B, p.rd, self.shape["routed_scaling_factor"], p.d)
        if p.routed:
            self._emit_lists(c)
        v.signal(sem["routed"])
        v.signal(self.g["routed_all"])
        if p.routed:
            self._emit_picks(c)
        if c == 0 and self.ids_out.in_hbm:
            q1.wait(sem["routed"], 1)
            q1.store(self.ids_out.ref.hbm_view(0, 0, p.d, 1), B["slot_ids"].sub(0, 0, p.d, 1))
            q1.signal(sem["ids_stored"])

    def _emit_lists(self, c: int) -> None:
        """Routed: each slot's list (its C best tokens, ids and weights, written into the combine's
        id and weight rows): what the x-row gathers and the weights need first."""
        p, B = self.p, self.B[c]
        v, t, off = self.kb.core(c).vpu, p.t, p.k
        for u0, rows, cap in p.classes:
            src = B["slot_w"].sub(u0, 0, rows, t)
            v.topk(view(B["pw"], 4 * off, "f32", rows, cap), view(B["pi"], 4 * off, "i32", rows, cap), src)
            off += rows * cap

    def _emit_picks(self, c: int) -> None:
        """Routed, after the lists are out: the capacity check, and each token's k rows of O (what
        only the combine reads)."""
        p, B = self.p, self.B[c]
        v, t, k = self.kb.core(c).vpu, p.t, p.k
        pi, pw = B["pi"], B["pw"]
        checked = False
        for n, (u0, rows, cap) in enumerate(p.classes):
            if cap < t:  # the (cap+1)-th weight of each of these slots
                pv = B[f"probe_v{n}"]
                v.topk(pv, B[f"probe_i{n}"], B["slot_w"].sub(u0, 0, rows, t))
                v.copy(B["fz"].sub(u0, 1, rows, 1), pv.sub(0, cap, rows, 1))
                checked = True
        if checked:
            # 1 where a slot's (cap+1)-th weight is positive (more tokens chose it than its list
            # holds), else 0; a flag of 1 beside the extra 0 is a second distinct value, which a
            # one-row vec.group refuses ("more distinct values than the 1 rows of dst").
            v.topk(B["fv"], B["fsrc"].sub(0, 0, p.d, 1), B["fz"])
            v.group(B["fdst"], B["fdw"], B["fsrc"], B["fzero"])
        # P [T, k + rows + T]: token t's weight at each O row that holds it; top-k: its k rows.
        v.group(B["ptd"], B["pt"], column(pi), column(pw))
        v.topk(B["cv"], B["crl"], B["pt"].sub(0, 0, t, k + p.r_log))
        v.signal(B["sem"]["crl_ready"])

    def _emit_x_rows(self, c: int) -> None:
        """Routed: queue 0 gathers the x rows of every slot core ``c`` runs, by its list, as its
        first descriptors after the routing: ahead of the weights in the HBM channels' queues
        (behind them a slot's rows wait for every core's weights in flight, ~7 us at gpt-oss-120b's
        shapes on jalapeno-v1, and hold up that slot's first matmul). x's BF16 rows when x is an
        HBM input (the vector unit quantises them, row by row as xq is: the same codes), else the
        rows of the core's copy of the quantised x (codes and scales)."""
        p, B = self.p, self.B[c]
        sem = self.B[c]["sem"]
        slots = [u for u, _ in p.core_terms(c) if u >= p.s]
        for q, u in enumerate(slots):
            # The first slot's rows on queue 0 ahead of the weights; the others' on queue 2, at once.
            q0 = self.q(c, 0 if q == 0 else 2)
            if q <= 1:
                if q == 1:
                    q0.wait(sem["routed"], 1)
                if not self.x_static:
                    q0.wait(sem["xq_stored"], 1)
            rows = p.term_rows(u)
            idx = column(B["pi"], p.o_row(u), rows)
            if self.x_static:
                q0.gather(B["xs"][q].sub(0, 0, rows, p.h), self.x.base, idx)
            else:
                xq, dst = self._xq_hbm(c), B["xb"][q]
                if isinstance(dst, MXTensor):
                    q0.gather(dst.codes.sub(0, 0, rows, p.h), xq.codes, idx)
                    q0.gather(dst.scales.sub(0, 0, rows, p.h // 32), xq.scales, idx)
                else:
                    q0.gather(dst.sub(0, 0, rows, p.h), xq, idx)
            q0.signal(sem["x_rows0" if q == 0 else "x_rows"])  # lands once this slot's rows have

    def _x_rows_ready(self, c: int, q: int) -> Ready:
        """When core c's q-th slot's x rows have landed."""
        sem = self.B[c]["sem"]
        return (sem["x_rows0"].id, 1) if q == 0 else (sem["x_rows"].id, q)

    def _emit_loads(self, c: int, prefetch: bool) -> int:
        """DMA queue 0: each item's chunk, loaded (shared) or gathered by its slot's expert id, in
        two pieces: its gate|up segment (``loaded_gu``), which the matrix unit needs first, then
        the rest (down projection and biases: ``loaded``). Where the matrix unit paces the core
        and it has items past the pipeline's fill, a routed item's rest goes after the next
        routed item's gate|up, the order the unit takes them in (gate|up of n + 1 before the
        down projection of n): a core's port sends in order, so the rest queued first would
        hold back the gate|up the unit waits for. ``prefetch``: only the leading shared items
        whose buffers are fresh; returns how many."""
        p, B = self.p, self.B[c]
        q0, sem = self.q(c, 0), B["sem"]
        items = p.core_items(c)
        start = 0 if prefetch else B["loads_done"]
        routed_waited = wave_waited = False
        # A routed item's rest, held back until the next item's gate|up is queued. Safe with two
        # or more buffers and LOOKAHEAD >= 2: item n's waits reach back to item n - 2 at most.
        # Only on a core with items beyond the pipeline's fill: the gain is per item in the steady
        # state, the cost (the last loads land in another order) once (gpt-oss-120b at batch 1,
        # 2-3 items a core: 0.5 us slower; at batch 64, 26-27 items: 2.7 us faster).
        held: Callable[[], None] | None = None
        hold = self._gate_up_first and p.nbuf >= 2 and LOOKAHEAD >= 2 and len(items) > p.nbuf + LOOKAHEAD
        for n in range(start, len(items)):
            is_shared, slot, j = items[n]
            if prefetch and (n >= p.nbuf or not is_shared):
                return n
            if held is not None and is_shared:
                held()
                held = None
            size, gu = p.chunk_sizes[j], gu_bytes(p.h, p.slices[j][1])
            dst = B["wbuf"][n % p.nbuf]
            if not is_shared and not routed_waited:
                # Before the buffer's wait below: the vector unit waits for the first slot's rows
                # before it drains the shared items ahead of it, which the matrix unit needs
                # drained to free that buffer (Kimi K2.5 at 96 tokens deadlocked so).
                q0.wait(sem["routed"], 1)
                if p.routed:
                    self._emit_x_rows(c)
                routed_waited = True
            if n >= p.nbuf:  # the buffer's previous item must be done on the matrix unit
                q0.wait(sem["freed"], n - p.nbuf + 1)
            if n >= LOOKAHEAD:
                q0.wait(sem["loaded"], n - LOOKAHEAD + 1)
            if is_shared:
                src = self.t["shared"].base.offset + slot * p.expert_bytes + p.chunk_off[j]
                q0.load(dst.sub(0, 0, 1, gu), Tile(Space.HBM, 0, src, "u8", 1, gu))
                q0.signal(sem["loaded_gu"])
                q0.load(dst.sub(0, gu, 1, size - gu), Tile(Space.HBM, 0, src + gu, "u8", 1, size - gu))
                q0.signal(sem["loaded"])
                continue
            base = self.t["experts"].base.offset + p.chunk_off[j]
            ids = B["slot_ids"].sub(slot, 0, 1, 1)
            q0.gather(dst.sub(0, 0, 1, gu), Tile(Space.HBM, 0, base, "u8", p.e, gu, p.expert_bytes), ids)
            q0.signal(sem["loaded_gu"])
            if not wave_waited:
                # Every core's first gate|up segment before anyone's next piece: a core's DMA
                # port sends its pieces in order, but the HBM channels serve transfers in the
                # order they reach them, so a core that routes a little late would find its first
                # segment queued behind every other core's first two chunks.
                q0.wait(self.g["routed_all"], len(self.workers))
                wave_waited = True

            def rest(dst=dst, base=base, gu=gu, size=size, ids=ids) -> None:
                q0.gather(dst.sub(0, gu, 1, size - gu),
                          Tile(Space.HBM, 0, base + gu, "u8", p.e, size - gu, p.expert_bytes), ids)
                q0.signal(sem["loaded"])

            if held is not None:
                held()
            held = rest if hold else None
            if not hold:
                rest()
        if held is not None:
            held()
        return len(items)

    def _views(self, c: int, n: int, j: int):
        p = self.p
        return chunk_views(self.B[c]["wbuf"][n % p.nbuf], p.h, p.slices[j][1], p.expert_bias, j == 0)

    def _rows_of(self, c: int, n: int) -> tuple[int, int, Any]:
        """(rows, first row in the core's partial, x operand) of core c's item n."""
        p, B = self.p, self.B[c]
        it = p.core_items(c)[n]
        if not p.routed:
            return p.t, 0, B["xq"]
        u = p.term(it)
        terms = p.core_terms(c)
        row = next(r for uu, r in terms if uu == u)
        rows = p.term_rows(u)
        if u < p.s:
            return rows, row, B["xq"]
        q = [uu for uu, _ in terms if uu >= p.s].index(u)
        x = B["xb"][q]
        x = x.sub(0, 0, rows, p.h)
        return rows, row, x

    def _emit_matmuls(self, c: int) -> None:
        """Matrix unit: gate|up of item n while the vector unit activates item n - 1, then its down
        projection into the core's accumulators; the down-bias matmul last."""
        p, B = self.p, self.B[c]
        m, sem = self.kb.core(c).mxu, B["sem"]
        items = p.core_items(c)
        first_of_term = {}
        for n, it in enumerate(items):
            first_of_term.setdefault(p.term(it), n)
        x_rows_waited = 0

        def gate_up(n: int) -> None:
            nonlocal x_rows_waited
            j = items[n][2]
            w = p.slices[j][1]
            rows, _, x = self._rows_of(c, n)
            if n == 0:
                m.wait(sem["xq_ready"], 1)
            if p.routed and not items[n][0] and first_of_term[p.term(items[n])] == n:
                x_rows_waited += 1  # the slot's x rows, gathered after the routing (and quantised)
                if self._quantise_rows:
                    m.wait(sem["x_quant"], x_rows_waited)
                else:
                    m.wait(*self._x_rows_ready(c, x_rows_waited - 1))
            m.wait(sem["loaded_gu"], n + 1)
            if n >= 2:  # the vector unit has read this accumulator's previous item
                m.wait(sem["gu_read"], n - 1)
            m.matmul_mx(B["acc_gu"][n % 2].sub(0, 0, rows, 2 * w), x, self._views(c, n, j).gu,
                        mode="overwrite")
            m.signal(sem["gu_done"])

        sh_blocks = 0

        def down(n: int) -> None:
            nonlocal sh_blocks
            j = items[n][2]
            w = p.slices[j][1]
            rows, row, _ = self._rows_of(c, n)
            m.wait(sem["act_ready"], n + 1)
            m.wait(sem["loaded"], n + 1)  # the chunk's down projection
            if p.routed and items[n][0]:  # a shared item: its T rows, block by block (drained by the vpu)
                dn = self._views(c, n, j).down
                for h0 in range(0, p.h, p.sh_block):
                    hw = min(p.sh_block, p.h - h0)
                    if sh_blocks >= 2:
                        m.wait(sem["sh_drained"], sh_blocks - 1)
                    m.matmul_mx(B["acc_sh"][sh_blocks % 2].sub(0, 0, rows, hw),
                                B["aq"][n % 2].sub(0, 0, rows, w),
                                dn.sub(0, h0, dn.codes.rows, hw), mode="overwrite")
                    m.signal(sem["sh_block"])
                    sh_blocks += 1
                m.signal(sem["freed"])
                return
            first = first_of_term[p.term(items[n])] == n if p.routed else n == 0
            m.matmul_mx(B["acc_out"].sub(row, 0, rows, p.h), B["aq"][n % 2].sub(0, 0, rows, w),
                        self._views(c, n, j).down, mode="overwrite" if first else "accumulate")
            m.signal(sem["freed"])

        for n in range(len(items)):
            gate_up(n)
            if n:
                down(n - 1)
        down(len(items) - 1)
        if bias_terms(p, c):  # acc += [w_hi w_mid w_lo ...] @ [b2; b2; b2; ...] for this core's terms
            rows = p.rows_on(c) if p.routed else p.t
            m.wait(sem["bias_ready"], 1)
            m.matmul(B["acc_out"].sub(0, 0, rows, p.h), B["wall"].sub(0, 0, rows, p.bias_cols), B["b2all"],
                     mode="accumulate")
            m.signal(sem["bias_done"])

    def _emit_bias_terms(self, v: Any, c: int, q: int, row: int, weight: Tile, down_bias: Tile) -> None:
        """Columns 3q..3q+2 (rows row..row+R) of the down-bias matmul: the weight's BF16 parts, and
        three copies of the term's down bias (copied out of its chunk before the buffer is reused)."""
        B = self.B[c]
        wall, res = B["wall"], B["bres"]
        rows = weight.rows
        src = weight
        for part in range(BIAS_PARTS):
            col = wall.sub(row, BIAS_PARTS * q + part, rows, 1)
            v.copy(col, src)  # rounds to BF16
            if part < BIAS_PARTS - 1:
                v.sub(res.sub(0, 0, rows, 1), src, col)  # the remainder, exact in FP32
                src = res.sub(0, 0, rows, 1)
            v.copy(B["b2all"].sub(BIAS_PARTS * q + part, 0, 1, down_bias.cols), down_bias)

    def _emit_activations(self, c: int) -> None:
        """Vector unit: per item, gate|up out of the accumulator (+ biases), the activation, times
        each row's gate weight, quantised for the down projection; then the partial out."""
        p, B, shape = self.p, self.B[c], self.shape
        v, sem = self.kb.core(c).vpu, B["sem"]
        items = p.core_items(c)
        gu, tmp, aq = B["gu"], B["tmp"], B["aq"]
        bias_items = bias_terms(p, c)
        # Routed: shared items (index -> (first, last) of the term on this core) and drains so far.
        shared_items: dict[int, tuple[bool, bool]] = {}
        if p.routed:
            for n, it in enumerate(items):
                if it[0]:
                    shared_items[n] = (n == 0 or items[n - 1][:2] != it[:2],
                                       n == len(items) - 1 or items[n + 1][:2] != it[:2])
        drains = [0]
        # Slot q's gathered x rows are quantised before the activation of the item before its
        # first (the matrix unit's gate|up of that first item then need not wait for it).
        quantise_at: dict[int, list[tuple[int, int]]] = {}
        if self._quantise_rows:
            slots = [u for u, _ in p.core_terms(c) if u >= p.s]
            for q, u in enumerate(slots):
                first = next(n for n, it in enumerate(items) if p.term(it) == u)
                quantise_at.setdefault(max(0, first - 1), []).append((q, u))
        for n, (is_shared, slot, j) in enumerate(items):
            for q, u in quantise_at.get(n, ()):
                rows_u = p.term_rows(u)
                xb = B["xb"][q].sub(0, 0, rows_u, p.h)
                v.wait(*self._x_rows_ready(c, q))
                v.quantize(xb.codes, xb.scales, B["xs"][q].sub(0, 0, rows_u, p.h))
                v.signal(sem["x_quant"])
            w = p.slices[j][1]
            rows, row, _ = self._rows_of(c, n)
            g_t, u_t, a_t = gu.sub(0, 0, rows, w), gu.sub(0, w, rows, w), tmp.sub(0, 0, rows, w)
            views = self._views(c, n, j)
            v.wait(sem["gu_done"], n + 1)
            v.acc_read(gu.sub(0, 0, rows, 2 * w), B["acc_gu"][n % 2].sub(0, 0, rows, 2 * w))
            v.signal(sem["gu_read"])
            if is_shared:
                wcol = None
            elif p.routed:  # the row's weight in the slot's list
                wcol = column(B["pw"], p.o_row(p.s + slot), rows)
            else:  # the token's gate weight for this slot's expert: row `slot` of the [D, T] table
                wcol = view(B["slot_w"], slot * p.t * 4, "f32", p.t, 1, 4)
            if p.expert_bias:
                v.wait(sem["loaded"], n + 1)  # the biases travel after the down projection
                v.add(gu.sub(0, 0, rows, 2 * w), gu.sub(0, 0, rows, 2 * w), views.gu_bias)
                if j == 0 and is_shared and p.routed:  # added to the rows once they are complete
                    v.copy(B[f"b2sh{slot}"], views.down_bias)
                elif j == 0:
                    weight = B["onecol"].sub(0, 0, rows, 1) if is_shared else wcol
                    self._emit_bias_terms(v, c, bias_items.index(n), row, weight, views.down_bias)
                    if n == bias_items[-1]:
                        v.signal(sem["bias_ready"])
            emit_activation(v, B.get("ones"), g_t, u_t, a_t, shape["activation"])
            if n >= 2:  # aq[n % 2] is free once the down matmul of item n - 2 is done
                v.wait(sem["freed"], n - 1)
            dst = aq[n % 2].sub(0, 0, rows, w)
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
            if n and shared_items.get(n - 1):  # the previous shared item's down blocks (done meanwhile)
                self._emit_shared_drain(c, n - 1, shared_items, drains)
        if shared_items.get(len(items) - 1):
            self._emit_shared_drain(c, len(items) - 1, shared_items, drains)
        # --- partial out to scratchpad, for the other cores to pull ---
        v.wait(sem["freed"], len(items))
        if bias_items:
            v.wait(sem["bias_done"], 1)
        rows = p.rows_on(c) if p.routed else p.t
        if rows:
            v.acc_read(B["partial"].sub(0, 0, rows, p.h), B["acc_out"].sub(0, 0, rows, p.h))

    def _emit_shared_drain(self, c: int, n: int, shared_items: dict[int, tuple[bool, bool]],
                           drains: list[int]) -> None:
        """Routed: the vector unit adds shared item n's down-projection blocks into the term's
        [T, H] rows in the scratchpad (the term's first item on this core writes them); after the
        term's last item here, the core holding slice 0 adds the down bias (weight 1: exactly the
        bias matmul's sum)."""
        p, B = self.p, self.B[c]
        v, sem = self.kb.core(c).vpu, B["sem"]
        first, last = shared_items[n]
        slot = p.core_items(c)[n][1]
        rows = B[f"sh_part{slot}"]
        if drains[0] == 0:  # the rows reuse the routing's tiles: every core has pulled its logits
            v.wait(self.g["pulled_all"], p.cores)
        for h0 in range(0, p.h, p.sh_block):
            hw = min(p.sh_block, p.h - h0)
            acc = B["acc_sh"][drains[0] % 2].sub(0, 0, p.t, hw)
            v.wait(sem["sh_block"], drains[0] + 1)
            dst = rows.sub(0, h0, p.t, hw)
            if first:
                v.acc_read(dst, acc)
            else:
                tmp = B["tmp_sh"].sub(0, 0, p.t, hw)
                v.acc_read(tmp, acc)
                v.add(dst, dst, tmp)  # FP32 sums in item order
            v.signal(sem["sh_drained"])
            drains[0] += 1
        if last and p.expert_bias and p.holders(slot)[0] == c:
            v.add(rows, rows, B[f"b2sh{slot}"])
        if last and p.holders(slot) == (c,):  # complete: the combining cores may copy its rows
            v.signal(sem["sh_done"])

    def _shared_ready(self, u: int) -> tuple[int, Ready]:
        """(owner core, the condition after which its [T, H] rows of shared term u are complete)."""
        p = self.p
        owner = p.holders(u)[0]
        sem = self.B[owner]["sem"]
        if len(p.holders(u)) > 1:
            return owner, (sem["owned_ready"].id, 1)
        alone = [uu for uu, _ in p.core_terms(owner) if uu < p.s and len(p.holders(uu)) == 1]
        return owner, (sem["sh_done"].id, alone.index(u) + 1)  # one signal per such term, in order

    # --- dense: reduction ---------------------------------------------------------------------
    def _emit_reduction(self, c: int) -> None:
        """Core c adds column slice c of every core's partial, in core order, and stores (or keeps)
        y[:, slice]."""
        p = self.p
        h0, hk = p.red[c]
        if hk == 0:
            return
        t, nq = p.t, self.nq
        B, core = self.B[c], self.kb.core(c)
        v = core.vpu
        sem, red = B["sem"], B["red"]
        ybuf, ysum = B["ybuf"].sub(0, 0, t, hk), B["ysum"].sub(0, 0, t, hk)
        # The partials are small (one descriptor each) and a queue keeps only
        # ``max_outstanding_per_queue`` in flight: spread over up to four queues, 64 cores' pulls
        # pay the DMA set-up once instead of once per 16 on each of two queues.
        queues = [core.dma[(q + 2) % nq] for q in range(min(nq, REDUCE_QUEUES))]
        for q in queues:
            q.wait(self.g["partials_ready"], p.cores)
        # Rounds of `group` partials (the buffer holds one round): y = ((p0 + p1) + p2) + ...
        for r, c_lo in enumerate(range(0, p.cores, p.group)):
            for q in queues:
                if r:
                    q.wait(sem["red_free"], r)
            for c2 in range(c_lo, min(p.cores, c_lo + p.group)):
                queues[c2 % len(queues)].copy(red.sub((c2 - c_lo) * t, 0, t, hk),
                                              self.B[c2]["partial"].sub(0, h0, t, hk))
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
        if self.y_out.in_hbm:
            queues[0].wait(sem["y_ready"], 1)
            queues[0].store(self.y_out.ref.hbm_view(0, h0, t, hk), ybuf)
            queues[0].signal(sem["y_stored"])

    # --- routed: terms completed, stored, combined ----------------------------------------------
    def _o_table(self, cols: int | None = None) -> Tile:
        ref = self.t["o_rows"]
        return ref.base if cols is None else ref.base.sub(0, 0, ref.shape[0], cols)

    def _term_rows_tile(self, c: int, u: int) -> Tile:
        """Core c's rows of term u: a shared term's [T, H] rows in the scratchpad, a slot's rows
        of its partial."""
        p, B = self.p, self.B[c]
        if u < p.s:
            return B[f"sh_part{u}"]
        row = next(r for uu, r in p.core_terms(c) if uu == u)
        return B["partial"].sub(row, 0, p.term_rows(u), p.h)

    def _emit_owner(self, c: int) -> None:
        """Core c pulls the rows other cores computed of the term it owns last, adds them in core
        order, and stores every term it owns into O."""
        p, B = self.p, self.B[c]
        core, sem = self.kb.core(c), B["sem"]
        v, q3 = core.vpu, self.q(c, 3)
        owned = [u for u, _ in p.core_terms(c)
                 if p.holders(u)[0] == c and not (u < p.s and len(p.holders(u)) == 1)]
        if not owned:
            return
        u_last = owned[-1]
        others = p.holders(u_last)[1:]
        rows = p.term_rows(u_last)
        if others:  # the staging reuses this core's weight buffers: its items are done
            q3.wait(sem["partial_ready"], 1)
        for n, h in enumerate(others):
            q3.wait(self.B[h]["sem"]["partial_ready"], 1)
            q3.copy(B["stage"].sub(n * rows, 0, rows, p.h), self._term_rows_tile(h, u_last))
            q3.signal(sem["staged"])
        if others:
            v.wait(sem["staged"], len(others))
            part = self._term_rows_tile(c, u_last)
            for n in range(len(others)):  # partials in core order: ((p_c + p_c+1) + ...)
                v.add(part, part, B["stage"].sub(n * rows, 0, rows, p.h))
        v.signal(sem["owned_ready"])
        q3.wait(sem["owned_ready"], 1)
        table = self._o_table()
        slots = [u for u in owned if u >= p.s]
        for u in slots:
            q3.store(table.sub(p.o_row(u), 0, p.term_rows(u), p.h), self._term_rows_tile(c, u))
        if slots:
            q3.signal(self.g["o_stored"])

    def _o_signals(self) -> int:
        """Signals on o_stored once O is complete: each owner of slots' rows, the zero rows."""
        p = self.p
        owners = sum(1 for c in self.workers
                     if any(u >= p.s and p.holders(u)[0] == c for u, _ in p.core_terms(c)))
        return owners + 1

    def _emit_zero_rows(self) -> None:
        """Core 0 stores O's k zero rows (what a token with fewer than k positive picks adds)."""
        B = self.B[0]
        v, q2 = self.kb.core(0).vpu, self.q(0, 2)
        v.signal(B["sem"]["zero_ready"])
        q2.wait(B["sem"]["zero_ready"], 1)
        table = self._o_table()
        for r in range(self.p.k):
            q2.store(table.sub(r, 0, 1, self.p.h), B["zrow"])
        q2.signal(self.g["o_stored"])

    def _emit_combine(self, c: int) -> None:
        """Core c: its tokens' k rows of O gathered (one gather) and added in top-k order, then the
        shared experts' rows, rounded to BF16 once; stored, or kept on chip."""
        p, B = self.p, self.B[c]
        core, sem = self.kb.core(c), B["sem"]
        v, q2, q3 = core.vpu, self.q(c, 2), self.q(c, 3)
        t0, n = p.combine_items()[c]
        k, h = p.k, p.h
        table = self._o_table()
        q2.wait(sem["crl_ready"], 1)  # crl is this core's own
        q2.wait(self.g["o_stored"], self._o_signals())
        if p.s:  # g reuses the shared rows' tiles: every core has copied its shared rows
            q2.wait(self.g["sh_copied"], len(p.combine_items()))
        g = B["g"]
        q2.gather(g.sub(0, 0, n * k, h), table, view(B["crl"], t0 * k * 4, "i32", n * k, 1, 4))
        q2.signal(sem["c_loaded"])
        loads = 1
        if p.s:  # the shared experts' rows, copied from the scratchpad of the core that completed them
            for s in range(p.s):
                owner, ready = self._shared_ready(s)
                q3.wait(*ready)
                q3.copy(B[f"gs{s}"].sub(0, 0, n, h), self.B[owner][f"sh_part{s}"].sub(t0, 0, n, h))
            q3.signal(sem["c_loaded"])
            q3.signal(self.g["sh_copied"])
            loads += 1
        v.wait(sem["c_loaded"], loads)  # the gather and the shared rows' loads (one signal each)
        terms = [Tile(g.space, g.core, g.offset + j * h * 4, "f32", n, h, k * h * 4) for j in range(k)]
        terms += [B[f"gs{s}"].sub(0, 0, n, h) for s in range(p.s)]
        ysum, ybuf = B["ysum"].sub(0, 0, n, h), B["ybuf"].sub(0, 0, n, h)
        if len(terms) == 1:
            v.copy(ybuf, terms[0])
        else:
            for m, term in enumerate(terms[1:], start=1):
                dst = ybuf if m == len(terms) - 1 else ysum
                v.add(dst, terms[0] if m == 1 else ysum, term)
        v.signal(sem["y_ready"])
        if self.y_out.in_hbm:
            q2.wait(sem["y_ready"], 1)
            q2.store(self.y_out.ref.hbm_view(t0, 0, n, h), ybuf)
            q2.signal(sem["y_stored"])


def _layout(parts: tuple[Spec, ...]) -> tuple[list[tuple[str, int, str, tuple]], int]:
    """64-byte aligned offsets of consecutive tiles in one region: ([(name, offset, dtype, shape)], bytes)."""
    out, off = [], 0
    for name, dtype, shape in parts:
        out.append((name, off, dtype, shape))
        off += aligned(dtype, shape)
    return out, off


def _union(kb: KernelBuilder, c: int, name: str, layouts: tuple[tuple[Spec, ...], ...]) -> dict[str, Tile]:
    """One scratchpad region shared by several sets of tiles that are live at different times
    (the semaphores that order their uses also order the reuse; the checker verifies it)."""
    laid = [_layout(parts) for parts in layouts]
    size = max(n for _, n in laid)
    if size == 0:
        return {}
    region = kb.sram(c, name, (1, size), "u8")
    return {tn: view(region, off, dt, *shape) for parts, _ in laid for tn, off, dt, shape in parts}


def emit_slots(ctx: EmitCtx, p: MoePlan, shape: dict[str, Any], tensors: dict[str, TensorRef],
               outs: dict[str, Out]) -> Emitter:
    """Emit the slot program for plan ``p`` (module docstring).

    Args:
        ctx: the emit context. p: the plan (``plan_slots`` within ``ctx.budget``).
        shape: the kernel's full shape.
        tensors: a ref for every tensor of ``slot_tensors`` but the outputs: x [T, H] bf16 (HBM or
            on chip); the router panels, biases and packed tables in HBM; routed: the HBM scratch
            ``xq`` and ``o_rows``.
        outs: "y" (and "expert_ids" with routed experts): ``Out.to(ref)`` or ``Out.onchip()``.

    Yields/returns ``{"y": ..., "expert_ids": ...}``.
    """
    prog = _Program(ctx, p, shape, tensors, outs)
    prog.prefetch()
    refs = prog.outputs()
    yield refs
    prog.rest()
    return refs
