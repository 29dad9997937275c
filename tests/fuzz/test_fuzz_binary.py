"""Fuzzing the binary format: any bytes decode to a Program or raise ``AssemblyError``.

The bytes are a valid binary (the shipped example, assembled) after random edits (bytes flipped,
inserted, deleted, the file cut short, fields overwritten with extreme values, pieces of it
spliced in twice), or anything at all after the magic. A binary that decodes must encode back to
the same bytes (the format has one spelling per program), and what `jalapeno-emu run` does next
(the legality check, the emulator's checker on the tiny chip, the timing and functional passes)
must also end in a project error or succeed.
"""

from __future__ import annotations

import struct
from pathlib import Path

from hypothesis import event, given
from hypothesis import strategies as st

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu import check_program as check_emulated
from jalapeno_emu.emu import run_functional, run_timing
from jalapeno_emu.errors import AssemblyError, EmuError
from jalapeno_emu.isa import assemble, check_legality, decode, decode_program, encode_program
from jalapeno_emu.isa.encoding import _ENGINE, _TILE, MAGIC, encode
from jalapeno_emu.isa.program import Program
from tests.fuzz.helpers import call, fuzz_settings, time_limit

EXAMPLE_FILE = Path(__file__).resolve().parents[2] / "examples" / "asm" / "tile_matmul.jasm"
EXAMPLE = assemble(EXAMPLE_FILE.read_text(), source="tile_matmul.jasm")
BINARY = encode_program(EXAMPLE, sources=False)
WITH_SOURCES = encode_program(EXAMPLE)
TINY = load_preset("tiny")

# Values that sit on the edges of the format's integer fields: a length of 2^32 - 1, a count
# that would allocate a huge list, a negative core, offsets near 2^64.
EXTREMES = st.sampled_from([
    struct.pack("<I", 0xFFFFFFFF), struct.pack("<I", 0x7FFFFFFF), struct.pack("<I", 0),
    struct.pack("<Q", 2**64 - 1), struct.pack("<Q", 2**63), struct.pack("<q", -1), struct.pack("<i", -2),
    struct.pack("<d", float("nan")), struct.pack("<d", float("inf")), b"\xff", b"\x00", b"\x80",
    "\ud800".encode("utf-8", "surrogatepass"), b"\xc3\x28",  # not UTF-8
])


@st.composite
def mutated_binary(draw: st.DrawFn) -> bytes:
    """A valid binary after one to four edits (see the module docstring)."""
    data = bytearray(draw(st.sampled_from([BINARY, WITH_SOURCES])))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "cut", "extreme", "splice"]))
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[i] = draw(st.integers(0, 255))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[i:i + draw(st.integers(1, 8))]
        elif op == "cut":
            del data[i:]
        elif op == "extreme":
            value = draw(EXTREMES)
            data[i:i + len(value)] = value
        else:  # a piece of the binary repeated elsewhere: plausible records in the wrong place
            j = draw(st.integers(0, len(data)))
            piece = data[i:i + draw(st.integers(1, 64))]
            data[j:j] = piece
    return bytes(data)


def _check_decoded(data: bytes) -> str:
    """Decode ``data``; on success re-encode it and run both checkers. Returns the outcome, for
    Hypothesis's statistics."""
    with time_limit(20, "decode_program"):
        result = call(decode_program, data, source="fuzz.bin")
    if isinstance(result, EmuError):
        assert isinstance(result, AssemblyError), repr(result)
        assert isinstance(getattr(result, "offset", None), int), "a decoding error names its byte offset"
        return "refused"
    assert isinstance(result, Program)
    assert encode_program(result) == data
    with time_limit(30, "check_program"):
        # Legality first, as `run` does; then the whole checker, which also bounds every tile
        # against the chip, so even an absurd but legal program is refused cheaply.
        if isinstance(call(check_legality, result), EmuError):
            return "decoded, illegal"
        if isinstance(call(check_emulated, result, TINY), EmuError):
            return "decoded, refused by the checker"
    # A program the checker passes is one `run` executes: both passes must finish or refuse it
    # (a mutated .init, say, names an allocation that is not there).
    with time_limit(60, "run_timing and run_functional"):
        timed = call(run_timing, result, TINY)
        ran = call(run_functional, result)
    if isinstance(timed, EmuError) or isinstance(ran, EmuError):
        return "checked, refused by a pass"
    return "decoded, checked and run"


@fuzz_settings(max_examples=300, deadline_s=10)
@given(mutated_binary())
def test_mutated_binaries(data):
    event(_check_decoded(data))


@fuzz_settings(max_examples=100, deadline_s=10)
@given(st.binary(max_size=300).map(lambda rest: MAGIC + b"\x01\x00" + rest) | st.binary(max_size=64))
def test_arbitrary_bytes(data):
    event(_check_decoded(data))


@fuzz_settings(max_examples=100, deadline_s=5)
@given(st.binary(max_size=200), st.integers(-8, 400))
def test_single_instruction_decoding(data, offset):
    # decode() takes an offset into any bytes-like object: out of range, mid-record, past the end.
    result = call(decode, data, offset, source="fuzz.bin")
    if not isinstance(result, EmuError):
        _, end = result
        assert offset < end <= len(data)


def test_the_unmutated_binaries_decode():
    # The mutations start from these: both must take the success path.
    assert _check_decoded(BINARY) == "decoded, checked and run"
    assert _check_decoded(WITH_SOURCES) == "decoded, checked and run"


def test_bytes_the_encoder_would_refuse_do_not_decode():
    # Found by test_mutated_binaries: one flipped bit made an HBM tile's core 1, which decoded into
    # a Program that encode_program then refused ("HBM is chip-global (core 0)"); likewise an mxu
    # engine with a queue. The decoder now refuses what the encoder refuses, at the record's offset.
    load = assemble("c0.dma0: dma.load sram[0]:0x0:f32[1,8], hbm:0x0:f32[1,8]").instructions[0]
    data = bytearray(encode(load))
    src_core = 1 + _ENGINE.size + _TILE.size + 1  # opcode, engine, dst tile, src tile's space byte
    data[src_core] = 1
    result = call(decode, bytes(data))
    assert isinstance(result, AssemblyError) and "HBM" in str(result) and result.offset == 0, result
    signal = assemble("c0.mxu: sem.signal 0").instructions[0]
    data = bytearray(encode(signal))
    data[1 + 5] = 5  # the engine's queue field (after unit u8 and core i32)
    result = call(decode, bytes(data))
    assert isinstance(result, AssemblyError) and "queue" in str(result) and result.offset == 1, result
