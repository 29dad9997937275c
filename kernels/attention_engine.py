"""The flash-attention engine shared by ``attention-decode`` and ``attention-prefill``.

A unit is the query rows of one KV head; ``_Core`` emits one core's program: KV tiles streamed
over the DMA queues, scores on the matrix unit, online softmax on the vector unit, P.V back on
the matrix unit (see kernels/attention.py for the whole design).

Every engine walks a unit's KV tiles in the same order, and a tile's buffers, accumulators and
queues come round again every ``period`` tiles (the KV slots, two parities, the queues per
stream). So a unit's steady tiles (past its first two, full, unmasked, nothing to take from
chip, HBM sources a constant step apart) go out in whole rounds of ``period`` as one hardware
loop per engine once there are ``LOOP_MIN_ROUNDS`` rounds (``isa.loops.issue_in_rounds``): the
same instructions on every engine as unrolled, so the same timing and bits. gpt-oss-120b's prefill
attention at TP4 on b200 (4096 new tokens over 4096 cached, 32-token tiles): 6.5M instructions
in 479k program items, built in 9 s instead of 45 s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from jalapeno_emu.isa.builder import EngineHandle, KernelBuilder, Semaphore
from jalapeno_emu.isa.loops import issue_in_rounds
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import DTYPES

from .planning import Budget

_DECODE_TILES = (2048, 1024, 512, 256, 128, 64, 32)
_PREFILL_TILES = (128, 64, 32)
_NBUF = 6  # KV slots per core: two tiles in flight per stream, one being multiplied, one spare
_MAX_RING = 32  # decode keeps up to this many units' queries and outputs without reuse


# --- the engine ------------------------------------------------------------------------------
@dataclass
class _Step:
    """One KV tile of a unit: ``n`` keys; how to load them; which mask (SRAM tile) to add."""

    n: int
    k: Tile | None = None  # contiguous HBM sources
    k_scale: Tile | None = None
    v: Tile | None = None
    v_parts: tuple[Tile, ...] = ()  # instead of v: row blocks loaded one under the other
    v_scale: Tile | None = None
    idx: Tile | None = None  # paged: [pages, 1] int32 SRAM indices into the pools
    mask: Tile | None = None  # [1, n] (broadcast over rows) or [nq, n] (per head)
    gated: bool = True  # its loads wait for emit_loads' gates (False: reads data already there)
    k_waits: tuple[tuple[int, int], ...] = ()  # conditions before its K (V) loads: a writer's
    v_waits: tuple[tuple[int, int], ...] = ()  # readiness regions the tile overlaps
    new: _NewRow | None = None  # decode: the new token's key and value come from on chip


@dataclass(frozen=True)
class _NewRow:
    """The new token's key and value for column ``col`` of a decode KV tile, kept on chip by the
    append that wrote them to the cache (the tile's other keys load from HBM around them).

    ``k`` [D, 1] and ``v`` [1, D] are scratchpad tiles holding the bytes the cache holds, ready
    at ``ready``. ``local``: on the tile's own core, so the vector unit copies them into the KV
    slot; otherwise the K and V queues copy them (``dma.copy``) after the tile's loads, waiting
    for ``ready`` only then."""

    col: int
    k: Tile
    v: Tile
    ready: tuple[int, int]
    local: bool


@dataclass
class _Merge:
    """Where the partial softmax states of a unit's KV splits meet: on the core of split 0.

    Split i's (m, l) land in column i of ``m``/``lsum`` [R, splits] (FP32), its unnormalised O
    in rows (i-1)*R.. of ``o`` [(splits-1)*R, D] (split 0 keeps its own); ``gathered`` counts the
    splits whose copies have landed. ``a`` and ``w`` [R, splits] are the merge's temporaries.
    """

    splits: int
    m: Tile
    lsum: Tile
    a: Tile
    w: Tile
    o: Tile | None
    gathered: Semaphore


@dataclass
class _Unit:
    """One block of query rows sharing a KV head: R = heads * nq rows, stacked head by head."""

    heads: int
    nq: int
    q: list[Tile]  # per head, HBM [nq, D]
    out: list[Tile]  # per head, HBM [nq, D]
    sink_row: int  # first query head (row of the sinks table)
    cos: Tile | None = None  # prefill: HBM [nq, D/2] per-position tables
    sin: Tile | None = None
    key: tuple = ()  # decode (sequence, KV head); prefill (sequence, KV head, query tile, first head)
    steps: list[_Step] = field(default_factory=list)
    sinks: bool = True  # the sink logits join the first tile (a KV split other than the first: no)
    q_fetch: Callable[[EngineHandle, Tile], None] | None = None  # instead of q: issues the loads
    # (or on-chip copies) of the unit's [R, D] query rows into the given tile on the given queue
    out_keep: Tile | None = None  # the output is kept here [R, D] (on chip) instead of stored
    merge: _Merge | None = None  # KV split: where the unit's splits meet
    split: int = 0  # which split of its (sequence, KV head) the unit is (0: the one that merges)

    @property
    def rows(self) -> int:
        return self.heads * self.nq


@dataclass(frozen=True)
class _Plan:
    """Static sizes of one kernel instance."""

    hpk: int  # query heads per KV head
    d: int
    tk: int  # max keys per tile
    nq_max: int  # max query tokens per unit (decode 1)
    nbuf: int
    kv_dtype: str
    sinks: bool
    scale: float
    page_size: int  # 0: contiguous
    ring: int = 2  # query-in and output buffers per core (>= units per core: no reuse waits)
    lean: bool = False  # small scratchpads (prefill): one query/output/RoPE-table buffer
    # (ring 1) and RoPE temporaries of one head's rows; costs a wait at each unit change

    def __post_init__(self) -> None:
        assert not self.lean or self.ring == 1, "a lean plan keeps one query/output buffer"

    @property
    def kv_queues(self) -> int:
        """DMA queues per KV stream: 2 (K on queues 0 and 2, V on 1 and 3, alternating tiles)
        when nothing else ever blocks queues 2 and 3, else 1 (K on 0, V on 1)."""
        return 2 if self.ring > 2 else 1

    @property
    def r_max(self) -> int:
        return self.hpk * self.nq_max

    def slots(self, name: str) -> int:
        """Buffers of a per-unit kind: the query ring, its RoPE tables, or the double buffers."""
        if name in ("qraw", "outb"):
            return self.ring
        if name in ("cos", "sin"):
            return min(2, self.ring)  # loaded with the queries: free when the ring slot is
        return 2

    def sram_buffers(self) -> list[tuple[str, tuple[int, int], str]]:
        """(name, shape, dtype) of every per-core scratchpad buffer of the engine."""
        r, d, tk, h = self.r_max, self.d, self.tk, self.d // 2
        kv = self.kv_dtype
        out = []
        for s in range(self.nbuf):
            out += [(f"k{s}", (d, tk), kv), (f"v{s}", (tk, d), kv)]
            if kv != "bf16":
                out += [(f"ks{s}", (d // 32, tk), "e8m0"), (f"vs{s}", (tk // 32, d), "e8m0")]
        for s in range(self.ring):
            out += [(f"qraw{s}", (r, d), "bf16"), (f"outb{s}", (r, d), "bf16")]
        for s in range(2):
            out += [(f"qrot{s}", (r, d), "bf16"), (f"p{s}", (r, tk), "bf16"), (f"O{s}", (r, d), "f32"),
                    (f"m{s}", (r, 1), "f32"), (f"l{s}", (r, 1), "f32"), (f"alpha{s}", (r, 1), "f32")]
            if self.nq_max > 1 and s < self.slots("cos"):
                out += [(f"cos{s}", (self.nq_max, h), "f32"), (f"sin{s}", (self.nq_max, h), "f32")]
        # Prefill rotates one head's rows at a time (decode all rows at once).
        rope_rows = self.nq_max if self.lean and self.nq_max > 1 else r
        out += [("s", (r, tk), "f32"), ("o", (r, d), "f32"), ("t1", (rope_rows, h), "f32"),
                ("t2", (rope_rows, h), "f32"), ("mt", (r, 1), "f32"), ("rs", (r, 1), "f32"),
                ("rcp", (r, 1), "f32")]
        return out

    def acc_bytes(self) -> int:
        return 2 * 4 * self.r_max * (self.tk + self.d)


def _nbytes(shape: tuple[int, int], dtype: str) -> int:
    return -(-shape[0] * DTYPES[dtype].row_bytes(shape[1]) // 64) * 64


def _sram_left(plan: _Plan, budget: Budget, consts_bytes: int) -> int:
    """Scratchpad bytes per core left in the budget after the engine's buffers and
    ``consts_bytes`` (negative: they do not fit)."""
    used = sum(_nbytes(s, dt) for _, s, dt in plan.sram_buffers()) + consts_bytes
    return budget.sram_bytes - used


def _fits(plan: _Plan, budget: Budget, consts_bytes: int) -> bool:
    return _sram_left(plan, budget, consts_bytes) >= 0 and plan.acc_bytes() <= budget.acc_bytes


def _view(t: Tile, rows: int, cols: int, dtype: str | None = None, byte_off: int = 0) -> Tile:
    """The bytes of a packed tile seen as a packed [rows, cols] tile (optionally another dtype)."""
    dt = dtype or t.dtype
    nb = rows * DTYPES[dt].row_bytes(cols)
    assert t.contiguous and byte_off + nb <= t.nbytes, (t, rows, cols, dt, byte_off)
    return Tile(t.space, t.core, t.offset + byte_off, dt, rows, cols)


class _Core:
    """Emits one core's share of the engine (see the module docstring)."""

    def __init__(self, kb: KernelBuilder, c: int, plan: _Plan, units: list[_Unit]) -> None:
        self.kb, self.c, self.p, self.units = kb, c, plan, units
        self.core = kb.core(c)
        self.buf = {name: kb.sram(c, name, shape, dt) for name, shape, dt in plan.sram_buffers()}
        r, tk, d = plan.r_max, plan.tk, plan.d
        self.acc_s = [kb.acc(c, f"accs{s}", (r, tk)) for s in range(2)]
        self.acc_o = [kb.acc(c, f"acco{s}", (r, d)) for s in range(2)]
        names = ("consts", "qload", "qraw_free", "qready", "sdone", "sread",
                 "pready", "pvdone", "oread", "fin", "stored")
        names += tuple(f"{x}load{i}" for x in "kv" for i in range(plan.kv_queues))
        # Flattened steps: (unit index, step) in the order every engine walks them.
        self.flat = [(u, st) for u, unit in enumerate(units) for st in unit.steps]
        # Steps whose new key and value the vector unit copies in: their order among them.
        self.taken = {j: i for i, j in enumerate(j for j, (_, st) in enumerate(self.flat)
                                                 if st.new is not None and st.new.local)}
        names += ("kvnew",) if self.taken else ()
        self.sem = {n: kb.semaphore(f"c{c}.{n}") for n in names}
        self._load_waited: set[tuple] = set()  # (stream, queue, condition) already waited for
        self.first, self.last = {}, {}
        for j, (u, _) in enumerate(self.flat):
            self.first.setdefault(u, j)
            self.last[u] = j

    def b(self, name: str, parity: int | None = None) -> Tile:
        if parity is None:
            return self.buf[name]
        return self.buf[f"{name}{parity % self.p.slots(name)}"]

    # -- hardware loops -----------------------------------------------------------------------
    @property
    def period(self) -> int:
        """Steps after which every buffer, accumulator and queue a step uses comes round again."""
        return math.lcm(self.p.nbuf, 2, self.p.kv_queues)

    def _steady(self, j: int, j0: int) -> bool:
        """Step j issues, on every engine, what step j0 does up to affine operands: a full tile of
        the same unit, at least its third (the first two load the queries and start the output),
        unmasked, contiguous, with no new key to take in."""
        (u, st), (u0, st0) = self.flat[j], self.flat[j0]
        return (u == u0 and j >= self.first[u] + 2 and st.n == st0.n and st.mask is None
                and st.new is None and st.idx is None and j not in self.taken
                and j + 1 not in self.taken)

    def _sources(self, j: int) -> list[Tile]:
        st = self.flat[j][1]
        return [t for t in (st.k, *(st.v_parts or (st.v,)), st.k_scale, st.v_scale) if t is not None]

    def _affine_sources(self, j: int, j0: int, period: int) -> bool:
        """Step j's HBM sources have the shapes of step (j - period)'s and (unless j is in the
        second round of a run starting at j0) moved by the step (j - period) took from (j - 2
        period)."""
        def shape(t: Tile) -> tuple:
            return t.space, t.core, t.dtype, t.rows, t.cols, t.stride

        now, prev = self._sources(j), self._sources(j - period)
        if list(map(shape, now)) != list(map(shape, prev)):
            return False
        if j - 2 * period < j0:
            return True
        before = self._sources(j - 2 * period)
        return all(a.offset - b.offset == b.offset - c.offset
                   for a, b, c in zip(now, prev, before, strict=True))

    # -- DMA queues ---------------------------------------------------------------------------
    def emit_loads(self, k_gate: tuple | None, v_gate: tuple | None, start: int = 0,
                   stop: int | None = None) -> None:
        """K tiles on queue 0 (and 2), V tiles on queue 1 (and 3), alternating: a signal on a
        DMA queue waits for that queue's transfers in flight, so two queues per stream keep two
        tiles in flight. A slot is reused once the matmul that read it is done.
        ``k_gate``/``v_gate`` (semaphore, value): each queue waits for its gate before its first
        load of a ``gated`` step (prefill: the first tile holding the chunk's own keys, so tiles
        of prior context stream while the chunk's K is being written); a step's ``k_waits`` /
        ``v_waits`` likewise, each once per queue. ``start``/``stop``: emit only steps
        start..stop-1 (a fused program's prefetch part takes the first slots' tiles, which wait
        for nothing but this core's own transfers)."""
        nq = self.p.kv_queues
        kqs = [self.core.dma[2 * i] for i in range(nq)]
        vqs = [self.core.dma[2 * i + 1] for i in range(nq)]
        stop = len(self.flat) if stop is None else stop
        period = self.period

        def steady(j: int, j0: int) -> bool:  # and each round's HBM sources a constant step on
            return (self._steady(j, j0) and self._load_plain(j, k_gate, v_gate)
                    and (j - j0 < period or self._affine_sources(j, j0, period)))

        issue_in_rounds(self.kb, start, stop, period, steady,
                        lambda j: self._emit_load(j, kqs, vqs, k_gate, v_gate))

    def _load_plain(self, j: int, k_gate: tuple | None, v_gate: tuple | None) -> bool:
        """Step j's loads wait for nothing of their own: no gate or writer condition its queues
        have not waited for already (those are issued once, so a loop body cannot hold them)."""
        p, st = self.p, self.flat[j][1]
        nq = p.kv_queues
        for stream, gate, conds in (("k", k_gate, st.k_waits), ("v", v_gate, st.v_waits)):
            if st.gated and gate is not None and (stream, j % nq) not in self._load_waited:
                return False
            if any((stream, j % nq, cond) not in self._load_waited for cond in conds):
                return False
        return j >= p.nbuf

    def _emit_load(self, j: int, kqs: list[EngineHandle], vqs: list[EngineHandle], k_gate: tuple | None,
                   v_gate: tuple | None) -> None:
        """Step j's K and V tile loads into its slot (see ``emit_loads``)."""
        p, nq, waited = self.p, self.p.kv_queues, self._load_waited
        st = self.flat[j][1]
        slot, kq, vq = j % p.nbuf, kqs[j % nq], vqs[j % nq]
        for stream, q, gate, conds in (("k", kq, k_gate, st.k_waits), ("v", vq, v_gate, st.v_waits)):
            if st.gated and gate is not None and (stream, j % nq) not in waited:
                q.wait(*gate)
                waited.add((stream, j % nq))
            for cond in conds:
                if (stream, j % nq, cond) not in waited:
                    q.wait(*cond)
                    waited.add((stream, j % nq, cond))
        if j >= p.nbuf:  # the slot's previous tile has been multiplied
            kq.wait(self.sem["sdone"], j - p.nbuf + 1)
            vq.wait(self.sem["pvdone"], j - p.nbuf + 1)
        k_dst, v_dst = self.buf[f"k{slot}"], self.buf[f"v{slot}"]
        fp8 = p.kv_dtype != "bf16"
        if st.new is not None:  # the keys around the new one from HBM, the new one from chip
            self._load_around_new(kq, vq, st, k_dst, _view(v_dst, st.n, p.d))
        elif st.idx is None:
            kq.load(k_dst.sub(0, 0, p.d, st.n), st.k)
            r0 = 0
            for src in st.v_parts or (st.v,):
                vq.load(_view(v_dst, st.n, p.d).sub(r0, 0, src.rows, p.d), src)
                r0 += src.rows
            if fp8:
                kq.load(self.buf[f"ks{slot}"].sub(0, 0, p.d // 32, st.n), st.k_scale)
                vq.load(_view(self.buf[f"vs{slot}"], st.n // 32, p.d), st.v_scale)
        else:
            pages, ps = st.idx.rows, p.page_size
            kq.gather(_view(k_dst, pages, p.d * ps), st.k, st.idx)
            vq.gather(_view(v_dst, pages, ps * p.d), st.v, st.idx)
            if fp8:
                kq.gather(_view(self.buf[f"ks{slot}"], pages, p.d // 32 * ps), st.k_scale, st.idx)
                vq.gather(_view(self.buf[f"vs{slot}"], pages, ps // 32 * p.d), st.v_scale, st.idx)
        kq.signal(self.sem[f"kload{j % nq}"])
        vq.signal(self.sem[f"vload{j % nq}"])

    def _load_around_new(self, kq: EngineHandle, vq: EngineHandle, st: _Step, k_dst: Tile,
                         v_dst: Tile) -> None:
        """A tile whose column ``st.new.col`` is the new token: K^T columns and V rows before and
        after it from HBM (never the bytes the append is storing), the new key and value copied
        from the append's core when it is another one (the vector unit takes them otherwise)."""
        d, c, n = self.p.d, st.new.col, st.n
        for a, b in ((0, c), (c + 1, n)):
            if a < b:
                kq.load(k_dst.sub(0, a, d, b - a), st.k.sub(0, a, d, b - a))
                vq.load(v_dst.sub(a, 0, b - a, d), st.v.sub(a, 0, b - a, d))
        if not st.new.local:  # after the loads, which wait for nothing
            for q, dst, src in ((kq, k_dst.sub(0, c, d, 1), st.new.k), (vq, v_dst.sub(c, 0, 1, d), st.new.v)):
                q.wait(*st.new.ready)
                q.copy(dst, src)

    def _take_new(self, j: int) -> None:
        """Vector unit: the new token's key and value (on this core) into step j's KV slot, once
        the slot's previous tile has been multiplied; signals ``kvnew`` (the S matmul waits)."""
        v, p, st = self.core.vpu, self.p, self.flat[j][1]
        slot = j % p.nbuf
        if j >= p.nbuf:
            v.wait(self.sem["sdone"], j - p.nbuf + 1)
            v.wait(self.sem["pvdone"], j - p.nbuf + 1)
        v.wait(*st.new.ready)
        v.copy(self.buf[f"k{slot}"].sub(0, st.new.col, p.d, 1), st.new.k)
        v.copy(_view(self.buf[f"v{slot}"], st.n, p.d).sub(st.new.col, 0, 1, p.d), st.new.v)
        v.signal(self.sem["kvnew"])

    def prefetchable(self) -> int:
        """How many leading steps a prefetch part may load: those of the first ``nbuf`` slots
        (no slot reuse, which waits for the matrix unit) before the first step with a wait of
        its own (a readiness region of a writer, or a gate)."""
        n = min(self.p.nbuf, len(self.flat))
        for j in range(n):
            st = self.flat[j][1]
            if st.k_waits or st.v_waits or (st.new is not None and not st.new.local):
                return j
        return n

    def emit_queries(self, consts: list[tuple[Tile, Tile]]) -> None:
        """Queue 2: the constants, then each unit's query rows (and RoPE rows) into a ring of 2."""
        self.emit_consts(consts)
        self.emit_query_loads()

    def emit_consts(self, consts: list[tuple[Tile, Tile]]) -> None:
        """Queue 2: the constants (RoPE rows, sinks, masks, block table), then their signal."""
        q = self.core.dma[2]
        for dst, src in consts:
            q.load(dst, src)
        q.signal(self.sem["consts"])

    def query_loads_wait(self) -> bool:
        """True when the query loads wait for the vector unit (a ring shorter than the units):
        they then belong after a fused program's prefetch part."""
        return self.p.ring < len(self.units)

    def emit_query_loads(self) -> None:
        """Queue 2: each unit's query rows (and RoPE rows) into its ring slot."""
        q = self.core.dma[2]
        for u, unit in enumerate(self.units):
            if u >= self.p.ring:  # ring slot free once the vector unit has rotated its last unit
                q.wait(self.sem["qraw_free"], u - self.p.ring + 1)
            raw, r0 = self.b("qraw", u), 0
            if unit.q_fetch is not None:
                unit.q_fetch(q, raw.sub(0, 0, unit.rows, self.p.d))
            for src in unit.q:  # heads stacked in rows
                q.load(raw.sub(r0, 0, src.rows, self.p.d), src)
                r0 += src.rows
            if unit.cos is not None:
                q.load(self.b("cos", u).sub(0, 0, unit.nq, self.p.d // 2), unit.cos)
                q.load(self.b("sin", u).sub(0, 0, unit.nq, self.p.d // 2), unit.sin)
            if self.p.ring < len(self.units):
                q.signal(self.sem["qload"])
        if self.units and self.p.ring >= len(self.units):
            # Every unit has its own buffers: one signal (a fence) for all, so the loads overlap.
            q.signal(self.sem["qload"], len(self.units))

    def emit_stores(self) -> None:
        """Queue 3: each finished unit's output rows to HBM (none for outputs kept on chip); a KV
        split other than the first copies its partial state (m, l, unnormalised O) into the
        merging core's buffers instead and signals the merge's ``gathered``."""
        q = self.core.dma[3]
        for u, unit in enumerate(self.units):
            if unit.out_keep is not None:  # kept on chip: nothing to store
                continue
            q.wait(self.sem["fin"], u + 1)
            if unit.split:
                mg, r, i = unit.merge, unit.rows, unit.split
                q.copy(mg.m.sub(0, i, r, 1), self.b("m", self.last[u]).sub(0, 0, r, 1))
                q.copy(mg.lsum.sub(0, i, r, 1), self.b("l", u).sub(0, 0, r, 1))
                q.copy(mg.o.sub((i - 1) * r, 0, r, self.p.d), self.b("O", u).sub(0, 0, r, self.p.d))
                q.signal(mg.gathered)
            else:
                ob, r0 = self.b("outb", u), 0
                for dst in unit.out:
                    q.store(dst, ob.sub(r0, 0, dst.rows, self.p.d))
                    r0 += dst.rows
            q.signal(self.sem["stored"])

    # -- matrix unit --------------------------------------------------------------------------
    def _s(self, j: int) -> None:
        p, mxu = self.p, self.core.mxu
        u, st = self.flat[j]
        unit = self.units[u]
        r, slot = unit.rows, j % p.nbuf
        if j == self.first[u]:
            mxu.wait(self.sem["qready"], u + 1)
        nq = p.kv_queues
        mxu.wait(self.sem[f"kload{j % nq}"], j // nq + 1)
        if j in self.taken:
            mxu.wait(self.sem["kvnew"], self.taken[j] + 1)
        if j >= 2:  # accumulators of tile j-2 have been read
            mxu.wait(self.sem["sread"], j - 1)
        q = self.b("qrot", u).sub(0, 0, r, p.d)
        acc = self.acc_s[j % 2]
        k, fp8 = self.buf[f"k{slot}"], p.kv_dtype != "bf16"
        ks = self.buf.get(f"ks{slot}")
        if st.idx is None:
            mxu.matmul(acc.sub(0, 0, r, st.n), q, k.sub(0, 0, p.d, st.n),
                       b_scale=ks.sub(0, 0, p.d // 32, st.n) if fp8 else None, mode="overwrite")
        else:  # one matmul per page: each page is its own [D, page_size] K^T block
            ps, esz = p.page_size, DTYPES[p.kv_dtype].bits // 8
            for i in range(st.idx.rows):
                kp = _view(k, p.d, ps, byte_off=i * p.d * ps * esz)
                sp = _view(ks, p.d // 32, ps, byte_off=i * p.d // 32 * ps) if fp8 else None
                mxu.matmul(acc.sub(0, i * ps, r, ps), q, kp, b_scale=sp, mode="overwrite")
        mxu.signal(self.sem["sdone"])

    def _pv(self, j: int) -> None:
        p, mxu = self.p, self.core.mxu
        u, st = self.flat[j]
        r, slot = self.units[u].rows, j % p.nbuf
        mxu.wait(self.sem["pready"], j + 1)
        nq = p.kv_queues
        mxu.wait(self.sem[f"vload{j % nq}"], j // nq + 1)
        if j >= 2:
            mxu.wait(self.sem["oread"], j - 1)
        v = _view(self.buf[f"v{slot}"], st.n, p.d)
        vs = _view(self.buf[f"vs{slot}"], st.n // 32, p.d) if p.kv_dtype != "bf16" else None
        mxu.matmul(self.acc_o[j % 2].sub(0, 0, r, p.d), self.b("p", j).sub(0, 0, r, st.n), v,
                   b_scale=vs, mode="overwrite")
        mxu.signal(self.sem["pvdone"])

    def _mxu_step(self, j: int) -> None:
        self._s(j)
        if j:
            self._pv(j - 1)

    def emit_mxu(self) -> None:
        """S(0), then S(j), P.V(j-1) alternately: S(j) overlaps the softmax of tile j-1."""
        n = len(self.flat)
        issue_in_rounds(self.kb, 0, n, self.period, self._steady, self._mxu_step)
        if n:
            self._pv(n - 1)

    # -- vector unit --------------------------------------------------------------------------
    def _rope(self, u: int, cos_row: Tile | None, sin_row: Tile | None) -> None:
        """Rotate-half RoPE of unit u's queries, times the softmax scale, rounded to BF16."""
        p, v = self.p, self.core.vpu
        unit = self.units[u]
        h2 = p.d // 2
        v.wait(self.sem["qload"], u + 1)
        raw, rot = self.b("qraw", u), self.b("qrot", u)
        if unit.nq == 1:  # decode: one position for every row, cos/sin broadcast along rows
            blocks = [(0, unit.rows, cos_row, sin_row)]
        else:  # prefill: per head, per-position tables of the unit's tokens
            cs = self.b("cos", u).sub(0, 0, unit.nq, h2)
            sn = self.b("sin", u).sub(0, 0, unit.nq, h2)
            blocks = [(h * unit.nq, unit.nq, cs, sn) for h in range(unit.heads)]
        for r0, n, cs, sn in blocks:
            x1, x2 = raw.sub(r0, 0, n, h2), raw.sub(r0, h2, n, h2)
            t1, t2 = self.buf["t1"].sub(0, 0, n, h2), self.buf["t2"].sub(0, 0, n, h2)
            v.mul(t1, x1, cs)
            v.mul(t2, x2, sn)
            v.sub(t1, t1, t2)
            v.scale(rot.sub(r0, 0, n, h2), t1, p.scale)
            v.mul(t1, x2, cs)
            v.mul(t2, x1, sn)
            v.add(t1, t1, t2)
            v.scale(rot.sub(r0, h2, n, h2), t1, p.scale)
        v.signal(self.sem["qraw_free"])
        v.signal(self.sem["qready"])

    def _softmax(self, j: int, sinks: Tile | None) -> None:
        v = self.core.vpu
        u, st = self.flat[j]
        unit = self.units[u]
        r, n, first = unit.rows, st.n, j == self.first[u]
        if not unit.sinks:
            sinks = None
        col = lambda name, par=None: self.b(name, par).sub(0, 0, r, 1)  # noqa: E731
        s = self.buf["s"].sub(0, 0, r, n)
        v.wait(self.sem["sdone"], j + 1)
        v.acc_read(s, self.acc_s[j % 2].sub(0, 0, r, n))
        v.signal(self.sem["sread"])
        if st.mask is not None:
            if st.mask.rows == 1:
                v.add(s, s, st.mask)
            else:
                for h in range(unit.heads):
                    sh = s.sub(h * unit.nq, 0, unit.nq, n)
                    v.add(sh, sh, st.mask)
        m, alpha, mt = col("m", j), col("alpha", j), col("mt")
        if first:
            if sinks is None:
                v.reduce("max", m, s)
            else:  # the sink logit joins the max and (below) the denominator
                v.reduce("max", mt, s)
                self._per_head(unit, sinks, lambda dst, a, b: v.max(dst, a, b), m, mt)
                self._per_head(unit, sinks, lambda dst, a, b: v.sub(dst, a, b), alpha, m)
                v.neg(alpha, alpha)
                v.exp(alpha, alpha)
        else:
            m_old = col("m", j - 1)
            v.reduce("max", mt, s)
            v.max(m, mt, m_old)
            v.sub(alpha, m_old, m)
            v.exp(alpha, alpha)
        v.sub(s, s, m)
        pb = self.b("p", j).sub(0, 0, r, n)
        v.exp(pb, s)
        v.signal(self.sem["pready"])
        lsum = col("l", u)
        if first and sinks is None:
            v.reduce("sum", lsum, pb)
        else:
            rs = col("rs")
            v.reduce("sum", rs, pb)
            if first:
                v.add(lsum, alpha, rs)
            else:
                v.mul(lsum, lsum, alpha)
                v.add(lsum, lsum, rs)

    @staticmethod
    def _per_head(unit: _Unit, sinks: Tile, op, dst: Tile, a: Tile) -> None:
        """dst = op(a, sink of each row's head); decode rows are one per head already."""
        if unit.nq == 1:
            op(dst, a, sinks.sub(unit.sink_row, 0, unit.rows, 1))
            return
        for h in range(unit.heads):  # the head's [1, 1] sink broadcasts over its nq rows
            r0 = h * unit.nq
            op(dst.sub(r0, 0, unit.nq, 1), a.sub(r0, 0, unit.nq, 1), sinks.sub(unit.sink_row + h, 0, 1, 1))

    def _update(self, j: int) -> None:
        v, d = self.core.vpu, self.p.d
        u, _ = self.flat[j]
        r = self.units[u].rows
        big = self.b("O", u).sub(0, 0, r, d)
        v.wait(self.sem["pvdone"], j + 1)
        if j == self.first[u]:
            v.acc_read(big, self.acc_o[j % 2].sub(0, 0, r, d))
            v.signal(self.sem["oread"])
            return
        o = self.buf["o"].sub(0, 0, r, d)
        v.acc_read(o, self.acc_o[j % 2].sub(0, 0, r, d))
        v.signal(self.sem["oread"])
        v.mul(big, big, self.b("alpha", j).sub(0, 0, r, 1))
        v.add(big, big, o)

    def _finalize(self, u: int) -> None:
        """out = bf16(O * recip(l)) into the unit's ring slot (or kept tile); a KV split other than
        the first only signals (its queue 3 copies the partial state to the merging core), the
        first merges its splits' states first (``_merge``)."""
        v, d = self.core.vpu, self.p.d
        unit = self.units[u]
        r = unit.rows
        if unit.split:
            v.signal(self.sem["fin"])
            return
        if unit.merge is not None:
            self._merge(u)
        if u >= self.p.ring and unit.out_keep is None:  # the ring slot's previous unit has been stored
            v.wait(self.sem["stored"], u - self.p.ring + 1)
        rcp = self.buf["rcp"].sub(0, 0, r, 1)
        v.recip(rcp, self.b("l", u).sub(0, 0, r, 1))
        dst = unit.out_keep if unit.out_keep is not None else self.b("outb", u).sub(0, 0, r, d)
        v.mul(dst, self.b("O", u).sub(0, 0, r, d), rcp)
        v.signal(self.sem["fin"])

    def _merge(self, u: int) -> None:
        """Flash-decoding's merge of the unit's KV splits, in split order, into its own O and l:
        m = max_i m_i, a_i = exp(m_i - m), l = sum_i a_i l_i, O = sum_i a_i O_i (split 0's sink
        is already in its m and l)."""
        v, d = self.core.vpu, self.p.d
        mg, r = self.units[u].merge, self.units[u].rows
        big, lsum = self.b("O", u).sub(0, 0, r, d), self.b("l", u).sub(0, 0, r, 1)
        v.copy(mg.m.sub(0, 0, r, 1), self.b("m", self.last[u]).sub(0, 0, r, 1))
        v.copy(mg.lsum.sub(0, 0, r, 1), lsum)
        v.wait(mg.gathered, mg.splits - 1)
        mt = self.buf["mt"].sub(0, 0, r, 1)
        v.reduce("max", mt, mg.m)
        v.sub(mg.a, mg.m, mt)
        v.exp(mg.a, mg.a)
        v.mul(mg.w, mg.lsum, mg.a)
        v.reduce("sum", lsum, mg.w)
        v.mul(big, big, mg.a.sub(0, 0, r, 1))
        o = self.buf["o"].sub(0, 0, r, d)
        for i in range(1, mg.splits):
            v.mul(o, mg.o.sub((i - 1) * r, 0, r, d), mg.a.sub(0, i, r, 1))
            v.add(big, big, o)

    def _vpu_step(self, j: int, sinks: Tile | None, cos_row: Tile | None, sin_row: Tile | None) -> None:
        """Step j on the vector unit: the next unit's RoPE at a unit's first step, the new key
        the next step's S matmul needs, softmax(j), then update(j-1) (and its unit's finish)."""
        u, _ = self.flat[j]
        if j == self.first[u] and u + 1 < len(self.units):
            self._rope(u + 1, cos_row, sin_row)
        if j + 1 in self.taken:  # before the softmax the S matmul of step j+1 follows
            self._take_new(j + 1)
        self._softmax(j, sinks)
        if j:
            self._update(j - 1)
            pu = self.flat[j - 1][0]
            if j - 1 == self.last[pu]:
                self._finalize(pu)

    def emit_vpu(self, sinks: Tile | None, cos_row: Tile | None, sin_row: Tile | None) -> None:
        """Rotate unit u+1's queries before the first softmax of unit u; softmax(j) then
        update(j-1), so the vector unit never waits on the P.V it has just enabled."""
        v = self.core.vpu
        v.wait(self.sem["consts"], 1)
        if not self.units:
            return
        self._rope(0, cos_row, sin_row)
        if 0 in self.taken:
            self._take_new(0)
        n = len(self.flat)
        issue_in_rounds(self.kb, 0, n, self.period, self._steady,
                        lambda j: self._vpu_step(j, sinks, cos_row, sin_row))
        self._update(n - 1)
        self._finalize(self.flat[n - 1][0])


def _assign(units: list[_Unit], work: list[int], cores: int) -> list[list[_Unit]]:
    """Longest-processing-time-first: each unit (``work``: its KV tiles) to the least-loaded core;
    a core keeps its units in their original order."""
    load = [0] * cores
    out: list[list[tuple[int, _Unit]]] = [[] for _ in range(cores)]
    for i in sorted(range(len(units)), key=lambda i: -work[i]):
        c = min(range(cores), key=lambda k: (load[k], k))
        load[c] += work[i] + 1
        out[c].append((i, units[i]))
    return [[u for _, u in sorted(lst, key=lambda t: t[0])] for lst in out]


