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

Messages name memory by allocation, with the tile's rows and columns inside it and the address
range after it (``rowrecip[0:64, 0:32] (sram[c0]:0x10080..0x100a0)``); a race says which ordering
edge is missing (a read that already has its data from another write is overtaken by the write:
a reused slot; otherwise the read runs ahead of its write); capacity errors give the lines that
allocated; a deadlock blames the wait that can never be met (``schedule.deadlock_error``).
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
from jalapeno_emu.isa.table import DTYPES, Space

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


class _Allocations:
    """The program's allocations per memory, to name the tile of a message and to bound HBM tiles.

    Built once per check (sorting the allocations); a tile's containing allocation is a bisection
    away, so the bounds check stays near-linear in the program. Shapes come from what the builder
    records in ``Program.meta`` ("tensors", "buffers"); programs without them (assembly,
    binaries) get byte ranges inside the allocation instead of rows and columns.
    """

    def __init__(self, program: Program) -> None:
        meta = dict(program.meta)
        self.shapes: dict[tuple[Space, int, str], tuple[str, tuple[int, int]]] = {}
        try:
            for name, (dtype, shape) in meta.get("tensors", ()):
                self.shapes[(Space.HBM, 0, name)] = (dtype, tuple(shape))
            for (space, core, name), (dtype, shape) in meta.get("buffers", ()):
                self.shapes[(Space(space), core, name)] = (dtype, tuple(shape))
        except (TypeError, ValueError):  # meta written by hand: names only
            self.shapes = {}
        by_mem: dict[tuple[Space, int], list[Allocation]] = defaultdict(list)
        for a in program.allocations:
            by_mem[(a.space, a.core if a.space is not Space.HBM else 0)].append(a)
        # Per memory: allocations by offset, their starts, and per prefix the one reaching furthest
        # (allocations of different regions may overlap).
        self.mem: dict[tuple[Space, int], tuple[list[int], list[Allocation], list[Allocation]]] = {}
        for key, allocs in by_mem.items():
            allocs.sort(key=lambda a: (a.offset, -a.end))
            reach: list[Allocation] = []
            for a in allocs:
                reach.append(a if not reach or a.end > reach[-1].end else reach[-1])
            self.mem[key] = ([a.offset for a in allocs], allocs, reach)
        try:
            spans = sorted((start, end, name) for name, ranges in meta.get("regions", ())
                           for start, end in ranges)
        except (TypeError, ValueError):
            spans = []
        self.region_starts = [s for s, _, _ in spans]
        self.region_spans = spans

    @staticmethod
    def _key(tile: Tile) -> tuple[Space, int]:
        return (tile.space, tile.core if tile.space is not Space.HBM else 0)

    def reaching(self, tile: Tile) -> Allocation | None:
        """Of the allocations starting at or before ``tile``, the one reaching furthest (or None)."""
        found = self.mem.get(self._key(tile))
        if found is None:
            return None
        starts, _, reach = found
        i = bisect.bisect_right(starts, tile.offset) - 1
        return reach[i] if i >= 0 else None

    def inside_one(self, tile: Tile) -> bool:
        """True when one allocation holds every byte of ``tile``'s range."""
        a = self.reaching(tile)
        return a is not None and tile.end <= a.end

    def _region(self, idx: int | None) -> str:
        """The region instruction ``idx`` was issued in ("" if none; regions do not nest)."""
        if idx is None:
            return ""
        i = bisect.bisect_right(self.region_starts, idx) - 1
        return self.region_spans[i][2] if i >= 0 and idx < self.region_spans[i][1] else ""

    def holding(self, tile: Tile, idx: int | None = None) -> Allocation | None:
        """The allocation that holds ``tile`` (for instruction ``idx``: one of its region first)."""
        found = self.mem.get(self._key(tile))
        if found is None:
            return None
        starts, allocs, _ = found
        i = bisect.bisect_right(starts, tile.offset)
        cands = [a for a in allocs[:i] if tile.end <= a.end]
        if len(cands) > 1:
            scope = self._region(idx)
            cands.sort(key=lambda a: (a.scope != scope, a.scope != "", a.nbytes))
        return cands[0] if cands else None

    def shape_of(self, a: Allocation) -> tuple[str, tuple[int, int]] | None:
        """(dtype, (rows, cols)) the builder allocated ``a`` as, when recorded."""
        return self.shapes.get((a.space, a.core, a.name))

    def rect(self, a: Allocation, tile: Tile) -> str:
        """``tile`` inside ``a``: "[r0:r1, c0:c1]" in ``a``'s rows and elements when it is such a
        rectangle, else the byte range "[bytes 0x40:0x80]" relative to ``a``."""
        rel = tile.offset - a.offset
        shape = self.shape_of(a)
        if shape is not None and rel >= 0:
            dtype, (_, cols) = shape
            dt = DTYPES.get(dtype)
            arb = dt.row_bytes(cols) if dt is not None and cols > 0 else 0
            if arb > 0:
                r0, cb = divmod(rel, arb)
                bits = dt.bits
                if ((tile.rows == 1 or tile.stride == arb) and cb + tile.row_bytes <= arb
                        and (cb * 8) % bits == 0 and (tile.row_bytes * 8) % bits == 0):
                    c0, c1 = cb * 8 // bits, (cb + tile.row_bytes) * 8 // bits
                    return f"[{r0}:{r0 + tile.rows}, {c0}:{c1}]"
                if tile.contiguous and cb == 0 and tile.nbytes % arb == 0:
                    return f"[{r0}:{r0 + tile.nbytes // arb}, 0:{cols}]"
        return f"[bytes {rel:#x}:{tile.end - a.offset:#x}]"

    def element(self, a: Allocation, offset: int) -> str:
        """Byte ``offset`` of memory as an element of ``a``: "buf[4, 0]" (or "buf byte 0x40")."""
        rel = offset - a.offset
        shape = self.shape_of(a)
        if shape is not None:
            dtype, (_, cols) = shape
            dt = DTYPES.get(dtype)
            arb = dt.row_bytes(cols) if dt is not None and cols > 0 else 0
            if arb > 0:
                row, cb = divmod(rel, arb)
                return f"{a.name}[{row}, {cb * 8 // dt.bits}]"
        return f"{a.name} byte {rel:#x}"

    def describe(self, tile: Tile, idx: int | None = None) -> str:
        """``tile`` by allocation name, the address range as secondary detail:
        "rowrecip[0:64, 0:32] (sram[c0]:0x10080..0x100a0)"."""
        a = self.holding(tile, idx)
        if a is not None:
            return f"{a.name}{self.rect(a, tile)} ({tile.region()})"
        a = self.reaching(tile)
        if a is not None and tile.offset < a.end:
            return (f"{a.name}{self.rect(a, tile)} ({tile.region()}), which runs "
                    f"{tile.end - a.end:,} B past the end of {a.name!r}")
        return f"{tile.region()} (in no allocation)"

    def rows_note(self, a: Allocation, tile: Tile) -> str:
        """" (X is [8, 64] f32: rows 0..7; the tile covers rows 0..8)", when shapes are known."""
        shape = self.shape_of(a)
        if shape is None:
            return f" ({a.name!r} is {a.nbytes:,} B)"
        dtype, (rows, cols) = shape
        dt = DTYPES.get(dtype)
        arb = dt.row_bytes(cols) if dt is not None and cols > 0 else 0
        if arb <= 0:
            return f" ({a.name!r} is {a.nbytes:,} B)"
        first = (tile.offset - a.offset) // arb
        last = (tile.end - 1 - a.offset) // arb
        return (f" ({a.name!r} is [{rows}, {cols}] {dtype}: rows 0..{rows - 1}; the tile covers rows "
                f"{first}..{last})")

    def outside(self, tile: Tile, capacity: int) -> tuple[str, str]:
        """Why ``tile`` is in no one allocation, and a hint that fits: (text, hint)."""
        a = self.reaching(tile)
        loop = "check the loop bound: the last tile runs past the end of the tensor"
        if a is None:
            return ("it covers no allocation (it starts before the first one)",
                    "allocate the tensor first (.alloc / kb.hbm)")
        if tile.offset < a.end:
            return (f"it starts in {a.name!r} but ends {tile.end - a.end:,} B past its end"
                    + self.rows_note(a, tile), loop)
        gap = tile.offset - a.end
        where = "right at the end" if gap == 0 else f"{gap:,} B past the end"
        if gap < max(a.nbytes, 4096) and tile.offset < capacity:
            return (f"it starts {where} of {a.name!r}, in no allocation" + self.rows_note(a, tile),
                    "check the loop bound: one tile too many, or an offset past the tensor")
        return (f"it covers no allocation (the nearest below it, {a.name!r}, ends {gap:,} B before "
                "it)", "allocate the tensor first (.alloc / kb.hbm)")


class _Context:
    """What the messages of a check need beyond the failing access: the program, its allocations
    (built on first use), and the walk's order and semaphore facts (to replay it up to an access)."""

    def __init__(self, program: Program, order: list[int], sem_signals: Mapping[int, Mapping[Engine, int]],
                 later: Mapping[int, Mapping[Engine, int]], allocations: _Allocations | None = None) -> None:
        self.program, self.order, self.sem_signals, self.later = program, order, sem_signals, later
        self._allocations = allocations

    @property
    def allocations(self) -> _Allocations:
        if self._allocations is None:
            self._allocations = _Allocations(self.program)
        return self._allocations

    def fed_by_another_write(self, read_idx: int, read_tile: Tile, not_idx: int) -> bool:
        """True when a write other than instruction ``not_idx``, overlapping ``read_tile``, happens
        before instruction ``read_idx`` in every schedule (the read takes its data from there).

        Replays the walk's clocks up to the read: only when a race is reported.
        """
        clocks = _Clocks(self.sem_signals, self.later)
        writes: list[tuple[Engine, int]] = []
        instrs = self.program.instructions
        for k in self.order:
            ins = instrs[k]
            eng, my_id, vc = clocks.step(k, ins)
            if k == read_idx:
                return any(vc.get(e, 0) >= i for e, i in writes)
            if k != not_idx and any(w and tiles_overlap(t, read_tile) for _, t, w in ins.tiles()):
                writes.append((eng, my_id))
        return False


def _race_error(ctx: _Context, idx: int, name: str, tile: Tile, writes: bool,
                j: int, t: Tile, e: Engine, w: bool) -> Race:
    """The Race of instruction ``idx``'s operand ``name`` (``tile``) with instruction ``j``'s access
    ``t`` on engine ``e``: both by buffer name, and which ordering edge is missing."""
    program, names = ctx.program, ctx.allocations
    ins, other = program.instructions[idx], program.instructions[j]
    here, there = names.describe(tile, idx), names.describe(t, j)
    verb, other_verb = ("writes" if writes else "reads"), ("writes" if w else "reads")
    text = (f"operand {name} {verb} {here}, which instruction #{j} on {e} ({other.mnemonic}, "
            f"{other.source or 'no source'}) {other_verb}"
            + (f" as {there}" if there != here else " too" if w == writes else "")
            + ", with no semaphore ordering between them")
    # Which of the two was meant to come first: a read that already has its data from another
    # ordered write is overtaken by this write (a reused slot), otherwise the read waits for it;
    # two writes go in issue order.
    if writes and w:
        first, second, kind = min(idx, j), max(idx, j), "write"
    else:
        (r, r_tile), wr = ((idx, tile), j) if not writes else ((j, t), idx)
        if ctx.fed_by_another_write(r, r_tile, wr):
            first, second, kind = r, wr, "reuse"
        else:
            first, second, kind = wr, r, "read"
    a, b = program.instructions[first], program.instructions[second]
    what = names.holding(tile, idx) or names.holding(t, j)
    buf = repr(what.name) if what is not None else "the same bytes"

    def at(k: int, x: Instruction) -> str:
        return f"the {x.mnemonic} at {x.source or f'instruction #{k}'} ({x.engine} #{k})"

    text += f": nothing orders {at(second, b)} after {at(first, a)}, so "
    if kind == "reuse":
        text += f"it may overwrite {buf} before that read of its old contents"
    elif kind == "read":
        text += f"it may read {buf} before that write lands"
    else:
        text += f"the two writes of {buf} may land in either order"
    hint = (f"signal a semaphore on {a.engine} after #{first} and wait for it on {b.engine} before "
            f"#{second}")
    if a.engine == b.engine:
        hint += (f" ({a.engine} keeps several transfers in flight: issue order alone does not order "
                 "them)")
    elif kind == "reuse":
        hint += ": the slot is free again only once its reader is done"
    return Race(text, index=idx, engine=str(ins.engine), source=ins.source,
                addresses=(tile.region(), t.region()), hint=hint)


def _uninitialized_error(ctx: _Context, tile: Tile, first_gap: int, idx: int, ins: Instruction,
                         name: str) -> UninitializedRead:
    """The UninitializedRead of ``ins``'s operand ``name``, whose byte ``first_gap`` nothing wrote."""
    names = ctx.allocations
    gap = Tile(tile.space, tile.core, first_gap, "u8", 1, 1)
    a = names.holding(gap, idx)
    where = names.element(a, first_gap) if a is not None else f"{first_gap:#x}"
    return UninitializedRead(
        f"operand {name} reads {names.describe(tile, idx)}, bytes of which nothing has written "
        f"(the first: {where})",
        index=idx, engine=str(ins.engine), source=ins.source, addresses=(tile.region(),),
        hint="load or compute the data first" + (
            "; the first matmul into fresh accumulators needs mode=overwrite"
            if ins.mnemonic in _MATMULS and name == "acc" else ""),
    )


def _check_capacity(program: Program, spec: ChipSpec, allocations: _Allocations | None = None) -> None:
    """Every allocation inside its memory on a core that exists (per space and core, against
    ``spec``), allocations of one region apart, and every tile inside its memory and HBM tiles
    inside one allocation. Errors name the allocations with the lines that made them."""
    caps = {Space.HBM: spec.hbm.capacity_bytes, Space.SRAM: spec.sram.scratchpad_bytes,
            Space.ACC: spec.sram.accumulator_bytes}
    by_space: dict[tuple[Space, int], list] = defaultdict(list)
    over: dict[tuple[Space, int], list[Allocation]] = {}
    for a in program.allocations:
        if a.space is not Space.HBM and not 0 <= a.core < spec.core.count:
            raise CapacityExceeded(f"allocation {a.name!r} is on core {a.core}, but {spec.name} has "
                                   f"{spec.core.count} cores", source=a.source or None)
        if a.end > caps[a.space]:
            over.setdefault((a.space, a.core), []).append(a)
        by_space[(a.space, a.core)].append(a)
    if over:
        (space, core), big = next(iter(over.items()))
        raise _capacity_error(program, space, core, big, caps[space], spec)
    for allocs in by_space.values():
        allocs.sort(key=lambda a: a.offset)
        # Regions of a fused program reuse memory over time: two allocations may overlap when
        # they belong to different regions (races between them are caught below).
        ends: dict[str, tuple[int, Allocation]] = {}  # per scope: the furthest-reaching so far
        for y in allocs:
            for scope, (end, x) in ends.items():
                if y.offset < end and (scope == "" or y.scope in ("", scope)):
                    raise OutOfBounds(f"allocations {x.name!r} ({x.source or 'no source'}) and "
                                      f"{y.name!r} ({y.source or 'no source'}) overlap in "
                                      f"{x.space.value} ({x.offset:#x}..{x.end:#x} and {y.offset:#x}..)",
                                      source=y.source or None)
            prev = ends.get(y.scope)
            if prev is None or y.end > prev[0]:
                ends[y.scope] = (y.end, y)
    names = allocations if allocations is not None else _Allocations(program)
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
            cap = caps[t.space]
            if t.end > cap:
                where = "HBM" if t.space is Space.HBM else f"the {cap:,} B {t.space.value}"
                if t.offset < cap:
                    how = (f"; it starts in {names.describe(t, idx)} and ends {t.end - cap:,} B past "
                           "the end of memory")
                    hint = "check the loop bound: the last tile runs past the end of memory"
                else:
                    how = f"; it starts {t.offset - cap:,} B past the end of memory"
                    hint = "check the tile's offset: it lies wholly past the end of memory"
                raise _err(OutOfBounds, f"operand {name} reaches byte {t.end:,}, past {where}{how}",
                           idx, ins, (t.region(),), hint=hint)
            if t.space is Space.HBM and not names.inside_one(t):
                why, hint = names.outside(t, cap)
                raise _err(OutOfBounds, f"operand {name} is not inside one HBM allocation: {why}",
                           idx, ins, (t.region(),), hint=hint)


def _capacity_error(program: Program, space: Space, core: int, big: list[Allocation], cap: int,
                    spec: ChipSpec) -> CapacityExceeded:
    """The CapacityExceeded for the allocations ``big`` that end past ``cap`` bytes of ``space``:
    each with its line, and the first instruction that touches bytes past the end."""
    where = "HBM" if space is Space.HBM else f"the {space.value} of core {core}"
    listed = "; ".join(f"{a.name!r} ({a.source or 'no source'}) spans bytes {a.offset:,}..{a.end:,}"
                       for a in big[:4])
    more = f" and {len(big) - 4} more" if len(big) > 4 else ""
    text = (f"{'allocation' if len(big) == 1 else 'allocations'} past the end of {where} "
            f"({cap:,} B on {spec.name}): {listed}{more}")
    for idx, ins in enumerate(program.instructions):
        hit = next((n for n, t, _ in ins.tiles()
                    if t.space is space and (space is Space.HBM or t.core == core)
                    and any(t.offset < a.end and a.offset < t.end for a in big)), None)
        if hit is not None:
            text += (f"; first used by instruction #{idx} on {ins.engine} ({ins.mnemonic} operand {hit}, "
                     f"{ins.source or 'no source'})")
            break
    hint = "shrink the tiles or reuse buffers"
    if program.preset != spec.name:
        hint += f" (the program was built for {program.preset!r}, and is checked against {spec.name!r})"
    return CapacityExceeded(text, source=big[0].source or None, hint=hint)


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
        CapacityExceeded, OutOfBounds: an allocation ends past its memory's capacity on the core
            (per space and core, against ``spec``; the error's source is the line that
            allocated it), or a tile leaves its memory or (HBM) its allocation.
        Deadlock: some engine waits forever: the wait that can never be met (or the cycle of
            waits), then every blocked engine and what it waits on.
        Race: two unordered accesses to overlapping bytes, one a write, and the ordering edge
            that is missing.
        UninitializedRead: SRAM or accumulators read before anything wrote them (HBM is host
            memory: inputs arrive there before a kernel starts, so it is not checked).
    """
    from jalapeno_emu.isa.legality import check_legality

    check_legality(program)
    allocations = _Allocations(program)
    _check_capacity(program, spec, allocations)
    order = sequential_order(program)

    sem_signals: dict[int, dict[Engine, int]] = defaultdict(lambda: defaultdict(int))
    for ins in program.instructions:
        if ins.mnemonic == "sem.signal":
            sem_signals[ins.arg("sem")][ins.engine] += ins.arg("count")

    later = _later_signals(program, order, sem_signals)
    clocks = _Clocks(sem_signals, later)
    ctx = _Context(program, order, sem_signals, later, allocations)
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
                _check_initialized(tile, written[key], idx, ins, name, ctx)
            if ins.mnemonic in _MATMULS and name == "acc" and ins.arg("mode") == "accumulate":
                if check_uninitialized:
                    _check_initialized(tile, written[key], idx, ins, name, ctx)
                history.check(tile, False, vc, idx, ctx, name)
            history.check(tile, writes, vc, idx, ctx, name)
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
              ctx: _Context, name: str) -> None:
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
            raise _race_error(ctx, idx, name, tile, writes, j, t, e, w)

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

    def first_gap(self, tile: Tile) -> int:
        """The first byte of ``tile`` (in address order) that no interval holds, or -1."""
        rows = [(tile.offset, tile.end)] if tile.contiguous else [
            (tile.offset + r * tile.stride, tile.offset + r * tile.stride + tile.row_bytes)
            for r in range(tile.rows)]
        for start, end in rows:
            i = bisect.bisect_right(self.starts, start) - 1
            if i < 0 or self.ends[i] <= start:
                return start
            if self.ends[i] < end:
                return self.ends[i]
        return -1


def _check_initialized(tile: Tile, written: _IntervalSet, idx: int, ins: Instruction, name: str,
                       ctx: _Context) -> None:
    # Its whole byte range first: one look-up settles most strided tiles too.
    if tile.contiguous or written.covers(tile.offset, tile.end):
        ok = written.covers(tile.offset, tile.end)
    else:
        rb, st = tile.row_bytes, tile.stride
        ok = all(written.covers(tile.offset + r * st, tile.offset + r * st + rb)
                 for r in range(tile.rows))
    if not ok:
        raise _uninitialized_error(ctx, tile, written.first_gap(tile), idx, ins, name)
