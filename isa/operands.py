"""Operands of the kernel builder's instructions: the values they take and how a call binds them.

Stage: ISA (front end, beside ``builder.py``). ``Semaphore`` and ``MXTensor`` are the operand
values a kernel passes besides tiles and immediates. Binding turns an engine handle's call
(``core.dma[0].load(dst, src)``, ``core.vpu.exp(dst, src)``) into the instruction's operands in
table order, fills in defaults and keys the legality check: each table row gets an
``IssueLayout`` once, with an issue function generated for it (``_issue_source``), so that issuing
an instruction costs a few type tests and one dictionary lookup, not a walk over its operands.
"""

from __future__ import annotations

import difflib
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

from jalapeno_emu.errors import IllegalInstruction
from jalapeno_emu.isa.program import Engine, Instruction, Tile

from .legality import cores_only_compared_with_cores, integer_points, operands_read
from .table import TABLE, InstrSpec

__all__ = ["BINARY_OPS", "ISSUE_LAYOUTS", "MISSING", "UNARY_OPS", "IssueLayout", "MXTensor", "Semaphore",
           "bind_operands", "bind_short_form", "operation_of", "unknown_instruction_message"]


@dataclass(frozen=True)
class Semaphore:
    """A semaphore handle: its id and name."""

    id: int
    name: str

    def __index__(self) -> int:
        return self.id


@dataclass(frozen=True, slots=True)
class MXTensor:
    """An MX tensor in memory: element codes and their E8M0 scales, blocked by 32 along ``axis``.

    Attributes:
        codes: [R, C] tile of element codes (fp4 packed two per byte, fp8 one per byte).
        scales: [R, C/32] (axis 1) or [R/32, C] (axis 0) tile of E8M0 bytes.
        axis: the blocked axis.
    """

    codes: Tile
    scales: Tile
    axis: int

    def sub(self, row: int, col: int, rows: int, cols: int) -> MXTensor:
        """The [rows, cols] block-aligned sub-tensor at element [row, col], with its scales."""
        if self.axis == 1:
            if col % 32 or cols % 32:
                raise IllegalInstruction(f"columns {col}..{col + cols} of an MX tensor blocked along "
                                         "columns must be multiples of 32")
            scales = self.scales.sub(row, col // 32, rows, cols // 32)
        else:
            if row % 32 or rows % 32:
                raise IllegalInstruction(f"rows {row}..{row + rows} of an MX tensor blocked along "
                                         "rows must be multiples of 32")
            scales = self.scales.sub(row // 32, col, rows // 32, cols)
        out = _new(MXTensor)  # the fields of a valid tensor's parts: set, not checked again
        _SET_MX_CODES(out, self.codes.sub(row, col, rows, cols))
        _SET_MX_SCALES(out, scales)
        _SET_MX_AXIS(out, self.axis)
        return out


_new = object.__new__
_SET_MX_CODES, _SET_MX_SCALES, _SET_MX_AXIS = (
    MXTensor.__dict__[name].__set__ for name in ("codes", "scales", "axis"))


MISSING = object()
UNARY_OPS = TABLE[[s.mnemonic for s in TABLE].index("vec.unary")].operand("op").choices
BINARY_OPS = TABLE[[s.mnemonic for s in TABLE].index("vec.binary")].operand("op").choices
_U64_MAX = 2**64 - 1  # binary field widths (isa/encoding.py), checked by legality
_U32_MAX = 2**32 - 1
_I32_MAX = 2**31 - 1


def _usage(row: InstrSpec) -> str:
    """How ``row`` is called: ``vec.unary(op, dst, src)``, ``sem.signal(sem, count=1)``."""
    operands = (op.name if not op.optional else f"{op.name}={op.default!r}" for op in row.operands)
    return f"{row.mnemonic}({', '.join(operands)})"


def bind_operands(engine: Engine, row: InstrSpec, layout: IssueLayout, args: tuple, kwargs: dict,
          source: str) -> list:
    """Operand values in table order from positional and keyword arguments (MISSING where absent)."""
    names = layout.names
    if len(args) > len(names):
        raise IllegalInstruction(f"{row.mnemonic} takes at most {len(names)} operands, "
                                 f"got {len(args)}: {_usage(row)}", engine=str(engine), source=source)
    values = list(args) + [MISSING] * (len(names) - len(args))
    for name, value in kwargs.items():
        if name not in names:
            raise IllegalInstruction(f"{row.mnemonic} has no operand {name!r}; it takes {names}: "
                                     f"{_usage(row)}", engine=str(engine), source=source)
        i = names.index(name)
        if values[i] is not MISSING:
            raise IllegalInstruction(f"operand {name!r} given twice: {_usage(row)}", engine=str(engine),
                                     source=source)
        values[i] = value
    return values


def bind_short_form(engine: Engine, layout: IssueLayout, op: str, args: tuple, kwargs: dict,
                source: str) -> tuple:
    """The operands after ``op`` of a short form (``vpu.exp(dst, src)`` is
    ``vec.unary("exp", dst, src)``) from positional and keyword arguments, for the calls the
    short form's fast path does not take; a wrong call raises naming both spellings."""
    row, names = layout.row, layout.names[1:]
    values = list(args[:len(names)]) + [MISSING] * (len(names) - len(args))
    problem = f"got {len(args)} operands" if len(args) > len(names) else None
    for name, value in kwargs.items():
        if problem is not None:
            break
        if name not in names:
            problem = (f"the operation is {op!r} already" if name == row.operands[0].name
                       else f"it has no operand {name!r}")
        elif values[names.index(name)] is not MISSING:
            problem = f"operand {name!r} given twice"
        else:
            values[names.index(name)] = value
    missing = [n for n, v in zip(names, values, strict=True) if v is MISSING]
    if problem is None and missing:
        problem = f"operand {', '.join(map(repr, missing))} missing"
    if problem is not None:
        listed = ", ".join(names)
        raise IllegalInstruction(
            f'{engine.unit}.{op}({listed}), short for {row.mnemonic}("{op}", {listed}): {problem}',
            engine=str(engine), source=source)
    return tuple(values)


def operation_of(rows: Any, name: str) -> InstrSpec | None:
    """The row among ``rows`` whose first operand is an operation ``name`` can be (``sum`` of
    ``vec.reduce``), or None."""
    for row in rows:
        first = row.operands[0] if row.operands else None
        if first is not None and first.kind == "enum" and name in first.choices:
            return row
    return None


def unknown_instruction_message(engine: Engine, rows: dict[str, InstrSpec], name: str) -> str:
    """The message for ``engine.<name>`` that is no instruction of the engine: what to write
    instead when ``name`` is an operation of one (``vpu.sum`` is ``reduce("sum", dst, src)``) or
    an instruction of another unit, else the close spellings. Only the error path pays for it."""
    text = f"engine {engine} has no instruction {name!r}"
    row = operation_of(rows.values(), name)
    if row is not None:
        rest = ", ".join(op.name for op in row.operands[1:])
        short = row.mnemonic.split(".")[-1]
        return f'{text}; {name!r} is an operation of {row.mnemonic}: write {short}("{name}", {rest})'
    units = sorted({r.unit for r in TABLE if r.mnemonic.split(".")[-1] == name
                    and r.unit not in (engine.unit, "any")})
    if units:
        where = " or ".join("core.dma[q]" if u == "dma" else "kb.link" if u == "link" else f"core.{u}"
                            for u in units)
        return f"{text}; {name} is an instruction of the {'/'.join(units)} unit: {where}.{name}(...)"
    names = [*rows, "issue"]
    names += [*UNARY_OPS] if "unary" in rows else []
    names += [*BINARY_OPS] if "binary" in rows else []
    names += ["matmul_mx"] if "matmul" in rows else []
    near = difflib.get_close_matches(name, names, n=3)
    if near:
        return f"{text}; did you mean {' or '.join(near)}? It takes {sorted(rows)}"
    return f"{text}; it takes {sorted(rows)}"


def _operand(layout: IssueLayout, i: int, v: Any, engine: Engine, source: str, base: int) -> tuple[Any, Any]:
    """Operand ``i``'s value as recorded (default filled in, a Semaphore as its id) and its part of
    the legality key (None: check the instruction on its own); tile cores are keyed relative to
    ``base``. The generated issue functions call this for any value that is not of the type the
    operand usually takes."""
    row, name = layout.row, layout.names[i]
    if type(v) is Tile:
        c, o, r, cl, st = v.core, v.offset, v.rows, v.cols, v.stride
        if type(c) is type(o) is type(r) is type(cl) is type(st) is int and o <= _U64_MAX \
                and 0 <= c <= _U32_MAX:
            rel = c - base if name in layout.cores_read else None
            return v, (id(v.space), rel, c == 0, v.dtype, r, cl, st, o if layout.with_offset else None)
        return v, None
    if v is MISSING:
        v = layout.defaults[i]
        if v is MISSING:
            raise IllegalInstruction(f"{row.mnemonic} needs operand {name!r}: {_usage(row)}",
                                     engine=str(engine), source=source)
    cls = type(v)
    if cls is Semaphore:
        v = v.id
        cls = type(v)
    elif cls is MXTensor:
        raise IllegalInstruction(f"operand {name!r} got an MXTensor; pass .codes/.scales or use matmul_mx",
                                 engine=str(engine), source=source)
    points = layout.points[i]
    if cls is int and points is not None:
        j = bisect_left(points, v)
        return v, 2 * j + (j < len(points) and points[j] == v)
    if cls is str or cls is int:
        return v, v
    return v, (cls, v)


def _issue_source(layout: IssueLayout) -> str:
    """Python source of the row's issue function: ``_operand`` unrolled over the operands, with
    the common type of each operand tested first, then the instruction and its legality check."""
    lines = ["def issue(kb, engine, values, source):",
             "    reg = kb._region",
             "    if reg is not None and reg._seen.get(id(engine)) is not engine:",
             "        reg._enter(engine)",
             f"    {', '.join(f'v{i}' for i in range(len(layout.names)))}, = values",
             "    base = engine.core"]
    if layout.relative_cores:
        lines += ["    if type(base) is int and 0 <= base <= I32:",
                  "        ekey = True",
                  "    else:",
                  "        ekey, base = (type(base), base), 0"]
    else:
        lines += ["    ekey, base = (type(base), base), 0"]
    for i, op in enumerate(layout.row.operands):
        v, k = f"v{i}", f"k{i}"
        slow = f"        {v}, {k} = _operand(layout, {i}, {v}, engine, source, base)"
        if op.kind == "tile":
            offset = "o" if layout.with_offset else "None"
            rel = "c - base" if op.name in layout.cores_read else "None"
            lines += [f"    if type({v}) is Tile:",
                      f"        c, o, r, cl, st = {v}.core, {v}.offset, {v}.rows, {v}.cols, {v}.stride",
                      "        if type(c) is type(o) is type(r) is type(cl) is type(st) is int and o <= U64 "
                      "and 0 <= c <= U32:",
                      f"            {k} = (id({v}.space), {rel}, c == 0, {v}.dtype, r, cl, st, {offset})",
                      "        else:",
                      f"            {k} = None"]
        elif op.kind in ("imm", "sem") and layout.points[i] is not None:
            lines += [f"    if type({v}) is Semaphore and type({v}.id) is int:",
                      f"        {v} = {v}.id",
                      f"    if type({v}) is int:",
                      f"        j = bisect_left(P{i}, {v})",
                      f"        {k} = 2 * j + (j < {len(layout.points[i])} and P{i}[j] == {v})"]
        else:
            common = {"enum": "str", "label": "str", "fimm": "float"}.get(op.kind, "int")
            lines += [f"    if type({v}) is {common}:",
                      f"        {k} = {v}" if common != "float" else f"        {k} = (float, {v})"]
        lines += ["    else:", slow]
    n = len(layout.names)
    args = ", ".join(f"({name!r}, v{i})" for i, name in enumerate(layout.names))
    keys = " and ".join(f"k{i} is not None" for i in range(n))
    # The Instruction's fields through its slots' setters (a frozen dataclass's __init__ looks
    # each up through object.__setattr__): the operands were bound above, the engine is the
    # handle's own.
    lines += ["    ins = new(Instruction)",
              "    SET_MNEMONIC(ins, MNEMONIC)",
              "    SET_ENGINE(ins, engine)",
              f"    SET_ARGS(ins, ({args},))",
              "    SET_SOURCE(ins, source)",
              f"    if {keys}:",
              f"        key = (ekey, engine.unit, engine.queue, MNEMONIC, "
              f"{', '.join(f'k{i}' for i in range(n))})",
              "        try:",
              "            hit = key in kb._legal",
              "        except TypeError:  # an unhashable operand: the check says what is wrong with it",
              "            hit, key = False, None",
              "        if not hit:",
              "            kb._check_new(ins, key)",
              "    else:",
              "        kb._check_new(ins, None)",
              "    kb._instructions.append(ins)",
              "    return ins"]
    return "\n".join(lines) + "\n"


class IssueLayout:
    """What issuing one table row needs, worked out once per row, including its issue function.

    Legality (``check_instruction``) is checked once per distinct *key*, which holds exactly what
    the checks read:

    - the engine's unit and queue, and whether its core is a valid core number;
    - per tile: its space, dtype, rows, cols and stride (the offset too if a rule reads it), its
      core relative to the engine's if a rule reads it, and whether it is 0 (HBM tiles must be on
      core 0). Keying cores relative to the engine's is exact because the rules only compare cores
      with cores (``legality.cores_only_compared_with_cores``, else cores are keyed as they are),
      so one check covers every core. A tile with a field that is not a plain int (a float, a numpy integer)
      or outside its binary field makes the key None: the instruction is checked on its own;
    - per integer operand that the rules only compare with constants (``value >= 1``), its
      position among those constants and its field's bounds (``legality.integer_points``):
      ``sem.wait``'s value differs on almost every call, its verdict on none;
    - per other operand, its value (with its type unless it is an int or str: ``True == 1`` but
      only one of them is a legal count).
    """

    __slots__ = ("cores_read", "defaults", "issue", "names", "pads", "points", "relative_cores", "row",
                 "with_offset")

    def __init__(self, row: InstrSpec) -> None:
        self.row = row
        self.names = tuple(op.name for op in row.operands)
        self.defaults = tuple(op.default if op.optional else MISSING for op in row.operands)
        self.with_offset = any("offset" in rule for rule in row.rules)
        # Defaults of trailing optional operands: ``signal(sem)`` is ``signal(sem, 1)``.
        self.pads = {k: self.defaults[k:] for k in range(len(self.names))
                     if MISSING not in self.defaults[k:]}
        points = integer_points(row)
        self.points = tuple(points.get(name) for name in self.names)
        self.relative_cores = cores_only_compared_with_cores(row)
        self.cores_read = operands_read(row, "core")
        scope = {"Tile": Tile, "Semaphore": Semaphore, "Instruction": Instruction, "new": object.__new__,
                 **{f"SET_{name.upper()}": Instruction.__dict__[name].__set__
                    for name in ("mnemonic", "engine", "args", "source")},
                 "U64": _U64_MAX,
                 "U32": _U32_MAX, "I32": _I32_MAX,
                 "bisect_left": bisect_left, "_operand": _operand, "layout": self,
                 "MNEMONIC": row.mnemonic, **{f"P{i}": p for i, p in enumerate(self.points)}}
        exec(compile(_issue_source(self), f"<issue {row.mnemonic}>", "exec"), scope)
        self.issue = scope["issue"]


ISSUE_LAYOUTS = {row.mnemonic: IssueLayout(row) for row in TABLE}
