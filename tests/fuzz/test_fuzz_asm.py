"""Fuzzing the assembler: any text gives a Program or an ``AssemblyError``, never another exception.

Three sources of text: statements built from the assembler's own vocabulary (directives, engines,
mnemonics, tiles, numbers too big for their field, quoted names), mutations of the shipped
examples ``examples/asm/*.jasm`` (lines dropped, duplicated, swapped, tokens replaced, characters
inserted, the file cut short), and arbitrary Unicode. A program that assembles must also survive
what the tool chain does with it next: disassembly and reassembly to the same binary, and the
binary decoding back to the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import event, given
from hypothesis import strategies as st

from jalapeno_emu.errors import AssemblyError, EmuError
from jalapeno_emu.isa import TABLE, assemble, decode_program, disassemble, encode_program
from jalapeno_emu.isa.program import Program
from jalapeno_emu.isa.table import DTYPES, OperandSpec, Space
from tests.fuzz.helpers import call, fuzz_settings, time_limit

# Every shipped assembly example is a starting point for mutations; tile_matmul is the one the
# other fuzz tests (binaries, CLI) build on.
EXAMPLES = {p.name: p.read_text() for p in sorted((Path(__file__).resolve().parents[2] / "examples" / "asm")
                                                  .glob("*.jasm"))}
EXAMPLE = EXAMPLES["tile_matmul.jasm"]

# --- the assembler's vocabulary, right and wrong --------------------------------------------------

# Integers in every spelling the grammar allows, and the ones it must refuse with a message: signs,
# leading zeros, hex, the edges of u32/u64/i64, and literals long enough that int() itself refuses
# them (more than 4,300 digits).
INTEGERS = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.integers(0, 2**70).map(hex),
    st.sampled_from(["0", "-0", "+1", "007", "0x", "0X1F", "0x_1", "1_000", "2**8", "1e3", "-1",
                     str(2**32), str(2**32 - 1), str(2**64), str(2**64 - 1), str(2**63), str(-(2**63) - 1),
                     "9" * 5000, "0x" + "f" * 3000, "0" * 40 + "1", ""]),
)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["inf", "-inf", "nan", "1e999", "-0.0", "1_0.0", "0x1p3", "1.", ".5", "e5", "9" * 400]),
)
WORDS = st.sampled_from([s.mnemonic for s in TABLE] + ["dma.lod", "vec", "mxu.matmul.x", "sem.wait"])
ENGINES = st.one_of(
    st.sampled_from(["c0.dma0", "c0.dma1", "c1.dma3", "c0.mxu", "c1.vpu", "link", "c0.dma", "c.mxu",
                     "c-1.vpu", "c0.gpu", "C0.MXU", "c99999999999999999999.mxu", "c0.dma" + "9" * 30]),
    st.builds("c{}.{}".format, st.integers(-3, 2**33), st.sampled_from(["mxu", "vpu", "dma0", "dma7"])),
)
SPACES = st.sampled_from(["hbm", "sram[0]", "sram[1]", "acc[0]", "acc[1]", "sram", "acc", "hbm[0]",
                          "sram[-1]", "sram[x]", "sram[]", "dram[0]", "sram[4294967296]"])
DTYPE_NAMES = st.sampled_from([*DTYPES, "f64", "fp4x", "", "F32"])


@st.composite
def tiles(draw: st.DrawFn) -> str:
    """A tile operand: ``SPACE:OFFSET:DTYPE[ROWS,COLS]`` with an optional ``/STRIDE``."""
    text = (f"{draw(SPACES)}:{draw(INTEGERS)}:{draw(DTYPE_NAMES)}"
            f"[{draw(INTEGERS)},{draw(INTEGERS)}]")
    if draw(st.booleans()):
        text += f"/{draw(INTEGERS)}"
    return text


NAMES = st.one_of(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,12}", fullmatch=True),
    st.text(max_size=12).map(lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'),
    st.sampled_from(['"', '"\\"', '"\\u12"', '"\\ud800"', "1abc", "a b", "é"]),
)
OPERANDS = st.one_of(
    tiles(), INTEGERS, FLOATS, NAMES,
    st.sampled_from(["overwrite", "accumulate", "exp", "add", "sum", "floor", "mode=overwrite",
                     "a_scale=", "count=2", "bogus=1", "=", ",", ""]),
    st.builds("{}={}".format, st.sampled_from(["mode", "a_scale", "b_scale", "count", "value", "op"]),
              st.one_of(tiles(), INTEGERS, NAMES)),
)


# Values of each operand kind that are mostly legal (tiles in a space and of a dtype the operand
# allows), so that rows built from them often assemble and the success path (round trips) is
# fuzzed too, not only the refusals.
PLAUSIBLE = {
    "imm": st.one_of(st.integers(-2, 4).map(str), INTEGERS),
    "fimm": FLOATS,
    "sem": st.one_of(st.integers(0, 3).map(str), st.sampled_from(["s0", "s1", "nope"])),
    "label": st.one_of(NAMES, st.sampled_from(['"a, b [c]; # d"', '""', '" x"', '"' + "y" * 65 + '"'])),
}


@st.composite
def plausible_tile(draw: st.DrawFn, op: OperandSpec) -> str:
    """A tile for operand ``op``: one of its spaces and dtypes, small aligned offset and shape."""
    space = draw(st.sampled_from(op.spaces or tuple(Space))).value
    where = space if space == "hbm" else f"{space}[{draw(st.sampled_from([0, 0, 1, 2]))}]"
    dtype = draw(st.sampled_from(op.dtypes or tuple(DTYPES)))
    rows, cols = draw(st.sampled_from([1, 2, 8, 32, 64])), draw(st.sampled_from([1, 2, 32, 64]))
    return f"{where}:{hex(draw(st.integers(0, 64)) * 128)}:{dtype}[{rows},{cols}]"


@st.composite
def row_instruction(draw: st.DrawFn) -> str:
    """An instruction of a real table row with operands of the right kinds, some by name."""
    row = draw(st.sampled_from(TABLE))
    unit = {"dma": "dma0", "any": "mxu"}.get(row.unit, row.unit)
    engine = "link" if unit == "link" else f"c{draw(st.sampled_from(['0', '0', '1', '2']))}.{unit}"
    ops = []
    for op in row.operands:
        if op.optional and draw(st.booleans()):
            continue
        if op.kind == "enum":
            value = draw(st.sampled_from(op.choices))
        elif op.kind == "tile":
            value = draw(plausible_tile(op))
        else:
            value = draw(PLAUSIBLE[op.kind])
        ops.append(f"{op.name}={value}" if op.optional else value)
    return f"{engine}: {row.mnemonic} {', '.join(ops)}"


@st.composite
def statements(draw: st.DrawFn) -> str:
    """One line: an instruction (``ENGINE: MNEMONIC OPERANDS``), a directive, or near misses."""
    kind = draw(st.sampled_from(["row", "row", "instruction", "instruction", "directive", "bare"]))
    if kind == "row":
        return draw(row_instruction())
    if kind == "instruction":
        ops = draw(st.lists(OPERANDS, max_size=7))
        sep = draw(st.sampled_from([", ", ",", " , ", " "]))
        space = draw(st.sampled_from([" ", "  ", "", "\t"]))
        return f"{draw(ENGINES)}:{space}{draw(WORDS)} {sep.join(ops)}"
    if kind == "directive":
        head = draw(st.sampled_from([".kernel", ".preset", ".alloc", ".sem", ".init", ".allok", "."]))
        fields = draw(st.lists(st.one_of(NAMES, INTEGERS, SPACES, DTYPE_NAMES,
                                         st.sampled_from(["zeros", "ones", "normal", "random"])),
                               max_size=6))
        return " ".join([head, *fields])
    return draw(st.one_of(WORDS, OPERANDS, st.text(max_size=30)))


COMMENTS = st.sampled_from(["", " ; note", " # note", ' ; "unclosed', ' "; not a comment"'])


@st.composite
def programs_text(draw: st.DrawFn) -> str:
    """Several statements, each with an optional trailing comment, joined by newlines; semaphores
    ``s0`` and ``s1`` are declared when the draw says so (rows may name them)."""
    lines = draw(st.lists(st.tuples(statements(), COMMENTS).map("".join), min_size=1, max_size=12))
    if draw(st.booleans()):
        lines = [".sem 0 s0", ".sem 1 s1", *lines]
    return draw(st.sampled_from(["\n", "\r\n", "\r"])).join(lines)


@st.composite
def mutated_example(draw: st.DrawFn) -> str:
    """A shipped example after a few random edits (see the module docstring)."""
    lines = EXAMPLES[draw(st.sampled_from(sorted(EXAMPLES)))].splitlines()
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["drop", "dup", "swap", "token", "insert", "cut", "statement"]))
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        if op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "token":
            # Replace one whitespace/comma-separated token with something from the vocabulary.
            parts = lines[i].replace(",", " , ").split()
            if parts:
                k = draw(st.integers(0, len(parts) - 1))
                parts[k] = draw(st.one_of(OPERANDS, ENGINES.map(lambda e: e + ":"), WORDS))
                lines[i] = " ".join(parts).replace(" , ", ", ")
        elif op == "insert":
            col = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:col] + draw(st.text(min_size=1, max_size=5)) + lines[i][col:]
        elif op == "cut":
            lines[i] = lines[i][:draw(st.integers(0, len(lines[i])))]
        else:
            lines.insert(i, draw(statements()))
    return "\n".join(lines)


# --- the properties --------------------------------------------------------------------------------


def _check_assembled(text: str) -> str:
    """Assemble ``text``; on success, the program must round-trip through disasm and the binary.

    Returns "refused" or "assembled", for Hypothesis's statistics (``--hypothesis-show-statistics``
    shows how often each test reaches the success path).
    """
    with time_limit(20, "assemble"):
        result = call(assemble, text, source="fuzz.jasm")
    if isinstance(result, EmuError):
        # The assembler's one error class, with the file and a line number in its message.
        assert isinstance(result, AssemblyError), repr(result)
        assert str(result).startswith("fuzz.jasm"), str(result)
        return "refused"
    assert isinstance(result, Program)
    # What `asm` writes (sources left out) must decode to itself, and what `disasm` prints must
    # assemble back to the same bytes. Bytes, not Program equality: a NaN immediate is not == to
    # itself, but its bits are.
    binary = encode_program(result, sources=False)
    assert encode_program(decode_program(binary), sources=False) == binary
    again = assemble(disassemble(result), source="again.jasm")
    assert encode_program(again, sources=False) == binary
    return "assembled"


@fuzz_settings(max_examples=250, deadline_s=5)
@given(programs_text())
def test_statements_from_the_vocabulary(text):
    event(_check_assembled(text))


@fuzz_settings(max_examples=150, deadline_s=5)
@given(st.lists(row_instruction(), min_size=1, max_size=4).map(lambda rows: "\n".join(
    [".sem 0 s0", ".sem 1 s1", ".alloc hbm x 0x0 65536", *rows])))
def test_rows_of_the_table_with_plausible_operands(text):
    event(_check_assembled(text))


@fuzz_settings(max_examples=250, deadline_s=5)
@given(mutated_example())
def test_mutations_of_the_shipped_example(text):
    event(_check_assembled(text))


@fuzz_settings(max_examples=100, deadline_s=5)
# Surrogate code points included: a str handed to assemble() need not be valid UTF-8 text.
@given(st.text(st.characters(exclude_categories=()), max_size=200))
def test_arbitrary_text(text):
    event(_check_assembled(text))


def test_unpaired_surrogate_escapes_in_names_are_refused_at_their_column():
    # Found by test_mutations_of_the_shipped_example: `.alloc hbm "\ud800" ...` assembled, and the
    # program then could not be written as a binary (its strings are UTF-8), so `asm` failed
    # without pointing at the line. Every quoted name goes through the same check.
    for text in ('.alloc hbm "\\ud800" 0x0 64', '.kernel "\\udfff"', '.sem 0 "a\\udc00"',
                 '.preset "\ud800"'):
        result = call(assemble, text, source="s.jasm")
        assert isinstance(result, AssemblyError) and "surrogate" in str(result), (text, result)
        assert str(result).startswith("s.jasm:1:"), str(result)
    # A proper pair is one character outside the BMP, and is fine.
    assert assemble('.kernel "\\ud83d\\ude00"').name == "\U0001f600"


def test_the_unmutated_examples_round_trip():
    # The mutation strategy starts from valid programs: if this failed, so would every "success"
    # branch above, silently, by never being reached.
    for text in EXAMPLES.values():
        assert _check_assembled(text) == "assembled"
