"""Which instructions the functional pass may run as one batched call: same signature, independent.

Stage: emulator, under ``functional.py``. The functional pass runs a Program's data instructions in
``schedule.sequential_order``, one jitted call each. On a chip of 64 cores most of them come in
dozens of copies (each core's load of its weight slice, each core's matmul), which do not depend
on each other: here they are gathered into *batches* that one call runs (vectorised, or for
matmuls one after another inside the call: ``functional._MAPPED``), with results identical to
running them in order.

A batch is instructions of one group (one compiled function over the same arrays) that all read
the memory as it was before the batch and write it in their order. The schedule gives each
instruction a *level*, the earliest round it can run in, walking the sequential order once:

- after every instruction whose writes it reads (read after write: the next level);
- with or after an earlier one whose bytes it writes (write after read or write): at the same
  level when both are of one group (the batch reads first and writes in order), else after.

Instructions of one level and one group form a batch; levels run in order, the batches of a
level in any order (two groups of one level share no byte). Instructions without a group
(links, probes) run alone, after everything before them and before everything after. Bytes are
tracked in granules of ``GRANULE`` bytes over each tile's first to last byte (a strided tile's
gaps count as touched): a false conflict costs a batch, never a wrong result. The walk is a loop
over granules compiled with numba (``_levels``; numpy calls per tile took a fused step's 9k
instructions 0.4 s, the loop 10 ms), cached on disk like the timing pass's event loop.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

__all__ = ["BATCH_MAX", "GRANULE", "batch_schedule"]

BATCH_MAX = 64  # instructions per batched call at most: one per core of jalapeno-v1
GRANULE = 32  # bytes per tracked granule (an HBM4 burst)

Span = tuple[int, int, int]  # (array id, first byte, end)


def batch_schedule(groups: Sequence[Hashable | None], reads: Sequence[Sequence[Span]],
                   writes: Sequence[Sequence[Span]], *, batch_max: int = BATCH_MAX) -> list[list[int]]:
    """The calls that run entries 0..n-1 (given in a legal sequential order) with the same result.

    Args:
        groups: per entry, its group (entries of one group can share a call), or None (runs alone,
            after everything before it and before everything after it).
        reads, writes: per entry, the byte ranges (array id, first byte, end) it reads and writes.
        batch_max: entries per call at most.

    Returns:
        Lists of entry indices, one per call, in the order to run them; within a call, in the
        sequential order (the order its writes land in).
    """
    n = len(groups)
    number: dict[Hashable, int] = {}
    group_of = np.array([-1 if g is None else number.setdefault(g, len(number)) for g in groups],
                        dtype=np.int64)
    # Every entry's spans in one flat list (CSR): its reads, then its writes.
    ptr = np.zeros(n + 1, dtype=np.int64)
    flat: list[tuple[int, int, int]] = []
    is_write: list[bool] = []
    for e in range(n):
        r, w = reads[e], writes[e]
        flat.extend(r)
        flat.extend(w)
        is_write.extend([False] * len(r) + [True] * len(w))
        ptr[e + 1] = len(flat)
    spans = np.array(flat, dtype=np.int64).reshape(-1, 3)
    ends: dict[int, int] = {}
    for key in np.unique(spans[:, 0]).tolist() if len(flat) else ():
        ends[key] = int(spans[spans[:, 0] == key, 2].max())
    # Each array's granules at a base of their own in one flat history.
    base = np.zeros(max(ends, default=-1) + 1, dtype=np.int64)
    total = 0
    for key in sorted(ends):
        base[key] = total
        total += -(-ends[key] // GRANULE)
    levels = _levels_loop()(group_of, ptr, spans, np.array(is_write, dtype=np.bool_), base, total, GRANULE)
    order = np.lexsort((np.arange(n), group_of, levels))  # by level, then group, then order
    out: list[list[int]] = []
    for (_level, g), members in itertools.groupby(order.tolist(), key=lambda e: (levels[e], group_of[e])):
        run = list(members)
        if g < 0:
            out.extend([e] for e in run)
            continue
        out.extend(run[i:i + batch_max] for i in range(0, len(run), batch_max))
    return out


def _levels(group_of, ptr, spans, is_write, base, total, granule):  # pragma: no cover (compiled)
    """Each entry's level (see the module docstring), walking the entries in order.

    Per granule of every array: the level and group of its last write, and the highest level
    that read it with its reader's group (-2: readers of several groups at that level); -1:
    never accessed. ``floor``: the level after the last entry without a group.
    """
    w_level = np.full(total, -1, np.int64)
    w_group = np.full(total, -1, np.int64)
    r_level = np.full(total, -1, np.int64)
    r_group = np.full(total, -1, np.int64)
    n = group_of.shape[0]
    levels = np.empty(n, np.int64)
    floor = 0
    top = -1
    for e in range(n):
        g = group_of[e]
        if g < 0:
            level = top + 1
            levels[e] = level
            floor = level + 1
            top = level + 1
            continue
        level = floor
        for s in range(ptr[e], ptr[e + 1]):
            lo, hi = spans[s, 1], spans[s, 2]
            if hi <= lo:
                continue
            b0 = base[spans[s, 0]]
            for i in range(b0 + lo // granule, b0 + (hi + granule - 1) // granule):
                if is_write[s]:  # after a write of another group; at or after a read
                    lv = w_level[i] + (1 if w_group[i] != g else 0)
                    rv = r_level[i] + (1 if r_group[i] != g else 0)
                    if lv > level:
                        level = lv
                    if rv > level:
                        level = rv
                elif w_level[i] + 1 > level:  # after the last write
                    level = w_level[i] + 1
        for s in range(ptr[e], ptr[e + 1]):
            lo, hi = spans[s, 1], spans[s, 2]
            if hi <= lo or is_write[s]:
                continue
            b0 = base[spans[s, 0]]
            for i in range(b0 + lo // granule, b0 + (hi + granule - 1) // granule):
                if r_level[i] == level and r_group[i] != g:
                    r_group[i] = -2
                elif r_level[i] < level:
                    r_group[i] = g
                    r_level[i] = level
        for s in range(ptr[e], ptr[e + 1]):
            lo, hi = spans[s, 1], spans[s, 2]
            if hi <= lo or not is_write[s]:
                continue
            b0 = base[spans[s, 0]]
            for i in range(b0 + lo // granule, b0 + (hi + granule - 1) // granule):
                w_level[i] = level
                w_group[i] = g
        levels[e] = level
        if level > top:
            top = level
    return levels


@functools.cache
def _levels_loop() -> Any:
    """:func:`_levels` compiled (numba loads on first use, not on import)."""
    from jalapeno_emu.compiled import njit_cached

    return njit_cached(_levels)
