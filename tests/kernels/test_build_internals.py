"""The fast paths of Program building give what the straightforward code they replaced gave.

Each is checked against a reference written the plain way (kept here): the arena's search for
free memory, the choice of on-chip pieces a region is copied from, sub-tiles made without
re-validation, and the builder's per-call-site cache of source lines.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from jalapeno_emu.errors import IllegalInstruction
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import Space
from jalapeno_emu.kernels.compose import Arena, _Segment
from jalapeno_emu.kernels.emit import Piece, _cover


def _find_reference(arena: Arena, segs: list, nbytes: int, align: int, allow_recent: bool):
    """Arena._find as first written: from every segment, walk the adjacent ones until it fits."""
    horizon = arena._releases - 1
    for i in range(len(segs)):
        start = -(-segs[i].start // align) * align
        j = i
        while True:
            s = segs[j]
            if not allow_recent and any(arena._age.get(f, 0) >= horizon for f in s.fences):
                break
            if s.end - start >= nbytes:
                return i, j, start
            if j + 1 >= len(segs) or segs[j + 1].start != s.end:
                break
            j += 1
    return None


def test_arena_find_matches_the_reference() -> None:
    rng = random.Random(7)
    fence_pool = [(k, 1) for k in range(5)]
    for _ in range(3000):
        arena = Arena.__new__(Arena)
        arena._releases = rng.randint(1, 6)
        arena._age = {f: rng.randint(0, arena._releases) for f in fence_pool}
        arena._recent = {}
        segs, pos = [], rng.randint(0, 100)
        for _ in range(rng.randint(0, 12)):
            size = rng.randint(1, 200)
            segs.append(_Segment(pos, pos + size, frozenset(rng.sample(fence_pool, rng.randint(0, 2)))))
            pos += size + rng.choice([0, 0, 0, rng.randint(1, 70)])
        for _ in range(4):
            nbytes, align = rng.randint(1, 400), rng.choice([1, 64, 128])
            for allow_recent in (False, True):
                assert arena._find(segs, nbytes, align, allow_recent) == \
                    _find_reference(arena, segs, nbytes, align, allow_recent)


def _cover_reference(order, r0, c0, rows, cols):
    """TensorRef.sources' choice as first written: a boolean grid of the region."""
    out, need = [], np.zeros((rows, cols), dtype=bool)
    for p in order:
        if p.tile is None:
            continue
        a0, b0 = max(r0, p.r0), max(c0, p.c0)
        a1, b1 = min(r0 + rows, p.r0 + p.rows), min(c0 + cols, p.c0 + p.cols)
        part = need[a0 - r0:a1 - r0, b0 - c0:b1 - c0]
        if part.any():
            continue
        part[...] = True
        out.append((p, a0, b0, a1 - a0, b1 - b0))
        if need.all():
            return out
    return None


def _pieces(rng: random.Random, rows: int, cols: int) -> list[Piece]:
    tile = Tile(Space.SRAM, 0, 0, "bf16", 64, 64)
    kind = rng.choice(["row bands", "column bands", "blocks", "random"])
    pieces = []
    if kind in ("row bands", "column bands"):
        n = rows if kind == "row bands" else cols
        cuts = sorted(rng.sample(range(1, n), min(rng.randint(0, 6), n - 1))) if n > 1 else []
        edges = [0, *cuts, n]
        for a, b in itertools.pairwise(edges):
            band = (a, 0, b - a, cols) if kind == "row bands" else (0, a, rows, b - a)
            pieces.append(Piece(*band, tile))
    elif kind == "blocks":
        pieces = [Piece(a, b, min(7, rows - a), min(9, cols - b), tile)
                  for a in range(0, rows, 7) for b in range(0, cols, 9)]
    else:  # overlapping pieces: more than the emitters make, to exercise the general path
        for _ in range(rng.randint(1, 60)):
            a, b = rng.randrange(rows), rng.randrange(cols)
            pieces.append(Piece(a, b, rng.randint(1, rows - a), rng.randint(1, cols - b), tile))
    pieces += [rng.choice(pieces) for _ in range(rng.randint(0, 5))]  # replicas
    pieces = [Piece(p.r0, p.c0, p.rows, p.cols, None) if rng.random() < 0.05 else p for p in pieces]
    if rng.random() < 0.5:
        rng.shuffle(pieces)
    return pieces


def test_cover_matches_the_grid_reference() -> None:
    rng = random.Random(11)
    covered = 0
    for _ in range(3000):
        rows, cols = rng.randint(1, 40), rng.randint(1, 40)
        pieces = _pieces(rng, rows, cols)
        r0, c0 = rng.randrange(rows), rng.randrange(cols)
        h, w = rng.randint(1, rows - r0), rng.randint(1, cols - c0)
        order = [p for p in pieces if p.overlaps(r0, c0, h, w)]
        want = _cover_reference(order, r0, c0, h, w)
        assert _cover(order, r0, c0, h, w) == want
        covered += want is not None
    assert covered > 1000  # both outcomes were exercised


def test_sub_tiles_equal_validated_tiles_and_keep_their_errors() -> None:
    rng = random.Random(3)
    for dtype in ("bf16", "fp4", "f32", "u8"):
        bits = {"bf16": 16, "fp4": 4, "f32": 32, "u8": 8}[dtype]
        for _ in range(300):
            rows, cols = rng.randint(1, 20), rng.randint(1, 20) * 2
            stride = cols * bits // 8 + rng.choice([0, 64])
            t = Tile(Space.SRAM, rng.randint(0, 3), rng.randint(0, 1000), dtype, rows, cols, stride)
            r, c = rng.randint(0, rows - 1), rng.randint(0, cols // 2 - 1) * 2
            h, w = rng.randint(1, rows - r), rng.randint(1, (cols - c) // 2) * 2
            sub = t.sub(r, c, h, w)
            assert sub == Tile(t.space, t.core, t.offset + r * stride + c * bits // 8, dtype, h, w, stride)
            assert type(sub) is Tile and sub.sub(0, 0, h, w) == sub
    t = Tile(Space.SRAM, 0, 0, "fp4", 4, 8)
    for args, message in (((0, 0, 0, 2), "must be positive"), ((0, 0, 5, 2), "outside"),
                          ((0, 1, 1, 2), "not byte aligned"), ((0, 0, 1, 3), "not whole bytes"),
                          ((-1, 0, 1, 2), "outside")):
        with pytest.raises(IllegalInstruction, match=message):
            t.sub(*args)


def test_sources_name_each_call_site_when_one_line_issues_from_many_places() -> None:
    kb = KernelBuilder("k", chip="tiny")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    vpu = kb.core(0).vpu

    def helper(t: Tile) -> None:
        vpu.exp(t, t)  # one call site, reached from two lines below

    for _ in range(3):
        helper(buf)
        vpu.add(buf, buf, buf)
    helper(buf.sub(0, 0, 4, 64))
    lines = [ins.source for ins in kb.build().instructions]
    here = lines[0].rpartition(":")[0]
    assert here == "test_build_internals.py"
    exp_line, add_line = lines[0], lines[1]
    assert exp_line != add_line
    assert lines == [exp_line, add_line] * 3 + [exp_line]
