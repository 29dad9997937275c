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
  contribute). ``barrier`` joins every participant. ``link.recv`` follows its ``link.send``.

Two accesses race when they touch overlapping bytes, at least one writes, and neither happens
before the other.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import numpy as np

from jalapeno_emu.chip import ChipSpec
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
    """Vector clocks implementing the ordering model in the module docstring."""

    def __init__(self) -> None:
        self.engine_vc: dict[Engine, dict[Engine, int]] = defaultdict(dict)
        self.counter: dict[Engine, int] = defaultdict(int)
        self.signal_vcs: dict[int, list[tuple[Engine, int, dict]]] = defaultdict(list)
        self.sends: dict[tuple[int, int], list[dict]] = defaultdict(list)

    def _record_signal(self, ins: Instruction, eng: Engine, vc: dict) -> None:
        sem = ins.arg("sem")
        prev = [c for e, c, _ in self.signal_vcs[sem] if e == eng]
        cum = (prev[-1] if prev else 0) + ins.arg("count")
        self.signal_vcs[sem].append((eng, cum, dict(vc)))

    @staticmethod
    def join(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            if out.get(k, 0) < v:
                out[k] = v
        return out

    def step(self, ins: Instruction, sem_totals, sem_signals) -> tuple[Engine, int, dict]:
        """(engine, id, vector clock) of the instruction's memory accesses."""
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
            joined: set[Engine] = set()
            for sig_eng, cum, svc in self.signal_vcs[sem]:
                # Only the first signal of sig_eng that every schedule needs is known to precede
                # the wait; later ones from that engine may come after it.
                others = sem_totals[sem] - sem_signals[sem].get(sig_eng, 0)
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
        return eng, my_id, dict(vc)


def check_program(program: Program, spec: ChipSpec, *, check_uninitialized: bool = True) -> list[int]:
    """Check ``program`` for ``spec``; return the sequential order it was checked in.

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

    sem_totals: dict[int, int] = defaultdict(int)
    sem_signals: dict[int, dict[Engine, int]] = defaultdict(lambda: defaultdict(int))
    for ins in program.instructions:
        if ins.mnemonic == "sem.signal":
            sem_totals[ins.arg("sem")] += ins.arg("count")
            sem_signals[ins.arg("sem")][ins.engine] += ins.arg("count")

    clocks = _Clocks()
    # per memory: (first byte, end, tile, writes, engine, id, instruction index)
    accesses: dict[tuple[Space, int], list[tuple]] = defaultdict(list)
    written: dict[tuple[Space, int], _IntervalSet] = defaultdict(_IntervalSet)
    pending_barrier: dict[int, list[tuple[Engine, dict]]] = defaultdict(list)
    for idx in order:
        ins = program.instructions[idx]
        eng, my_id, vc = clocks.step(ins, sem_totals, sem_signals)
        if ins.mnemonic == "barrier":
            bid = ins.arg("id")
            pending_barrier[bid].append((eng, vc))
            if len(pending_barrier[bid]) >= ins.arg("count"):
                joined: dict = {}
                for _, v in pending_barrier[bid]:
                    joined = clocks.join(joined, v)
                for e, _ in pending_barrier[bid]:
                    clocks.engine_vc[e] = clocks.join(clocks.engine_vc[e], joined)
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
