"""The assembler and disassembler: the documented example, identity round trips for every table row,
and errors that point at the line and column of the offending token."""

import dataclasses
from pathlib import Path

import pytest

from jalapeno_emu.errors import AssemblyError
from jalapeno_emu.isa import TABLE, assemble, check_legality, disassemble
from jalapeno_emu.isa.asm import format_instruction, format_tile
from jalapeno_emu.isa.program import Allocation, Engine, HbmInit, Instruction, Program, Tile
from jalapeno_emu.isa.table import Space
from tests.isa.forms import legal_forms

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "asm" / "tile_matmul.jasm"

BRIEF = """\
; comment (also '#')
.kernel gemm_tile
.preset tiny
.alloc hbm A 0x0 8192              ; name offset size  (also: .alloc sram[0] buf 0x0 4096)
.sem 3 a_ready                     ; id name
.init A normal bf16 7              ; name zeros|ones|normal dtype [seed]
c0.dma0: dma.load sram[0]:0x0:bf16[128,256], hbm:0x0:bf16[128,256]/8192
c0.mxu:  mxu.matmul acc[0]:0x0:f32[32,64], sram[0]:0x0:fp4[32,64], sram[0]:0x400:fp4[64,64], \
a_scale=sram[0]:0x800:e8m0[32,2], b_scale=sram[0]:0x880:e8m0[2,64], mode=overwrite
c0.vpu:  vec.unary exp, sram[0]:0x0:f32[8,8], sram[0]:0x100:f32[8,8]
c0.vpu:  vec.clamp sram[0]:0x0:f32[8,8], sram[0]:0x100:f32[8,8], -7.0, 7.0
c0.mxu:  sem.signal 3            ; count defaults to 1
c0.vpu:  sem.wait 3, 1
link:    link.send hbm:0x0:f32[1,64], 0, 1
"""


def _unsourced(program: Program) -> Program:
    return dataclasses.replace(program, instructions=tuple(
        dataclasses.replace(i, source="") for i in program.instructions))


def _round_trips(program: Program) -> Program:
    again = assemble(disassemble(program), source="again.jasm")
    assert _unsourced(again) == _unsourced(program)
    return again


def test_the_documented_example_assembles():
    p = assemble(BRIEF, source="gemm.jasm")
    assert (p.name, p.preset, p.semaphores) == ("gemm_tile", "tiny", ((3, "a_ready"),))
    assert p.allocations == (Allocation("A", Space.HBM, 0, 0, 8192),)
    assert p.inits == (HbmInit("A", "normal", "bf16", 7),)
    assert [str(i.engine) for i in p.instructions] == ["c0.dma0", "c0.mxu", "c0.vpu", "c0.vpu", "c0.mxu",
                                                       "c0.vpu", "link"]
    load, matmul, *_, signal, wait, send = p.instructions
    assert load.arg("src") == Tile(Space.HBM, 0, 0, "bf16", 128, 256, 8192)
    assert matmul.arg("b_scale") == Tile(Space.SRAM, 0, 0x880, "e8m0", 2, 64)
    assert matmul.arg("mode") == "overwrite"
    assert signal.args == (("sem", 3), ("count", 1)) and signal.source == "gemm.jasm:11"
    assert wait.args == (("sem", 3), ("value", 1)) and send.engine == Engine(-1, "link")
    _round_trips(p)


def test_the_example_file_assembles_checks_and_round_trips():
    p = assemble(EXAMPLE.read_text(), source=str(EXAMPLE))
    check_legality(p)
    assert p.name == "tile_matmul" and len(p.instructions) == 14
    assert {str(e) for e in p.engines()} == {"c0.dma0", "c0.dma1", "c0.mxu", "c0.vpu"}
    assert {i.name for i in p.inits} == {"A", "A_scale", "B", "B_scale"}
    matmul = next(i for i in p.instructions if i.mnemonic == "mxu.matmul")
    assert matmul.arg("a").dtype == "fp4" and matmul.arg("a_scale") is not None
    _round_trips(p)


@pytest.mark.parametrize("spec", TABLE, ids=lambda s: s.mnemonic)
def test_every_legal_form_of_every_row_disassembles_and_reassembles(spec):
    forms = legal_forms(spec)
    assert len(forms) >= 3
    program = Program(f"all_{spec.mnemonic}", tuple(forms))
    again = _round_trips(program)
    assert [i.source for i in again.instructions] == [f"again.jasm:{n}" for n in range(4, 4 + len(forms))]
    for ins in forms:  # one statement alone, too
        text = format_instruction(ins)
        assert _unsourced(assemble(text)).instructions == (dataclasses.replace(ins, source=""),)


def test_builder_programs_disassemble_to_valid_assembly():
    from jalapeno_emu.isa.builder import KernelBuilder

    kb = KernelBuilder("builder-made (v2)", chip="tiny")
    x = kb.hbm("x", (8, 64), "f32")
    w = kb.hbm_mx("w", (64, 32), "fp4", axis=0)
    buf, sw = kb.sram(1, "buf", (8, 64), "f32"), kb.sram_mx(1, "w", (64, 32), "fp4", 0)
    done, twin = kb.semaphore("loaded"), kb.semaphore("loaded")  # same name twice: printed by id
    c1 = kb.core(1)
    c1.dma[3].load(buf, x)
    c1.dma[3].load(sw.codes, w.codes)
    c1.dma[3].signal(done, 2)
    c1.vpu.wait(done, 2)
    c1.vpu.exp(buf, buf)
    c1.vpu.clamp(buf, buf, -1, 2.5)
    c1.vpu.signal(twin)
    p = kb.build()
    text = disassemble(p)
    assert '.kernel "builder-made (v2)"' in text and ".alloc sram[1] w.scales" in text
    assert "sem.signal 0, count=2" in text and "vec.clamp" in text
    _round_trips(p)


def test_names_that_need_quotes_and_unusual_values_round_trip():
    t = Tile(Space.SRAM, 0, 0, "f32", 1, 8, 4096)  # one row with a stride: str(Tile) would drop it
    assert format_tile(t) == "sram[0]:0x0:f32[1,8]/4096"
    p = Program(
        "k ; not # a comment \"quoted\"\u2028",
        (Instruction("vec.clamp", Engine(0, "vpu"), (("dst", t), ("src", t), ("lo", float("-inf")),
                                                       ("hi", 1e-300))),
         Instruction("sem.wait", Engine(0, "dma", 2), (("sem", 7), ("value", 0x10))),
         Instruction("barrier", Engine(-1, "link"), (("id", 0), ("count", 3)))),
        allocations=(Allocation("a b", Space.SRAM, 0, 0, 64), Allocation("a b", Space.SRAM, 1, 0, 64),
                     Allocation("H", Space.HBM, 0, 2**40, 0)),
        preset="jalapeno-v1",
        semaphores=((7, "sem;7"), (8, "ok")),
        inits=(HbmInit("H", "zeros", "u8", -5), HbmInit("H", "ones", "f32")),
    )
    # Two .init of one allocation are refused in text; drop the second for the text round trip.
    p = dataclasses.replace(p, inits=p.inits[:1])
    text = disassemble(p)
    assert len(text.splitlines()) == 1 + 2 + 3 + 2 + 1 + 3
    _round_trips(p)


def test_operand_spellings():
    p = assemble("""
        .sem 5 go
        c0.vpu: sem.signal go, 3            # positional optional operand
        c0.vpu: sem.signal count=4, sem=0x5 # all by keyword, any order
        c0.mxu: barrier 0x1, 2
        c0.vpu: vec.scale sram[0]:16:f32[2,2], sram[0]:0:f32[2,2], 1e-3
        c0.vpu: vec.clamp sram[0]:0:f32[2,2], sram[0]:0:f32[2,2], -inf, 7
        c0.vpu: vec.quantize sram[0]:0x100:fp4[2,64], sram[0]:0x200:e8m0[2,2], sram[0]:0x300:f32[2,64], rceil
    """, source="s.jasm")
    a, b, barrier, scale, clamp, quant = p.instructions
    assert a.args == (("sem", 5), ("count", 3)) and b.args == (("sem", 5), ("count", 4))
    assert barrier.args == (("id", 1), ("count", 2))
    assert scale.arg("factor") == 1e-3 and clamp.arg("lo") == float("-inf") and clamp.arg("hi") == 7.0
    assert quant.arg("scale_mode") == "rceil" and quant.source == "s.jasm:8"


@pytest.mark.parametrize(
    ("text", "line", "column", "message"),
    [
        ("c0.mxu: mxu.matmull acc[0]:0x0:f32[32,64]", 1, 9, "unknown mnemonic 'mxu.matmull'"),
        ("\n\n  c0.foo: sem.signal 1", 3, 3, "unknown engine 'c0.foo'"),
        ("c0.mxu sem.signal 1", 1, 7, "missing ':' after the engine c0.mxu"),
        ("sem.signal 1", 1, 1, "sem.signal needs an engine in front"),
        ("c0.mxu: sem.signal 1, 2, 3", 1, 26, "sem.signal takes 2 operands (sem, [count=]); got 3"),
        ("c0.vpu: vec.unary exp, sram[0]:0x0:f32[8,8]", 1, 44, "vec.unary is missing operand src"),
        ("c0.vpu: vec.unary exp, sram[0]:0x0:f32[8 8], sram[0]:0:f32[8,8]", 1, 24, "bad tile syntax"),
        ("c0.vpu: vec.unary exp, sram[0]:0x0:f33[8,8], sram[0]:0:f32[8,8]", 1, 36, "unknown dtype 'f33'"),
        ("c0.vpu: vec.unary exp, sram:0x0:f32[8,8], sram[0]:0:f32[8,8]", 1, 24, "sram is per core"),
        ("c0.vpu: vec.unary exp, hbm[0]:0x0:f32[8,8], sram[0]:0:f32[8,8]", 1, 27, "hbm is chip-global"),
        ("c0.vpu: vec.unary exp, dram[0]:0:f32[8,8], sram[0]:0:f32[8,8]", 1, 24, "unknown memory space"),
        ("c0.vpu: vec.unary exp, sram[0]:0x0:f32[8,8], sram[0]:zz:f32[8,8]", 1, 54, "offset must be"),
        ("c0.vpu: vec.unary exq, sram[0]:0:f32[8,8], sram[0]:0:f32[8,8]", 1, 19, "must be one of copy, exp"),
        ("c0.vpu: vec.clamp sram[0]:0:f32[8,8], sram[0]:0:f32[8,8], x, 7.0", 1, 59, "lo must be a number"),
        ("c0.vpu: vec.clamp sram[0]:0:f32[8,8],, sram[0]:0:f32[8,8], 1.0, 7.0", 1, 38, "empty operand"),
        ("c0.vpu: sem.signal 1,", 1, 21, "empty operand"),
        ("c0.vpu: sem.signal 1, cnt=2", 1, 23, "sem.signal has no operand 'cnt'"),
        ("c0.vpu: sem.signal count=2, 1", 1, 29, "positional operand after a name=value operand"),
        ("c0.vpu: sem.signal 1, count=2, count=3", 1, 32, "operand count is given twice"),
        ("c0.vpu: sem.signal -1", 1, 20, "must be a non-negative integer"),
        ("c0.vpu: barrier -0x10, 2", 1, 1, "rule `id >= 0` fails: id=-16"),  # imm may be negative
        ("c0.vpu: sem.wait nope, 1", 1, 18, "unknown semaphore 'nope'"),
        (".sem 1 s\n.sem 2 s\nc0.vpu: sem.wait s, 1", 3, 18, "names more than one id"),
        ("c0.dma0: dma.load sram[0]:0x0:fp4[8,3], hbm:0x0:fp4[8,3]", 1, 19, "is not whole bytes"),
        ("c0.dma0: dma.load sram[0]:0:f32[8,8]/4, hbm:0:f32[8,8]", 1, 19, "rows overlap"),
        # legality failures: at the operand at fault, else at the statement
        ("c0.vpu: vec.unary exp, hbm:0x0:f32[8,8], sram[0]:0:f32[8,8]", 1, 24, "operand dst is in hbm"),
        ("  c0.mxu: vec.unary exp, sram[0]:0:f32[8,8], sram[0]:0:f32[8,8]", 1, 3, "runs on a vpu engine"),
        ("c0.dma0: dma.load sram[1]:0:f32[8,8], hbm:0:f32[8,8]", 1, 1, "rule `dst.core == core` fails"),
        ("c0.vpu: vec.clamp sram[0]:0:f32[8,8], sram[0]:0:f32[8,8], 8.0, 7.0", 1, 1,
         "rule `lo <= hi` fails: lo=8.0, hi=7.0"),
        # directives
        (".alloc hbm A 0 10\n.alloc hbm A 0x10 10", 2, 12, "duplicate allocation name 'A' in hbm"),
        (".allot hbm A 0 10", 1, 1, "unknown directive '.allot'"),
        (".alloc hbm A 0", 1, 1, ".alloc takes SPACE NAME OFFSET SIZE; got 3 fields"),
        (".alloc hbm A 0 1 2", 1, 18, ".alloc takes SPACE NAME OFFSET SIZE; got 5 fields"),
        (".init B normal f32", 1, 7, ".init names 'B', which is not an HBM allocation"),
        (".alloc hbm B 0 4\n.init B gauss f32", 2, 9, "init kind 'gauss'"),
        (".alloc hbm B 0 4\n.init B ones f23", 2, 14, "unknown dtype 'f23'"),
        (".kernel a\n.kernel b", 2, 1, "second .kernel directive"),
        (".kernel 9lives", 1, 9, "kernel name '9lives' is not a name"),
        (".sem 1 a\n.sem 1 b", 2, 6, "semaphore 1 is already named on line 1"),
        (".alloc hbm A 0x10000000000000000 1", 1, 14, "does not fit in 64 bits"),
        ("hello world", 1, 1, "expected `ENGINE: MNEMONIC OPERANDS` or a directive"),
    ],
)
def test_errors_point_at_the_token(text, line, column, message):
    with pytest.raises(AssemblyError) as info:
        assemble(text, source="bad.jasm")
    exc = info.value
    assert (exc.line, exc.column) == (line, column), str(exc)
    assert message in str(exc) and str(exc).startswith(f"bad.jasm:{line}:{column}: ")
    assert "\n" not in str(exc)


def test_hints_suggest_close_matches():
    cases = {
        "c0.mxu: mxu.matmull acc[0]:0:f32[32,64]": "did you mean mxu.matmul or mxu.matmul_t?",
        "c0.vpu: vec.unary exp, sram[0]:0:f16x[8,8], sram[0]:0:f32[8,8]": "did you mean f16?",
        ".alloc hbm A 0 8\n.alloc hbm A 8 8": "first allocated on line 1",
        "c0.vpu: sem.signal 1, cout=2": "did you mean count?",
        ".sem 0 ready\nc0.vpu: sem.wait raedy, 1": "did you mean ready?",
        "c0.mxu: vec.unary exp, sram[0]:0:f32[8,8], sram[0]:0:f32[8,8]": "issue it to c0.vpu",
    }
    for text, hint in cases.items():
        with pytest.raises(AssemblyError) as info:
            assemble(text)
        assert info.value.hint == hint, text


def test_docstring_examples_run():
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module("jalapeno_emu.isa.asm"))
    assert result.attempted > 0 and result.failed == 0


def test_comments_blank_lines_and_defaults():
    p = assemble('; only a comment\n\n   # another\n.alloc hbm "x;y#z" 0 8 ; trailing\n', source="dir/k.jasm")
    assert p.name == "k" and p.preset == "tiny" and p.instructions == ()
    assert p.allocations == (Allocation("x;y#z", Space.HBM, 0, 0, 8),)
    assert assemble("").name == "kernel"


def test_a_byte_order_mark_is_not_part_of_the_first_line():
    # Windows editors save UTF-8 with a BOM; before, line 1 read as "\ufeff.kernel" and failed.
    text = ".kernel bom\nc0.mxu: sem.signal 3\n"
    with_bom = assemble("\ufeff" + text)
    assert with_bom.name == assemble(text).name == "bom"
    assert with_bom.instructions == assemble(text).instructions
