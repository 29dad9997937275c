"""Which flat buffer backs each address range of a Program, and how large each backing array is.

Stage: emulator (memory), for ``functional.py``. Memory is byte-addressed, exactly as the chip
sees it: one flat uint8 buffer per HBM allocation (so only what is allocated is backed by host
memory), one per core's scratchpad and one per core's accumulator memory, each up to the highest
byte the program allocates or touches (``sizes``, the buffers a ``FunctionalResult`` returns).

The functional pass keeps them in fewer, larger arrays (``backing``): each HBM allocation in one
of its own, a few bytes larger than it holds (its size rounded up to a power of two, or to an
eighth of one above 1 MiB), and the on-chip memory of every core in one array per space ("sram",
"acc"). That array backs only the *runs* of each core's memory that instructions touch (every
tile's first to last byte, runs closer than ``RUN_GAP_BYTES`` merged), packed one after another
and rounded up like an HBM allocation: a fused step on 64 cores reaches the top of every 8 MiB
scratchpad (512 MiB, 0.2-0.3 s to create each run) while touching a few MiB of it. Bytes no
instruction touches keep their first value, which ``FunctionalResult`` fills in.

The pass compiles one function per instruction *signature*, which includes its arrays' sizes and
not where in them its tiles sit, so the same instruction on any core, or on buffers of nearby
sizes, is one signature (a fused tiny-gpt-oss prefill step: 443 signatures with exact sizes, 113
rounded; each compilation, even one JAX's persistent cache holds, costs about 15 ms of tracing and
lowering), and independent instructions of one signature on many cores run as one batched call.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from jalapeno_emu.errors import OutOfBounds
from jalapeno_emu.isa.program import Allocation, Instruction, Program, Tile
from jalapeno_emu.isa.table import Space

__all__ = ["RUN_GAP_BYTES", "MemoryLayout", "backing_bytes"]

RUN_GAP_BYTES = 256
"""Touched ranges of one core's memory this close are backed as one run: fewer runs to look up,
at most this many bytes of gap backed per run."""

_SPACE_NAME = {space: space.value for space in Space}
_RUN_ALIGN = 64  # each run starts at a multiple of this in its array (whole bursts, aligned rows)

Runs = tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # per core: (start, end) byte ranges


@dataclass(frozen=True)
class MemoryLayout:
    """Which flat buffer backs each address range.

    Attributes:
        hbm: HBM allocations, sorted by offset (each its own buffer "hbm:NAME").
        sram_bytes: per core, the scratchpad bytes of its buffer ("sram:C").
        acc_bytes: per core, the accumulator bytes of its buffer ("acc:C").
        sram_runs, acc_runs: per core, the byte ranges instructions touch, sorted and disjoint:
            what the "sram" and "acc" arrays back.
    """

    hbm: tuple[Allocation, ...]
    sram_bytes: tuple[tuple[int, int], ...]
    acc_bytes: tuple[tuple[int, int], ...]
    sram_runs: Runs = ()
    acc_runs: Runs = ()

    @staticmethod
    def of(program: Program) -> MemoryLayout:
        """The layout a program needs: its HBM allocations, SRAM/ACC up to the highest byte
        allocated or used, and the runs of on-chip memory its instructions touch."""
        hbm = tuple(sorted((a for a in program.allocations if a.space is Space.HBM),
                           key=lambda a: a.offset))
        need: dict[tuple[Space, int], int] = {}
        for a in program.allocations:
            if a.space is not Space.HBM:
                need[(a.space, a.core)] = max(need.get((a.space, a.core), 0), a.end)
        spans: dict[tuple[Space, int], set[tuple[int, int]]] = {}
        off_chip = Space.HBM
        for ins in program.instructions:  # (the operands directly: a fused step has 30k of them)
            for _, t in ins.args:
                if type(t) is Tile and t.space is not off_chip:
                    key = (t.space, t.core)
                    end = t.end
                    if end > need.get(key, 0):
                        need[key] = end
                    got = spans.get(key)
                    if got is None:
                        got = spans[key] = set()
                    got.add((t.offset, end))
        sram = tuple(sorted((c, n) for (s, c), n in need.items() if s is Space.SRAM))
        acc = tuple(sorted((c, n) for (s, c), n in need.items() if s is Space.ACC))
        runs = {key: _merged(v) for key, v in spans.items()}
        return MemoryLayout(hbm, sram, acc,
                            tuple(sorted((c, r) for (s, c), r in runs.items() if s is Space.SRAM)),
                            tuple(sorted((c, r) for (s, c), r in runs.items() if s is Space.ACC)))

    @functools.cached_property
    def _hbm_offsets(self) -> list[int]:
        return [a.offset for a in self.hbm]

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        """Buffer name -> size in bytes (computed once)."""
        return self.buffers()

    @functools.cached_property
    def _placed(self) -> tuple[dict[tuple[str, int], tuple[list[int], list[int], list[int]]], dict[str, int]]:
        """((space, core) -> (run starts, run ends, their first bytes in the space's array)),
        and each space's bytes of runs."""
        where: dict[tuple[str, int], tuple[list[int], list[int], list[int]]] = {}
        used: dict[str, int] = {}
        for space, per_core in (("sram", self.sram_runs), ("acc", self.acc_runs)):
            at = 0
            for c, runs in per_core:
                starts, ends, bases = [], [], []
                for lo, hi in runs:
                    starts.append(lo)
                    ends.append(hi)
                    bases.append(at)
                    at += -(-(hi - lo) // _RUN_ALIGN) * _RUN_ALIGN
                where[(space, c)] = (starts, ends, bases)
            if per_core:
                used[space] = at
        return where, used

    @functools.cached_property
    def backing(self) -> dict[str, int]:
        """Array name -> bytes: "hbm:NAME" an HBM allocation's size rounded up, "sram" and "acc"
        the runs of every core packed (each from a multiple of 64 bytes), rounded up alike
        (:func:`backing_bytes`; absent when no instruction touches the space)."""
        out = {k: backing_bytes(n) for k, n in self.sizes.items() if k.startswith("hbm:")}
        for space, n in self._placed[1].items():
            out[space] = backing_bytes(n)
        return out

    def pieces(self, name: str) -> list[tuple[str, int, int, int]]:
        """Where buffer ``name`` of ``sizes`` is backed: (array name, first byte there, end,
        first byte in the buffer) per run (an HBM buffer: one piece, all of it)."""
        if name.startswith("hbm:"):
            return [(name, 0, self.sizes[name], 0)]
        space, core = name.split(":")
        hit = self._placed[0].get((space, int(core)))
        if hit is None:
            return []
        return [(space, base, base + hi - lo, lo) for lo, hi, base in zip(*hit, strict=True)]

    def buffers(self) -> dict[str, int]:
        """Buffer name -> size in bytes."""
        out = {f"hbm:{a.name}": a.nbytes for a in self.hbm}
        out.update({f"sram:{c}": n for c, n in self.sram_bytes})
        out.update({f"acc:{c}": n for c, n in self.acc_bytes})
        return out

    def locate(self, tile: Tile, *, index: int | None = None, ins: Instruction | None = None
               ) -> tuple[str, int]:
        """(array name in ``backing``, offset within it) of ``tile``; raises OutOfBounds if it is
        not backed (an on-chip tile no instruction of the program touches)."""
        if tile.space is Space.HBM:
            # The allocation starting at or before the tile is the only candidate when
            # allocations do not overlap; the scan keeps hand-written overlapping ones working.
            i = bisect.bisect_right(self._hbm_offsets, tile.offset) - 1
            candidates = [self.hbm[i]] if i >= 0 else []
            for a in (*candidates, *self.hbm):
                if a.offset <= tile.offset and tile.end <= a.end:
                    return f"hbm:{a.name}", tile.offset - a.offset
            raise OutOfBounds(
                "HBM tile is not inside one allocation", index=index,
                engine=str(ins.engine) if ins else None, source=ins.source if ins else None,
                addresses=(tile.region(),), hint="allocate the tensor first (.alloc / kb.hbm)")
        space = _SPACE_NAME[tile.space]  # (an enum's .value is a descriptor call: 6 us a tile)
        hit = self._placed[0].get((space, tile.core))
        if hit is not None:
            starts, ends, bases = hit
            i = bisect.bisect_right(starts, tile.offset) - 1
            if i >= 0 and tile.end <= ends[i]:
                return space, bases[i] + tile.offset - starts[i]
        raise OutOfBounds(
            "on-chip tile is not in memory the program's instructions touch", index=index,
            engine=str(ins.engine) if ins else None, source=ins.source if ins else None,
            addresses=(tile.region(),))


def _merged(spans: set[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted disjoint (start, end) ranges covering ``spans``, ranges less than
    ``RUN_GAP_BYTES`` apart joined."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1] + RUN_GAP_BYTES:
            if hi > out[-1][1]:
                out[-1][1] = hi
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def backing_bytes(n: int) -> int:
    """Bytes backing a buffer of ``n`` bytes: the next power of two (at least 64) up to 1 MiB,
    above it the next multiple of an eighth of the next power of two (at most 25 % more)."""
    if n <= 1 << 20:
        return max(64, 1 << (n - 1).bit_length())
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step
