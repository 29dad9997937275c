"""The indexed checker answers exactly what the straightforward one (tests/emu/check_reference.py)
answers: on every registered kernel, and on copies of them broken on purpose (a wait dropped or
satisfied by fewer signals), the same programs pass with the same order, and the same first
race (or other error) is reported with the same message, instruction and addresses."""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from collections.abc import Callable

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program, tiles_overlap
from jalapeno_emu.emu.clocks import later_signals
from jalapeno_emu.emu.schedule import sequential_order
from jalapeno_emu.errors import EmuError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.program import Engine, Program, Tile
from jalapeno_emu.isa.table import Space
from jalapeno_emu.kernels import all_kernels, get_kernel
from tests.emu.check_reference import (
    reference_check_program,
    reference_later_signals,
    reference_tiles_overlap,
)

TINY = load_preset("tiny")

# Shapes beyond each kernel's (small) default that take other code paths: several tiles per
# dimension, split KV, paged caches, sliding windows.
_EXTRA_SHAPES: list[tuple[str, dict]] = [
    ("gemm", {"m": 256, "n": 512, "k": 1024}),
    ("gemm", {"m": 64, "n": 256, "k": 512, "bias": False, "act_fmt": "bf16"}),
    ("attention-decode", {"batch": 1, "kv_heads": 1, "q_heads": 2, "kv_splits": 2, "context": 512}),
    ("attention-decode", {"page_size": 64, "window": 128}),
    ("attention-prefill", {"seq": 128, "prior": 64, "capacity": 256}),
    ("mla-decode", {"batch": 1, "kv_splits": 2, "context": 256}),
    ("moe", {"tokens": 16, "experts": 8, "top_k": 2, "shared_experts": 1}),
]


def _cases() -> list[tuple[str, dict]]:
    return [(k.name, {}) for k in all_kernels()] + _EXTRA_SHAPES


def _outcome(fn, program: Program) -> tuple:
    """("ok", order) or (error class, message, every attribute of the error)."""
    try:
        return ("ok", fn(program, TINY))
    except EmuError as e:
        return (type(e).__name__, str(e), sorted(vars(e).items()))


def _broken_copies(program: Program, rng: random.Random, n: int) -> list[Program]:
    """Up to ``n`` copies with one wait removed and up to ``n`` with one wait lowered to 1."""
    waits = [i for i, ins in enumerate(program.instructions) if ins.mnemonic == "sem.wait"]
    out = []
    for i in rng.sample(waits, min(n, len(waits))):
        out.append(dataclasses.replace(
            program, instructions=program.instructions[:i] + program.instructions[i + 1:]))
    high = [i for i in waits if program.instructions[i].arg("value") > 1]
    for i in rng.sample(high, min(n, len(high))):
        ins = program.instructions[i]
        args = tuple((k, 1 if k == "value" else v) for k, v in ins.args)
        lowered = dataclasses.replace(ins, args=args)
        out.append(dataclasses.replace(
            program, instructions=(*program.instructions[:i], lowered, *program.instructions[i + 1:])))
    return out


def _case_id(value: str | dict) -> str:
    return value if isinstance(value, str) else ",".join(f"{k}={v}" for k, v in value.items())


@pytest.mark.parametrize(("name", "shape"), _cases(), ids=_case_id)
def test_checker_matches_the_reference(name, shape):
    kdef = get_kernel(name)
    program = kdef.build(kdef.shape(shape), TINY).program
    want = _outcome(reference_check_program, program)
    assert want[0] == "ok", want  # the registered kernels are correct
    assert _outcome(check_program, program) == want
    order = sequential_order(program)
    sem_signals: dict[int, dict[Engine, int]] = defaultdict(lambda: defaultdict(int))
    for ins in program.instructions:
        if ins.mnemonic == "sem.signal":
            sem_signals[ins.arg("sem")][ins.engine] += ins.arg("count")
    assert (later_signals(program, order, sem_signals)
            == reference_later_signals(program, order, sem_signals))
    rng = random.Random(f"{name}{sorted(shape.items())}")
    for broken in _broken_copies(program, rng, 4):
        assert _outcome(check_program, broken) == _outcome(reference_check_program, broken)


def test_some_broken_copies_race():
    # The comparison above is only as good as the errors it meets: make sure races are among them.
    kdef = get_kernel("gemm")
    program = kdef.build(kdef.shape({"m": 256, "n": 512, "k": 1024}), TINY).program
    kinds = {_outcome(check_program, p)[0]
             for p in _broken_copies(program, random.Random(0), 8)}
    assert "Race" in kinds


def test_tile_overlap_shortcut_matches_the_general_solve():
    rng = random.Random(1)
    for _ in range(4000):
        tiles = []
        for _ in range(2):
            rows, row_bytes = rng.randint(1, 6), rng.randint(1, 12)
            stride = rng.choice([row_bytes, row_bytes + rng.randint(0, 20)])
            tiles.append(Tile(Space.SRAM, 0, rng.randint(0, 60), "u8", rows, row_bytes, stride))
        if rng.random() < 0.5:  # same stride, the shortcut's case
            b = tiles[1]
            stride = max(tiles[0].stride, b.row_bytes)
            tiles[0] = Tile(Space.SRAM, 0, tiles[0].offset, "u8", tiles[0].rows, tiles[0].cols, stride)
            tiles[1] = Tile(Space.SRAM, 0, b.offset, "u8", b.rows, b.cols, stride)
        a, b = tiles
        assert tiles_overlap(a, b) == reference_tiles_overlap(a, b), (a, b)
        assert tiles_overlap(b, a) == reference_tiles_overlap(a, b), (a, b)


def _random_program(rng: random.Random, skip: float, prefill: int = 0) -> Program:
    """Transfers between random strided and contiguous tiles of a small SRAM buffer per core and
    one HBM tensor on two DMA queues of each core, and vector copies within each buffer, in
    batches: before each batch the engine waits for every engine's signals so far (or some of
    them), each wait left out with probability ``skip`` (the races, at any depth); after each
    access it signals its own semaphore. Issue order is a legal schedule: nothing deadlocks.
    ``prefill``: that many loads of large tiles into each core's buffer first."""
    kb = KernelBuilder("fuzz", chip="tiny")
    hbm = kb.hbm("H", (8, 32), "f32")  # 128-byte rows
    sram = [kb.sram(c, "S", (8, 32), "f32") for c in (0, 1)]
    engines = [h for c in (0, 1) for h in (kb.core(c).dma[0], kb.core(c).dma[1], kb.core(c).vpu)]
    sems = [kb.semaphore(f"e{i}") for i in range(len(engines))]
    signalled = [0] * len(engines)

    def fresh(base: Tile, rows: int, cols: int) -> tuple[int, int]:
        stride = max(4 * cols, rng.choice([4 * cols, 16, 32, 64, 128, 128]))
        last = (8 * 128 - ((rows - 1) * stride + 4 * cols)) // 4
        offset = 4 * rng.randrange(0, last + 1)
        if rng.random() < 0.5:  # often on a 16-byte grid, where tiles meet edge to edge
            offset = offset // 16 * 16
        return offset, stride

    pool: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)

    def tile(base: Tile, rows: int, cols: int) -> Tile:
        # Mostly geometries seen before, so that accesses repeat and cover one another.
        seen = pool[(rows, cols)]
        if not seen or rng.random() < 0.3:
            seen.append(fresh(base, rows, cols))
        offset, stride = rng.choice(seen)
        return Tile(base.space, base.core, base.offset + offset, "f32", rows, cols, stride)

    for i in range(2 * prefill):  # loads first, so that reads of unwritten bytes come late
        e = 3 * (i % 2)  # each core's dma0, one load after the other
        q = engines[e]
        if signalled[e]:
            q.wait(sems[e], signalled[e])
        rows, cols = rng.choice([(8, 32), (4, 32), (8, 16), (5, 20), (8, 31)])
        q.load(tile(sram[q.engine.core], rows, cols), tile(hbm, rows, cols))
        q.signal(sems[e])
        signalled[e] += 1
    for _ in range(rng.randint(5, 40)):
        i = rng.randrange(len(engines))
        eng = engines[i]
        for j, count in enumerate(signalled):
            if count and rng.random() >= skip:
                # now and then only an earlier count: ordered after some of j's work, not all
                eng.wait(sems[j], count if rng.random() < 0.7 else rng.randint(1, count))
        # Now and then two transfers, unordered on a queue, each followed by a signal: others
        # may wait for the first and not the second.
        for k in range(1 if rng.random() < 0.8 else 2):
            if k:
                eng.signal(sems[i])
                signalled[i] += 1
            rows, cols = rng.choice([(1, 1), (1, 4), (1, 5), (1, 13), (1, 75), (2, 4), (4, 2),
                                     (3, 6), (8, 4), (2, 25), (8, 32), (4, 1)])
            mem = sram[eng.engine.core]
            if eng.engine.unit == "vpu":
                eng.copy(tile(mem, rows, cols), tile(mem, rows, cols))
            elif rng.random() < 0.6:
                eng.load(tile(mem, rows, cols), tile(hbm, rows, cols))
            else:
                eng.store(tile(hbm, rows, cols), tile(mem, rows, cols))
        eng.signal(sems[i])
        signalled[i] += 1
    return kb.build()


def test_checker_matches_the_reference_on_random_programs():
    rng = random.Random(7)
    kinds = []
    for n in range(200):
        uninit = n % 2 == 1  # after loads of most of the buffers: reads of holes, at any depth
        program = _random_program(rng, skip=(0.0, 0.02, 0.1)[n % 3], prefill=3 if uninit else 0)
        want = _outcome(lambda p, s, u=uninit: reference_check_program(p, s, check_uninitialized=u),
                        program)
        got = _outcome(lambda p, s, u=uninit: check_program(p, s, check_uninitialized=u), program)
        assert got == want
        kinds.append(got[0])
    assert {"ok", "Race", "UninitializedRead"} <= set(kinds)


def _race_named(program: Program) -> str:
    """The earlier instruction a Race names; the reference must name the same."""
    want = _outcome(lambda p, s: reference_check_program(p, s, check_uninitialized=False), program)
    got = _outcome(lambda p, s: check_program(p, s, check_uninitialized=False), program)
    assert got == want and got[0] == "Race", got
    return got[1].split(", which ")[1].split(" on ")[0]


def _reads_of_t() -> tuple[KernelBuilder, Callable[[int], Tile], Tile, Tile]:
    kb = KernelBuilder("prune", chip="tiny")
    h = kb.hbm("H", (6, 64), "f32")
    t, u = kb.sram(0, "T", (1, 64), "f32"), kb.sram(0, "U", (1, 64), "f32")
    return kb, lambda i: h.sub(i, 0, 1, 64), t, u


def test_a_covered_access_is_dropped_so_the_race_names_the_next_one():
    # Two reads of T on one queue (#0, #2); a read on another queue after the first only (#5)
    # drops #0; the unordered write (#6) races #2 first.
    kb, row, t, u = _reads_of_t()
    s = kb.semaphore("s")
    c0 = kb.core(0)
    c0.dma[0].store(row(0), t)
    c0.dma[0].signal(s)
    c0.dma[0].store(row(1), t)
    c0.dma[0].signal(s)
    c0.dma[1].wait(s, 1)
    c0.dma[1].store(row(2), t)
    c0.vpu.copy(t, u)
    assert _race_named(kb.build()) == "instruction #2"


def test_the_race_named_is_the_earliest_across_engines():
    # Reads of T: b1 and b2 on dma1, a1 and a2 on dma0, interleaved b1 a1 b2 a2 but unordered
    # (waits that another engine could satisfy order nothing); Y (vpu) reads T after b1 only and
    # drops it; Z writes T after Y: unordered with a1, b2 and a2, it races a1 first, though
    # dma1's run was met first and dma0's ends later.
    kb, row, t, u = _reads_of_t()
    st, s1, sk, sh, g, sv = (kb.semaphore(n) for n in ("t", "s1", "k", "h", "g", "v"))
    c0 = kb.core(0)
    q0, q1, q2, vpu = c0.dma[0], c0.dma[1], c0.dma[2], c0.vpu
    q1.signal(st)
    q1.store(row(0), t)  # b1, #1
    q1.signal(s1)
    q1.wait(sk, 1)  # dma0 or dma2 may satisfy it
    q1.store(row(1), t)  # b2, #4
    q1.signal(sh)
    q1.signal(g)
    q0.wait(st, 1)
    q0.store(row(2), t)  # a1, #8
    q0.signal(sk)
    q0.wait(sh, 1)  # dma1 or dma2 may satisfy it
    q0.store(row(3), t)  # a2
    q0.signal(g)
    vpu.wait(s1, 1)
    vpu.wait(g, 1)  # dma0 or dma1 may satisfy it
    vpu.copy(u, t)  # Y
    vpu.signal(sv)
    q2.wait(sv, 1)
    q2.load(t, row(4))  # Z
    q2.signal(sk)
    q2.signal(sh)
    assert _race_named(kb.build()) == "instruction #8"


def test_one_row_tiles_of_any_stride_are_checked_like_the_reference():
    # A one-row tile's stride means nothing and may be 0 (the assembler and the binary format
    # take it): it must not be divided by.
    kb = KernelBuilder("stride0", chip="tiny")
    h = kb.hbm("H", (4, 64), "f32")
    kb.sram(0, "S", (4, 64), "f32")
    q = kb.core(0).dma[0]
    q.load(Tile(Space.SRAM, 0, 0, "f32", 1, 64, 0), Tile(Space.HBM, 0, h.offset, "f32", 1, 64, 0))
    q.load(Tile(Space.SRAM, 0, 0, "f32", 2, 32, 256), Tile(Space.HBM, 0, h.offset, "f32", 2, 32, 256))
    assert _race_named(kb.build()) == "instruction #0"
