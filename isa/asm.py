"""The assembler: ``.jasm`` text -> ``Program`` (``disassemble``, the way back, lives in
``isa/disasm.py`` and is re-exported here).

Stage: ISA, next to the builder: both produce the Program the emulator runs. Mnemonics, operand
names, order, kinds and defaults all come from ``isa/table.py``.

Syntax
------

One statement per line; ``;`` or ``#`` starts a comment (outside double quotes). Blank lines are
ignored. Directives may come in any order; each applies to the whole file.

```
; comment (also '#')
.kernel gemm_tile                      ; kernel name (default: the file's stem)
.preset tiny                           ; chip preset (default: tiny)
.alloc hbm A 0x0 8192                  ; SPACE NAME OFFSET SIZE; SPACE is hbm, sram[CORE] or acc[CORE]
.alloc sram[0] buf 0x0 4096
.sem 3 a_ready                         ; ID NAME: names a semaphore id
.init A normal bf16 7                  ; NAME zeros|ones|normal DTYPE [SEED]: initial HBM contents
c0.dma0: dma.load sram[0]:0x0:bf16[128,256], hbm:0x0:bf16[128,256]/8192
c0.mxu:  mxu.matmul acc[0]:0x0:f32[32,64], sram[0]:0x0:bf16[32,64], sram[0]:0x1000:bf16[64,64]
c0.vpu:  vec.unary exp, sram[0]:0x0:f32[8,8], sram[0]:0x100:f32[8,8]
c0.vpu:  vec.clamp sram[0]:0x0:f32[8,8], sram[0]:0x100:f32[8,8], -7.0, 7.0
c0.mxu:  sem.signal 3                  ; count defaults to 1
c0.vpu:  sem.wait a_ready, 1           ; a semaphore by id or by its .sem name
link:    link.send hbm:0x0:f32[1,64], 0, 1
```

Instructions are ``ENGINE: MNEMONIC OPERANDS``. Engines are ``c<core>.dma<queue>``,
``c<core>.mxu``, ``c<core>.vpu`` and the chip-level ``link``. Operands are separated by commas:
positional ones fill the row's required operands in table order, then its optional ones; any
operand may instead be written ``name=value`` (the disassembler writes optional operands that
way and leaves out those equal to their default). Operand values:

- tile: ``hbm:OFFSET:DTYPE[ROWS,COLS]``, ``sram[CORE]:...`` or ``acc[CORE]:...``, optionally
  followed by ``/STRIDE`` (bytes between rows; default: packed rows). An absent optional tile
  is simply not written.
- imm: an integer, decimal or ``0x`` hex, may be negative. sem: a non-negative integer or a
  name declared with ``.sem``.
- fimm: any Python float literal (``7``, ``-7.0``, ``1e-6``, ``inf``).
- enum: one of the row's choices, unquoted.
- label: a name or a double-quoted JSON string, 1 to 64 printable characters
  (``c0.vpu: probe sram[0]:0x0:f32[8,1], "rowmax after exp"``).

Every integer must fit the field the binary format stores it in (``isa/encoding.py``): u32 for
tile cores, rows, columns and semaphore ids, i32 for allocation cores, u64 for offsets, strides
and sizes, i64 for imm operands and ``.init`` seeds; a larger one is an ``AssemblyError`` at its
column that names the field and its range.

An MX matmul names its scale tiles (and its mode) as keywords; the statement stays on one line
(wrapped here): ``c0.mxu: mxu.matmul acc[0]:0x0:f32[32,64], sram[0]:0x0:fp4[32,64],
sram[0]:0x400:fp4[64,64], a_scale=sram[0]:0x800:e8m0[32,2], b_scale=sram[0]:0x880:e8m0[2,64],
mode=overwrite``. ``examples/asm/tile_matmul.jasm`` is a whole kernel.

Loops: ``.loop COUNT`` ... ``.endloop`` around instructions of one engine issues them COUNT
times in a row (a ``Loop`` item of the Program: the program does not grow with COUNT). An operand
written ``OPERAND +=STEP`` changes by STEP from one iteration to the next (STEP may be negative:
``+=-64``): a tile's offset, by bytes, or an integer (an ``imm``, a semaphore id, a ``sem.wait``
value); the rest is the same in every iteration. A double-buffered stream, for example::

    .loop 64
    c0.dma0: sem.wait freed, 1 +=1
    c0.dma0: dma.load sram[0]:0x0:bf16[8,128], hbm:0x4000:bf16[8,128] +=2048
    c0.dma0: sem.signal loaded
    .endloop

Loops do not nest, and other engines' instructions go in loops of their own (engines order
themselves by semaphores, not by position in the file). Iterations 0, 1 and COUNT-1 are checked
like any instruction, which covers every iteration since operands are affine in it; an error
names the iteration. ``disassemble`` writes a program's loops back this way. The checker, the
functional pass and the timing pass see a loop as its iterations written out (for timing,
instruction by instruction the same result).

Names (kernel, preset, allocations, semaphores) are ``[A-Za-z_][A-Za-z0-9_.-]*`` or a double-quoted
JSON string. ``.init NAME KIND DTYPE [SEED]`` fills the HBM allocation NAME before a run: KIND is
the fill (zeros, ones, or a standard normal seeded by SEED, default 0) and DTYPE the element type
it is written as; the functional pass (``jalapeno_emu.emu.functional``) defines the conversion.

Every error is an ``AssemblyError`` with the file, line and 1-based column of the offending token,
and a hint where one helps. Legality failures (see ``isa/legality.py``) point at the operand at
fault, or at the instruction. Each assembled instruction's ``source`` is ``"FILE:LINE"`` (for
messages; ``jalapeno-emu asm`` leaves sources out of the binary, see ``isa/encoding.py``).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from jalapeno_emu.errors import AssemblyError, EmuError, IllegalInstruction
from jalapeno_emu.isa.program import Allocation, HbmInit, Instruction, Loop, Program, Tile, parse_engine

from .disasm import NAME_RE as _NAME_RE
from .disasm import disassemble, format_instruction, format_tile
from .legality import check_engine, check_instruction
from .table import DTYPES, TABLE, InstrSpec, OperandSpec, Space, by_mnemonic

__all__ = ["INIT_KINDS", "assemble", "disassemble", "format_instruction", "format_tile"]

INIT_KINDS = ("zeros", "ones", "normal")
"""``.init`` kinds (``HbmInit.kind``)."""

_DIRECTIVES = (".kernel", ".preset", ".alloc", ".sem", ".init")
_LOOP_MARKS = (".loop", ".endloop")  # statements, in order with the instructions
_STEP_RE = re.compile(r"\s\+=\s*(?P<step>[+-]?(?:0[xX][0-9a-fA-F]+|[0-9]+))$")
_INT_RE = re.compile(r"[+-]?(?:0[xX][0-9a-fA-F]+|[0-9]+)")
_TOKEN_RE = re.compile(r'"(?:[^"\\]|\\.)*"|[^\s"]+')
_SPACE_RE = re.compile(r"(?P<space>[A-Za-z_]\w*)(?:\[(?P<core>[^\]]*)\])?")
_TILE_RE = re.compile(
    r"(?P<where>[A-Za-z_]\w*(?:\[[^\]]*\])?):(?P<off>[^:\s]+):(?P<dt>[A-Za-z_]\w*)"
    r"\[\s*(?P<rows>[^,\]\s]+)\s*,\s*(?P<cols>[^\]\s]+)\s*\](?:/(?P<stride>\S+))?"
)
_KEYWORD_RE = re.compile(r"([A-Za-z_]\w*)\s*=\s*")
_ENGINE_RE = re.compile(r"\s*([^\s:;#]+)\s*:")
_TILE_SYNTAX = "hbm:OFFSET:DTYPE[ROWS,COLS] or sram[CORE]:... / acc[CORE]:..., optionally /STRIDE"


@dataclass(frozen=True)
class _Tok:
    text: str
    col: int  # 1-based


class _Asm:
    """One assembly run: the source name for messages, and the raising helper."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, message: str, line: int, col: int | None, hint: str | None = None) -> AssemblyError:
        return AssemblyError(message, line=line, column=col, source=self.source, hint=hint)

    # --- scalar fields ------------------------------------------------------------------------
    def integer(self, tok: _Tok, line: int, what: str, *, signed: bool = False, field: str = "u64") -> int:
        """``tok`` as an integer that fits ``field``, the binary format's field that stores it
        (``"u32"``, ``"u64"``, ``"i32"``, ``"i64"``; see ``isa/encoding.py``)."""
        if not _INT_RE.fullmatch(tok.text) or (not signed and tok.text[0] in "+-"):
            kind = "an integer" if signed else "a non-negative integer"
            raise self.error(f"{what} must be {kind} (decimal or 0x hex), got {_clip(tok.text)!r}", line,
                             tok.col)
        lo, hi = _BINARY_INTS[field]
        body = tok.text.lstrip("+-")
        is_hex = body[:2].lower() == "0x"
        significant = (body[2:] if is_hex else body).lstrip("0")
        # Judge the size on the text first: int() refuses more than 4,300 decimal digits (with a
        # bare ValueError), and no field holds more than 20 decimal or 16 hex digits anyway.
        if len(significant) > (16 if is_hex else 20) or not lo <= (value := _int0(tok.text)) <= hi:
            raise self.error(f"{what} {_clip(tok.text)} does not fit in {field[1:]} bits: the binary "
                             f"format stores it as {field} ({lo}..{hi})", line, tok.col)
        return value

    def name(self, tok: _Tok, line: int, what: str) -> str:
        if tok.text.startswith('"'):
            try:
                value = json.loads(tok.text)
            except ValueError:
                value = None
            if not isinstance(value, str):
                raise self.error(f"{what} {tok.text} is not a valid quoted name", line, tok.col)
            # JSON's \uXXXX escapes can spell half of a surrogate pair, which no UTF-8 text (and
            # so no binary, whose strings are UTF-8) can hold: refuse it here, at its column.
            if any("\ud800" <= ch <= "\udfff" for ch in value):
                raise self.error(f"{what} {_clip(tok.text)} holds an unpaired surrogate escape (\\ud800.."
                                 "\\udfff), which is not Unicode text", line, tok.col,
                                 hint="escape a character outside the BMP as a pair, e.g. \\ud83d\\ude00")
            return value
        if not _NAME_RE.fullmatch(tok.text):
            raise self.error(f"{what} {tok.text!r} is not a name", line, tok.col,
                             hint='names are [A-Za-z_][A-Za-z0-9_.-]*, or a "quoted string"')
        return tok.text

    def space(self, tok: _Tok, line: int, core_field: str = "u32") -> tuple[Space, int]:
        m = _SPACE_RE.fullmatch(tok.text)
        spaces = {s.value: s for s in Space}
        if not m or m.group("space") not in spaces:
            word = m.group("space") if m else tok.text
            close = difflib.get_close_matches(word, list(spaces), n=1)
            hint = f"did you mean {close[0]}?" if close else "spaces: hbm, sram[CORE], acc[CORE]"
            raise self.error(f"unknown memory space {word!r}", line, tok.col, hint=hint)
        space = spaces[m.group("space")]
        core_text = m.group("core")
        if space is Space.HBM:
            if core_text is not None:
                col = tok.col + m.start("core") - 1
                raise self.error("hbm is chip-global and takes no [core]", line, col)
            return space, 0
        if core_text is None:
            raise self.error(f"{space.value} is per core: write {space.value}[CORE]", line, tok.col)
        core = self.integer(_Tok(core_text, tok.col + m.start("core")), line, f"{space.value} core",
                            field=core_field)
        return space, core

    # --- operand values -----------------------------------------------------------------------
    def tile(self, tok: _Tok, line: int, what: str) -> Tile:
        m = _TILE_RE.fullmatch(tok.text)
        if not m:
            raise self.error(f"bad tile syntax {tok.text!r} for {what}", line, tok.col,
                             hint=f"write {_TILE_SYNTAX}")

        def sub(group: str) -> _Tok:
            return _Tok(m.group(group), tok.col + m.start(group))

        space, core = self.space(sub("where"), line)
        offset = self.integer(sub("off"), line, f"{what} offset")
        dt = sub("dt")
        if dt.text not in DTYPES:
            close = difflib.get_close_matches(dt.text, list(DTYPES), n=1)
            raise self.error(f"unknown dtype {dt.text!r} in {what}", line, dt.col,
                             hint=f"did you mean {close[0]}?" if close else f"dtypes: {', '.join(DTYPES)}")
        rows = self.integer(sub("rows"), line, f"{what} rows", field="u32")
        cols = self.integer(sub("cols"), line, f"{what} cols", field="u32")
        stride = self.integer(sub("stride"), line, f"{what} stride") if m.group("stride") is not None else -1
        try:
            return Tile(space, core, offset, dt.text, rows, cols, stride)
        except EmuError as exc:
            raise self.error(f"{what}: {exc.message}", line, tok.col, hint=exc.hint) from None

    def value(self, op: OperandSpec, spec: InstrSpec, tok: _Tok, line: int,
              sems: Mapping[str, int | None]) -> Any:
        what = f"{spec.mnemonic} operand {op.name}"
        if op.kind == "tile":
            return self.tile(tok, line, what)
        if op.kind == "imm":
            return self.integer(tok, line, what, signed=True, field="i64")
        if op.kind == "fimm":
            try:
                if any(c.isspace() for c in tok.text) or "_" in tok.text:
                    raise ValueError
                return float(tok.text)
            except ValueError:
                raise self.error(f"{what} must be a number, got {tok.text!r}", line, tok.col) from None
        if op.kind == "enum":
            if tok.text not in op.choices:
                close = difflib.get_close_matches(tok.text, op.choices, n=1)
                raise self.error(f"{what} must be one of {', '.join(op.choices)}, got {tok.text!r}", line,
                                 tok.col, hint=f"did you mean {close[0]}?" if close else None)
            return tok.text
        if op.kind == "sem":
            if _NAME_RE.fullmatch(tok.text):
                if tok.text not in sems:
                    close = difflib.get_close_matches(tok.text, [n for n in sems if n], n=1)
                    raise self.error(f"unknown semaphore {tok.text!r}", line, tok.col,
                                     hint=f"did you mean {close[0]}?" if close
                                     else "declare it with `.sem ID NAME`, or write the id")
                sem_id = sems[tok.text]
                if sem_id is None:
                    raise self.error(f"semaphore name {tok.text!r} names more than one id; write the id",
                                     line, tok.col)
                return sem_id
            return self.integer(tok, line, what, field="u32")
        if op.kind == "label":  # its length and characters are checked with the instruction
            return self.name(tok, line, what)
        raise AssertionError(op.kind)  # pragma: no cover - legality rejects unknown kinds first


_BINARY_INTS: dict[str, tuple[int, int]] = {
    "u32": (0, 2**32 - 1), "u64": (0, 2**64 - 1), "i32": (-(2**31), 2**31 - 1), "i64": (-(2**63), 2**63 - 1),
}
"""Integer fields of the binary format (``isa/encoding.py``) by struct code: (least, greatest)."""


def _clip(text: str, keep: int = 24) -> str:
    """``text`` for a message: a token thousands of characters long would swamp the line."""
    return text if len(text) <= keep else f"{text[:keep - 8]}...{text[-4:]} ({len(text):,} characters)"


def _int0(text: str) -> int:
    # int(text, 0) rejects "007"; allow leading zeros in decimal, the way people pad offsets.
    sign = -1 if text.startswith("-") else 1
    body = text.lstrip("+-")
    return sign * (int(body, 16) if body[:2].lower() == "0x" else int(body, 10))


def _strip_comment(line: str) -> str:
    """The line without its comment (';' or '#' outside double quotes)."""
    in_quote = escaped = False
    for i, ch in enumerate(line):
        if in_quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_quote = False
        elif ch == '"':
            in_quote = True
        elif ch in ";#":
            return line[:i]
    return line


def _tokens(text: str, start: int = 0) -> list[_Tok]:
    return [_Tok(m.group(), start + m.start() + 1) for m in _TOKEN_RE.finditer(text)]


def _split_operands(text: str, start: int, line: int, asm: _Asm) -> list[_Tok]:
    """Split on commas outside [brackets] and "quotes"; each piece stripped, with its 1-based column."""
    pieces, depth, begin = [], 0, 0
    in_quote = escaped = False
    for i, ch in enumerate(text + ","):
        if in_quote and i < len(text):  # a quoted label may hold commas and brackets
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_quote = False
            continue
        if ch == '"':
            in_quote = True
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(depth - 1, 0)
        elif ch == "," and depth == 0:
            raw = text[begin:i]
            stripped = raw.strip()
            col = start + begin + (len(raw) - len(raw.lstrip())) + 1
            if not stripped:
                if i == len(text) and not pieces and not text.strip():
                    break  # no operands at all
                raise asm.error("empty operand (two commas in a row, or a comma at the end)", line,
                                start + min(i, len(text) - 1) + 1)
            pieces.append(_Tok(stripped, col))
            begin = i + 1
    return pieces


def _signature(spec: InstrSpec) -> str:
    return ", ".join(op.name if not op.optional else f"[{op.name}=]" for op in spec.operands)


def _default_name(source: str) -> str:
    stem = PurePath(source).stem if not source.startswith("<") else ""
    return stem or "kernel"


def assemble(text: str, *, source: str = "<asm>") -> Program:
    """Assemble ``.jasm`` text (syntax in this module's docstring) into a checked Program.

    Args:
        text: the assembly source.
        source: the file name, used in messages and in each instruction's ``source``
            ("FILE:LINE").

    Returns:
        The Program; every instruction is legal (``check_instruction``) and canonical (all
        operands present, in table order).

    Raises:
        AssemblyError: with line, 1-based column and a hint.

    >>> p = assemble("c0.mxu: sem.signal 3")
    >>> p.instructions[0].args, p.instructions[0].source
    ((('sem', 3), ('count', 1)), '<asm>:1')
    """
    asm = _Asm(source)
    # Editors on Windows start UTF-8 files with a byte-order mark; it is not part of line 1.
    text = text.removeprefix("\ufeff")
    directives: list[tuple[int, list[_Tok]]] = []
    statements: list[tuple[int, str]] = []  # line number, code without its comment
    for lineno, raw in enumerate(text.splitlines(), start=1):
        code = _strip_comment(raw).rstrip()
        if not code.strip():
            continue
        if code.lstrip().startswith(".") and code.split()[0] not in _LOOP_MARKS:
            directives.append((lineno, _tokens(code)))
        else:
            statements.append((lineno, code))

    name: str | None = None
    preset: str | None = None
    allocations: list[Allocation] = []
    alloc_keys: dict[tuple[str, Space, int], int] = {}
    sems: list[tuple[int, str]] = []
    sem_lines: dict[int, int] = {}
    sem_names: dict[str, int | None] = {}  # None: the name is on several ids (ambiguous)
    init_lines: list[tuple[int, _Tok, HbmInit]] = []
    for lineno, toks in directives:
        head, args = toks[0], toks[1:]
        if head.text not in _DIRECTIVES:
            close = difflib.get_close_matches(head.text, _DIRECTIVES, n=1)
            hint = f"did you mean {close[0]}?" if close else f"directives: {', '.join(_DIRECTIVES)}"
            raise asm.error(f"unknown directive {head.text!r}", lineno, head.col, hint=hint)
        shapes = {".kernel": ("NAME",), ".preset": ("NAME",), ".alloc": ("SPACE", "NAME", "OFFSET", "SIZE"),
                  ".sem": ("ID", "NAME"), ".init": ("NAME", "KIND", "DTYPE", "[SEED]")}[head.text]
        need = sum(1 for s in shapes if not s.startswith("["))
        if not need <= len(args) <= len(shapes):
            col = args[len(shapes)].col if len(args) > len(shapes) else head.col
            raise asm.error(f"{head.text} takes {' '.join(shapes)}; got {len(args)} field"
                            f"{'' if len(args) == 1 else 's'}", lineno, col)
        if head.text in (".kernel", ".preset"):
            if (name if head.text == ".kernel" else preset) is not None:
                raise asm.error(f"second {head.text} directive", lineno, head.col,
                                hint=f"a file has one {head.text}")
            value = asm.name(args[0], lineno, f"{head.text[1:]} name")
            if head.text == ".kernel":
                name = value
            else:
                preset = value
        elif head.text == ".alloc":
            space, core = asm.space(args[0], lineno, core_field="i32")
            a_name = asm.name(args[1], lineno, "allocation name")
            offset = asm.integer(args[2], lineno, "allocation offset")
            size = asm.integer(args[3], lineno, "allocation size")
            key = (a_name, space, core)
            if key in alloc_keys:
                raise asm.error(f"duplicate allocation name {a_name!r} in {args[0].text}", lineno,
                                args[1].col, hint=f"first allocated on line {alloc_keys[key]}")
            alloc_keys[key] = lineno
            allocations.append(Allocation(a_name, space, core, offset, size, f"{asm.source}:{lineno}"))
        elif head.text == ".sem":
            sem_id = asm.integer(args[0], lineno, "semaphore id", field="u32")
            s_name = asm.name(args[1], lineno, "semaphore name")
            if sem_id in sem_lines:
                raise asm.error(f"semaphore {sem_id} is already named on line {sem_lines[sem_id]}", lineno,
                                args[0].col)
            sem_lines[sem_id] = lineno
            sem_names[s_name] = None if s_name in sem_names else sem_id
            sems.append((sem_id, s_name))
        else:  # .init
            i_name = asm.name(args[0], lineno, "init name")
            if args[1].text not in INIT_KINDS:
                raise asm.error(f"init kind {args[1].text!r} is not one of {', '.join(INIT_KINDS)}", lineno,
                                args[1].col)
            if args[2].text not in DTYPES:
                close = difflib.get_close_matches(args[2].text, list(DTYPES), n=1)
                raise asm.error(f"unknown dtype {args[2].text!r}", lineno, args[2].col,
                                hint=f"did you mean {close[0]}?" if close else f"dtypes: {', '.join(DTYPES)}")
            seed = asm.integer(args[3], lineno, "seed", signed=True, field="i64") if len(args) > 3 else 0
            init_lines.append((lineno, args[0], HbmInit(i_name, args[1].text, args[2].text, seed)))

    hbm_names = {a.name for a in allocations if a.space is Space.HBM}
    seen_inits: dict[str, int] = {}
    for lineno, tok, init in init_lines:
        if init.name not in hbm_names:
            raise asm.error(f".init names {init.name!r}, which is not an HBM allocation", lineno, tok.col,
                            hint="declare it first with `.alloc hbm NAME OFFSET SIZE`")
        if init.name in seen_inits:
            raise asm.error(f"second .init for {init.name!r}", lineno, tok.col,
                            hint=f"the first is on line {seen_inits[init.name]}")
        seen_inits[init.name] = lineno

    items = _items(asm, statements, sem_names)
    return Program(
        name if name is not None else _default_name(source),
        tuple(items),
        tuple(allocations),
        preset if preset is not None else "tiny",
        tuple(sems),
        tuple(i for _, _, i in init_lines),
    )


def _items(asm: _Asm, statements: list[tuple[int, str]], sems: Mapping[str, int | None]
           ) -> list[Instruction | Loop]:
    """The program's items: instructions, and a Loop for each ``.loop N`` ... ``.endloop`` block."""
    items: list[Instruction | Loop] = []
    loop: tuple[int, int, int] | None = None  # (line, column of the count, count) of an open .loop
    body: list[tuple[int, Instruction, tuple[tuple[str, int], ...], dict[str, int]]] = []
    index = 0  # instruction index of the next statement, loops unrolled (for messages)
    for lineno, code in statements:
        toks = _tokens(code)
        head = toks[0]
        if head.text == ".loop":
            if loop is not None:
                raise asm.error("a .loop inside a .loop", lineno, head.col,
                                hint=f"the loop opened on line {loop[0]} ends with .endloop first; "
                                "loops do not nest")
            if len(toks) != 2:
                raise asm.error(f".loop takes COUNT; got {len(toks) - 1} fields", lineno, head.col)
            count = asm.integer(toks[1], lineno, "loop count", field="u32")
            if count < 1:
                raise asm.error(f"loop count {count} must be at least 1", lineno, toks[1].col)
            loop, body = (lineno, toks[1].col, count), []
            continue
        if head.text == ".endloop":
            if loop is None:
                raise asm.error(".endloop without a .loop", lineno, head.col)
            if len(toks) != 1:
                raise asm.error(".endloop takes no fields", lineno, toks[1].col)
            if not body:
                raise asm.error("empty loop: no instruction between .loop and .endloop", lineno, head.col)
            items.append(_loop(asm, loop, body, index))
            index += loop[2] * len(body)
            loop = None
            continue
        ins, steps, step_cols = _instruction(asm, lineno, code, sems, index, in_loop=loop is not None)
        if loop is None:
            items.append(ins)
            index += 1
        else:
            if body and ins.engine != body[0][1].engine:
                raise asm.error(f"a loop runs on one engine: this line is for {ins.engine}, the loop's "
                                f"first line (line {body[0][0]}) for {body[0][1].engine}", lineno,
                                len(code) - len(code.lstrip()) + 1,
                                hint="write one loop per engine; engines order themselves by semaphores")
            body.append((lineno, ins, steps, step_cols))
    if loop is not None:
        raise asm.error(f".loop {loop[2]} on line {loop[0]} has no .endloop", loop[0], loop[1])
    return items


def _loop(asm: _Asm, loop: tuple[int, int, int], body: list, index: int) -> Loop:
    """The Loop of a ``.loop`` block, its iterations 1 and COUNT-1 checked as instructions too
    (operands are affine in the iteration: a bound that holds at both ends holds between, an
    alignment that holds for two consecutive iterations holds for all)."""
    line, col, count = loop
    try:
        made = Loop(body[0][1].engine, tuple(ins for _, ins, _, _ in body), count,
                    tuple(steps for _, _, steps, _ in body))
    except IllegalInstruction as exc:
        raise asm.error(getattr(exc, "reason", exc.message), line, col, hint=exc.hint) from None
    for i in sorted({1, count - 1} & set(range(1, count))):
        for k, ins in enumerate(made.iteration(i)):
            lineno, _, _, step_cols = body[k]
            try:
                check_instruction(ins, index=index + i * len(body) + k)
            except IllegalInstruction as exc:
                op = getattr(exc, "operand", None) or ""
                message = f"in iteration {i} of the loop: {getattr(exc, 'reason', exc.message)}"
                if exc.addresses:
                    message += f" [{', '.join(exc.addresses)}]"
                raise asm.error(message, lineno, step_cols.get(op, 1), hint=exc.hint) from None
    return made


def _instruction(asm: _Asm, lineno: int, code: str, sems: Mapping[str, int | None],
                 index: int, *, in_loop: bool = False
                 ) -> tuple[Instruction, tuple[tuple[str, int], ...], dict[str, int]]:
    """Parse and check one ``ENGINE: MNEMONIC OPERANDS`` line: the instruction, the steps of its
    operands written ``OPERAND +=STEP`` (only in a loop) and the column of each stepped operand."""
    indent = len(code) - len(code.lstrip())
    m = _ENGINE_RE.match(code)
    if not m:
        first = code.split()[0]
        try:
            parse_engine(first)
            raise asm.error(f"missing ':' after the engine {first}", lineno, indent + len(first) + 1,
                            hint="write `ENGINE: MNEMONIC OPERANDS`")
        except IllegalInstruction:
            pass  # not an engine either: say what a statement looks like
        if by_mnemonic(first):
            raise asm.error(f"{first} needs an engine in front", lineno, indent + 1,
                            hint=f"write e.g. `c0.{_unit_example(by_mnemonic(first))}: {first} ...`")
        raise asm.error(f"expected `ENGINE: MNEMONIC OPERANDS` or a directive, got {first!r}", lineno,
                        indent + 1)
    engine_text = m.group(1)
    try:
        engine = parse_engine(engine_text)
        bad_engine = check_engine(engine)
    except IllegalInstruction as exc:
        # The engine's form is right but a number is too long to parse: say so, else "unknown".
        bad_engine = exc.message if "digits" in exc.message else f"unknown engine {_clip(engine_text)!r}"
    if bad_engine:
        raise asm.error(bad_engine, lineno, m.start(1) + 1,
                        hint="engines are c<core>.dma<queue>, c<core>.mxu, c<core>.vpu and link")
    rest = code[m.end():]
    mm = re.match(r"\s*(\S+)", rest)
    if not mm:
        raise asm.error(f"missing mnemonic after {engine_text}:", lineno, m.end() + 1)
    mnemonic, mn_col = mm.group(1), m.end() + mm.start(1) + 1
    spec = by_mnemonic(mnemonic)
    if spec is None:
        close = difflib.get_close_matches(mnemonic, [s.mnemonic for s in TABLE], n=3)
        raise asm.error(f"unknown mnemonic {mnemonic!r}", lineno, mn_col,
                        hint=f"did you mean {' or '.join(close)}?" if close else "see isa/README.md")
    ops_start = m.end() + mm.end()
    pieces = _split_operands(code[ops_start:], ops_start, lineno, asm)

    # Positionals fill the required operands first, then the optional ones, each in table order.
    positional_order = sorted(spec.operands, key=lambda op: op.optional)
    values: dict[str, Any] = {}
    cols: dict[str, int] = {}
    n_positional = 0
    seen_keyword = False
    steps: list[tuple[str, int]] = []
    step_of: dict[int, tuple[int, int]] = {}  # piece -> (step, its column)
    for k, tok in enumerate(pieces):
        sm = _STEP_RE.search(tok.text)
        if sm is None:
            continue
        if not in_loop:
            raise asm.error("an operand step (+=) outside a loop", lineno, tok.col + sm.start() + 1,
                            hint="steps say how an operand changes from one iteration of a "
                            ".loop to the next")
        step_tok = _Tok(sm.group("step"), tok.col + sm.start("step"))
        step_of[k] = (asm.integer(step_tok, lineno, "operand step", signed=True, field="i64"),
                      tok.col + sm.start() + 1)
        pieces[k] = _Tok(tok.text[:sm.start()].rstrip(), tok.col)
    step_cols: dict[str, int] = {}
    for k, tok in enumerate(pieces):
        kw = _KEYWORD_RE.match(tok.text)
        if kw:
            seen_keyword = True
            op_name = kw.group(1)
            names = [op.name for op in spec.operands]
            if op_name not in names:
                close = difflib.get_close_matches(op_name, names, n=1)
                hint = f"did you mean {close[0]}?" if close else f"{mnemonic} takes {_signature(spec)}"
                raise asm.error(f"{mnemonic} has no operand {op_name!r}", lineno, tok.col, hint=hint)
            op = spec.operand(op_name)
            value_tok = _Tok(tok.text[kw.end():], tok.col + kw.end())
            if not value_tok.text:
                raise asm.error(f"{op_name}= needs a value", lineno, tok.col)
        else:
            if seen_keyword:
                raise asm.error("positional operand after a name=value operand", lineno, tok.col,
                                hint=f"{mnemonic} takes {_signature(spec)}")
            if n_positional >= len(positional_order):
                n = len(spec.operands)
                raise asm.error(f"{mnemonic} takes {n} operand{'' if n == 1 else 's'} ({_signature(spec)}); "
                                f"got {len(pieces)}", lineno, tok.col)
            op = positional_order[n_positional]
            n_positional += 1
            value_tok = tok
        if op.name in values:
            raise asm.error(f"{mnemonic} operand {op.name} is given twice", lineno, tok.col)
        values[op.name] = asm.value(op, spec, value_tok, lineno, sems)
        cols[op.name] = tok.col
        if k in step_of:
            step, step_col = step_of[k]
            if op.kind not in ("tile", "imm", "sem"):
                raise asm.error(f"{mnemonic} operand {op.name} is {op.kind}; only tiles (their offset) "
                                "and integers step in a loop", lineno, step_col)
            if step:
                steps.append((op.name, step))
                step_cols[op.name] = step_col
    missing = [op.name for op in spec.operands if not op.optional and op.name not in values]
    if missing:
        plural = "s" if len(missing) > 1 else ""
        raise asm.error(f"{mnemonic} is missing operand{plural} {', '.join(missing)} "
                        f"(got {len(pieces)} of {len(spec.operands)})", lineno,
                        pieces[-1].col + len(pieces[-1].text) if pieces else mn_col,
                        hint=f"{mnemonic} takes {_signature(spec)}")
    args = tuple((op.name, values.get(op.name, op.default)) for op in spec.operands)
    ins = Instruction(mnemonic, engine, args, f"{asm.source}:{lineno}")
    try:
        check_instruction(ins, index=index)
    except IllegalInstruction as exc:
        col = cols.get(getattr(exc, "operand", None) or "", indent + 1)
        # The line and column replace the "instruction #i on engine" prefix; keep the addresses.
        message = getattr(exc, "reason", exc.message)
        if exc.addresses:
            message += f" [{', '.join(exc.addresses)}]"
        raise asm.error(message, lineno, col, hint=exc.hint) from None
    order = [op.name for op in spec.operands]
    return ins, tuple(sorted(steps, key=lambda st: order.index(st[0]))), step_cols


def _unit_example(spec: InstrSpec | None) -> str:
    unit = spec.unit if spec else "mxu"
    return {"dma": "dma0", "any": "mxu"}.get(unit, unit) if unit != "link" else "link"
