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

The pieces: ``clocks`` (the ordering model's vector clocks), ``races`` (the history of accesses
that finds races and uninitialised reads), ``allocations`` (names in messages); capacity and
bounds are checked here.
"""

from __future__ import annotations

from collections import defaultdict

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu.allocations import Allocations
from jalapeno_emu.emu.clocks import Clocks, later_signals
from jalapeno_emu.emu.progress import ProgressFn, report_interval, resolve_progress
from jalapeno_emu.emu.races import (
    MATMULS,
    AccessHistory,
    CheckContext,
    IntervalSet,
    check_initialized,
    tiles_overlap,
)
from jalapeno_emu.emu.schedule import sequential_order
from jalapeno_emu.errors import (
    CapacityExceeded,
    IllegalInstruction,
    OutOfBounds,
)
from jalapeno_emu.isa.program import Allocation, Engine, Instruction, Program
from jalapeno_emu.isa.table import Space

__all__ = ["check_program", "tiles_overlap"]


def _err(cls, msg: str, idx: int, ins: Instruction, addresses=(), hint=None):
    return cls(msg, index=idx, engine=str(ins.engine), source=ins.source, addresses=addresses,
               hint=hint)


def _check_capacity(program: Program, spec: ChipSpec, allocations: Allocations | None = None) -> None:
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
    names = allocations if allocations is not None else Allocations(program)
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


def check_program(program: Program, spec: ChipSpec, *, check_uninitialized: bool = True,
                  progress: ProgressFn | None = None) -> list[int]:
    """Check ``program`` for ``spec``; return the sequential order it was checked in.

    ``progress``: called with (instructions analysed, total) about every 1% of the race and
    uninitialised-read analysis (the longest part: each access is compared with the earlier
    accesses still live that share a byte with it, :class:`AccessHistory`, so its time grows about
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
    allocations = Allocations(program)
    _check_capacity(program, spec, allocations)
    order = sequential_order(program)

    sem_signals: dict[int, dict[Engine, int]] = defaultdict(lambda: defaultdict(int))
    for ins in program.instructions:
        if ins.mnemonic == "sem.signal":
            sem_signals[ins.arg("sem")][ins.engine] += ins.arg("count")

    later = later_signals(program, order, sem_signals)
    clocks = Clocks(sem_signals, later)
    ctx = CheckContext(program, order, sem_signals, later, allocations)
    histories: dict[tuple[Space, int], AccessHistory] = defaultdict(AccessHistory)
    written: dict[tuple[Space, int], IntervalSet] = defaultdict(IntervalSet)
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
                check_initialized(tile, written[key], idx, ins, name, ctx)
            if ins.mnemonic in MATMULS and name == "acc" and ins.arg("mode") == "accumulate":
                if check_uninitialized:
                    check_initialized(tile, written[key], idx, ins, name, ctx)
                history.check(tile, False, vc, idx, ctx, name)
            history.check(tile, writes, vc, idx, ctx, name)
            history.add(tile, writes, eng, my_id, idx)
            if writes and tile.space is not Space.HBM:
                written[key].add_tile(tile)
    if progress is not None:
        progress(len(order), len(order))
    return order
