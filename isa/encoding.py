"""The binary format of instructions and Programs (``.bin`` files): encoder and decoder.

Stage: ISA, beside the assembler: ``jalapeno-emu asm`` writes this format, ``disasm`` reads it.

Format
------

Everything is little-endian, fixed-width fields packed with ``struct``; strings are a u32 byte
length then UTF-8. The operand layout of each instruction comes from its row in ``isa/table.py``,
so a new row is encodable without touching this module.

Program:

```
magic     4 bytes   b"JEMU"
version   u16       1 for a program without loops, 2 (FORMAT_VERSION) for one with loops
name      str       kernel name
preset    str       chip preset
allocs    u32 n, then n x (name str, space u8, core i32, offset u64, nbytes u64)
sems      u32 n, then n x (id u32, name str)
inits     u32 n, then n x (name str, kind str, dtype u8, seed i64)
items     u32 n, then n items; nothing may follow. Version 1: each item is an instruction.
          Version 2: an instruction, or a loop (``isa.program.Loop``):
            marker u8 0 (no opcode is 0), count u32, body length u32, then per body
            instruction: the instruction, steps u8 n, n x (operand index u8 in table
            order, step i64)
```

A program without loops is written as version 1, byte for byte what readers before loops
wrote and read; the reader takes both versions.

Instruction:

```
opcode    u8        the row's opcode
engine    unit u8 (dma 1, mxu 2, vpu 3, link 4), core i32 (-1 for link), queue u32
operands  in table order:
          tile  optional tiles first get a presence byte (0 absent, 1 present); then
                space u8 (hbm 1, sram 2, acc 3), core u32, offset u64, dtype u8 (the
                table's DType.code), rows u32, cols u32, stride u64 (bytes)
          imm   i64         fimm  f64         enum  u8 index into choices         sem  u32
          label str (a probe's name: 1 to 64 printable characters)
source    str       where it was built or assembled ("k.py:42"), or empty
```

Sources are the only part of an encoding that says where a program came from rather than what it
is, and ``jalapeno-emu asm`` writes them empty (``encode_program(..., sources=False)``): a
binary then depends on the program alone, so one file assembled from any folder gives the same
bytes, and ``asm`` -> ``disasm`` -> ``asm`` gives back the same bytes (a disassembly's line
numbers differ from the original's). The kernel name is kept; without ``.kernel`` it is the
file's stem, the one part of the file name that matters. Errors from running a binary name
instructions by index (``instruction #5 on c0.vpu``), the position in the ``disasm`` listing;
run the ``.jasm`` for file and line.

Optional imm/enum operands are always written (with their value, default or not), so the decoder
returns instructions in canonical form: every operand present, in table order (see
``legality.canonical``). ``Program.meta`` is not encoded.

Malformed input (bad magic, a newer version, truncation, an unknown opcode/unit/space/dtype
code, an enum index out of range, invalid UTF-8, an impossible tile, an instruction ``encode``
would refuse such as an HBM tile on core 1 or an mxu with a queue, bytes after the last
instruction) raises ``AssemblyError`` naming the byte offset; the offset is also in ``.offset``.
So every Program ``decode_program`` returns encodes back to the same bytes.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

from jalapeno_emu.errors import AssemblyError, EmuError, IllegalInstruction, InvalidArgumentError
from jalapeno_emu.isa.program import Allocation, Engine, HbmInit, Instruction, Loop, Program, Tile

from .legality import check_engine, operand_values
from .table import DTYPES, Space, by_mnemonic, by_opcode

__all__ = ["FORMAT_VERSION", "MAGIC", "decode", "decode_program", "encode", "encode_program"]

MAGIC = b"JEMU"
FORMAT_VERSION = 2
_LOOP_MARKER = 0  # the first byte of a loop item (opcodes start at 1)

# Codes start at 1 so that a run of zero bytes never decodes as something plausible.
_SPACE_CODES = {Space.HBM: 1, Space.SRAM: 2, Space.ACC: 3}
_SPACES = {v: k for k, v in _SPACE_CODES.items()}
_UNIT_CODES = {"dma": 1, "mxu": 2, "vpu": 3, "link": 4}
_UNITS = {v: k for k, v in _UNIT_CODES.items()}
_DTYPES_BY_CODE = {d.code: d.name for d in DTYPES.values()}

_U8, _U16, _U32, _I32 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<i"))
_U64, _I64, _F64 = (struct.Struct(f) for f in ("<Q", "<q", "<d"))
_TILE = struct.Struct("<BIQBIIQ")  # space, core, offset, dtype, rows, cols, stride
_ENGINE = struct.Struct("<BiI")  # unit, core, queue


def _str(text: str) -> bytes:
    data = text.encode("utf-8")
    return _U32.pack(len(data)) + data


def _tile(t: Tile) -> bytes:
    return _TILE.pack(_SPACE_CODES[t.space], t.core, t.offset, DTYPES[t.dtype].code, t.rows, t.cols, t.stride)


def encode(ins: Instruction) -> bytes:
    """Encode one instruction (no program header).

    Only what the format needs is checked (known mnemonic, well-formed engine, every operand of
    the right kind and within its field); run ``check_instruction`` for full legality.

    Raises:
        IllegalInstruction: the instruction cannot be represented.
    """
    spec, values = operand_values(ins, domains=False)
    bad_engine = check_engine(ins.engine)
    if bad_engine:
        raise IllegalInstruction(bad_engine, engine=str(ins.engine), source=ins.source or None)
    if not isinstance(ins.source, str):
        raise IllegalInstruction(f"source {ins.source!r} is not a string", engine=str(ins.engine))
    engine = _ENGINE.pack(_UNIT_CODES[ins.engine.unit], ins.engine.core, ins.engine.queue)
    out = [_U8.pack(spec.opcode), engine]
    for op in spec.operands:
        value = values[op.name]
        if op.kind == "tile":
            if op.optional:
                out.append(_U8.pack(value is not None))
            if value is not None:
                out.append(_tile(value))
        elif op.kind == "imm":
            out.append(_I64.pack(value))
        elif op.kind == "fimm":
            out.append(_F64.pack(float(value)))
        elif op.kind == "enum":
            out.append(_U8.pack(op.choices.index(value)))
        elif op.kind == "sem":
            out.append(_U32.pack(value))
        elif op.kind == "label":
            out.append(_str(value))
        else:  # pragma: no cover - a new operand kind needs an encoding
            raise ValueError(f"no encoding for operand kind {op.kind!r}")
    out.append(_str(ins.source))
    return b"".join(out)


def encode_program(program: Program, *, sources: bool = True) -> bytes:
    """Encode a whole Program: header, allocations, semaphore names, inits, instructions.

    Args:
        program: the program.
        sources: keep each instruction's ``source``; False writes them empty, so the bytes do not
            depend on where the text was assembled (what ``jalapeno-emu asm`` does).

    Raises:
        IllegalInstruction: an instruction cannot be represented (its index is in the message).
        InvalidArgumentError: a program-level field cannot be represented (unknown init dtype,
            a negative offset...).
    """
    items = program.items
    version = FORMAT_VERSION if program.loops else 1
    try:
        out = [MAGIC, _U16.pack(version), _str(program.name), _str(program.preset)]
        out.append(_U32.pack(len(program.allocations)))
        for a in program.allocations:
            out += [_str(a.name), _U8.pack(_SPACE_CODES[a.space]), _I32.pack(a.core), _U64.pack(a.offset),
                    _U64.pack(a.nbytes)]
        out.append(_U32.pack(len(program.semaphores)))
        for sem_id, name in program.semaphores:
            out += [_U32.pack(sem_id), _str(name)]
        out.append(_U32.pack(len(program.inits)))
        for init in program.inits:
            out += [_str(init.name), _str(init.kind), _U8.pack(DTYPES[init.dtype].code), _I64.pack(init.seed)]
    except (struct.error, KeyError, AttributeError, TypeError, UnicodeError) as exc:
        raise InvalidArgumentError(f"program {program.name!r} has a field the binary format cannot hold: "
                                   f"{type(exc).__name__}: {exc}") from None
    out.append(_U32.pack(len(items)))
    index = 0  # instruction index, loops unrolled (what messages and the checker count)

    def one(ins: Instruction, index: int) -> bytes:
        try:
            return encode(ins if sources or not ins.source else dataclasses.replace(ins, source=""))
        except IllegalInstruction as exc:
            raise IllegalInstruction(getattr(exc, "reason", exc.message), index=index, engine=exc.engine,
                                     source=exc.source, hint=exc.hint) from None

    for item in items:
        if type(item) is not Loop:
            out.append(one(item, index))
            index += 1
            continue
        out += [_U8.pack(_LOOP_MARKER), _U32.pack(item.count), _U32.pack(len(item.body))]
        for k, (ins, steps) in enumerate(zip(item.body, item.steps, strict=True)):
            out.append(one(ins, index + k))
            names = [op.name for op in by_mnemonic(ins.mnemonic).operands]
            out.append(_U8.pack(len(steps)))
            out += [_U8.pack(names.index(name)) + _I64.pack(step) for name, step in steps]
        index += item.size
    return b"".join(out)


class _Reader:
    """Bounds-checked reads that turn every failure into an AssemblyError with the byte offset."""

    def __init__(self, data: bytes, pos: int, source: str) -> None:
        self.data = bytes(data)
        self.pos = pos
        self.source = source

    def fail(self, message: str, at: int | None = None, hint: str | None = None) -> AssemblyError:
        at = self.pos if at is None else at
        exc = AssemblyError(f"byte {at}: {message}", source=self.source, hint=hint)
        exc.offset = at
        return exc

    def take(self, fmt: struct.Struct, what: str) -> tuple[Any, ...]:
        end = self.pos + fmt.size
        if end > len(self.data):
            left = len(self.data) - self.pos
            raise self.fail(f"truncated: {what} needs {fmt.size} bytes, only {left} left")
        values = fmt.unpack_from(self.data, self.pos)
        self.pos = end
        return values

    def one(self, fmt: struct.Struct, what: str) -> Any:
        return self.take(fmt, what)[0]

    def text(self, what: str) -> str:
        at = self.pos
        n = self.one(_U32, f"length of {what}")
        if self.pos + n > len(self.data):
            raise self.fail(f"truncated: {what} is {n} bytes long, only {len(self.data) - self.pos} left", at)
        raw = self.data[self.pos:self.pos + n]
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8", self.pos + exc.start) from None
        self.pos += n
        return value

    def dtype(self, what: str) -> str:
        at = self.pos
        code = self.one(_U8, what)
        if code not in _DTYPES_BY_CODE:
            raise self.fail(f"unknown dtype code {code} in {what}", at)
        return _DTYPES_BY_CODE[code]

    def space(self, what: str) -> Space:
        at = self.pos
        code = self.one(_U8, what)
        if code not in _SPACES:
            raise self.fail(f"unknown memory space code {code} in {what}", at)
        return _SPACES[code]


def _read_tile(r: _Reader, what: str) -> Tile:
    at = r.pos
    space = r.space(what)
    r.pos = at  # re-read the whole record in one unpack now that the space byte is known good
    _, core, offset, dtype_code, rows, cols, stride = r.take(_TILE, what)
    if dtype_code not in _DTYPES_BY_CODE:
        raise r.fail(f"unknown dtype code {dtype_code} in {what}", at + 13)
    try:
        return Tile(space, core, offset, _DTYPES_BY_CODE[dtype_code], rows, cols, stride)
    except EmuError as exc:
        raise r.fail(f"{what} is not a valid tile: {exc.message}", at) from None


def _read_instruction(r: _Reader) -> Instruction:
    at = r.pos
    opcode = r.one(_U8, "opcode")
    spec = by_opcode(opcode)
    if spec is None:
        raise r.fail(f"unknown opcode {opcode:#04x}", at)
    unit_at = r.pos
    unit_code, core, queue = r.take(_ENGINE, f"{spec.mnemonic} engine")
    if unit_code not in _UNITS:
        raise r.fail(f"unknown engine unit code {unit_code} in {spec.mnemonic}", unit_at)
    args: list[tuple[str, Any]] = []
    for op in spec.operands:
        what = f"{spec.mnemonic} operand {op.name}"
        if op.kind == "tile":
            present = True
            if op.optional:
                flag_at = r.pos
                flag = r.one(_U8, f"presence byte of {what}")
                if flag not in (0, 1):
                    raise r.fail(f"presence byte of {what} is {flag}, not 0 or 1", flag_at)
                present = bool(flag)
            args.append((op.name, _read_tile(r, what) if present else None))
        elif op.kind == "imm":
            args.append((op.name, r.one(_I64, what)))
        elif op.kind == "fimm":
            args.append((op.name, r.one(_F64, what)))
        elif op.kind == "enum":
            idx_at = r.pos
            idx = r.one(_U8, what)
            if idx >= len(op.choices):
                raise r.fail(f"{what}: choice index {idx} is out of range (0..{len(op.choices) - 1})", idx_at)
            args.append((op.name, op.choices[idx]))
        elif op.kind == "sem":
            args.append((op.name, r.one(_U32, what)))
        elif op.kind == "label":
            args.append((op.name, r.text(what)))
        else:  # pragma: no cover
            raise ValueError(f"no decoding for operand kind {op.kind!r}")
    source = r.text(f"source of {spec.mnemonic}")
    ins = Instruction(spec.mnemonic, Engine(core, _UNITS[unit_code], queue), tuple(args), source)
    # What encode() refuses, no encoder wrote: refuse it here too (an HBM tile on core 1, an mxu
    # with a queue), so that every decoded Program encodes back to the same bytes.
    bad_engine = check_engine(ins.engine)
    if bad_engine:
        raise r.fail(f"{spec.mnemonic}: {bad_engine}", unit_at)
    try:
        operand_values(ins, domains=False)
    except IllegalInstruction as exc:
        raise r.fail(f"instruction is not encodable: {getattr(exc, 'reason', exc.message)}", at) from None
    return ins


def decode(data: bytes, offset: int = 0, *, source: str = "<binary>") -> tuple[Instruction, int]:
    """Decode one instruction starting at ``offset``.

    Args:
        data: the bytes (any bytes-like object).
        offset: where the instruction starts.
        source: the file name, for messages.

    Returns:
        (the instruction in canonical form, the offset just past it).

    Raises:
        AssemblyError: malformed bytes, naming the byte offset (also in ``.offset``).
    """
    r = _Reader(data, offset, source)
    if not 0 <= offset <= len(r.data):
        raise r.fail(f"offset {offset} is outside the {len(r.data)}-byte input", 0)
    ins = _read_instruction(r)
    return ins, r.pos


def decode_program(data: bytes, *, source: str = "<binary>") -> Program:
    """Decode a whole Program written by :func:`encode_program`.

    Raises:
        AssemblyError: bad magic, a newer format version, malformed or trailing bytes, naming the
            byte offset (also in ``.offset``).
    """
    r = _Reader(data, 0, source)
    if r.data[:4] != MAGIC:
        looks_text = r.data[:4].isascii() and all(32 <= b < 127 or b in (9, 10, 13) for b in r.data[:64])
        hint = ("this looks like assembly text; use `jalapeno-emu asm` on it"
                if looks_text and r.data else None)
        raise r.fail(f"not a jalapeno-emu binary (magic {r.data[:4]!r}, expected {MAGIC!r})", 0, hint=hint)
    r.pos = 4
    version = r.one(_U16, "format version")
    if version not in (1, FORMAT_VERSION):
        raise r.fail(f"format version {version} is not supported (this reader knows 1 to {FORMAT_VERSION})",
                     4)
    name = r.text("kernel name")
    preset = r.text("preset name")
    allocations = []
    for _ in range(r.one(_U32, "allocation count")):
        a_name = r.text("allocation name")
        space = r.space(f"allocation {a_name!r}")
        (core,) = r.take(_I32, f"allocation {a_name!r} core")
        off, nbytes = r.one(_U64, f"allocation {a_name!r} offset"), r.one(_U64, f"allocation {a_name!r} size")
        allocations.append(Allocation(a_name, space, core, off, nbytes))
    sems = []
    for _ in range(r.one(_U32, "semaphore count")):
        sem_id = r.one(_U32, "semaphore id")
        sems.append((sem_id, r.text(f"name of semaphore {sem_id}")))
    inits = []
    for _ in range(r.one(_U32, "init count")):
        i_name = r.text("init name")
        kind = r.text(f"init kind of {i_name!r}")
        dtype = r.dtype(f"init dtype of {i_name!r}")
        inits.append(HbmInit(i_name, kind, dtype, r.one(_I64, f"init seed of {i_name!r}")))
    items: list[Instruction | Loop] = []
    for _ in range(r.one(_U32, "item count" if version > 1 else "instruction count")):
        if version > 1 and r.pos < len(r.data) and r.data[r.pos] == _LOOP_MARKER:
            items.append(_read_loop(r))
        else:
            items.append(_read_instruction(r))
    if r.pos != len(r.data):
        raise r.fail(f"{len(r.data) - r.pos} bytes of trailing garbage after the last instruction")
    return Program(name, tuple(items), tuple(allocations), preset, tuple(sems), tuple(inits))


def _read_loop(r: _Reader) -> Loop:
    at = r.pos
    r.pos += 1  # the marker
    count, n = r.one(_U32, "loop count"), r.one(_U32, "loop body length")
    if count < 1 or n < 1:
        raise r.fail(f"a loop of {count} iterations over {n} instructions; both must be at least 1", at + 1)
    body, steps = [], []
    for _ in range(n):
        ins = _read_instruction(r)
        operands = by_mnemonic(ins.mnemonic).operands
        mine = []
        for _ in range(r.one(_U8, f"step count of {ins.mnemonic}")):
            idx_at = r.pos
            idx = r.one(_U8, f"stepped operand of {ins.mnemonic}")
            if idx >= len(operands):
                raise r.fail(f"{ins.mnemonic} has no operand {idx} to step (0..{len(operands) - 1})", idx_at)
            mine.append((operands[idx].name, r.one(_I64, f"step of {ins.mnemonic} {operands[idx].name}")))
        body.append(ins)
        steps.append(tuple(mine))
    try:
        return Loop(body[0].engine, tuple(body), count, tuple(steps))
    except IllegalInstruction as exc:
        raise r.fail(f"not a valid loop: {getattr(exc, 'reason', exc.message)}", at) from None
