"""Races and reads of memory never written: the checker's history of accesses.

Stage: emulator, under ``check`` (``check_program`` walks the program with ``clocks.Clocks`` and
hands every access to an ``AccessHistory`` per memory and every read to ``check_initialized``).
Two accesses race when they touch overlapping bytes, at least one writes, and neither happens
before the other (the ordering model is in ``check``'s docstring). A race says which ordering
edge is missing: a read that already has its data from another write is overtaken by the write
(a reused slot); otherwise the read runs ahead of its write.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import numpy as np

from jalapeno_emu.emu.allocations import Allocations
from jalapeno_emu.emu.clocks import Clocks
from jalapeno_emu.errors import Race, UninitializedRead
from jalapeno_emu.isa.program import Engine, Instruction, Program, Tile
from jalapeno_emu.isa.table import Space

__all__ = ["MATMULS", "AccessHistory", "CheckContext", "IntervalSet", "check_initialized", "race_error",
           "tile_contains", "tiles_overlap", "uninitialized_error"]


MATMULS = ("mxu.matmul", "mxu.matmul_t")  # their acc is read too in mode=accumulate


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


class CheckContext:
    """What the messages of a check need beyond the failing access: the program, its allocations
    (built on first use), and the walk's order and semaphore facts (to replay it up to an access)."""

    def __init__(self, program: Program, order: list[int], sem_signals: Mapping[int, Mapping[Engine, int]],
                 later: Mapping[int, Mapping[Engine, int]], allocations: Allocations | None = None) -> None:
        self.program, self.order, self.sem_signals, self.later = program, order, sem_signals, later
        self._allocations = allocations

    @property
    def allocations(self) -> Allocations:
        if self._allocations is None:
            self._allocations = Allocations(self.program)
        return self._allocations

    def fed_by_another_write(self, read_idx: int, read_tile: Tile, not_idx: int) -> bool:
        """True when a write other than instruction ``not_idx``, overlapping ``read_tile``, happens
        before instruction ``read_idx`` in every schedule (the read takes its data from there).

        Replays the walk's clocks up to the read: only when a race is reported.
        """
        clocks = Clocks(self.sem_signals, self.later)
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


def race_error(ctx: CheckContext, idx: int, name: str, tile: Tile, writes: bool,
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


def uninitialized_error(ctx: CheckContext, tile: Tile, first_gap: int, idx: int, ins: Instruction,
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
            if ins.mnemonic in MATMULS and name == "acc" else ""),
    )


def tile_contains(outer: Tile, inner: Tile) -> bool:
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
    """The accesses kept in a :class:`AccessHistory` to tiles of one geometry (offset, rows, row bytes,
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


class AccessHistory:
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
              ctx: CheckContext, name: str) -> None:
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
                        contains = tile_contains(tile, bucket.tile)
                    if contains:
                        if hb == len(run):
                            del bucket.runs[run_key]
                        else:
                            del run[:hb]
            if not bucket.runs:
                self._remove(bucket)
        if first is not None:
            _, j, t, e, w = first
            raise race_error(ctx, idx, name, tile, writes, j, t, e, w)

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


class IntervalSet:
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


def check_initialized(tile: Tile, written: IntervalSet, idx: int, ins: Instruction, name: str,
                       ctx: CheckContext) -> None:
    # Its whole byte range first: one look-up settles most strided tiles too.
    if tile.contiguous or written.covers(tile.offset, tile.end):
        ok = written.covers(tile.offset, tile.end)
    else:
        rb, st = tile.row_bytes, tile.stride
        ok = all(written.covers(tile.offset + r * st, tile.offset + r * st + rb)
                 for r in range(tile.rows))
    if not ok:
        raise uninitialized_error(ctx, tile, written.first_gap(tile), idx, ins, name)
