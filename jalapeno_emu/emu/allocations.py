"""Who allocated which bytes: the program's allocations per memory, for the checker's messages
and its bounds check.

Stage: emulator, under ``check`` (``check_program``): a message names memory by allocation, with
the tile's rows and columns inside it (``races``, capacity and bounds errors).
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from jalapeno_emu.isa.program import Allocation, Program, Tile
from jalapeno_emu.isa.table import DTYPES, Space

__all__ = ["Allocations"]


class Allocations:
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
