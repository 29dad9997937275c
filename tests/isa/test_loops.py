"""Hardware loops: ``KernelBuilder.repeat`` records them, every pass reads them as their unrolled
instructions, and the timing pass prices them from their bodies with the same result."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.costs import ProgramFacts
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.errors import AssemblyError, IllegalInstruction, InvalidArgumentError, OutOfBounds
from jalapeno_emu.isa.asm import assemble, disassemble
from jalapeno_emu.isa.builder import KernelBuilder, unrolled_loops
from jalapeno_emu.isa.encoding import FORMAT_VERSION, decode_program, encode_program
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


def _unsourced(program: Program) -> list:
    """The items, sources left out (the assembler's are its own lines)."""
    def strip(ins: Instruction) -> tuple:
        return (ins.mnemonic, ins.engine, ins.args)
    return [(item.engine, tuple(map(strip, item.body)), item.count, item.steps) if type(item) is Loop
            else strip(item) for item in program.items]


def test_assembly_and_binary_carry_loops_as_loops():
    looped = _stream_kernel(8)
    text = disassemble(looped)
    assert text.count(".loop 3") == 3 and text.count(".endloop") == 3 and "+=4096" in text
    again = assemble(text)
    assert again.loops and _unsourced(again) == _unsourced(looped)
    data = encode_program(looped)
    assert struct.unpack_from("<H", data, 4)[0] == FORMAT_VERSION == 2
    assert decode_program(data) == looped
    assert encode_program(assemble(text), sources=False) == encode_program(looped, sources=False)
    # a program of 3 loops of 3 iterations is smaller than its 24 instructions written out
    with unrolled_loops():
        assert len(data) < len(encode_program(_stream_kernel(8)))


def test_a_loop_in_assembly_runs_as_written_out():
    body = ("c0.dma0: dma.load sram[0]:0x0:f32[1,64] +=256, hbm:0x0:f32[1,64] +=256\n"
            "c0.dma0: sem.signal 0\n")
    head = ".alloc hbm x 0x0 4096\n.alloc sram[0] buf 0x0 4096\n"
    looped = assemble(head + ".loop 16\n" + body + ".endloop\nc0.vpu: sem.wait 0, 16\n")
    plain = assemble(head + "".join(body.replace("+=256", "").replace("0x0:f32", f"{256 * i:#x}:f32")
                                    for i in range(16)) + "c0.vpu: sem.wait 0, 16\n")
    def ops(program: Program) -> list:
        return [(i.mnemonic, i.args) for i in program.instructions]
    assert ops(looped) == ops(plain)
    spec = load_preset("tiny")
    assert run_timing(looped, spec).summary() == run_timing(plain, spec).summary()


def test_a_loop_of_one_or_two_iterations_assembles():
    for count in (1, 2):
        program = assemble(f".loop {count}\nc0.dma0: sem.signal 0 +=1\n.endloop\n")
        assert [i.arg("sem") for i in program.instructions] == list(range(count))


@pytest.mark.parametrize(("text", "message"), [
    (".loop 2\nc0.dma0: sem.signal 0\n", "has no .endloop"),
    (".endloop\n", ".endloop without a .loop"),
    (".loop 2\n.loop 2\n", "a .loop inside a .loop"),
    (".loop 2\n.endloop\n", "empty loop"),
    (".loop 0\nc0.dma0: sem.signal 0\n.endloop\n", "loop count 0 must be at least 1"),
    (".loop 2\nc0.dma0: sem.signal 0\nc0.vpu: sem.signal 1\n.endloop\n", "a loop runs on one engine"),
    ("c0.vpu: sem.wait 0, 1 +=1\n", r"operand step \(\+=\) outside a loop"),
    (".loop 2\nc0.vpu: vec.clamp sram[0]:0x0:f32[1,64], sram[0]:0x0:f32[1,64], 0.0 +=1, 1.0\n.endloop\n",
     "only tiles .* and integers step"),
    (".loop 4\nc0.vpu: sem.wait 0, 3 +=-1\n.endloop\n",
     r"tiny.jasm:2:.*iteration 3 of the loop: .*value >= 1"),
    (".loop 5\nc0.vpu: sem.wait 0, 3 +=-1\n.endloop\n", "would take operand 'value' to -1"),
])
def test_malformed_loops_in_assembly_name_their_line(text, message):
    with pytest.raises(AssemblyError, match=message):
        assemble(text, source="tiny.jasm")


def test_a_malformed_loop_in_a_binary_names_its_byte():
    program = assemble(".loop 2\nc0.dma0: sem.signal 0 +=1\n.endloop\n")
    data = bytearray(encode_program(program))
    at = len(encode_program(Program(program.name, (), preset=program.preset)))  # the loop's marker
    assert data[at] == 0 and struct.unpack_from("<I", data, at + 1)[0] == 2
    data[at + 1:at + 5] = struct.pack("<I", 0)
    with pytest.raises(AssemblyError, match="a loop of 0 iterations") as exc:
        decode_program(bytes(data))
    assert exc.value.offset == at + 1
    data[at + 1:at + 5] = struct.pack("<I", 2)
    assert decode_program(bytes(data)).items == program.items
    assert struct.unpack_from("<Bq", data, len(data) - 9) == (0, 1)  # operand 0 (sem) steps by 1
    data[-9] = 7  # sem.signal has two operands
    with pytest.raises(AssemblyError, match="has no operand 7 to step") as exc:
        decode_program(bytes(data))
    assert exc.value.offset == len(data) - 9


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


def test_the_looped_assembly_example_computes_exp_and_times_as_written_out():
    from pathlib import Path

    path = Path(__file__).parents[2] / "examples" / "asm" / "stream_loop.jasm"
    program = assemble(path.read_text(), source=path.name)
    assert len(program.loops) == 3 and program.n_instructions == 636
    plain = Program(program.name, program.instructions, program.allocations, program.preset,
                    program.semaphores, program.inits)
    spec = load_preset("tiny")
    check_program(program, spec)
    assert run_timing(program, spec).summary() == run_timing(plain, spec).summary()
    result = run_functional(program)
    x = np.frombuffer(result.read_bytes("x"), np.float32)
    y = np.frombuffer(result.read_bytes("y"), np.float32)
    np.testing.assert_allclose(y, np.exp(x), rtol=1e-6)
    assert np.array_equal(y.view(np.uint32),
                          np.frombuffer(run_functional(plain).read_bytes("y"), np.uint32))


def _rounds_kernel(n: int, steady_from: int) -> Program:
    """``issue_in_rounds`` over n steps of a two-slot load/scale/store stream, steady from
    ``steady_from`` on."""
    from jalapeno_emu.isa.loops import issue_in_rounds

    kb = KernelBuilder("rounds", "tiny")
    a, b = kb.hbm("A", (8 * n, 64), "f32"), kb.hbm("B", (8 * n, 64), "f32")
    buf = [kb.sram(0, f"buf{s}", (8, 64), "f32") for s in range(2)]
    c = kb.core(0)
    loaded, stored = kb.semaphore("loaded"), kb.semaphore("stored")

    def step(j: int) -> None:
        if j >= 2:
            c.dma[0].wait(stored, j - 1)
        c.dma[0].load(buf[j % 2], a.sub(8 * j, 0, 8, 64))
        c.dma[0].signal(loaded)
        c.dma[1].wait(loaded, j + 1)
        c.dma[1].store(b.sub(8 * j, 0, 8, 64), buf[j % 2])
        c.dma[1].signal(stored)

    issue_in_rounds(kb, 0, n, 2, lambda j, _: j >= steady_from, step)
    return kb.build()


@pytest.mark.parametrize("n, steady_from, loops", [(13, 2, True), (13, 6, False), (8, 1, False)])
def test_issue_in_rounds_loops_only_whole_steady_rounds(n, steady_from, loops):
    """Steps 2..11 (five rounds of two) become loops, step 12 follows as it is; a steady run of
    fewer than four rounds (7 steps from step 6 or from step 1) stays unrolled."""
    program = _rounds_kernel(n, steady_from)
    with unrolled_loops():
        plain = _rounds_kernel(n, steady_from)
    assert bool(program.loops) == loops
    if loops:
        assert all(loop.count == 5 for loop in program.loops)  # the run's five rounds
    _same_per_engine(program, plain)


def _fenced_kernel(first_wait: int, extra_first: bool = False) -> tuple[Program, Program]:
    """Six iterations of load-then-signal on a queue first used inside a fenced region (so
    iteration 0 brings the fence's wait), looped and unrolled; iteration 0 waits for ``ticks``
    to reach ``first_wait`` (iteration i: i + 1) and, with ``extra_first``, issues one more load."""
    def build() -> Program:
        kb = KernelBuilder("fenced", "tiny")
        a = kb.hbm("A", (8 * 6, 64), "f32")
        buf = kb.sram(0, "buf", (8, 64), "f32")
        gate, ticks, done = kb.semaphore("gate"), kb.semaphore("ticks"), kb.semaphore("done")
        c = kb.core(0)
        for _ in range(12):
            c.dma[1].signal(ticks)
        c.dma[1].signal(gate)

        def body(i: int) -> None:
            c.dma[0].wait(ticks, first_wait if i == 0 else i + 1)
            if extra_first and i == 0:
                c.dma[0].load(buf, a.sub(0, 0, 8, 64))
            c.dma[0].load(buf, a.sub(8 * i, 0, 8, 64))
            c.dma[0].signal(done)

        with kb.region("fenced", fences=((gate.id, 1),)):
            kb.repeat(6, body)
        return kb.build()

    looped = build()
    with unrolled_loops():
        plain = build()
    return looped, plain


def test_repeat_keeps_a_regions_fences_before_the_loop_and_loops_every_iteration():
    looped, plain = _fenced_kernel(1)
    (loop,) = looped.loops
    assert loop.count == 6 and loop.engine == Engine(0, "dma", 0)
    fence = looped.items[looped.items.index(loop) - 1]
    assert fence.mnemonic == "sem.wait" and fence.engine == loop.engine and fence.source == "fenced:fence"
    _same_per_engine(looped, plain)
    spec = load_preset("tiny")
    assert run_timing(looped, spec).summary() == run_timing(plain, spec).summary()


@pytest.mark.parametrize("first_wait, extra_first", [(9, False), (1, True)])
def test_repeat_issues_a_first_iteration_that_differs_as_it_is(first_wait, extra_first):
    # iteration 0 is not on the others' steps (another wait value, or another instruction):
    # it stays plain and iterations 1..5 are the loop
    looped, plain = _fenced_kernel(first_wait, extra_first)
    (loop,) = looped.loops
    assert loop.count == 5
    _same_per_engine(looped, plain)
