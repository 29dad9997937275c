"""The checker's race and uninitialised-read walk written the straightforward way, to test the
fast one against.

``jalapeno_emu.emu.check`` (with ``races`` and ``clocks``) indexes its history of accesses (by
tile geometry, byte range and engine) and finds the signal a wait needs by bisection; here every
access is compared with a flat list of every kept earlier access, every wait scans every signal
so far, and tile overlap is always the exact numpy solve; written bytes are tracked row by row.
Everything else (legality, capacity, the sequential order, the fixed point of signals after
waits) is the checker's own.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu import check as fast
from jalapeno_emu.emu import clocks, races
from jalapeno_emu.emu.schedule import sequential_order
from jalapeno_emu.isa.program import Engine, Instruction, Program, Tile
from jalapeno_emu.isa.table import Space

__all__ = ["reference_check_program", "reference_later_signals", "reference_tiles_overlap"]


def reference_tiles_overlap(a: Tile, b: Tile) -> bool:
    """Whether two tiles share a byte, by the general solve for every row (no fast paths)."""
    if a.space is not b.space or (a.space is not Space.HBM and a.core != b.core):
        return False
    if a.end <= b.offset or b.end <= a.offset:
        return False
    if a.contiguous and b.contiguous:
        return True
    if a.rows > b.rows:
        a, b = b, a
    x = a.offset + np.arange(a.rows, dtype=np.int64) * a.stride
    la, lb, sb, b0 = a.row_bytes, b.row_bytes, max(b.stride, 1), b.offset
    q_min = np.maximum(np.floor_divide(x - lb - b0, sb) + 1, 0)
    q_max = np.minimum(-np.floor_divide(-(x + la - b0), sb) - 1, b.rows - 1)
    return bool(np.any(q_min <= q_max))


class _ScanningClocks(clocks.Clocks):
    """The checker's clocks, but a wait scans every signal on its semaphore so far, in order."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.flat: dict[int, list[tuple[Engine, int, dict]]] = defaultdict(list)

    def _record_signal(self, ins: Instruction, eng: Engine, vc: dict) -> None:
        super()._record_signal(ins, eng, vc)
        sem = ins.arg("sem")
        self.flat[sem].append((eng, self.cumulative[(sem, eng)], self.signals[-1][3]))

    def _wait_join(self, vc: dict, idx: int, sem: int, need: int) -> dict:
        later = self.later.get(idx, {})
        per_engine = self.sem_signals.get(sem, {})
        possible = self.sem_totals.get(sem, 0) - sum(later.values())
        joined: set[Engine] = set()
        for sig_eng, cum, svc in self.flat[sem]:
            others = possible - (per_engine.get(sig_eng, 0) - later.get(sig_eng, 0))
            if sig_eng not in joined and cum >= need - others > 0:
                vc = self.join(vc, svc)
                joined.add(sig_eng)
        return vc


def reference_later_signals(program: Program, order: list[int], sem_signals,
                            max_rounds: int = 8) -> dict[int, dict[Engine, int]]:
    """``clocks.later_signals`` (its fixed point) with the scanning clocks."""
    return clocks.later_signals(program, order, sem_signals, max_rounds, clocks=_ScanningClocks)


def _check_races(prior: list, tile: Tile, writes: bool, eng: Engine, vc: dict, idx: int,
                 ctx: races.CheckContext, ins: Instruction, name: str) -> None:
    """Compare ``tile`` with every kept earlier access; drop those it covers and follows."""
    s0, e0 = tile.offset, tile.end
    keep = []
    for entry in prior:
        ps, pe, t, w, e, i, j = entry
        if pe <= s0 or e0 <= ps:
            keep.append(entry)
            continue
        hb = vc.get(e, 0) >= i
        if (w or writes) and not hb and reference_tiles_overlap(t, tile):
            # the message is the checker's own (naming buffers and the missing edge)
            raise races.race_error(ctx, idx, name, tile, writes, j, t, e, w)
        if hb and (writes or not w) and races.tile_contains(tile, t):
            continue
        keep.append(entry)
    prior[:] = keep


class _Written:
    """Bytes written so far in one memory, as sorted disjoint intervals (the checker's first
    version, row by row for strided tiles)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self.ends, start)
        j = bisect.bisect_right(self.starts, end)
        if i < j:
            start = min(start, self.starts[i])
            end = max(end, self.ends[j - 1])
        self.starts[i:j] = [start]
        self.ends[i:j] = [end]

    def add_tile(self, tile: Tile) -> None:
        for r in range(tile.rows):
            s = tile.offset + r * tile.stride
            self.add(s, s + tile.row_bytes)

    def first_gap(self, tile: Tile) -> int:
        """The first byte of ``tile``, row by row, that nothing wrote (-1: none)."""
        for r in range(tile.rows):
            s = tile.offset + r * tile.stride
            for b in range(s, s + tile.row_bytes):
                i = bisect.bisect_right(self.starts, b) - 1
                if i < 0 or self.ends[i] <= b:
                    return b
        return -1

    def covers_tile(self, tile: Tile) -> bool:
        for r in range(tile.rows):
            s = tile.offset + r * tile.stride
            i = bisect.bisect_right(self.starts, s) - 1
            if i < 0 or self.ends[i] < s + tile.row_bytes:
                return False
        return True


def _check_initialized(tile: Tile, written: _Written, idx: int, ins: Instruction, name: str,
                       ctx: races.CheckContext) -> None:
    if not written.covers_tile(tile):
        raise races.uninitialized_error(ctx, tile, written.first_gap(tile), idx, ins, name)


def reference_check_program(program: Program, spec: ChipSpec, *,
                            check_uninitialized: bool = True) -> list[int]:
    """What ``check.check_program`` answers, computed the slow, obvious way."""
    from jalapeno_emu.isa.legality import check_legality

    check_legality(program)
    fast._check_capacity(program, spec)
    order = sequential_order(program)
    sem_signals: dict[int, dict[Engine, int]] = defaultdict(lambda: defaultdict(int))
    for ins in program.instructions:
        if ins.mnemonic == "sem.signal":
            sem_signals[ins.arg("sem")][ins.engine] += ins.arg("count")
    later = reference_later_signals(program, order, sem_signals)
    walk = _ScanningClocks(sem_signals, later)
    ctx = races.CheckContext(program, order, sem_signals, later)
    accesses: dict[tuple[Space, int], list[tuple]] = defaultdict(list)
    written: dict[tuple[Space, int], _Written] = defaultdict(_Written)
    for idx in order:
        ins = program.instructions[idx]
        eng, my_id, vc = walk.step(idx, ins)
        for name, tile, writes in ins.tiles():
            key = (tile.space, tile.core if tile.space is not Space.HBM else 0)
            if not writes and check_uninitialized and tile.space is not Space.HBM:
                _check_initialized(tile, written[key], idx, ins, name, ctx)
            if ins.mnemonic in races.MATMULS and name == "acc" and ins.arg("mode") == "accumulate":
                if check_uninitialized:
                    _check_initialized(tile, written[key], idx, ins, name, ctx)
                _check_races(accesses[key], tile, False, eng, vc, idx, ctx, ins, name)
            _check_races(accesses[key], tile, writes, eng, vc, idx, ctx, ins, name)
            accesses[key].append((tile.offset, tile.end, tile, writes, eng, my_id, idx))
            if writes and tile.space is not Space.HBM:
                written[key].add_tile(tile)
    return order
