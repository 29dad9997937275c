"""The binary format: identity round trips for every table row and whole Programs; malformed input
is always an AssemblyError naming the byte offset."""

import dataclasses
import random
import struct
from pathlib import Path

import pytest

from jalapeno_emu.errors import AssemblyError, IllegalInstruction, InvalidArgumentError
from jalapeno_emu.isa import TABLE, assemble, decode, decode_program, encode, encode_program
from jalapeno_emu.isa.encoding import MAGIC
from jalapeno_emu.isa.program import Allocation, Engine, HbmInit, Instruction, Program, Tile
from jalapeno_emu.isa.table import Space
from tests.isa.forms import encodable_forms

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "asm" / "tile_matmul.jasm"


@pytest.mark.parametrize("spec", TABLE, ids=lambda s: s.mnemonic)
def test_every_form_of_every_row_round_trips(spec):
    forms = encodable_forms(spec)
    assert len(forms) > 5
    for ins in forms:
        data = encode(ins)
        assert decode(data) == (ins, len(data))
        assert data[0] == spec.opcode


def test_instructions_decode_back_to_back_from_offsets():
    forms = [f for s in TABLE for f in encodable_forms(s)[:2]]
    blob = b"".join(encode(i) for i in forms)
    pos, out = 0, []
    while pos < len(blob):
        ins, pos = decode(blob, pos)
        out.append(ins)
    assert out == forms


def test_encoding_is_canonical_for_omitted_optional_operands():
    short = Instruction("sem.signal", Engine(0, "mxu"), (("sem", 4),), "k.py:1")
    ins, _ = decode(encode(short))
    assert ins.args == (("sem", 4), ("count", 1)) and ins.source == "k.py:1"


def _program() -> Program:
    return dataclasses.replace(
        assemble(EXAMPLE.read_text(), source="tile_matmul.jasm"),
        name="Ünïcode kernel ; #1",
        semaphores=((0, "inputs_ready"), (1, "acc ready"), (2, "")),
        inits=(HbmInit("A", "normal", "fp4", -3), HbmInit("A_scale", "ones", "e8m0")),
    )


def test_whole_program_round_trip():
    program = _program()
    data = encode_program(program)
    assert data[:4] == MAGIC and struct.unpack_from("<H", data, 4)[0] == 1  # no loops: version 1
    assert decode_program(data) == program
    empty = Program("empty", ())
    assert decode_program(encode_program(empty)) == empty


def test_builder_program_round_trip():
    from jalapeno_emu.isa.builder import KernelBuilder

    kb = KernelBuilder("builder_tile", chip="tiny")
    a, b = kb.hbm_mx("A", (32, 64), "fp4", axis=1), kb.hbm_mx("B", (64, 32), "fp8e4", axis=0)
    sa, sb = kb.sram_mx(0, "a", (32, 64), "fp4", 1), kb.sram_mx(0, "b", (64, 32), "fp8e4", 0)
    acc, done = kb.acc(0, "acc", (32, 32)), kb.semaphore("done")
    c0 = kb.core(0)
    for src, dst in ((a, sa), (b, sb)):
        c0.dma[2].load(dst.codes, src.codes)
        c0.dma[2].load(dst.scales, src.scales)
    c0.dma[2].signal(done)
    c0.mxu.wait(done, 1)
    c0.mxu.matmul_mx(acc, sa, sb, mode="overwrite")
    program = kb.build()
    decoded = decode_program(encode_program(program))
    assert decoded == program and decoded.meta == ()  # meta is not part of the format


def test_encode_refuses_what_the_format_cannot_hold():
    sig = Instruction("sem.signal", Engine(0, "mxu"), (("sem", 1), ("count", 2**64)))
    with pytest.raises(IllegalInstruction, match="must be a signed 64-bit integer"):
        encode(sig)
    with pytest.raises(IllegalInstruction, match="unknown mnemonic"):
        encode(Instruction("nop", Engine(0, "mxu"), ()))
    with pytest.raises(IllegalInstruction, match="the link engine is chip-level"):
        encode(dataclasses.replace(sig, engine=Engine(0, "link"), args=(("sem", 1),)))
    bad = Program("p", (Instruction("sem.signal", Engine(0, "mxu"), (("sem", 1),)), sig))
    with pytest.raises(IllegalInstruction, match="instruction #1"):
        encode_program(bad)
    with pytest.raises(InvalidArgumentError, match="cannot hold"):
        encode_program(Program("p", (), inits=(HbmInit("A", "ones", "f64"),)))
    with pytest.raises(InvalidArgumentError, match="cannot hold"):
        encode_program(Program("p", (), allocations=(Allocation("A", Space.HBM, 0, -1, 8),)))


def _err(data: bytes) -> AssemblyError:
    with pytest.raises(AssemblyError) as info:
        decode_program(data, source="k.bin")
    exc = info.value
    assert f"byte {exc.offset}:" in str(exc) and str(exc).startswith("k.bin: ")
    return exc


def _first_instruction_offset(data: bytes, program: Program) -> int:
    return len(data) - sum(len(encode(i)) for i in program.instructions)


def test_bad_magic_version_and_trailing_garbage():
    good = encode_program(_program())
    exc = _err(b"; assembly\nc0.mxu: sem.signal 1\n")
    assert exc.offset == 0 and "not a jalapeno-emu binary" in str(exc) and "jalapeno-emu asm" in exc.hint
    assert _err(b"\x00\x01\x02").hint is None
    assert _err(b"").offset == 0
    exc = _err(MAGIC + struct.pack("<H", 99) + good[6:])
    assert exc.offset == 4 and "format version 99" in str(exc)
    exc = _err(good + b"\x00junk")
    assert exc.offset == len(good) and "5 bytes of trailing garbage" in str(exc)


def test_every_truncation_is_an_assembly_error_inside_the_input():
    data = encode_program(_program())
    for n in range(len(data)):
        exc = _err(data[:n])
        assert 0 <= exc.offset <= n
        if n >= 6:
            assert "truncated" in str(exc)


def test_unknown_codes_name_their_offset():
    program = Program("p", (Instruction("dma.load", Engine(0, "dma", 1), (
        ("dst", Tile(Space.SRAM, 0, 0, "f32", 8, 8)), ("src", Tile(Space.HBM, 0, 0, "f32", 8, 8)))),
        Instruction("mxu.matmul", Engine(0, "mxu"), (
            ("acc", Tile(Space.ACC, 0, 0, "f32", 32, 32)), ("a", Tile(Space.SRAM, 0, 0, "bf16", 32, 32)),
            ("b", Tile(Space.SRAM, 0, 0, "bf16", 32, 32)), ("a_scale", None), ("b_scale", None),
            ("mode", "overwrite")))))
    data = encode_program(program)
    at = _first_instruction_offset(data, program)

    def poke(offset, value):
        return data[:offset] + bytes([value]) + data[offset + 1:]

    cases = [
        (at, 0xEE, at, "unknown opcode 0xee"),
        (at + 1, 9, at + 1, "unknown engine unit code 9"),
        (at + 10, 0, at + 10, "unknown memory space code 0"),  # dst's space
        (at + 10 + 13, 77, at + 10 + 13, "unknown dtype code 77"),  # dst's dtype
    ]
    second = at + len(encode(program.instructions[0]))
    a_scale = second + 10 + 3 * 30  # opcode + engine, then the three required tiles
    cases += [
        (a_scale, 2, a_scale, "presence byte of mxu.matmul operand a_scale is 2"),
        (a_scale + 2, 5, a_scale + 2, "operand mode: choice index 5 is out of range"),
    ]
    for offset, value, want, message in cases:
        exc = _err(poke(offset, value))
        assert exc.offset == want and message in str(exc), (message, str(exc))


def test_impossible_tiles_and_bad_utf8_are_assembly_errors():
    program = Program("p", (Instruction("sem.signal", Engine(0, "mxu"), (("sem", 1), ("count", 1)), "é"),))
    data = encode_program(program)
    exc = _err(data[:-2] + b"\xff" + data[-1:])
    assert "not valid UTF-8" in str(exc) and exc.offset == len(data) - 2
    tile = Instruction("vec.acc_read", Engine(0, "vpu"), (
        ("dst", Tile(Space.SRAM, 0, 0, "f32", 8, 8)), ("src", Tile(Space.ACC, 0, 0, "f32", 8, 8))))
    data = encode_program(Program("p", (tile,)))
    at = _first_instruction_offset(data, Program("p", (tile,))) + 10
    rows_zero = data[:at + 14] + b"\0\0\0\0" + data[at + 18:]
    exc = _err(rows_zero)
    assert exc.offset == at and "is not a valid tile" in str(exc) and "must be positive" in str(exc)


def test_random_corruption_never_escapes_as_another_exception():
    data = encode_program(_program())
    rng = random.Random(1234)
    for _ in range(400):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        try:
            decode_program(bytes(buf))
        except AssemblyError as exc:
            assert 0 <= exc.offset <= len(buf)


def test_decode_offset_outside_the_input():
    with pytest.raises(AssemblyError, match="outside the 3-byte input"):
        decode(b"abc", 7)
