"""Static costs: what each instruction costs on its own, computed in bulk before the timing loop.

Stage: emulator, the first half of the timing pass (``timing.py`` is the second: the event loop
that adds what depends on other engines). Everything here is independent of the schedule: the
engine each instruction runs on, its kind, its duration on a matrix or vector unit, its bytes on
the core's DMA port and on each HBM pseudo-channel, its fixed costs and FLOPs. The cost models
themselves are documented in ``timing.py``; every parameter comes from the ``ChipSpec``.

Two steps, so that timing one program under many hardware knobs (what-if sweeps) reads the
program once:

1. ``ProgramFacts``: what the program says, independent of the chip (engines and streams, tile
   shapes and addresses, semaphore ids, matmul shapes and formats), as numpy arrays. Reading 100k
   Instruction objects is the slow part, so the facts are cached per Program object (for as long
   as the object lives). Instructions are grouped by mnemonic and their operands read with
   ``map``/``operator`` getters, so the per-instruction Python work is a few C-level calls.
2. ``StaticCosts``: the facts priced on one ``ChipSpec``, in numpy.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu.hbm_map import channel_bytes
from jalapeno_emu.emu.schedule import link_key
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.program import Engine, Instruction, Loop, Program
from jalapeno_emu.isa.table import DTYPES, Space, by_mnemonic

__all__ = ["KIND_NAMES", "TRANSCENDENTAL_OPS", "ProgramFacts", "StaticCosts", "program_facts"]

TRANSCENDENTAL_OPS = frozenset({"exp", "rsqrt", "sigmoid", "silu", "recip"})
"""``vec.unary`` ops that run on the special-function units (``transcendental_elements_per_cycle``)."""

# Kinds of work the event loop tells apart (small ints, compared in its hot loop). Kinds up to
# WAIT are local: they touch no state another engine reads before it is final, so an engine runs
# through them ahead of the global clock; the others are processed in time order.
# PROBE (a ``probe``: timing class "debug") takes no time and nothing waits for it.
MXU, VEC, WAIT, HBM, COPY, SIGNAL, BARRIER, SEND, RECV, PROBE = range(10)
KIND_NAMES = ("mxu", "vec", "wait", "hbm", "copy", "signal", "barrier", "send", "recv", "probe")
# Category per kind, an index into timeline.CATEGORIES ("dma", "mxu", "vpu", "sync", "link").
_CATEGORY_OF_KIND = np.array([1, 2, 3, 0, 0, 3, 3, 4, 4, 3], dtype=np.int8)

_MNEMONIC, _ENGINE, _ARGS = attrgetter("mnemonic"), attrgetter("engine"), attrgetter("args")
_NAME, _VALUE = itemgetter(0), itemgetter(1)
_BITS = {name: d.bits for name, d in DTYPES.items()}
_DTYPE, _ROWS, _COLS = attrgetter("dtype"), attrgetter("rows"), attrgetter("cols")


def _pick(seq: Sequence[Any], idx: np.ndarray) -> tuple:
    """``tuple(seq[i] for i in idx)``, in C."""
    return itemgetter(*idx.tolist())(seq) if len(idx) > 1 else (seq[int(idx[0])],)


def _operand(args: tuple, position: int, name: str) -> list:
    """Operand ``name`` of every instruction in ``args`` (their ``Instruction.args``).

    Operands are read at their table position (builder, assembler and decoder all emit that
    canonical order); if any instruction disagrees, all are looked up by name instead.
    """
    try:
        items = list(map(itemgetter(position), args))
        if set(map(_NAME, items)) == {name}:
            return list(map(_VALUE, items))
    except IndexError:
        pass
    return [dict(a).get(name) for a in args]


def _ints(values: Sequence[Any], getter: Any = None) -> np.ndarray:
    """int64 array of ``values`` (or of ``getter(v)`` for each)."""
    return np.array(values if getter is None else list(map(getter, values)), dtype=np.int64)


def _row_bytes(tiles: Sequence[Any]) -> np.ndarray:
    """int64 bytes of one row of each tile (cols x bits / 8)."""
    return _ints(tiles, _COLS) * _ints(list(map(_DTYPE, tiles)), _BITS.__getitem__) // 8


def _unique_rows(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct rows of int64[m, c] ``keys``, int64[m] index of each row among them).

    ``np.unique(axis=0)`` sorts a structured view, which is many times slower than a lexsort.
    """
    order = np.lexsort(keys.T[::-1])
    ordered = keys[order]
    new = np.ones(len(keys), dtype=bool)
    new[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    inverse = np.empty(len(keys), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ordered[new], inverse


def _record_steps(rep: int, ins: Instruction, steps: dict[str, int], step_sem: list, step_count: list,
                  step_hbm: list) -> None:
    """Note the steps of loop body instruction ``ins`` (rep index ``rep``) that change a fact."""
    row = by_mnemonic(ins.mnemonic)
    if row is None:
        return  # _read names the unknown mnemonic
    if row.timing == "sync":
        first, second = ("id", "count") if ins.mnemonic == "barrier" else \
            ("sem", "value" if ins.mnemonic == "sem.wait" else "count")
        if first in steps:
            step_sem.append((rep, steps[first]))
        if second in steps:
            step_count.append((rep, steps[second]))
    elif row.timing == "dma":
        hbm_name = next((op.name for op in row.operands
                         if op.kind == "tile" and op.spaces == (Space.HBM,)), None)
        if hbm_name is not None and hbm_name in steps:
            step_hbm.append((rep, steps[hbm_name]))


class ProgramFacts:
    """What a Program says about cost, independent of the chip. Arrays are indexed by instruction.

    Attributes:
        n: number of instructions.
        engines: tuple of Engine, sorted; ``engine_index`` (int32[n]) points into it.
        streams: per engine, its instruction indices in issue order.
        kind: int8[n], ``MXU`` ... ``PROBE``.
        core: int64[n] the issuing engine's core (-1 for the link engine).
        nbytes: int64[n] bytes a DMA or link send moves.
        sem: int64[n] semaphore number (an index into ``semaphore_ids``) or barrier id.
        count: int64[n] signal count, wait value or barrier count.
        semaphore_ids: int64[S] the semaphore ids used, by number.
        mm: int64[n, 3] matmul M, N, K; fmt: int8[n] 0 mxfp4, 1 mxfp8, 2 bf16, -1 not a matmul.
        elements: int64[n] vector elements (passes included); special: bool[n] transcendental.
        hbm_idx: int64[h] the DMAs that touch HBM; hbm_tile: int64[h, 4] their HBM side as
            (offset, rows, row bytes, stride); gather_rows: int64[n] rows of each gather (0 else).
        links: (index, (peer, tag)) of each link instruction.
    """

    def __init__(self, program: Program) -> None:
        loops = program.loops
        if loops and not any(loop.engine.unit == "link" for loop in loops):
            self._read_looped(program)
        else:
            self._read(program.instructions)
        for arr in (self.kind, self.nbytes, self.sem, self.count, self.mm, self.fmt, self.elements,
                    self.special, self.gather_rows, self.hbm_idx, self.hbm_tile, self.engine_index,
                    self.core):
            arr.setflags(write=False)  # shared by every Timeline of this program

    def _read_looped(self, program: Program) -> None:
        """The facts of a program with loops, reading each loop's body once.

        The items' distinct instructions (plain ones, and each loop's body) are read as a
        program of their own; every instruction of the unrolled program is then a row of those
        facts, with its iteration's steps added to the fields a step can change: wait values and
        semaphore or barrier ids (``count``, ``sem``) and the HBM tile's offset. Nothing else a
        fact holds depends on an operand a loop may step (byte counts, shapes and formats do not
        change from one iteration to the next).
        """
        items = program.items
        reps: list = []
        sizes = np.empty(len(items), dtype=np.int64)
        body_len = np.ones(len(items), dtype=np.int64)
        rep_start = np.empty(len(items), dtype=np.int64)
        step_sem, step_count, step_hbm = [], [], []  # (rep index, step)
        for k, item in enumerate(items):
            rep_start[k] = len(reps)
            if type(item) is Loop:
                sizes[k], body_len[k] = item.size, len(item.body)
                for ins, steps in zip(item.body, item.steps, strict=True):
                    if steps:
                        _record_steps(len(reps), ins, dict(steps), step_sem, step_count, step_hbm)
                    reps.append(ins)
            else:
                sizes[k] = 1
                reps.append(item)
        self._read(reps)
        # Unrolled position -> (item, position within it) -> (rep, iteration).
        n = int(sizes.sum())
        item_of = np.repeat(np.arange(len(items)), sizes)
        within = np.arange(n) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        blen = body_len[item_of]
        rep = rep_start[item_of] + within % blen
        it = within // blen
        d_sem, d_count, d_hbm = (np.zeros(len(reps), dtype=np.int64) for _ in range(3))
        for arr, pairs in ((d_sem, step_sem), (d_count, step_count), (d_hbm, step_hbm)):
            if pairs:
                where, step = np.array(pairs, dtype=np.int64).T
                arr[where] = step
        # The rep facts' semaphore numbers are dense indices: back to ids before stepping them.
        rep_kind = self.kind
        rep_sem = self.sem.copy()
        sync = (rep_kind == SIGNAL) | (rep_kind == WAIT)
        rep_sem[sync] = self.semaphore_ids[self.sem[sync]]
        self.n = n
        self.kind = rep_kind[rep]
        self.nbytes = self.nbytes[rep]
        self.sem = rep_sem[rep] + it * d_sem[rep]
        self.count = self.count[rep] + it * d_count[rep]
        self.mm = self.mm[rep]
        self.fmt = self.fmt[rep]
        self.elements = self.elements[rep]
        self.special = self.special[rep]
        self.gather_rows = self.gather_rows[rep]
        self.engine_index = self.engine_index[rep]
        self.core = self.core[rep]
        order = np.argsort(self.engine_index, kind="stable")
        cuts = np.searchsorted(self.engine_index[order], np.arange(1, len(self.engines)))
        self.streams = [part.tolist() for part in np.split(order, cuts)]
        row_of = np.full(len(reps), -1, dtype=np.int64)
        row_of[self.hbm_idx] = np.arange(len(self.hbm_idx))
        rows = row_of[rep]
        self.hbm_idx = np.nonzero(rows >= 0)[0]
        tiles = self.hbm_tile[rows[self.hbm_idx]]
        tiles[:, 0] += it[self.hbm_idx] * d_hbm[rep[self.hbm_idx]]
        self.hbm_tile = tiles
        sync = (self.kind == SIGNAL) | (self.kind == WAIT)
        self.semaphore_ids, dense = np.unique(self.sem[sync], return_inverse=True)
        self.sem[sync] = dense.reshape(-1)

    def _read(self, instrs: Sequence[Instruction]) -> None:
        """Read the facts of ``instrs``, one per instruction."""
        n = self.n = len(instrs)
        self.kind = np.zeros(n, dtype=np.int8)
        self.nbytes = np.zeros(n, dtype=np.int64)
        self.sem = np.zeros(n, dtype=np.int64)
        self.count = np.zeros(n, dtype=np.int64)
        self.mm = np.zeros((n, 3), dtype=np.int64)
        self.fmt = np.full(n, -1, dtype=np.int8)
        self.elements = np.zeros(n, dtype=np.int64)
        self.special = np.zeros(n, dtype=bool)
        self.gather_rows = np.zeros(n, dtype=np.int64)
        self.links: list[tuple[int, Any]] = []
        hbm_idx: list[np.ndarray] = []
        hbm_tile: list[np.ndarray] = []

        self._engines(list(map(_ENGINE, instrs)))
        mnemonics = list(map(_MNEMONIC, instrs))
        all_args = list(map(_ARGS, instrs))
        names = sorted(set(mnemonics))
        code_of = {m: k for k, m in enumerate(names)}
        codes = np.array(list(map(code_of.__getitem__, mnemonics)), dtype=np.int32)
        order = np.argsort(codes, kind="stable")
        bounds = np.searchsorted(codes[order], np.arange(len(names) + 1))
        for k, mn in enumerate(names):
            idx = order[bounds[k]:bounds[k + 1]]
            row = by_mnemonic(mn)
            if row is None:
                raise InvalidArgumentError(f"instruction #{int(idx[0])}: unknown mnemonic {mn!r}")
            group_args = _pick(all_args, idx)
            pos = {op.name: p for p, op in enumerate(row.operands)}

            def operand(name: str, group_args=group_args, pos=pos) -> list:
                return _operand(group_args, pos[name], name)

            if row.timing == "dma":
                dst = operand("dst")
                self.nbytes[idx] = _ints(dst, _ROWS) * _row_bytes(dst)
                # The operand the table puts in HBM (load: src, store: dst, gather: src); copy: none.
                hbm_name = next((op.name for op in row.operands
                                 if op.kind == "tile" and op.spaces == (Space.HBM,)), None)
                self.kind[idx] = COPY if hbm_name is None else HBM
                if hbm_name is None:
                    continue
                tiles = dst if hbm_name == "dst" else operand(hbm_name)
                # A gather's row indices are data: assume rows 0..n-1 of the table, n = dst.rows.
                rows = _ints(dst if mn == "dma.gather" else tiles, _ROWS)
                if mn == "dma.gather":
                    self.gather_rows[idx] = rows
                row_bytes = _row_bytes(tiles)
                stride = np.where(rows > 1, _ints(tiles, attrgetter("stride")), row_bytes)
                hbm_idx.append(idx)
                hbm_tile.append(np.stack([_ints(tiles, attrgetter("offset")), rows, row_bytes, stride],
                                         axis=1))
            elif row.timing == "matmul":
                a, b = operand("a"), operand("b")
                n_of = _ROWS if mn == "mxu.matmul_t" else _COLS  # matmul_t's b is [N, K]
                self.mm[idx] = np.stack([_ints(a, _ROWS), _ints(b, n_of), _ints(a, _COLS)], axis=1)
                a_dt, b_dt = np.array(list(map(_DTYPE, a))), np.array(list(map(_DTYPE, b)))
                self.fmt[idx] = np.where((a_dt == "fp4") & (b_dt == "fp4"), 0,
                                         np.where((a_dt == "bf16") | (b_dt == "bf16"), 2, 1))
                self.kind[idx] = MXU
            elif row.timing in ("vector", "reduce"):
                src = operand("a" if mn == "vec.binary" else "src")
                elements = _ints(src, _ROWS) * _ints(src, _COLS)
                if mn == "vec.topk":  # a sorting network over k: ceil(log2(k + 1)) passes
                    elements *= _ints(operand("dst"), lambda t: t.cols.bit_length())
                elif mn == "vec.quantize":
                    elements *= 2  # one pass for each block's amax, one to scale and round
                elif mn == "vec.group":  # sort the R*k keys (a pass per bit of R*k), write [U, R]
                    dst_w = operand("dst_w")
                    elements = elements * np.array([int(e).bit_length() for e in elements], dtype=np.int64) \
                        + _ints(dst_w, _ROWS) * _ints(dst_w, _COLS)
                elif mn == "vec.unary":
                    self.special[idx] = list(map(TRANSCENDENTAL_OPS.__contains__, operand("op")))
                self.elements[idx] = elements
                self.kind[idx] = VEC
            elif row.timing == "sync":
                first, second = ("sem", "count") if mn == "sem.signal" else \
                    ("sem", "value") if mn == "sem.wait" else ("id", "count")
                self.kind[idx] = SIGNAL if mn == "sem.signal" else WAIT if mn == "sem.wait" else BARRIER
                self.sem[idx] = _ints(operand(first), int)
                self.count[idx] = _ints(operand(second), int)
            elif row.timing == "link":
                self.links.extend((i, link_key(instrs[i])) for i in idx.tolist())
                if mn == "link.send":
                    src = operand("src")
                    self.nbytes[idx] = _ints(src, _ROWS) * _row_bytes(src)
                self.kind[idx] = SEND if mn == "link.send" else RECV
            elif row.timing == "debug":
                self.kind[idx] = PROBE
            else:  # a table row whose timing class this pass has no model for: say so
                raise InvalidArgumentError(f"instruction #{int(idx[0])} ({mn}): the timing pass has "
                                           f"no cost model for timing class {row.timing!r}")
        # Semaphores numbered 0..S-1 so the event loop keeps per-semaphore state in lists.
        sems = (self.kind == SIGNAL) | (self.kind == WAIT)
        self.semaphore_ids, dense = np.unique(self.sem[sems], return_inverse=True)
        self.sem[sems] = dense.reshape(-1)
        self.hbm_idx = np.concatenate(hbm_idx) if hbm_idx else np.zeros(0, dtype=np.int64)
        self.hbm_tile = np.concatenate(hbm_tile) if hbm_tile else np.zeros((0, 4), dtype=np.int64)

    def _engines(self, engs: list[Engine]) -> None:
        """Number the engines in sorted order and split the program into per-engine streams."""
        n = len(engs)
        if not n:
            self.engines, self.streams = (), []
            self.engine_index = np.zeros(0, dtype=np.int32)
            self.core = np.zeros(0, dtype=np.int64)
            return
        # The builder shares one Engine object per queue: find the distinct objects by id, then
        # merge equal ones (an assembler may create many).
        ids = np.array(list(map(id, engs)), dtype=np.int64)
        _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        objs = [engs[j] for j in first.tolist()]
        distinct = sorted(set(objs), key=lambda e: (e.core, e.unit, e.queue))
        number = {e: k for k, e in enumerate(distinct)}
        per_obj = np.array([number[o] for o in objs], dtype=np.int32)
        self.engines = tuple(distinct)
        self.engine_index = per_obj[inverse.reshape(-1)]
        self.core = np.array([e.core for e in distinct], dtype=np.int64)[self.engine_index]
        order = np.argsort(self.engine_index, kind="stable")
        cuts = np.searchsorted(self.engine_index[order], np.arange(1, len(distinct)))
        self.streams = [part.tolist() for part in np.split(order, cuts)]


_FACTS: dict[int, tuple[weakref.ref, ProgramFacts]] = {}


def program_facts(program: Program) -> ProgramFacts:
    """The ``ProgramFacts`` of ``program``, read once per Program object and kept while it lives."""
    key = id(program)
    hit = _FACTS.get(key)
    if hit is not None and hit[0]() is program:
        return hit[1]
    facts = ProgramFacts(program)
    try:
        ref = weakref.ref(program, lambda _, key=key: _FACTS.pop(key, None))
    except TypeError:  # not weak-referenceable: do not cache
        return facts
    _FACTS[key] = (ref, facts)
    return facts


class StaticCosts:
    """A program's facts priced on one chip: per-instruction costs that do not depend on the schedule.

    Attributes (arrays indexed by instruction unless said otherwise; the event loop,
    ``timing_core.event_loop``, reads the first group, the ``Timeline`` the second):
        facts: the ``ProgramFacts`` (engines, streams, engine_index, semaphore_ids, ...).
        kind: int8 kinds (``MXU`` ... ``PROBE``).
        dur: float64, s: engine time (matmul, vector, link send) or core DMA port time (DMA).
        extra: float64, s: DMA fixed cost beyond one setup + HBM latency (gather rounds).
        a1, a2: int64: semaphore number and count/value, barrier number (an index into
            ``barrier_ids``) and count, link key number (an index into ``link_keys``, the
            (peer, tag) pairs), or the issuing core (DMA).
        split_of: int64 for HBM DMAs, the index of their split over the pseudo-channels (-1 for
            others); per split: ``split_dt`` (float64[U, n_pc] service time per pseudo-channel, s),
            ``split_dense`` (bool[U]: every channel touched), ``split_min`` (float64[U]: least
            service time of any channel when dense, else 0), and the channels it touches,
            ``touched[touched_off[u]:touched_off[u + 1]]``.
        category, nbytes, hbm, flops, fmt, fixed, work, core_dma: numpy arrays for the Timeline.
        channel_bytes: int64[n_pc] bytes each HBM pseudo-channel serves over the whole program.
    """

    def __init__(self, program: Program, spec: ChipSpec) -> None:
        f = self.facts = program_facts(program)
        n, kind = f.n, f.kind
        clock = spec.core.clock_hz
        mx, vu, dma, hbm, link = spec.matrix, spec.vector, spec.dma, spec.hbm, spec.link
        dur = np.zeros(n, dtype=np.float64)
        extra = np.zeros(n, dtype=np.float64)
        self.fixed = fixed = np.zeros(n, dtype=np.float64)
        self.work = work = np.zeros(n, dtype=np.float64)

        # DMA: core port time; fixed setup (+ HBM latency, + gather rounds).
        hbm_dma, copy = kind == HBM, kind == COPY
        copy_rate = min(dma.bytes_per_s_per_core, spec.sram.bytes_per_cycle * clock)
        dur[hbm_dma] = f.nbytes[hbm_dma] / dma.bytes_per_s_per_core
        dur[copy] = f.nbytes[copy] / copy_rate
        dma_fixed = dma.setup_latency_s + hbm.latency_s
        gathers = f.gather_rows > 0
        extra[gathers] = (-(-f.gather_rows[gathers] // dma.max_outstanding_per_queue) - 1) * dma_fixed
        fixed[hbm_dma] = dma_fixed + extra[hbm_dma]
        fixed[copy] = dma.setup_latency_s

        # Matrix unit: tile steps at the format's rate, plus issue overhead.
        mm = kind == MXU
        if mm.any():
            m, nn, k = f.mm[mm].T
            macs = np.array([mx.mxfp4_macs_per_cycle, mx.mxfp8_macs_per_cycle, mx.bf16_macs_per_cycle],
                            dtype=np.float64)[f.fmt[mm]]
            steps = (-(-m // mx.tile_m)) * (-(-nn // mx.tile_n)) * (-(-k // mx.tile_k))
            work[mm] = steps * (mx.tile_m * mx.tile_n * mx.tile_k) / macs / clock
            fixed[mm] = mx.issue_overhead_cycles / clock
        self.flops = np.where(mm, 2.0 * f.mm[:, 0] * f.mm[:, 1] * f.mm[:, 2], 0.0)

        # Vector unit: elements over lanes (special-function rate for transcendentals) + issue.
        vec = kind == VEC
        rate = np.where(f.special[vec], vu.transcendental_elements_per_cycle, vu.lanes)
        work[vec] = -(-f.elements[vec] // rate) / clock
        fixed[vec] = vu.issue_overhead_cycles / clock
        compute = mm | vec
        dur[compute] = fixed[compute] + work[compute]

        # Link: alpha-beta, the chip spec's message cost (LinkSpec.message_s): set-up plus the path's
        # hop and switch latencies, then bytes over the striped ports. The rack's collectives price
        # each step with the same formula, so a collective emitted here times as it is modelled there.
        send = kind == SEND
        dur[send] = link.alpha_s + f.nbytes[send] / link.stripe_bytes_per_s
        fixed[send] = link.alpha_s

        self.category = _CATEGORY_OF_KIND[kind]
        self.hbm = hbm_dma
        self.nbytes = f.nbytes
        self.fmt = f.fmt
        self.core_dma = np.where(hbm_dma | copy, dur, 0.0)
        self.kind = kind
        self.dur = dur
        self.extra = extra
        a1 = np.where(hbm_dma | copy, f.core, f.sem)
        # Barriers and link keys numbered 0..B-1 and 0..L-1, as semaphores are (ProgramFacts).
        bar = kind == BARRIER
        self.barrier_ids = np.zeros(0, dtype=np.int64)
        if bar.any():
            self.barrier_ids, dense = np.unique(a1[bar], return_inverse=True)
            a1[bar] = dense.reshape(-1)
        self.link_keys: list = []
        if f.links:
            number: dict = {}
            idx = np.array([i for i, _ in f.links], dtype=np.int64)
            a1[idx] = [number.setdefault(key, len(number)) for _, key in f.links]
            self.link_keys = list(number)
        self.a1 = a1
        self.a2 = f.count
        self._channels(spec)

    def _channels(self, spec: ChipSpec) -> None:
        """Per-pseudo-channel service times of each HBM DMA, shared between equal splits."""
        hbm, f = spec.hbm, self.facts
        g, n_pc = hbm.interleave_bytes, hbm.pseudo_channels
        rate = hbm.bytes_per_s_per_pseudo_channel * hbm.efficiency
        self.split_of = np.full(f.n, -1, dtype=np.int64)
        self.split_dt = np.zeros((0, n_pc), dtype=np.float64)
        self.split_dense = np.zeros(0, dtype=bool)
        self.split_min = np.zeros(0, dtype=np.float64)
        self.touched_off = np.zeros(1, dtype=np.int64)
        self.touched = np.zeros(0, dtype=np.int64)
        self.channel_bytes = np.zeros(n_pc, dtype=np.int64)
        if not len(f.hbm_idx):
            return
        # Descriptors with the same shape and offset modulo one interleave round share a split.
        keys = f.hbm_tile.copy()
        keys[:, 0] %= g * n_pc
        keys, inverse = _unique_rows(keys)
        split = np.stack([channel_bytes(*map(int, key), g, n_pc) for key in keys])
        uses = np.bincount(inverse, minlength=len(keys))
        self.channel_bytes = (uses[:, None] * split).sum(axis=0)
        nonzero = split != 0
        self.split_dt = split / rate
        self.split_dense = nonzero.all(axis=1)
        self.split_min = np.where(self.split_dense, split.min(axis=1) / rate, 0.0)
        self.touched_off = np.concatenate(([0], np.cumsum(nonzero.sum(axis=1)))).astype(np.int64)
        self.touched = np.nonzero(nonzero)[1].astype(np.int64)
        self.split_of[f.hbm_idx] = inverse
