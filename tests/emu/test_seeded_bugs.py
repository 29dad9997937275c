"""Seeded kernel bugs (issue 13): each program below is a small, correct-looking kernel with one
bug of a kind kernel developers make, and the checker must name it the way they need to read it.

For every bug, ``check_program`` must raise the error class of that kind, at the instruction that
is at fault, with its source line (the builder records ``file.py:LINE`` of each call) in the
message, and the message must name the buffer involved by its allocation name (for a deadlock:
the semaphore the hopeless wait is on). The kinds: a write-write race, a read without the wait
for its load, a slot reused before its reader finished, a tile out of bounds, a read of memory
nothing wrote, an allocation over the scratchpad's capacity, and a wait that can never be met.

Cases ``tests/emu/test_check.py`` already has in the same form (a matmul without its wait, fresh
accumulators read in accumulate mode, a tile past its HBM tensor's rows, load-signal-store on one
DMA queue) appear here in other forms, so this suite stands on its own.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu import check_program
from jalapeno_emu.errors import CapacityExceeded, Deadlock, OutOfBounds, ProgramError, Race, UninitializedRead
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.program import Instruction, Program

TINY = load_preset("tiny")
ROWS, COLS = 8, 64  # one f32 tile: 2 KiB


def _line() -> str:
    """``"test_seeded_bugs.py:N"`` for the caller's line: what the builder records as the source of
    an instruction issued on that line, computed independently of the builder."""
    return f"test_seeded_bugs.py:{sys._getframe(1).f_lineno}"


@dataclass(frozen=True)
class Seeded:
    """One seeded bug: the program, the error it must raise, and what its message must name.

    Attributes:
        program: the buggy kernel.
        error: the checker's error class for this kind of bug.
        at: the source (``file:line``) of the instruction at fault (for capacity: of the
            allocation): the error's ``source`` and its message must give it.
        also: for a race, the source of the other access: both sides are at fault (which one
            the error is raised at depends on the order the checker walks), and the message must
            give both lines.
        names: what the message must name: the buffer's allocation name (a deadlock: the semaphore).
    """

    program: Program
    error: type[ProgramError]
    at: str
    also: tuple[str, ...]
    names: str


def _issued(ins: Instruction, line: str) -> str:
    """``line``, after checking that the builder recorded it as ``ins``'s source."""
    assert ins.source == line, (ins.source, line)
    return line


def write_write_race(fixed: bool = False) -> Seeded:
    """The vector unit writes ``out`` while a DMA queue, not waiting for it, loads into ``out``."""
    kb = KernelBuilder("ww", chip="tiny")
    x_h, y_h = kb.hbm("X", (ROWS, COLS), "f32"), kb.hbm("Y", (ROWS, COLS), "f32")
    x, out = kb.sram(0, "x", (ROWS, COLS), "f32"), kb.sram(0, "out", (ROWS, COLS), "f32")
    loaded, done = kb.semaphore("loaded"), kb.semaphore("done")
    c0 = kb.core(0)
    c0.dma[0].load(x, x_h)
    c0.dma[0].signal(loaded)
    c0.vpu.wait(loaded, 1)
    vpu_write = _issued(c0.vpu.exp(out, x), _line())
    c0.vpu.signal(done)
    if fixed:
        c0.dma[1].wait(done, 1)  # the bug: this wait is missing
    dma_write = _issued(c0.dma[1].load(out, y_h), _line())
    return Seeded(kb.build(), Race, dma_write, (vpu_write,), "out")


def read_without_wait(fixed: bool = False) -> Seeded:
    """A DMA queue loads ``buf`` and signals; the vector unit reads ``buf`` without waiting."""
    kb = KernelBuilder("nowait", chip="tiny")
    x_h = kb.hbm("X", (ROWS, COLS), "f32")
    buf, out = kb.sram(0, "buf", (ROWS, COLS), "f32"), kb.sram(0, "out", (ROWS, COLS), "f32")
    loaded = kb.semaphore("loaded")
    c0 = kb.core(0)
    load = _issued(c0.dma[0].load(buf, x_h), _line())
    c0.dma[0].signal(loaded)
    if fixed:
        c0.vpu.wait(loaded, 1)  # the bug: this wait is missing
    read = _issued(c0.vpu.exp(out, buf), _line())
    return Seeded(kb.build(), Race, read, (load,), "buf")


def slot_reused_before_its_reader_finished(fixed: bool = False) -> Seeded:
    """Double buffering over three tiles: the third load goes into slot 0 while the vector unit
    may still be reading tile 0 from it. The queue waits, but for the wrong semaphore (its own
    loads, not the reader's ``consumed``)."""
    kb = KernelBuilder("reuse", chip="tiny")
    x_h = kb.hbm("X", (3 * ROWS, COLS), "f32")
    slots = [kb.sram(0, f"slot{i}", (ROWS, COLS), "f32") for i in range(2)]
    outs = [kb.sram(0, f"out{i}", (ROWS, COLS), "f32") for i in range(3)]
    loaded, consumed = kb.semaphore("loaded"), kb.semaphore("consumed")
    c0 = kb.core(0)
    dma, vpu = c0.dma[0], c0.vpu
    dma.load(slots[0], x_h.sub(0, 0, ROWS, COLS))
    dma.signal(loaded)
    dma.load(slots[1], x_h.sub(ROWS, 0, ROWS, COLS))
    dma.signal(loaded)
    if fixed:
        dma.wait(consumed, 1)
    else:
        dma.wait(loaded, 2)  # the bug: it waits for its own loads, not for slot 0's reader
    reload = _issued(dma.load(slots[0], x_h.sub(2 * ROWS, 0, ROWS, COLS)), _line())
    dma.signal(loaded)
    vpu.wait(loaded, 1)
    first_read = _issued(vpu.exp(outs[0], slots[0]), _line())  # the reader the reload overtakes
    vpu.signal(consumed)
    vpu.wait(loaded, 2)
    vpu.exp(outs[1], slots[1])
    vpu.signal(consumed)
    vpu.wait(loaded, 3)
    vpu.exp(outs[2], slots[0])
    return Seeded(kb.build(), Race, reload, (first_read,), "slot0")


def tile_past_its_tensor(fixed: bool = False) -> Seeded:
    """A load of nine rows from the eight-row tensor ``X``: the tile runs one row past its end."""
    kb = KernelBuilder("oob", chip="tiny")
    x_h = kb.hbm("X", (ROWS, COLS), "f32")
    kb.hbm("Y", (ROWS, COLS), "f32")
    rows = ROWS if fixed else ROWS + 1  # the bug: X has ROWS rows
    buf = kb.sram(0, "buf", (rows, COLS), "f32")
    load = _issued(kb.core(0).dma[0].load(buf, dataclasses.replace(x_h, rows=rows)), _line())
    return Seeded(kb.build(), OutOfBounds, load, (), "X")


def read_of_rows_never_loaded(fixed: bool = False) -> Seeded:
    """Only the first half of ``buf`` is loaded; the vector unit reads all of it."""
    kb = KernelBuilder("uninit", chip="tiny")
    x_h = kb.hbm("X", (ROWS, COLS), "f32")
    buf, out = kb.sram(0, "buf", (ROWS, COLS), "f32"), kb.sram(0, "out", (ROWS, COLS), "f32")
    loaded = kb.semaphore("loaded")
    c0 = kb.core(0)
    loaded_rows = ROWS if fixed else ROWS // 2  # the bug: half of it
    c0.dma[0].load(buf.sub(0, 0, loaded_rows, COLS), x_h.sub(0, 0, loaded_rows, COLS))
    c0.dma[0].signal(loaded)
    c0.vpu.wait(loaded, 1)
    read = _issued(c0.vpu.exp(out, buf), _line())
    return Seeded(kb.build(), UninitializedRead, read, (), "buf")


def scratchpad_over_capacity(fixed: bool = False) -> Seeded:
    """A kernel built for a chip with twice tiny's scratchpad, checked for tiny: its 384 KiB
    buffer ``big`` does not fit tiny's 256 KiB."""
    roomy = TINY.replace(**{"sram.scratchpad_bytes": 2 * TINY.sram.scratchpad_bytes})
    kb = KernelBuilder("big", chip=roomy)
    # The bug: 1.5x tiny's scratchpad (half of it fits).
    rows = (1 if fixed else 3) * TINY.sram.scratchpad_bytes // 2 // (COLS * 4)
    x_h = kb.hbm("X", (rows, COLS), "f32")
    big, allocated = kb.sram(0, "big", (rows, COLS), "f32"), _line()
    load = _issued(kb.core(0).dma[0].load(big, x_h), _line())
    program = dataclasses.replace(kb.build(), preset="tiny")
    # At fault: the allocation (its line), and the message also names the first instruction using it.
    return Seeded(program, CapacityExceeded, allocated, (load,), "big")


def wait_that_can_never_be_met(fixed: bool = False) -> Seeded:
    """The vector unit waits for two signals on ``loaded``, which only one load ever sends; the
    store queue, waiting for the vector unit, is blocked only as a consequence."""
    kb = KernelBuilder("deadlock", chip="tiny")
    x_h, y_h = kb.hbm("X", (ROWS, COLS), "f32"), kb.hbm("Y", (ROWS, COLS), "f32")
    buf, out = kb.sram(0, "buf", (ROWS, COLS), "f32"), kb.sram(0, "out", (ROWS, COLS), "f32")
    loaded, done = kb.semaphore("loaded"), kb.semaphore("done")
    c0 = kb.core(0)
    c0.dma[0].load(buf, x_h)
    c0.dma[0].signal(loaded)
    need = 1 if fixed else 2  # the bug: one signal is all there will be
    hopeless = _issued(c0.vpu.wait(loaded, need), _line())
    c0.vpu.exp(out, buf)
    c0.vpu.signal(done)
    c0.dma[1].wait(done, 1)  # a victim: blocked because the vector unit is
    c0.dma[1].store(y_h, out)
    return Seeded(kb.build(), Deadlock, hopeless, (), "loaded")


CASES: dict[str, Callable[..., Seeded]] = {
    "write-write race": write_write_race,
    "read without its wait": read_without_wait,
    "slot reused before its reader finished": slot_reused_before_its_reader_finished,
    "tile past its tensor": tile_past_its_tensor,
    "read of rows never loaded": read_of_rows_never_loaded,
    "scratchpad over capacity": scratchpad_over_capacity,
    "wait that can never be met": wait_that_can_never_be_met,
}


def _raised(case: Seeded) -> ProgramError:
    """The error ``check_program`` raises for ``case``, asserting its class."""
    with pytest.raises(case.error) as info:
        check_program(case.program, TINY)
    return info.value


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_fixed_kernel_passes(name):
    # Each seeded program differs from a correct one only where it says "the bug": the checker
    # must pass the correct one, or the tests below could pass for the wrong reason.
    check_program(CASES[name](fixed=True).program, TINY)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_error_is_raised_at_the_faulty_line(name):
    case = CASES[name]()
    err = _raised(case)
    assert err.source in (case.at, *case.also), (err.source, case.at, case.also)
    for line in (case.at, *case.also):
        assert line in str(err), (line, str(err))


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_message_names_the_buffer(name):
    case = CASES[name]()
    err = _raised(case)
    # As a whole name: "out" inside "without" does not count.
    assert re.search(rf"(?<![\w.]){re.escape(case.names)}(?![\w])", str(err)), (case.names, str(err))
