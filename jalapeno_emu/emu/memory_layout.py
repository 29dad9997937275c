"""Which flat buffer backs each address range of a Program, and how large each backing array is.

Stage: emulator (memory), for ``functional.py``. Memory is byte-addressed, exactly as the chip
sees it: one flat uint8 buffer per HBM allocation (so only what is allocated is backed by host
memory), one per core's scratchpad and one per core's accumulator memory, each up to the highest
byte the program touches (``sizes``, the buffers a ``FunctionalResult`` returns).

The functional pass keeps them in fewer, larger arrays (``backing``): each HBM allocation in one
of its own, a few bytes larger than it holds (its size rounded up to a power of two, or to an
eighth of one above 1 MiB), and the scratchpads of the cores the program uses in one array "sram"
(accumulators: "acc"), the k-th of them at byte ``k * core_stride[space]``, the stride the largest
core's bytes rounded up, the count rounded up to a power of two. The pass compiles one function
per instruction *signature*, which includes its arrays' sizes and not where in them its tiles
sit, so the same instruction on any core, or on buffers of nearby sizes, is one signature (a
fused tiny-gpt-oss prefill step: 443 signatures with exact sizes, 113 rounded; each compilation,
even one JAX's persistent cache holds, costs about 15 ms of tracing and lowering), and
independent instructions of one signature on many cores run as one batched call.
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
    def core_stride(self) -> dict[str, int]:
        """Space ("sram", "acc") -> bytes between two cores' memories in its array: the largest
        core's bytes rounded up (:func:`backing_bytes`)."""
        return {space: backing_bytes(max((n for _, n in per_core), default=1))
                for space, per_core in (("sram", self.sram_bytes), ("acc", self.acc_bytes))}

    @functools.cached_property
    def backing(self) -> dict[str, int]:
        """Array name -> bytes: "hbm:NAME" an HBM allocation's size rounded up
        (:func:`backing_bytes`); "sram" and "acc" every core's memory at ``core_stride`` apart,
        for a power of two of cores (absent when no core uses the space)."""
        out = {k: backing_bytes(n) for k, n in self.sizes.items() if k.startswith("hbm:")}
        for space, per_core in (("sram", self.sram_bytes), ("acc", self.acc_bytes)):
            if per_core:
                out[space] = (1 << (len(per_core) - 1).bit_length()) * self.core_stride[space]
        return out

    @functools.cached_property
    def _core_base(self) -> dict[tuple[str, int], int]:
        """(space, core) -> first byte of that core's memory in the space's array."""
        return {(space, c): k * self.core_stride[space]
                for space, per_core in (("sram", self.sram_bytes), ("acc", self.acc_bytes))
                for k, (c, _) in enumerate(per_core)}

    def core_range(self, name: str) -> tuple[str, int, int]:
        """(array name, first byte, end) of buffer ``name`` of ``sizes`` within ``backing``."""
        if name.startswith("hbm:"):
            return name, 0, self.sizes[name]
        space, core = name.split(":")
        base = self._core_base[(space, int(core))]
        return space, base, base + self.sizes[name]

    def buffers(self) -> dict[str, int]:
        """Buffer name -> size in bytes."""
        out = {f"hbm:{a.name}": a.nbytes for a in self.hbm}
        out.update({f"sram:{c}": n for c, n in self.sram_bytes})
        out.update({f"acc:{c}": n for c, n in self.acc_bytes})
        return out

    def locate(self, tile: Tile, *, index: int | None = None, ins: Instruction | None = None
               ) -> tuple[str, int]:
        """(array name in ``backing``, offset within it) of ``tile``; raises OutOfBounds if it is
        not backed."""
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
        space = tile.space.value
        return space, self._core_base[(space, tile.core)] + tile.offset


def backing_bytes(n: int) -> int:
    """Bytes backing a buffer of ``n`` bytes: the next power of two (at least 64) up to 1 MiB,
    above it the next multiple of an eighth of the next power of two (at most 25 % more)."""
    if n <= 1 << 20:
        return max(64, 1 << (n - 1).bit_length())
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step
