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
from collections import defaultdict
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
        self.signal_vcs: dict[int, list[tuple[Engine, int, dict]]] = defaultdict(list)
        self.sends: dict[tuple[int, int], list[dict]] = defaultdict(list)
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
        self.signal_vcs[sem].append((eng, cum, dict(vc)))
        self.signals.append((sem, eng, count, self.signal_vcs[sem][-1][2]))

    @staticmethod
    def join(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            if out.get(k, 0) < v:
                out[k] = v
        return out

    def step(self, idx: int, ins: Instruction) -> tuple[Engine, int, dict]:
        """(engine, id, vector clock) of instruction ``idx``'s memory accesses; call in a legal order."""
        eng = ins.engine
        self.counter[eng] += 1
        my_id = self.counter[eng]
        vc = dict(self.engine_vc[eng])
        mn = ins.mnemonic
        if eng.unit == "dma":
            # A DMA queue's own progress never advances its clock component: only a signal, which
            # takes effect once every earlier transfer has completed, vouches for them.
            if mn == "sem.signal":
                sig_vc = dict(vc)
                sig_vc[eng] = my_id
                self._record_signal(ins, eng, sig_vc)
                return eng, my_id, vc
            if mn not in ("sem.wait", "barrier"):
                return eng, my_id, vc
        else:
            vc[eng] = my_id
        if mn == "sem.wait":
            sem, need = ins.arg("sem"), ins.arg("value")
            self.waits.append((idx, sem, eng, my_id))
            later = self.later.get(idx, {})
            per_engine = self.sem_signals.get(sem, {})
            # Everything signalled on sem except what is known to come after this wait.
            possible = self.sem_totals.get(sem, 0) - sum(later.values())
            joined: set[Engine] = set()
            for sig_eng, cum, svc in self.signal_vcs[sem]:
                # Only the first signal of sig_eng that every schedule needs is known to precede
                # the wait; later ones from that engine may come after it. The others can
                # contribute at most what they signal short of their signals after the wait.
                others = possible - (per_engine.get(sig_eng, 0) - later.get(sig_eng, 0))
                if sig_eng not in joined and cum >= need - others > 0:
                    vc = self.join(vc, svc)
                    joined.add(sig_eng)
        elif mn == "link.recv":
            sends = self.sends[link_key(ins)]
            if sends:
                vc = self.join(vc, sends.pop(0))
        self.engine_vc[eng] = vc
        if mn == "sem.signal":
            self._record_signal(ins, eng, vc)
        elif mn == "link.send":
            self.sends[link_key(ins)].append(dict(vc))
        elif mn == "barrier":
            self._arrive(ins.arg("id"), ins.arg("count"), eng, vc)
        return eng, my_id, dict(vc)

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
    uninitialised-read analysis (the part that takes minutes at full size: each access is compared
    with a history of earlier ones that grows with the program, so the time grows faster than the
    instruction count); defaults to the enclosing ``emu.progress.reporting_progress`` callback,
    as pass ``"check"``.

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
    # per memory: (first byte, end, tile, writes, engine, id, instruction index)
    accesses: dict[tuple[Space, int], list[tuple]] = defaultdict(list)
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
            if not writes and check_uninitialized and tile.space is not Space.HBM:
                _check_initialized(tile, written[key], idx, ins, name)
            if ins.mnemonic in _MATMULS and name == "acc" and ins.arg("mode") == "accumulate":
                if check_uninitialized:
                    _check_initialized(tile, written[key], idx, ins, name)
                _check_races(accesses[key], tile, False, eng, my_id, vc, idx, program, ins, name)
            _check_races(accesses[key], tile, writes, eng, my_id, vc, idx, program, ins, name)
            accesses[key].append((tile.offset, tile.end, tile, writes, eng, my_id, idx))
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


def _check_races(prior, tile, writes, eng, my_id, vc, idx, program, ins, name) -> None:
    """Raise Race if ``tile`` conflicts with an unordered earlier access; prune the history.

    An earlier access X that happens before this access Y, lies inside Y's bytes, and is no
    stronger than Y (Y writes, or X only reads) can never race with a later access Z unless Y
    does too: Z comes later in a legal order, so Z is not before Y; if Z were after Y it would be
    after X. Dropping such X keeps the history to roughly the live tiles.
    """
    s0, e0 = tile.offset, tile.end
    keep = []
    for entry in prior:
        ps, pe, t, w, e, i, j = entry
        if pe <= s0 or e0 <= ps:
            keep.append(entry)
            continue
        hb = vc.get(e, 0) >= i
        if (w or writes) and not hb and tiles_overlap(t, tile):
            other = program.instructions[j]
            raise Race(
                f"operand {name} ({'writes' if writes else 'reads'}) overlaps instruction #{j} on "
                f"{e} ({other.mnemonic}, {'writes' if w else 'reads'}, {other.source or 'no source'}) "
                "with no semaphore ordering between them",
                index=idx, engine=str(ins.engine), source=ins.source,
                addresses=(tile.region(), t.region()),
                hint="signal a semaphore after the first and wait for it before the second",
            )
        if hb and (writes or not w) and _contains(tile, t):
            continue
        keep.append(entry)
    prior[:] = keep


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
        for r in range(tile.rows):
            s = tile.offset + r * tile.stride
            self.add(s, s + tile.row_bytes)

    def covers(self, start: int, end: int) -> bool:
        """True when [start, end) lies inside one interval."""
        i = bisect.bisect_right(self.starts, start) - 1
        return i >= 0 and self.ends[i] >= end


def _check_initialized(tile: Tile, written: _IntervalSet, idx: int, ins: Instruction, name: str) -> None:
    if tile.contiguous:
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
