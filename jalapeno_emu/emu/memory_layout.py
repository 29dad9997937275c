"""Which flat buffer backs each address range of a Program, and how large each backing array is.

Stage: emulator (memory), for ``functional.py``. Memory is byte-addressed, exactly as the chip
sees it: one flat uint8 buffer per HBM allocation (so only what is allocated is backed by host
memory), one per core's scratchpad and one per core's accumulator memory, each up to the highest
byte the program touches.

A buffer is backed by a few bytes more than it holds (its size rounded up to a power of two, or to
an eighth of one above 1 MiB; every core's scratchpad as large as the largest): the functional
pass compiles one function per instruction *signature*, which includes its buffers' sizes, so
the same instruction on any core, or on buffers of nearby sizes, is then one signature (a fused
tiny-gpt-oss prefill step: 443 signatures with exact sizes, 113 rounded), and each compilation,
even one JAX's persistent cache holds, costs about 15 ms of tracing and lowering.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from jalapeno_emu.errors import OutOfBounds
from jalapeno_emu.isa.program import Allocation, Instruction, Program, Tile
from jalapeno_emu.isa.table import Space

__all__ = ["MemoryLayout", "backing_bytes"]


@dataclass(frozen=True)
class MemoryLayout:
    """Which flat buffer backs each address range.

    Attributes:
        hbm: HBM allocations, sorted by offset (each its own buffer "hbm:NAME").
        sram_bytes: per core, the scratchpad bytes backed ("sram:C").
        acc_bytes: per core, the accumulator bytes backed ("acc:C").
    """

    hbm: tuple[Allocation, ...]
    sram_bytes: tuple[tuple[int, int], ...]
    acc_bytes: tuple[tuple[int, int], ...]

    @staticmethod
    def of(program: Program) -> MemoryLayout:
        """The layout a program needs: its HBM allocations, and SRAM/ACC up to the highest byte used."""
        hbm = tuple(sorted((a for a in program.allocations if a.space is Space.HBM),
                           key=lambda a: a.offset))
        need: dict[tuple[Space, int], int] = {}
        for a in program.allocations:
            if a.space is not Space.HBM:
                need[(a.space, a.core)] = max(need.get((a.space, a.core), 0), a.end)
        off_chip = Space.HBM
        for ins in program.instructions:  # (the operands directly: a fused step has 30k of them)
            for _, t in ins.args:
                if type(t) is Tile and t.space is not off_chip:
                    key = (t.space, t.core)
                    end = t.end
                    if end > need.get(key, 0):
                        need[key] = end
        sram = tuple(sorted((c, n) for (s, c), n in need.items() if s is Space.SRAM))
        acc = tuple(sorted((c, n) for (s, c), n in need.items() if s is Space.ACC))
        return MemoryLayout(hbm, sram, acc)

    @functools.cached_property
    def _hbm_offsets(self) -> list[int]:
        return [a.offset for a in self.hbm]

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        """Buffer name -> size in bytes (computed once)."""
        return self.buffers()

    @functools.cached_property
    def backing(self) -> dict[str, int]:
        """Buffer name -> bytes of the array backing it: an HBM allocation's size rounded up
        (:func:`backing_bytes`); every core's scratchpad (and accumulators) the largest of them,
        rounded up, so that the same instruction on any core is one signature."""
        out = {k: backing_bytes(n) for k, n in self.sizes.items() if k.startswith("hbm:")}
        for space, per_core in (("sram", self.sram_bytes), ("acc", self.acc_bytes)):
            top = backing_bytes(max((n for _, n in per_core), default=1))
            out.update({f"{space}:{c}": top for c, _ in per_core})
        return out

    def buffers(self) -> dict[str, int]:
        """Buffer name -> size in bytes."""
        out = {f"hbm:{a.name}": a.nbytes for a in self.hbm}
        out.update({f"sram:{c}": n for c, n in self.sram_bytes})
        out.update({f"acc:{c}": n for c, n in self.acc_bytes})
        return out

    def locate(self, tile: Tile, *, index: int | None = None, ins: Instruction | None = None
               ) -> tuple[str, int]:
        """(buffer name, offset within it) of ``tile``; raises OutOfBounds if it is not backed."""
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
        return f"{tile.space.value}:{tile.core}", tile.offset


def backing_bytes(n: int) -> int:
    """Bytes backing a buffer of ``n`` bytes: the next power of two (at least 64) up to 1 MiB,
    above it the next multiple of an eighth of the next power of two (at most 25 % more)."""
    if n <= 1 << 20:
        return max(64, 1 << (n - 1).bit_length())
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step
