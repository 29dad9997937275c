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
gaps count as touched): a false conflict costs a batch, never a wrong result.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

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
    ends: dict[int, int] = {}
    for spans in (*reads, *writes):
        for key, _, hi in spans:
            ends[key] = max(ends.get(key, 0), hi)
    size = {k: -(-hi // GRANULE) for k, hi in ends.items()}
    # Per granule: level and group of the last write; highest level read, and its reader's group
    # (-2: readers of several groups at that level). Levels start at 0; -1: never accessed.
    w_level = {k: np.full(n, -1, np.int64) for k, n in size.items()}
    w_group = {k: np.full(n, -1, np.int64) for k, n in size.items()}
    r_level = {k: np.full(n, -1, np.int64) for k, n in size.items()}
    r_group = {k: np.full(n, -1, np.int64) for k, n in size.items()}
    number: dict[Hashable, int] = {}
    floor = 0  # the level after the last entry without a group
    top = -1  # the highest level given so far
    placed: list[tuple[int, int, int]] = []  # (level, group number or -1, entry)

    def granules(lo: int, hi: int) -> slice:
        return slice(lo // GRANULE, -(-hi // GRANULE))

    for e, group in enumerate(groups):
        if group is None:
            level = top + 1
            placed.append((level, -1, e))
            floor = top = level + 1
            continue
        g = number.setdefault(group, len(number))
        level = floor
        for key, lo, hi in reads[e]:
            if hi > lo:
                level = max(level, int(w_level[key][granules(lo, hi)].max()) + 1)
        for key, lo, hi in writes[e]:
            if hi > lo:
                at = granules(lo, hi)
                other_w = w_group[key][at] != g
                level = max(level, int((w_level[key][at] + other_w).max()),
                            int((r_level[key][at] + (r_group[key][at] != g)).max()))
        for key, lo, hi in reads[e]:
            if hi > lo:
                at = granules(lo, hi)
                lv, gr = r_level[key][at], r_group[key][at]
                gr[(lv == level) & (gr != g)] = -2
                up = lv < level
                gr[up] = g
                lv[up] = level
        for key, lo, hi in writes[e]:
            if hi > lo:
                at = granules(lo, hi)
                w_level[key][at] = level
                w_group[key][at] = g
        placed.append((level, g, e))
        top = max(top, level)
    placed.sort()  # by level, then group, then sequential order
    out: list[list[int]] = []
    for (_level, g), members in itertools.groupby(placed, key=lambda p: p[:2]):
        run = [e for *_, e in members]
        if g < 0:
            out.extend([e] for e in run)
            continue
        out.extend(run[i:i + batch_max] for i in range(0, len(run), batch_max))
    return out
