"""What the checker's messages say (issue 13): buffers by name with the tile's rows and columns,
hints that fit an out-of-bounds tile, capacity with the lines that allocated, the wait a deadlock
is to blame on, and the ordering edge a race is missing."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu import check_program, run_timing
from jalapeno_emu.errors import CapacityExceeded, Deadlock, OutOfBounds, Race, UninitializedRead
from jalapeno_emu.isa import assemble
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import Space

TINY = load_preset("tiny")


def _line(back: int = 0) -> str:
    return f"test_check_messages.py:{sys._getframe(1).f_lineno - back}"


def test_a_race_names_the_buffer_and_the_tiles_rows_and_columns():
    kb = KernelBuilder("names", chip="tiny")
    x_h = kb.hbm("X", (64, 64), "f32")
    kb.sram(0, "pad", (1, 32), "f32")
    rowrecip, out = kb.sram(0, "rowrecip", (64, 64), "f32"), kb.sram(0, "out", (64, 32), "f32")
    c0 = kb.core(0)
    c0.dma[0].load(rowrecip, x_h)
    c0.vpu.exp(out, rowrecip.sub(0, 32, 64, 32))  # no wait for the load
    with pytest.raises(Race) as info:
        check_program(kb.build(), TINY)
    text = str(info.value)
    # the name and the tile inside it first, the address range as the secondary detail
    assert f"rowrecip[0:64, 32:64] (sram[c0]:{rowrecip.offset + 128:#x}.." in text, text
    assert "as rowrecip[0:64, 0:64]" in text, text  # the load's tile, which differs


def test_a_tile_in_no_allocation_says_so():
    kb = KernelBuilder("none", chip="tiny")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    stray = Tile(Space.SRAM, 0, 0x8000, "f32", 8, 64)
    kb.core(0).vpu.exp(buf, stray)
    with pytest.raises(UninitializedRead, match=r"sram\[c0\]:0x8000\.\.0x8800 \(in no allocation\)"):
        check_program(kb.build(), TINY)


def test_an_uninitialised_read_names_the_first_element_never_written():
    kb = KernelBuilder("holes", chip="tiny")
    x_h = kb.hbm("X", (8, 64), "f32")
    buf, out = kb.sram(0, "buf", (8, 64), "f32"), kb.sram(0, "out", (8, 64), "f32")
    s = kb.semaphore("s")
    c0 = kb.core(0)
    c0.dma[0].load(buf.sub(0, 0, 8, 16), x_h.sub(0, 0, 8, 16))  # the first 16 columns only
    c0.dma[0].signal(s)
    c0.vpu.wait(s, 1)
    c0.vpu.exp(out, buf)
    with pytest.raises(UninitializedRead, match=r"buf\[0:8, 0:64\].*the first: buf\[0, 16\]"):
        check_program(kb.build(), TINY)


def _one_load(rows_past: int = 0, *, offset_rows: int = 0) -> KernelBuilder:
    kb = KernelBuilder("loop", chip="tiny")
    x_h = kb.hbm("x", (60, 64), "f32")  # 15 KiB: y starts on the next page, 1 KiB after x ends
    kb.hbm("y", (64, 64), "f32")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    src = Tile(Space.HBM, 0, x_h.offset + offset_rows * 256, "f32", 8 + rows_past, 64)
    kb.core(0).dma[0].load(Tile(Space.SRAM, 0, buf.offset, "f32", 8 + rows_past, 64), src)
    return kb


def test_a_tile_one_row_past_its_tensor_hints_at_the_loop_bound():
    with pytest.raises(OutOfBounds) as info:
        check_program(_one_load(rows_past=1, offset_rows=52).build(), TINY)
    err = info.value
    assert ("ends 256 B past its end ('x' is [60, 64] f32: rows 0..59; the tile covers rows 52..60)"
            in str(err)), str(err)
    assert "loop bound" in err.hint and "allocate" not in err.hint


def test_a_tile_starting_right_after_its_tensor_hints_at_the_loop_bound():
    # One tile too many in a loop over x's rows: it starts one past the end, in the gap before y.
    with pytest.raises(OutOfBounds) as info:
        check_program(_one_load(rows_past=-4, offset_rows=60).build(), TINY)
    err = info.value
    assert "starts right at the end of 'x'" in str(err), str(err)
    assert "loop bound" in err.hint and "allocate" not in err.hint


def test_a_tile_far_from_any_allocation_says_to_allocate():
    kb = KernelBuilder("far", chip="tiny")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    kb.core(0).dma[0].load(buf, Tile(Space.HBM, 0, TINY.hbm.capacity_bytes // 2, "f32", 8, 64))
    with pytest.raises(OutOfBounds, match="covers no allocation") as info:
        check_program(kb.build(), TINY)
    assert "allocate the tensor first" in info.value.hint


def test_a_tile_past_the_end_of_memory_hints_at_the_loop_bound():
    cap = TINY.sram.scratchpad_bytes
    kb = KernelBuilder("edge", chip="tiny")
    x_h = kb.hbm("X", (8, 64), "f32")
    kb.core(0).dma[0].load(Tile(Space.SRAM, 0, cap - 1024, "f32", 8, 64), x_h)
    with pytest.raises(OutOfBounds, match="ends 1,024 B past the end of memory") as info:
        check_program(kb.build(), TINY)
    assert "loop bound" in info.value.hint


def test_capacity_names_every_allocation_past_the_end_with_its_line():
    roomy = TINY.replace(**{"sram.scratchpad_bytes": 4 * TINY.sram.scratchpad_bytes})
    kb = KernelBuilder("big", chip=roomy)
    quarter = TINY.sram.scratchpad_bytes // 4 // 256
    kb.sram(0, "fits", (quarter, 64), "f32")
    kb.sram(0, "a", (4 * quarter, 64), "f32"), (first := _line())
    kb.sram(0, "b", (quarter, 64), "f32"), (second := _line())
    program = dataclasses.replace(kb.build(), preset="tiny")
    with pytest.raises(CapacityExceeded) as info:
        check_program(program, TINY)
    err = info.value
    assert err.source == first
    assert re.search(rf"'a' \({first}\).*'b' \({second}\)", str(err)), str(err)
    assert "fits" not in str(err)


def test_the_builders_capacity_error_names_the_line():
    kb = KernelBuilder("big", chip="tiny")
    with pytest.raises(CapacityExceeded, match="free") as info:
        kb.sram(0, "huge", (1024, 1024), "f32")
    assert info.value.source == _line(1)
    assert _line(2) in str(info.value)


def test_an_assembled_allocation_carries_its_line():
    text = "\n".join([
        ".kernel cap",
        ".alloc hbm X 0x0 4096",
        f".alloc sram[0] huge 0x0 {TINY.sram.scratchpad_bytes + 64}",
        "c0.dma0: dma.load sram[0]:0x0:f32[16,64], hbm:0x0:f32[16,64]",
    ])
    program = assemble(text, source="cap.jasm")
    assert program.allocation("huge").source == "cap.jasm:3"
    with pytest.raises(CapacityExceeded, match=r"'huge' \(cap\.jasm:3\)") as info:
        check_program(program, TINY)
    assert info.value.source == "cap.jasm:3" and "cap.jasm:4" in str(info.value)


def _stuck_in_a_cycle() -> tuple[KernelBuilder, str, str]:
    kb = KernelBuilder("cycle", chip="tiny")
    a, b = kb.semaphore("a"), kb.semaphore("b")
    c0 = kb.core(0)
    c0.mxu.wait(a, 1), (mxu_wait := _line())
    c0.mxu.signal(b)
    c0.vpu.wait(b, 1), (vpu_wait := _line())
    c0.vpu.signal(a)
    c0.dma[0].wait(a, 1)  # a victim of the cycle
    return kb, mxu_wait, vpu_wait


def test_a_deadlock_cycle_is_the_headline_and_its_victims_follow():
    kb, mxu_wait, vpu_wait = _stuck_in_a_cycle()
    with pytest.raises(Deadlock) as info:
        check_program(kb.build(), TINY)
    err = info.value
    text = str(err)
    headline, blocked = text.split("Blocked: ")
    assert "in a cycle" in headline and mxu_wait in headline and vpu_wait in headline
    assert "c0.dma0" not in headline and "c0.dma0" in blocked  # the victim is listed, not blamed
    assert err.engine == "c0.mxu" and err.source == mxu_wait


def test_the_timing_pass_blames_the_hopeless_wait_not_a_victim():
    kb = KernelBuilder("stuck", chip="tiny")
    never, done = kb.semaphore("never"), kb.semaphore("done")
    c0 = kb.core(0)
    c0.dma[0].wait(done, 1)  # a victim, first in engine order
    c0.vpu.wait(never, 1), (hopeless := _line())
    c0.vpu.signal(done)
    with pytest.raises(Deadlock) as info:
        run_timing(kb.build(), TINY)
    err = info.value
    assert err.engine == "c0.vpu" and err.source == hopeless
    assert str(err).index("can never be met") < str(err).index("Blocked: ")
    assert "c0.dma0" in str(err).split("Blocked: ")[1]


def test_a_wait_on_a_semaphore_only_its_own_engine_signals_later_is_hopeless():
    kb = KernelBuilder("own", chip="tiny")
    s = kb.semaphore("s")
    c0 = kb.core(0)
    c0.vpu.wait(s, 1)
    c0.vpu.signal(s)
    with pytest.raises(Deadlock, match=r"can never be met.*the 1 its own engine signals later come"):
        check_program(kb.build(), TINY)


def test_a_reused_slot_names_the_missing_reader_to_reload_edge():
    # load slot; the vector unit reads it (after a wait); the queue reloads the slot waiting only for
    # its own first load: the reload must wait for the reader, not the other way round.
    kb = KernelBuilder("reuse", chip="tiny")
    x_h = kb.hbm("X", (16, 64), "f32")
    slot, out = kb.sram(0, "slot", (8, 64), "f32"), kb.sram(0, "out", (8, 64), "f32")
    loaded = kb.semaphore("loaded")
    q, vpu = kb.core(0).dma[0], kb.core(0).vpu
    q.load(slot, x_h.sub(0, 0, 8, 64))
    q.signal(loaded)
    q.wait(loaded, 1)
    q.load(slot, x_h.sub(8, 0, 8, 64)), (reload := _line())
    vpu.wait(loaded, 1)
    vpu.exp(out, slot), (read := _line())
    with pytest.raises(Race) as info:
        check_program(kb.build(), TINY)
    err = info.value
    assert re.search(rf"nothing orders the dma\.load at {reload} \(c0\.dma0 #3\) after the vec\.unary "
                     rf"at {read} \(c0\.vpu #5\), so it may overwrite 'slot' before that read",
                     str(err)), str(err)
    assert "on c0.vpu after #5 and wait for it on c0.dma0 before #3" in err.hint


def test_two_transfers_of_one_queue_are_said_to_need_a_wait():
    kb = KernelBuilder("q", chip="tiny")
    x_h, y_h = kb.hbm("X", (8, 64), "f32"), kb.hbm("Y", (8, 64), "f32")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    q = kb.core(0).dma[0]
    q.load(buf, x_h), (load := _line())
    q.store(y_h, buf), (store := _line())
    with pytest.raises(Race) as info:
        check_program(kb.build(), TINY)
    err = info.value
    assert f"nothing orders the dma.store at {store} (c0.dma0 #1) after the dma.load at {load}" in str(err)
    assert "before that write lands" in str(err)
    assert "issue order alone does not order them" in err.hint


def test_a_reload_overtaking_the_store_of_its_slot_names_the_store_to_reload_edge():
    # The case: the store of a slot and the reload into it on one queue race; the message
    # must say that the reload is to wait for the store, not call it a race of two transfers.
    kb = KernelBuilder("store-reload", chip="tiny")
    x_h, y_h = kb.hbm("X", (16, 64), "f32"), kb.hbm("Y", (16, 64), "f32")
    slot = kb.sram(0, "slot", (8, 64), "f32")
    loaded, done = kb.semaphore("loaded"), kb.semaphore("done")
    q, vpu = kb.core(0).dma[0], kb.core(0).vpu
    q.load(slot, x_h.sub(0, 0, 8, 64))
    q.signal(loaded)
    vpu.wait(loaded, 1)
    vpu.exp(slot, slot)
    vpu.signal(done)
    q.wait(done, 1)
    q.store(y_h.sub(0, 0, 8, 64), slot), (store := _line())
    q.load(slot, x_h.sub(8, 0, 8, 64)), (reload := _line())
    with pytest.raises(Race) as info:
        check_program(kb.build(), TINY)
    err = info.value
    assert (f"nothing orders the dma.load at {reload} (c0.dma0 #7) after the dma.store at {store} "
            "(c0.dma0 #6), so it may overwrite 'slot' before that read of its old contents") in str(err)
    assert "on c0.dma0 after #6 and wait for it on c0.dma0 before #7" in err.hint
    assert "issue order alone does not order them" in err.hint
