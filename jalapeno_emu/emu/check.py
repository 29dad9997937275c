"""The program checker: capacity and bounds, deadlock, races and reads of memory never written.

Stage: emulator, before either pass. It proves properties of the static Program, so a program
that passes runs the same way in any legal interleaving of its engines.

Ordering model (the same one the timing pass implements):
- The matrix unit, the vector unit and the link engine finish instructions in issue order, so
  program order on them is a happens-before order.
- A DMA queue keeps several descriptors in flight: two DMAs on one queue are NOT ordered with each
  other. A ``sem.signal`` on a DMA queue takes effect once every earlier transfer of the queue
  has completed, but the queue does not stop at it; a ``sem.wait`` (or ``barrier``) does stop
  it. So "load; signal s; wait s; store" orders the store after the load, "load; signal; store"
  does not.
- ``sem.wait(s, v)`` happens after those ``sem.signal``s on ``s`` that every schedule must have
  executed to reach ``v`` (an engine's signals count only beyond what all other engines could
  contribute before the wait). Signals that happen after the wait cannot contribute: the waiting
  engine's own later signals, and any signal ordered after the wait through other semaphores,
  barriers or links; so "wait s, 1; exp b; signal s" on one engine, with "load b; signal s" on a
  DMA queue, orders the exp after the load. ``barrier`` joins every participant. ``link.recv``
  follows its ``link.send``.

Two accesses race when they touch overlapping bytes, at least one writes, and neither happens
before the other.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Mapping

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu.progress import ProgressFn, report_interval, resolve_progress
from jalapeno_emu.emu.schedule import link_key, sequential_order
from jalapeno_emu.errors import (
    CapacityExceeded,
    IllegalInstruction,
    OutOfBounds,
    Race,
    UninitializedRead,
)
from jalapeno_emu.isa.program import Allocation, Engine, Instruction, Program, Tile
from jalapeno_emu.isa.table import Space

__all__ = ["check_program", "tiles_overlap"]

_MATMULS = ("mxu.matmul", "mxu.matmul_t")  # their acc is read too in mode=accumulate



def _err(cls, msg: str, idx: int, ins: Instruction, addresses=(), hint=None):
    return cls(msg, index=idx, engine=str(ins.engine), source=ins.source, addresses=addresses,
               hint=hint)


def tiles_overlap(a: Tile, b: Tile) -> bool:
    """True when two tiles of the same memory share at least one byte (strides honoured exactly)."""
    if a.space is not b.space or (a.space is not Space.HBM and a.core != b.core):
        return False
    if a.end <= b.offset or b.end <= a.offset:
        return False
    if a.contiguous and b.contiguous:
        return True
    if a.rows == 1 or b.rows == 1 or a.stride == b.stride:
        # One row stride for both (the common case: tiles of one tensor): row r of a and row q
        # of b overlap when -lb < d + (q - r) * s < la, so solve for k = q - r in O(1).
        s = a.stride if a.rows > 1 else b.stride
        d = b.offset - a.offset
        k_min = max((-b.row_bytes - d) // s + 1, 1 - a.rows)
        k_max = min(-((d - a.row_bytes) // s) - 1, b.rows - 1)
        return k_min <= k_max
    if a.rows > b.rows:
        a, b = b, a
    # For each row [x, x + la) of a, is there a row q of b with b0 + q*sb < x + la and
    # b0 + q*sb + lb > x?  Solve for the admissible q range and intersect with [0, rows_b).
    x = a.offset + np.arange(a.rows, dtype=np.int64) * a.stride
    la, lb, sb, b0 = a.row_bytes, b.row_bytes, max(b.stride, 1), b.offset
    q_min = np.floor_divide(x - lb - b0, sb) + 1
    q_max = -np.floor_divide(-(x + la - b0), sb) - 1
    q_min = np.maximum(q_min, 0)
    q_max = np.minimum(q_max, b.rows - 1)
    return bool(np.any(q_min <= q_max))


def _check_capacity(program: Program, spec: ChipSpec) -> None:
    caps = {Space.HBM: spec.hbm.capacity_bytes, Space.SRAM: spec.sram.scratchpad_bytes,
            Space.ACC: spec.sram.accumulator_bytes}
    by_space: dict[tuple[Space, int], list] = defaultdict(list)
    for a in program.allocations:
        where = "HBM" if a.space is Space.HBM else f"{a.space.value} of core {a.core}"
        if a.space is not Space.HBM and not 0 <= a.core < spec.core.count:
            raise CapacityExceeded(f"allocation {a.name!r} is on core {a.core}, but {spec.name} has "
                                   f"{spec.core.count} cores")
        if a.end > caps[a.space]:
            raise CapacityExceeded(
                f"allocation {a.name!r} ends at byte {a.end:,} of {where}, which holds "
                f"{caps[a.space]:,} B", hint="shrink the tiles or reuse buffers")
        by_space[(a.space, a.core)].append(a)
    for allocs in by_space.values():
        allocs.sort(key=lambda a: a.offset)
        # Regions of a fused program reuse memory over time: two allocations may overlap when
        # they belong to different regions (races between them are caught below).
        ends: dict[str, tuple[int, Allocation]] = {}  # per scope: the furthest-reaching so far
        for y in allocs:
            for scope, (end, x) in ends.items():
                if y.offset < end and (scope == "" or y.scope in ("", scope)):
                    raise OutOfBounds(f"allocations {x.name!r} and {y.name!r} overlap in "
                                      f"{x.space.value} ({x.offset:#x}..{x.end:#x} and {y.offset:#x}..)")
            prev = ends.get(y.scope)
            if prev is None or y.end > prev[0]:
                ends[y.scope] = (y.end, y)
    hbm = sorted((a for a in program.allocations if a.space is Space.HBM), key=lambda a: a.offset)
    for idx, ins in enumerate(program.instructions):
        eng = ins.engine
        if eng.unit != "link" and not 0 <= eng.core < spec.core.count:
            raise _err(IllegalInstruction, f"core {eng.core} does not exist ({spec.name} has "
                       f"{spec.core.count})", idx, ins)
        if eng.unit == "dma" and not 0 <= eng.queue < spec.dma.queues_per_core:
            raise _err(IllegalInstruction, f"DMA queue {eng.queue} does not exist (each core has "
                       f"{spec.dma.queues_per_core})", idx, ins)
        for name, t, _ in ins.tiles():
            if t.space is not Space.HBM and not 0 <= t.core < spec.core.count:
                raise _err(OutOfBounds, f"operand {name} is on core {t.core}, which does not exist",
                           idx, ins, (t.region(),))
            if t.end > caps[t.space]:
                where = "HBM" if t.space is Space.HBM else f"the {caps[t.space]:,} B {t.space.value}"
                raise _err(OutOfBounds, f"operand {name} reaches byte {t.end:,}, past {where}",
                           idx, ins, (t.region(),))
            if t.space is Space.HBM and not any(a.offset <= t.offset and t.end <= a.end for a in hbm):
                raise _err(OutOfBounds, f"operand {name} is not inside one HBM allocation", idx, ins,
                           (t.region(),), hint="allocate the tensor first (.alloc / kb.hbm)")


class _Clocks:
    """Vector clocks implementing the ordering model in the module docstring.

    Args:
        sem_signals: per semaphore, each engine's signal count over the whole program.
        later: per ``sem.wait`` (its instruction index), the signal counts on its semaphore, per
            signalling engine, known to happen after the wait (:func:`_later_signals`); they
            cannot help satisfy it.
    """

    def __init__(self, sem_signals: Mapping[int, Mapping[Engine, int]],
                 later: Mapping[int, Mapping[Engine, int]]) -> None:
        self.engine_vc: dict[Engine, dict[Engine, int]] = defaultdict(dict)
        self.counter: dict[Engine, int] = defaultdict(int)
        # Per semaphore, per signalling engine: its cumulative counts (increasing) and the clock
        # of each of its signals, so a wait finds the signal it needs by bisection instead of
        # scanning every signal so far (which made the walk quadratic in the program).
        self.signal_vcs: dict[int, dict[Engine, tuple[list[int], list[dict]]]] = defaultdict(dict)
        self.sends: dict[tuple[int, int], deque[dict]] = defaultdict(deque)
        self.cumulative: dict[tuple[int, Engine], int] = {}  # (sem, engine) -> its signals so far
        self.pending_barrier: dict[int, list[tuple[Engine, dict]]] = defaultdict(list)
        self.sem_signals = sem_signals
        self.sem_totals = {sem: sum(per_engine.values()) for sem, per_engine in sem_signals.items()}
        self.later = later
        # What _later_signals needs once the walk is over: every signal's (sem, engine, count,
        # clock) and every wait's (index, sem, engine, id).
        self.signals: list[tuple[int, Engine, int, dict]] = []
        self.waits: list[tuple[int, int, Engine, int]] = []

    def _record_signal(self, ins: Instruction, eng: Engine, vc: dict) -> None:
        sem, count = ins.arg("sem"), ins.arg("count")
        cum = self.cumulative[(sem, eng)] = self.cumulative.get((sem, eng), 0) + count
        cums, vcs = self.signal_vcs[sem].setdefault(eng, ([], []))
        cums.append(cum)
        vcs.append(dict(vc))
        self.signals.append((sem, eng, count, vcs[-1]))

    @staticmethod
    def join(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            if out.get(k, 0) < v:
                out[k] = v
        return out

    def step(self, idx: int, ins: Instruction) -> tuple[Engine, int, dict]:
        """(engine, id, vector clock) of instruction ``idx``'s memory accesses; call in a legal order.

        The clock returned is shared with the walk's own state: read it, do not change it.
        """
        eng = ins.engine
        self.counter[eng] += 1
        my_id = self.counter[eng]
        mn = ins.mnemonic
        if eng.unit == "dma":
            # A DMA queue's own progress never advances its clock component: only a signal, which
            # takes effect once every earlier transfer has completed, vouches for them.
            vc = self.engine_vc[eng]
            if mn == "sem.signal":
                sig_vc = dict(vc)
                sig_vc[eng] = my_id
                self._record_signal(ins, eng, sig_vc)
                return eng, my_id, vc
            if mn not in ("sem.wait", "barrier"):
                return eng, my_id, vc
            vc = dict(vc)
        else:
            vc = dict(self.engine_vc[eng])
            vc[eng] = my_id
        if mn == "sem.wait":
            self.waits.append((idx, ins.arg("sem"), eng, my_id))
            vc = self._wait_join(vc, idx, ins.arg("sem"), ins.arg("value"))
        elif mn == "link.recv":
            sends = self.sends[link_key(ins)]
            if sends:
                vc = self.join(vc, sends.popleft())
        self.engine_vc[eng] = vc
        if mn == "sem.signal":
            self._record_signal(ins, eng, vc)
        elif mn == "link.send":
            self.sends[link_key(ins)].append(dict(vc))
        elif mn == "barrier":
            self._arrive(ins.arg("id"), ins.arg("count"), eng, vc)
        return eng, my_id, vc

    def _wait_join(self, vc: dict, idx: int, sem: int, need: int) -> dict:
        """``vc`` joined with the clocks of the signals wait ``idx`` (sem >= need) is known to follow."""
        later = self.later.get(idx, {})
        per_engine = self.sem_signals.get(sem, {})
        # Everything signalled on sem except what is known to come after this wait.
        possible = self.sem_totals.get(sem, 0) - sum(later.values())
        for sig_eng, (cums, vcs) in self.signal_vcs[sem].items():
            # Only the first signal of sig_eng that every schedule needs is known to precede
            # the wait; later ones from that engine may come after it. The others can
            # contribute at most what they signal short of their signals after the wait.
            others = possible - (per_engine.get(sig_eng, 0) - later.get(sig_eng, 0))
            need_here = need - others
            if need_here > 0:
                k = bisect.bisect_left(cums, need_here)  # its first signal reaching that
                if k < len(cums):
                    vc = self.join(vc, vcs[k])
        return vc

    def _arrive(self, bid: int, count: int, eng: Engine, vc: dict) -> None:
        """One engine reaches barrier ``bid``; the last of ``count`` joins every participant's clock."""
        pending = self.pending_barrier[bid]
        pending.append((eng, vc))
        if len(pending) >= count:
            joined: dict = {}
            for _, v in pending:
                joined = self.join(joined, v)
            for e, _ in pending:
                self.engine_vc[e] = self.join(self.engine_vc[e], joined)

    def signals_after_waits(self) -> dict[int, dict[Engine, int]]:
        """Per wait seen so far (instruction index): signal counts on its semaphore, per signalling
        engine, whose clocks show them after the wait.

        A signal follows wait #w of engine E when its clock's E component is at least w: it comes
        after an instruction of E issued at or after the wait (for a DMA queue, a signal of the
        queue issued after the wait, which the queue cannot reach before the wait is satisfied).
        """
        groups: dict[tuple[int, Engine], list[tuple[int, int]]] = defaultdict(list)
        for idx, sem, eng, my_id in self.waits:
            groups[(sem, eng)].append((my_id, idx))
        by_sem: dict[int, list[tuple[Engine, int, dict]]] = defaultdict(list)
        for sem, eng, count, vc in self.signals:
            by_sem[sem].append((eng, count, vc))
        out: dict[int, dict[Engine, int]] = {}
        for (sem, weng), waits in groups.items():
            waits.sort()
            ids = [my_id for my_id, _ in waits]
            # A signal whose clock shows weng at c follows the waits with id <= c, a prefix of the
            # sorted waits: add its count over that prefix with a difference array per engine.
            diff: dict[Engine, list[int]] = {}
            for sig_eng, count, vc in by_sem[sem]:
                k = bisect.bisect_right(ids, vc.get(weng, 0))
                if k:
                    d = diff.setdefault(sig_eng, [0] * (len(waits) + 1))
                    d[0] += count
                    d[k] -= count
            for sig_eng, d in diff.items():
                running = 0
                for i, (_, idx) in enumerate(waits):
                    running += d[i]
                    if running:
                        out.setdefault(idx, {})[sig_eng] = running
        return out


def _later_signals(program: Program, order: list[int], sem_signals: Mapping[int, Mapping[Engine, int]],
                   max_rounds: int = 8) -> dict[int, dict[Engine, int]]:
    """Per wait: the signals on its semaphore, per engine, known to happen after it.

    Knowing more of them orders more (fewer signals remain to satisfy a wait, so more are
    required before it), which in turn puts more signals after other waits: iterate the clocks
    from "none known" to a fixed point. Every round only adds orderings that hold in every
    schedule, so stopping after ``max_rounds`` (rare: one round per link of a chain of waits on
    reused semaphores) is safe: it can only report a race that more rounds would have cleared.
    """
    if not any(ins.mnemonic == "sem.wait" for ins in program.instructions):
        return {}
    later: dict[int, dict[Engine, int]] = {}
    for _ in range(max_rounds):
        clocks = _Clocks(sem_signals, later)
        for idx in order:
            clocks.step(idx, program.instructions[idx])
        found = clocks.signals_after_waits()
        if found == later:
            break
        later = found
    return later


def check_program(program: Program, spec: ChipSpec, *, check_uninitialized: bool = True,
                  progress: ProgressFn | None = None) -> list[int]:
    """Check ``program`` for ``spec``; return the sequential order it was checked in.

    ``progress``: called with (instructions analysed, total) about every 1% of the race and
    uninitialised-read analysis (the longest part: each access is compared with the earlier
    accesses still live that share a byte with it, :class:`_History`, so its time grows about
    linearly with the program; ~15,000 instructions/s on one core for a 4096^3 GEMM on tiny);
    defaults to the enclosing ``emu.progress.reporting_progress`` callback, as pass ``"check"``.

    Raises:
        IllegalInstruction: an instruction breaks the ISA's rules.
        CapacityExceeded, OutOfBounds: memory does not fit or a tile leaves its memory.
        Deadlock: some engine waits forever (who waits on what is in the message).
        Race: two unordered accesses to overlapping bytes, one a write.
        UninitializedRead: SRAM or accumulators read before anything wrote them (HBM is host
            memory: inputs arrive there before a kernel starts, so it is not checked).
    """
    from jalapeno_emu.isa.legality import check_program as check_legality

    check_legality(program)
    _check_capacity(program, spec)
    order = sequential_order(program)

    sem_signals: dict[int, dict[Engine, int]] = defaultdict(lambda: defaultdict(int))
    for ins in program.instructions:
        if ins.mnemonic == "sem.signal":
            sem_signals[ins.arg("sem")][ins.engine] += ins.arg("count")

    clocks = _Clocks(sem_signals, _later_signals(program, order, sem_signals))
    histories: dict[tuple[Space, int], _History] = defaultdict(_History)
    written: dict[tuple[Space, int], _IntervalSet] = defaultdict(_IntervalSet)
    progress = resolve_progress(progress, "check")
    every = report_interval(len(order))
    for done, idx in enumerate(order):
        if progress is not None and done % every == 0:
            progress(done, len(order))
        ins = program.instructions[idx]
        eng, my_id, vc = clocks.step(idx, ins)
        for name, tile, writes in ins.tiles():
            key = (tile.space, tile.core if tile.space is not Space.HBM else 0)
            history = histories[key]
            if not writes and check_uninitialized and tile.space is not Space.HBM:
                _check_initialized(tile, written[key], idx, ins, name)
            if ins.mnemonic in _MATMULS and name == "acc" and ins.arg("mode") == "accumulate":
                if check_uninitialized:
                    _check_initialized(tile, written[key], idx, ins, name)
                history.check(tile, False, vc, idx, program, name)
            history.check(tile, writes, vc, idx, program, name)
            history.add(tile, writes, eng, my_id, idx)
            if writes and tile.space is not Space.HBM:
                written[key].add_tile(tile)
    if progress is not None:
        progress(len(order), len(order))
    return order


def _contains(outer: Tile, inner: Tile) -> bool:
    """True when every byte of ``inner`` is a byte of ``outer`` (exact for the common layouts)."""
    if outer.contiguous:
        return outer.offset <= inner.offset and inner.end <= outer.end
    if inner.rows > 1 and inner.stride != outer.stride:
        return False
    rel = inner.offset - outer.offset
    if rel < 0:
        return False
    row, col = divmod(rel, outer.stride)
    return col + inner.row_bytes <= outer.row_bytes and row + inner.rows <= outer.rows


class _SpanIndex:
    """Items with integer spans [start, end), found by overlap with a query span.

    One sorted start list per span size class (class c: 2**c <= end - start < 2**(c + 1)): an
    item of class c that overlaps [s, e) starts in (s - 2**(c + 1), e), a bisection away, and
    items there that end before s are few unless many spans of one class nest.
    """

    __slots__ = ("classes",)

    def __init__(self) -> None:
        self.classes: dict[int, tuple[list[int], list[int], list]] = {}

    def add(self, start: int, end: int, item: object) -> None:
        """Index ``item`` under [start, end) (end > start)."""
        starts, ends, items = self.classes.setdefault((end - start).bit_length() - 1, ([], [], []))
        i = bisect.bisect_right(starts, start)
        starts.insert(i, start)
        ends.insert(i, end)
        items.insert(i, item)

    def remove(self, start: int, end: int, item: object) -> None:
        """Drop ``item``, indexed under [start, end)."""
        c = (end - start).bit_length() - 1
        starts, ends, items = self.classes[c]
        i = bisect.bisect_left(starts, start)
        while items[i] is not item:
            i += 1
        del starts[i], ends[i], items[i]
        if not starts:
            del self.classes[c]

    def overlapping(self, start: int, end: int, out: list) -> None:
        """Append to ``out`` every item whose span meets [start, end)."""
        for c, (starts, ends, items) in self.classes.items():
            lo = bisect.bisect_right(starts, start - (2 << c))
            hi = bisect.bisect_left(starts, end, lo)
            out.extend([items[k] for k in range(lo, hi) if ends[k] > start])

    def __bool__(self) -> bool:
        return bool(self.classes)


class _Bucket:
    """The accesses kept in a :class:`_History` to tiles of one geometry (offset, rows, row bytes,
    stride): whether they overlap or contain another tile is the same for all of them.

    ``runs``: per (writes, engine), the kept accesses as (engine's instruction id, sequence
    number, instruction index, tile), in issue order, so ids and sequence numbers both increase.
    ``slot``: the grid column it is indexed in (None: indexed by byte range).
    """

    __slots__ = ("end", "row", "rows", "runs", "slot", "start", "tile")

    def __init__(self, tile: Tile) -> None:
        self.tile = tile
        self.start = tile.offset
        self.end = tile.end
        self.runs: dict[tuple[bool, Engine], list[tuple[int, int, int, Tile]]] = {}
        self.slot: _Slot | None = None
        self.row = self.rows = 0


class _Slot:
    """The buckets of one :class:`_Grid` covering the same columns [col, col + width) of each of
    their rows; indexed by row range."""

    __slots__ = ("col", "grid", "rows", "width")

    def __init__(self, grid: _Grid, col: int, width: int) -> None:
        self.grid, self.col, self.width = grid, col, width
        self.rows = _SpanIndex()


class _Grid:
    """The strided buckets of one row stride, seen as rectangles of a grid ``stride`` bytes wide:
    byte x is row x // stride, column x % stride. A tile of that stride whose rows do not cross a
    grid row is rows [r, r + rows) by columns [c, c + row bytes), so the buckets overlapping it
    are found by column (one slot per column range) then by row, instead of by byte range, which
    for the tiles of one matrix takes in every tile of the same block of rows.

    ``lo``, ``hi``: the byte range every bucket ever indexed here lies in. ``spans``: the same
    buckets by byte range, for tiles that are not a few rectangles of this grid.
    """

    __slots__ = ("columns", "hi", "lo", "slots", "spans", "stride")

    def __init__(self, stride: int, lo: int, hi: int) -> None:
        self.stride = stride
        self.lo, self.hi = lo, hi
        self.columns = _SpanIndex()  # of _Slot
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.spans = _SpanIndex()

    def rectangles(self, tile: Tile) -> list[tuple[int, int, int, int]] | None:
        """``tile``'s bytes as (first row, end row, first column, end column) rectangles of this
        grid, or None when they are not a few (rows of another stride)."""
        s = self.stride
        if tile.rows > 1 and tile.stride != tile.row_bytes:
            row, col = divmod(tile.offset, s)
            if tile.stride == s and col + tile.row_bytes <= s:
                return [(row, row + tile.rows, col, col + tile.row_bytes)]
            return None
        # contiguous bytes [a, b): the rest of a's row, whole rows, the start of b's row
        (ra, ca), (rb, cb) = divmod(tile.offset, s), divmod(tile.end, s)
        if ra == rb:
            return [(ra, ra + 1, ca, cb)]
        out = [(ra, ra + 1, ca, s)]
        if rb > ra + 1:
            out.append((ra + 1, rb, 0, s))
        if cb:
            out.append((rb, rb + 1, 0, cb))
        return out


class _History:
    """The earlier accesses to one memory that a later access could still race with.

    The rules are those of a flat list of accesses in issue order, scanned in full by every new
    access: the first entry (in issue order) that overlaps it, is unordered with it, and of
    which one writes, is the race reported; an earlier access X that happens before the new
    access Y, lies inside Y's bytes and is no stronger than Y (Y writes, or X only reads) is
    dropped, since a later access Z races X only if it races Y too (Z comes later in a legal
    order, so Z is not before Y; if Z were after Y it would be after X).

    Scanning that list made the checker quadratic: HBM inputs are read again and again and
    never overwritten, so their reads are never dropped. Here the same entries are grouped so
    that one access touches little more than what overlaps it:

    - by tile geometry (:class:`_Bucket`), so overlap and containment are decided once per
      geometry; strided geometries are indexed as rectangles of a grid per row stride
      (:class:`_Grid`), the others by byte range (:class:`_SpanIndex`);
    - within a geometry, per (writes, engine): the accesses of one engine happen before the new
      one exactly up to its clock's component for that engine, a prefix of the run, so the
      first unordered one is found by bisection, and the ordered ones are dropped as a prefix.

    Skipping buckets that share no byte with the access changes nothing: the flat scan raises
    only on overlap and drops only what the access contains. The race reported is the earliest
    (by sequence number) of the first unordered access of every conflicting run: the one the
    flat scan would have met first.
    """

    def __init__(self) -> None:
        self.buckets: dict[tuple[int, int, int, int], _Bucket] = {}
        self.spans = _SpanIndex()  # buckets that are not rectangles of a grid, by byte range
        self.grids: dict[int, _Grid] = {}
        self.seq = 0

    def _overlapping(self, tile: Tile) -> list[_Bucket]:
        """The buckets that may share a byte with ``tile`` (every one that does, and a few more)."""
        start, end = tile.offset, tile.end
        out: list[_Bucket] = []
        self.spans.overlapping(start, end, out)
        for grid in self.grids.values():
            if end <= grid.lo or grid.hi <= start:
                continue
            rects = grid.rectangles(tile)
            if rects is None:
                grid.spans.overlapping(start, end, out)
                continue
            found: list[_Bucket] = []
            for r0, r1, c0, c1 in rects:
                slots: list[_Slot] = []
                grid.columns.overlapping(c0, c1, slots)
                for slot in slots:
                    slot.rows.overlapping(r0, r1, found)
            # a bucket spanning rows of two rectangles is found twice
            out.extend(dict.fromkeys(found) if len(rects) > 1 else found)
        return out

    def _remove(self, bucket: _Bucket) -> None:
        del self.buckets[_geometry(bucket.tile)]
        slot = bucket.slot
        if slot is None:
            self.spans.remove(bucket.start, bucket.end, bucket)
            return
        slot.rows.remove(bucket.row, bucket.row + bucket.rows, bucket)
        grid = slot.grid
        grid.spans.remove(bucket.start, bucket.end, bucket)
        if not slot.rows:
            grid.columns.remove(slot.col, slot.col + slot.width, slot)
            del grid.slots[(slot.col, slot.width)]
            if not grid.slots:
                del self.grids[grid.stride]

    def _new_bucket(self, tile: Tile, key: tuple[int, int, int, int]) -> _Bucket:
        bucket = self.buckets[key] = _Bucket(tile)
        s, width = tile.stride, tile.row_bytes
        # (a one-row tile's stride means nothing and may be 0: test it before dividing)
        row, col = divmod(tile.offset, s) if tile.rows > 1 and s != width else (0, s)
        if tile.rows == 1 or s == width or col + width > s:
            self.spans.add(bucket.start, bucket.end, bucket)
            return bucket
        grid = self.grids.get(s)
        if grid is None:
            grid = self.grids[s] = _Grid(s, bucket.start, bucket.end)
        grid.lo, grid.hi = min(grid.lo, bucket.start), max(grid.hi, bucket.end)
        slot = grid.slots.get((col, width))
        if slot is None:
            slot = grid.slots[(col, width)] = _Slot(grid, col, width)
            grid.columns.add(col, col + width, slot)
        bucket.slot, bucket.row, bucket.rows = slot, row, tile.rows
        slot.rows.add(row, row + tile.rows, bucket)
        grid.spans.add(bucket.start, bucket.end, bucket)
        return bucket

    def check(self, tile: Tile, writes: bool, vc: Mapping[Engine, int], idx: int,
              program: Program, name: str) -> None:
        """Raise Race if ``tile`` conflicts with an unordered kept access; drop what it covers."""
        first = None  # (sequence number, instruction index, tile, engine, writes) of the race
        start, end = tile.offset, tile.end
        for bucket in self._overlapping(tile):
            overlaps = None
            # Containment needs the byte range inside ours: a cheap test first.
            contains = None if start <= bucket.start and bucket.end <= end else False
            for run_key, run in list(bucket.runs.items()):
                w, e = run_key
                conflicts = w or writes
                if not conflicts and contains is False:
                    continue  # two reads that cannot drop one another
                v = vc.get(e, 0)
                if run[-1][0] <= v:
                    hb = len(run)
                else:  # run[:hb] happen before this access
                    hb = 0 if run[0][0] > v else bisect.bisect_right(run, v, key=_entry_id)
                if conflicts and hb < len(run) and (first is None or run[hb][1] < first[0]):
                    if overlaps is None:
                        overlaps = tiles_overlap(bucket.tile, tile)
                    if overlaps:
                        _, seq, j, t = run[hb]
                        first = (seq, j, t, e, w)
                if hb and (writes or not w) and contains is not False:
                    if contains is None:
                        contains = _contains(tile, bucket.tile)
                    if contains:
                        if hb == len(run):
                            del bucket.runs[run_key]
                        else:
                            del run[:hb]
            if not bucket.runs:
                self._remove(bucket)
        if first is not None:
            _, j, t, e, w = first
            other = program.instructions[j]
            ins = program.instructions[idx]
            raise Race(
                f"operand {name} ({'writes' if writes else 'reads'}) overlaps instruction #{j} on "
                f"{e} ({other.mnemonic}, {'writes' if w else 'reads'}, {other.source or 'no source'}) "
                "with no semaphore ordering between them",
                index=idx, engine=str(ins.engine), source=ins.source,
                addresses=(tile.region(), t.region()),
                hint="signal a semaphore after the first and wait for it before the second",
            )

    def add(self, tile: Tile, writes: bool, eng: Engine, my_id: int, idx: int) -> None:
        """Keep the access ``tile`` of instruction ``idx`` (id ``my_id`` on ``eng``)."""
        key = _geometry(tile)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self._new_bucket(tile, key)
        bucket.runs.setdefault((writes, eng), []).append((my_id, self.seq, idx, tile))
        self.seq += 1


def _entry_id(entry: tuple[int, int, int, Tile]) -> int:
    return entry[0]


def _geometry(tile: Tile) -> tuple[int, int, int, int]:
    """What decides which bytes a tile covers: tiles alike in it overlap and contain alike."""
    return (tile.offset, tile.rows, tile.row_bytes, tile.stride)


class _IntervalSet:
    """Disjoint, sorted byte intervals written so far in one memory (for uninitialised reads)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        """Insert [start, end), merging with neighbours it touches."""
        i = bisect.bisect_left(self.ends, start)  # first interval that ends at or after start
        j = bisect.bisect_right(self.starts, end)  # one past the last that starts at or before end
        if i < j:
            start = min(start, self.starts[i])
            end = max(end, self.ends[j - 1])
        self.starts[i:j] = [start]
        self.ends[i:j] = [end]

    def add_tile(self, tile: Tile) -> None:
        """Insert every row of ``tile``."""
        if tile.contiguous:
            self.add(tile.offset, tile.end)
            return
        if self.covers(tile.offset, tile.end):
            return  # rewriting written memory (the common case): nothing to add, row by row
        for r in range(tile.rows):
            s = tile.offset + r * tile.stride
            self.add(s, s + tile.row_bytes)

    def covers(self, start: int, end: int) -> bool:
        """True when [start, end) lies inside one interval."""
        i = bisect.bisect_right(self.starts, start) - 1
        return i >= 0 and self.ends[i] >= end


def _check_initialized(tile: Tile, written: _IntervalSet, idx: int, ins: Instruction, name: str) -> None:
    # Its whole byte range first: one look-up settles most strided tiles too.
    if tile.contiguous or written.covers(tile.offset, tile.end):
        ok = written.covers(tile.offset, tile.end)
    else:
        rb, st = tile.row_bytes, tile.stride
        ok = all(written.covers(tile.offset + r * st, tile.offset + r * st + rb)
                 for r in range(tile.rows))
    if not ok:
        raise UninitializedRead(
            f"operand {name} reads {tile.space.value} bytes that nothing has written",
            index=idx, engine=str(ins.engine), source=ins.source, addresses=(tile.region(),),
            hint="load or compute the data first" + (
                "; the first matmul into fresh accumulators needs mode=overwrite"
                if ins.mnemonic in _MATMULS and name == "acc" else ""),
        )
