"""The checker: each class of illegal program raises its own error with instruction and source."""

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program, tiles_overlap
from jalapeno_emu.errors import CapacityExceeded, Deadlock, OutOfBounds, Race, UninitializedRead
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import Space
from tests.emu.programs import build_gemm, matmul_tile_program

TINY = load_preset("tiny")


def test_well_formed_programs_pass():
    assert len(check_program(matmul_tile_program(), TINY)) == 13
    for double in (False, True):
        check_program(build_gemm(256, 256, 1024, double_buffer=double), TINY)


def test_missing_wait_is_a_race_naming_both_instructions():
    with pytest.raises(Race) as err:
        check_program(matmul_tile_program(race=True), TINY)
    e = err.value
    assert e.index == 5 and e.engine == "c0.mxu" and "programs.py" in e.source
    assert "instruction #0 on c0.dma0" in str(e) and e.hint


def test_accumulating_into_fresh_accumulators_is_an_uninitialized_read():
    with pytest.raises(UninitializedRead, match="mode=overwrite"):
        check_program(matmul_tile_program(uninit=True), TINY)


def test_unsatisfiable_wait_is_a_deadlock_saying_who_waits_on_whom():
    with pytest.raises(Deadlock) as err:
        check_program(matmul_tile_program(wait_value=2), TINY)
    assert "c0.mxu" in str(err.value) and "(loaded) >= 2" in str(err.value)


def _load_then_store(sync: str) -> KernelBuilder:
    kb = KernelBuilder("q", chip="tiny")
    x_h, y_h = kb.hbm("X", (8, 64), "f32"), kb.hbm("Y", (8, 64), "f32")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    s = kb.semaphore("loaded")
    q = kb.core(0).dma[0]
    q.load(buf, x_h)
    if sync in ("signal", "signal+wait"):
        q.signal(s)
    if sync == "signal+wait":
        q.wait(s, 1)
    q.store(y_h, buf)
    return kb


@pytest.mark.parametrize(("sync", "racy"), [("none", True), ("signal", True), ("signal+wait", False)])
def test_dmas_on_one_queue_are_ordered_only_by_a_wait(sync, racy):
    # A queue keeps several transfers in flight and does not stop at a signal, so the store may
    # overtake the load unless the queue waits for the signal that covers the load.
    prog = _load_then_store(sync).build()
    if racy:
        with pytest.raises(Race, match=r"instruction #0 on c0\.dma0"):
            check_program(prog, TINY)
    else:
        check_program(prog, TINY)


def test_a_later_signal_does_not_order_an_earlier_wait():
    kb = KernelBuilder("late", chip="tiny")
    x_h = kb.hbm("X", (8, 64), "f32")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    out = kb.sram(0, "out", (8, 64), "f32")
    s = kb.semaphore("s")
    c0 = kb.core(0)
    c0.mxu.signal(s)  # an unrelated first signal satisfies the wait
    c0.dma[0].load(buf, x_h)
    c0.dma[0].signal(s)
    c0.vpu.wait(s, 1)
    c0.vpu.exp(out, buf)  # may run before the load: a race
    with pytest.raises(Race):
        check_program(kb.build(), TINY)


def test_sram_allocation_over_capacity():
    kb = KernelBuilder("big", chip="tiny")
    with pytest.raises(CapacityExceeded, match="free"):
        kb.sram(0, "huge", (1024, 1024), "f32")


def test_tile_outside_hbm_allocation_is_out_of_bounds():
    kb = KernelBuilder("oob", chip="tiny")
    x_h = kb.hbm("X", (8, 64), "f32")
    buf = kb.sram(0, "buf", (16, 64), "f32")
    outside = Tile(Space.HBM, 0, x_h.offset, "f32", 16, 64)
    kb.core(0).dma[0].load(buf, outside)
    with pytest.raises(OutOfBounds, match="not inside one HBM allocation"):
        check_program(kb.build(), TINY)


def test_strided_tiles_overlap_exactly():
    m = Tile(Space.SRAM, 0, 0, "f32", 8, 64)  # 8 rows of 256 B
    left = Tile(Space.SRAM, 0, 0, "f32", 8, 32, 256)
    right = Tile(Space.SRAM, 0, 128, "f32", 8, 32, 256)
    assert not tiles_overlap(left, right)
    assert tiles_overlap(left, m) and tiles_overlap(right, m)
    assert tiles_overlap(right, Tile(Space.SRAM, 0, 1020, "f32", 1, 2))
    assert not tiles_overlap(right, Tile(Space.SRAM, 0, 0, "f32", 1, 32))
    assert not tiles_overlap(left, Tile(Space.SRAM, 1, 0, "f32", 8, 32, 256))


def _reused_semaphore(waiter: str, *, extra: str = "") -> KernelBuilder:
    """A DMA queue loads ``buf`` and signals s; ``waiter`` waits for s >= 1, uses ``buf``, then
    signals on the same semaphore (issue 13). ``extra``: "early" adds an unrelated signal on s
    that can satisfy the wait without the load; "chain" routes the waiter's signal through
    another engine (wait t, signal s), so it is after the wait only transitively."""
    kb = KernelBuilder("reuse", chip="tiny")
    x_h, y_h = kb.hbm("X", (8, 64), "f32"), kb.hbm("Y", (8, 64), "f32")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    s, t = kb.semaphore("s"), kb.semaphore("t")
    c0 = kb.core(0)
    if extra == "early":
        c0.mxu.signal(s)
    c0.dma[0].load(buf, x_h)
    c0.dma[0].signal(s)
    eng = c0.vpu if waiter == "vpu" else c0.dma[1]
    eng.wait(s, 1)
    if waiter == "vpu":
        eng.exp(buf, buf)
    else:
        eng.store(y_h, buf)
    if extra == "chain":
        eng.signal(t)
        c0.mxu.wait(t, 1)
        c0.mxu.signal(s)
    else:
        eng.signal(s)
    return kb


@pytest.mark.parametrize("waiter", ["vpu", "dma"])
@pytest.mark.parametrize("extra", ["", "chain"])
def test_signals_after_a_wait_do_not_count_towards_it(waiter, extra):
    # The waiter's own signal (directly, or through another engine) comes after its wait, so only
    # the load's signal can satisfy it: the use is ordered after the load.
    check_program(_reused_semaphore(waiter, extra=extra).build(), TINY)


@pytest.mark.parametrize("waiter", ["vpu", "dma"])
def test_a_wait_satisfiable_without_the_load_still_races(waiter):
    with pytest.raises(Race, match=r"instruction #1 on c0\.dma0"):
        check_program(_reused_semaphore(waiter, extra="early").build(), TINY)
