"""Hardware loops: ``KernelBuilder.repeat`` records them, every pass reads them as their unrolled
instructions, and the timing pass prices them from their bodies with the same result."""

from __future__ import annotations

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.costs import ProgramFacts
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.errors import IllegalInstruction, InvalidArgumentError, OutOfBounds
from jalapeno_emu.isa.asm import assemble, disassemble
from jalapeno_emu.isa.builder import KernelBuilder, unrolled_loops
from jalapeno_emu.isa.encoding import decode_program, encode_program
from jalapeno_emu.isa.program import Engine, Instruction, Loop, Program, Tile
from jalapeno_emu.isa.table import Space
from jalapeno_emu.kernels.registry import get_kernel


def _stream_kernel(count: int = 8) -> Program:
    """Load row block i of A, scale it on the vector unit, store it to row block i of B."""
    kb = KernelBuilder("stream", "tiny")
    a, b = kb.hbm("A", (8 * count, 64), "f32"), kb.hbm("B", (8 * count, 64), "f32")
    buf = [kb.sram(0, f"buf{s}", (8, 64), "f32") for s in range(2)]
    c = kb.core(0)
    loaded, scaled, stored = kb.semaphore("loaded"), kb.semaphore("scaled"), kb.semaphore("stored")

    def body(i: int) -> None:
        # two slots: one iteration handles rows 16i..16i+15, so the slots repeat
        for s in range(2):
            j = 2 * i + s
            if j >= 2:
                c.dma[0].wait(stored, j - 1)
            c.dma[0].load(buf[s], a.sub(8 * j, 0, 8, 64))
            c.dma[0].signal(loaded)
            c.vpu.wait(loaded, j + 1)
            c.vpu.scale(buf[s], buf[s], 2.0)
            c.vpu.signal(scaled)
            c.dma[1].wait(scaled, j + 1)
            c.dma[1].store(b.sub(8 * j, 0, 8, 64), buf[s])
            c.dma[1].signal(stored)

    with kb.region("stream"):
        kb.repeat(count // 2, body)
    return kb.build()


def _streams(program: Program) -> dict[Engine, list[Instruction]]:
    out: dict[Engine, list[Instruction]] = {}
    for ins in program.instructions:
        out.setdefault(ins.engine, []).append(ins)
    return out


def _same_per_engine(looped: Program, unrolled: Program) -> None:
    assert not unrolled.loops
    assert looped.n_instructions == len(unrolled.instructions)
    assert _streams(looped) == _streams(unrolled)


def test_repeat_records_one_loop_per_engine_for_the_iterations_after_the_first():
    program = _stream_kernel(16)
    assert {loop.engine for loop in program.loops} == {Engine(0, "dma", 0), Engine(0, "vpu"),
                                                        Engine(0, "dma", 1)}
    assert all(loop.count == 7 for loop in program.loops)  # iterations 1..7; 0 is issued as is
    load_loop = next(loop for loop in program.loops if loop.engine == Engine(0, "dma", 0))
    # per iteration: the two loads move 16 rows of 256 B down A, the waits two stores further
    assert dict(load_loop.steps[1]) == {"src": 16 * 256}
    assert dict(load_loop.steps[0]) == {"value": 2}
    assert len(program.items) < program.n_instructions == len(program.instructions)
    with unrolled_loops():
        _same_per_engine(program, _stream_kernel(16))


def test_region_ranges_count_unrolled_instructions():
    program = _stream_kernel(16)
    (name, ranges), = dict(program.meta)["regions"]
    assert name == "stream" and ranges == ((0, program.n_instructions),)


def test_a_looped_program_runs_checks_and_times_as_its_unrolled_form():
    spec = load_preset("tiny")
    looped = _stream_kernel(16)
    with unrolled_loops():
        unrolled = _stream_kernel(16)
    check_program(looped, spec)
    a = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
    got = run_functional(looped, {"A": a}).read("B")
    assert np.array_equal(got, 2 * a)
    tl, tu = run_timing(looped, spec), run_timing(unrolled, spec)
    assert tl.summary() == tu.summary()
    # the same start and end for every instruction, engine by engine
    fl, fu = ProgramFacts(looped), ProgramFacts(unrolled)
    for sl, su in zip(fl.streams, fu.streams, strict=True):
        assert np.array_equal(tl.start_s[sl], tu.start_s[su]) and np.array_equal(tl.end_s[sl], tu.end_s[su])


def test_facts_of_a_looped_program_step_semaphores_and_hbm_offsets():
    looped = _stream_kernel(16)
    with unrolled_loops():
        unrolled = _stream_kernel(16)
    fl, fu = ProgramFacts(looped), ProgramFacts(unrolled)
    assert fl.n == fu.n and fl.engines == fu.engines
    assert np.array_equal(fl.semaphore_ids, fu.semaphore_ids)
    for name in ("kind", "nbytes", "sem", "count", "elements", "core", "engine_index"):
        for sl, su in zip(fl.streams, fu.streams, strict=True):
            assert np.array_equal(getattr(fl, name)[sl], getattr(fu, name)[su]), name

    def hbm(f: ProgramFacts) -> list[list]:
        tile = {int(i): tuple(t) for i, t in zip(f.hbm_idx, f.hbm_tile, strict=True)}
        return [[tile.get(i) for i in s] for s in f.streams]
    assert hbm(fl) == hbm(fu)


def test_a_looped_gemm_kernel_is_its_unrolled_program():
    spec = load_preset("tiny")
    kdef = get_kernel("gemm")
    shape = kdef.shape({"m": 64, "n": 256, "k": 8192})
    build = kdef.build(shape, spec)
    with unrolled_loops():
        plain = kdef.build(shape, spec)
    assert build.program.loops, "the K loop's steady state should be a hardware loop"
    _same_per_engine(build.program, plain.program)
    assert run_timing(build.program, spec).summary() == run_timing(plain.program, spec).summary()
    check_program(build.program, spec)
    inputs = build.make_inputs(0)
    got = run_functional(build.program, inputs).read("y", *build.outputs["y"], space="hbm")
    want = run_functional(plain.program, inputs).read("y", *plain.outputs["y"], space="hbm")
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_assembly_and_binary_carry_a_looped_program_unrolled():
    looped = _stream_kernel(8)

    def unsourced(program: Program) -> dict[Engine, list[tuple]]:
        return {e: [(i.mnemonic, i.args) for i in v] for e, v in _streams(program).items()}
    assert unsourced(assemble(disassemble(looped))) == unsourced(looped)
    assert unsourced(decode_program(encode_program(looped))) == unsourced(looped)


def test_a_body_that_branches_on_the_index_is_refused():
    kb = KernelBuilder("bad", "tiny")
    a = kb.hbm("A", (64, 64), "f32")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    c = kb.core(0)

    def body(i: int) -> None:
        c.dma[0].load(buf, a.sub(8 * i, 0, 8, 64))
        if i == 7:  # the last iteration does something else
            c.dma[0].load(buf, a.sub(0, 0, 8, 64))
    with pytest.raises(InvalidArgumentError, match=r"instructions to c0\.dma0 in iteration 7"):
        kb.repeat(8, body)


def test_a_body_whose_step_is_not_constant_is_refused():
    kb = KernelBuilder("bad", "tiny")
    a = kb.hbm("A", (64 * 64, 64), "f32")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    c = kb.core(0)
    with pytest.raises(InvalidArgumentError, match="not affine in the index"):
        kb.repeat(8, lambda i: c.dma[0].load(buf, a.sub(8 * i * i, 0, 8, 64)))


def test_a_body_that_changes_a_shape_or_allocates_is_refused():
    kb = KernelBuilder("bad", "tiny")
    a = kb.hbm("A", (64, 64), "f32")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    c = kb.core(0)
    with pytest.raises(InvalidArgumentError, match="only tile offsets and integers may change"):
        kb.repeat(6, lambda i: c.dma[0].load(buf.sub(0, 0, 1 + i, 64), a.sub(0, 0, 1 + i, 64)))
    kb2 = KernelBuilder("bad2", "tiny")
    with pytest.raises(InvalidArgumentError, match="allocates"):
        kb2.repeat(6, lambda i: kb2.sram(0, f"t{i}", (8, 64), "f32"))
    with pytest.raises(InvalidArgumentError, match="non-negative integer"):
        kb2.repeat(-1, lambda i: None)


def test_short_repeats_are_issued_unrolled():
    kb = KernelBuilder("short", "tiny")
    s = kb.semaphore("s")
    kb.repeat(3, lambda i: kb.core(0).vpu.signal(s))
    assert kb.repeat(0, lambda i: 1 / 0) == ()
    program = kb.build()
    assert not program.loops and len(program.instructions) == 3


def test_the_checker_sees_every_iteration_of_a_loop():
    kb = KernelBuilder("oob", "tiny")
    a = kb.hbm("A", (64, 64), "f32")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    # rows 8i..8i+7 of A for i up to 8: the last iteration reads past A
    kb.repeat(9, lambda i: kb.core(0).dma[0].load(buf, Tile(Space.HBM, 0, a.offset + 2048 * i, "f32", 8, 64)))
    program = kb.build()
    assert program.loops
    with pytest.raises(OutOfBounds, match="not inside one HBM allocation"):
        check_program(program, load_preset("tiny"))


def test_loop_records_are_validated():
    eng = Engine(0, "vpu")
    sig = Instruction("sem.signal", eng, (("sem", 0), ("count", 1)))
    with pytest.raises(IllegalInstruction, match="at least once"):
        Loop(eng, (sig,), 0, ((),))
    with pytest.raises(IllegalInstruction, match=r"holds a sem.signal for c1\.vpu"):
        Loop(eng, (Instruction("sem.signal", Engine(1, "vpu"), sig.args),), 2, ((),))
    wait = Instruction("sem.wait", eng, (("sem", 0), ("value", 4)))
    with pytest.raises(IllegalInstruction, match="to -2"):
        Loop(eng, (wait,), 4, ((("value", -2),),))
    with pytest.raises(IllegalInstruction, match="no tile or integer operand 'label'"):
        Loop(eng, (wait,), 4, ((("label", 1),),))
    loop = Loop(eng, (wait,), 3, ((("value", 2),),))
    assert [i.arg("value") for i in loop.expand()] == [4, 6, 8]
    program = Program("p", (sig, loop))
    assert program.n_instructions == 4 and len(program.instructions) == 4 and program.loops == (loop,)
