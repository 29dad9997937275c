"""The legality checker: is an ``Instruction`` (or a whole ``Program``) allowed by the instruction table?

Stage: ISA. The assembler runs it on every line, the CLI on every file, the emulator before a pass.
Everything it checks comes from ``isa/table.py``: the mnemonic, which engine unit may issue it,
each operand's kind, memory spaces, dtypes and enum choices, and the row's ``rules``. The rules
are Python expressions kept as text in the table (so the reference prints them verbatim); they are
parsed once with :mod:`ast`, restricted to comparisons and arithmetic over operand fields, and
evaluated with no builtins, so a table row can never run arbitrary code.

Capacity (does a tile fit the preset's SRAM?) and bounds against allocations are not checked here:
they need a chip preset and belong to the emulator.
"""

from __future__ import annotations

import ast
import difflib
import numbers
from typing import Any

from jalapeno_emu.errors import IllegalInstruction
from jalapeno_emu.isa.program import Engine, Instruction, Program, Tile

from .table import LABEL_MAX_CHARS, TABLE, InstrSpec, OperandSpec, Space, by_mnemonic

__all__ = ["ENGINE_UNITS", "canonical", "check_engine", "check_instruction", "check_legality",
           "check_program", "check_rule", "cores_only_compared_with_cores", "integer_points", "label_problem",
           "operands_read"]

ENGINE_UNITS = ("dma", "mxu", "vpu", "link")
"""Engine kinds an ``Engine`` may have (the table's ``unit`` may also be "any")."""

# Widths of the binary fields (isa/encoding.py). The checker enforces them so that every legal
# instruction encodes, and the encoder can reuse the structural half of the checker.
_I64 = (-(2**63), 2**63 - 1)
_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_I32_MAX = 2**31 - 1

_TILE_ATTRS = frozenset({"rows", "cols", "shape", "dtype", "nbytes", "row_bytes", "core", "offset", "stride"})
_ALLOWED_NODES = (
    ast.Expression, ast.Name, ast.Attribute, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp,
    ast.Constant, ast.Tuple, ast.Load,
    ast.And, ast.Or, ast.Not, ast.USub,
    ast.FloorDiv, ast.Mod, ast.Add, ast.Sub, ast.Mult,
    ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is, ast.IsNot, ast.In, ast.NotIn,
)


class _Rule:
    """A compiled rule: its code, the names it reads, and the sub-expressions quoted on failure."""

    __slots__ = ("code", "names", "shown")

    def __init__(self, code, names: frozenset[str], shown: tuple[tuple[str, str, str | None], ...]):
        self.code = code
        self.names = names
        self.shown = shown  # (label, name, attribute or None), in source order


_RULES: dict[str, _Rule] = {}


def _compile_rule(rule: str) -> _Rule:
    """Parse and vet one rule string (cached: every row's rules compile once per process)."""
    cached = _RULES.get(rule)
    if cached is not None:
        return cached
    try:
        tree = ast.parse(rule, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"table rule {rule!r} is not an expression: {exc.msg}") from None
    names: set[str] = set()
    shown: dict[str, tuple[int, str, str | None]] = {}
    attr_bases: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise ValueError(f"table rule {rule!r} uses {type(node).__name__}, which rules may not use")
        if isinstance(node, ast.Attribute):
            if not isinstance(node.value, ast.Name) or node.attr not in _TILE_ATTRS:
                raise ValueError(f"table rule {rule!r}: only <operand>.<{'|'.join(sorted(_TILE_ATTRS))}>"
                                 " attributes are allowed")
            attr_bases.add(id(node.value))
            label = f"{node.value.id}.{node.attr}"
            shown.setdefault(label, (node.col_offset, node.value.id, node.attr))
        elif isinstance(node, ast.Name):
            names.add(node.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and id(node) not in attr_bases:
            shown.setdefault(node.id, (node.col_offset, node.id, None))
    compiled = _Rule(
        compile(tree, f"<rule {rule}>", "eval"),
        frozenset(names),
        tuple((label, name, attr)
              for label, (_, name, attr) in sorted(shown.items(), key=lambda kv: kv[1][0])),
    )
    _RULES[rule] = compiled
    return compiled


# (mnemonic, rule) -> the row whose operands the rule was found to name only (checked once per row).
_VETTED: dict[tuple[str, str], InstrSpec] = {}

_ORDER_OPS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _compared_with_constants_only(tree: ast.AST, name: str) -> bool:
    """True when every use of ``name`` in ``tree`` is a term of a comparison (``==``, ``<``, ...)
    whose other terms are all integer constants, e.g. ``value >= 1`` or ``0 <= id < 8``."""
    uses = sum(isinstance(node, ast.Name) and node.id == name for node in ast.walk(tree))
    plain = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare) or not all(isinstance(op, _ORDER_OPS) for op in node.ops):
            continue
        terms = [node.left, *node.comparators]
        mine = [t for t in terms if isinstance(t, ast.Name) and t.id == name]
        others = [t for t in terms if not (isinstance(t, ast.Name) and t.id == name)]
        if mine and all(isinstance(t, ast.Constant) and type(t.value) is int for t in others):
            plain += len(mine)
    return plain == uses


def integer_points(spec: InstrSpec) -> dict[str, tuple[int, ...]]:
    """Where :func:`check_instruction`'s verdict can change along each integer operand of ``spec``.

    For every ``imm`` or ``sem`` operand that the row's rules use only in comparisons with integer
    constants (``value >= 1``; not in arithmetic, not against another operand): the sorted points
    made of those constants and the bounds of the operand's binary field. For a plain ``int``
    value, the verdict depends only on which point it equals or which two points it lies between,
    so a caller may cache verdicts by that position (the builder does: ``sem.wait``'s value differs
    on almost every call). Operands used in any other way are left out.

    Returns:
        operand name -> sorted tuple of points.
    """
    trees = [_compile_tree(rule) for rule in spec.rules]
    out: dict[str, tuple[int, ...]] = {}
    for op in spec.operands:
        if op.kind not in ("imm", "sem"):
            continue
        if not all(_compared_with_constants_only(tree, op.name) for tree in trees):
            continue
        points = set(_I64 if op.kind == "imm" else (0, _U32_MAX))
        for tree in trees:
            points.update(node.value for node in ast.walk(tree)
                          if isinstance(node, ast.Constant) and type(node.value) is int)
        out[op.name] = tuple(sorted(points))
    return out


_EQUALITY_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def _is_core(node: ast.AST) -> bool:
    """``core`` or ``<operand>.core``."""
    return (isinstance(node, ast.Name) and node.id == "core") or \
        (isinstance(node, ast.Attribute) and node.attr == "core")


def cores_only_compared_with_cores(spec: InstrSpec) -> bool:
    """True when ``spec``'s rules read core numbers (``core``, ``<tile>.core``) only to compare them
    with each other for equality (``==``, ``!=``, ``in``/``not in`` a tuple of cores).

    Then the rules' verdict is the same for any two instructions whose cores are equal in the same
    pattern (``dst.core == core`` holds for both or for neither, ...), whatever the numbers: the
    builder checks an instruction once for all cores instead of once per core.
    """
    for rule in spec.rules:
        tree = _compile_tree(rule)
        uses = sum(_is_core(node) for node in ast.walk(tree))
        allowed = 0
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare) or not all(isinstance(op, _EQUALITY_OPS) for op in node.ops):
                continue
            terms = [node.left, *node.comparators]
            flat = [e for t in terms for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            if all(_is_core(t) for t in flat):
                allowed += len(flat)
        if allowed != uses:
            return False
    return True


def operands_read(spec: InstrSpec, attr: str) -> frozenset[str]:
    """Names of the operands whose ``attr`` (e.g. "core") some rule of ``spec`` reads."""
    nodes = [node for rule in spec.rules for node in ast.walk(_compile_tree(rule))]
    return frozenset(node.value.id for node in nodes if isinstance(node, ast.Attribute)
                     and node.attr == attr and isinstance(node.value, ast.Name))


def _compile_tree(rule: str) -> ast.Expression:
    """The vetted syntax tree of ``rule``."""
    _compile_rule(rule)  # vets it
    return ast.parse(rule, mode="eval")


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def check_rule(spec: InstrSpec, rule: str, env: dict[str, Any]) -> str | None:
    """Evaluate one of ``spec``'s rules over ``env``; None when it holds, else why not.

    Args:
        spec: the row the rule belongs to (its operand names, plus ``core``, are the only names).
        rule: the rule text, e.g. ``"a.cols == b.rows"``.
        env: operand values by name, plus ``core`` (the issuing engine's core).

    Returns:
        None if the rule holds, else one sentence quoting the rule and the values it read, e.g.
        "rule `a.cols == b.rows` fails: a.cols=64, b.rows=32".

    Raises:
        ValueError: the rule itself is malformed (a bug in the table, not in the program).
    """
    compiled = _compile_rule(rule)
    if _VETTED.get((spec.mnemonic, rule)) is not spec:
        allowed = {op.name for op in spec.operands} | {"core"}
        unknown = compiled.names - allowed
        if unknown:
            raise ValueError(f"{spec.mnemonic} rule {rule!r} names {sorted(unknown)}, which are not operands")
        _VETTED[(spec.mnemonic, rule)] = spec
    try:
        ok = bool(eval(compiled.code, {"__builtins__": {}}, env))  # vetted AST: no calls, no builtins
        problem = None
    except Exception as exc:  # e.g. an attribute of an absent tile; report, never crash
        ok, problem = False, f"{type(exc).__name__}: {exc}"
    if ok:
        return None
    values = []
    for label, name, attr in compiled.shown:
        value = env.get(name)
        if attr is not None:
            if value is None:
                values.append(f"{name}=None")
                continue
            value = getattr(value, attr, None)
        values.append(f"{label}={_show(value)}")
    text = f"rule `{rule}` fails: {', '.join(dict.fromkeys(values))}"
    return text if problem is None else f"{text} ({problem})"


def _illegal(message: str, ins: Instruction, index: int | None, *, operand: str | None = None,
             hint: str | None = None, addresses: tuple[str, ...] = ()) -> IllegalInstruction:
    exc = IllegalInstruction(message, index=index, engine=str(ins.engine), source=ins.source or None,
                             hint=hint, addresses=addresses)
    exc.operand = operand  # the assembler points its column at this operand
    exc.reason = message  # the bare sentence, without the "instruction #i on engine" prefix
    return exc


def _engine_hint(unit: str, core: int) -> str:
    core = max(core, 0)
    return {"dma": f"c{core}.dma0 (any DMA queue of the core)", "mxu": f"c{core}.mxu",
            "vpu": f"c{core}.vpu", "link": "link"}[unit]


def check_engine(engine: Engine) -> str | None:
    """None when ``engine`` is a well-formed queue name, else what is wrong with it.

    Well-formed: unit in ``ENGINE_UNITS``; core and queue non-negative and within the binary
    fields; ``queue == 0`` unless the unit is dma; the link engine is ``Engine(-1, "link", 0)``.
    """
    if not isinstance(engine, Engine):
        return f"engine {engine!r} is not an Engine"
    if engine.unit not in ENGINE_UNITS:
        return f"engine unit {engine.unit!r} is not one of {', '.join(ENGINE_UNITS)}"
    if engine.unit == "link":
        # Printed as plain "link": any other core/queue would not survive the assembly round trip.
        if (engine.core, engine.queue) != (-1, 0):
            return (f"the link engine is chip-level: core must be -1 and queue 0 "
                    f"(got {engine.core}, {engine.queue})")
        return None
    if not isinstance(engine.core, int) or not 0 <= engine.core <= _I32_MAX:
        return f"engine core {engine.core!r} must be a non-negative integer (at most {_I32_MAX})"
    if not isinstance(engine.queue, int) or not 0 <= engine.queue <= _U32_MAX:
        return f"engine queue {engine.queue!r} must be a non-negative integer (at most {_U32_MAX})"
    if engine.unit != "dma" and engine.queue != 0:
        return f"only DMA engines have queues; {engine.unit} queue must be 0 (got {engine.queue})"
    return None


def _lookup(ins: Instruction, index: int | None) -> InstrSpec:
    spec = by_mnemonic(ins.mnemonic) if isinstance(ins.mnemonic, str) else None
    if spec is None:
        close = difflib.get_close_matches(str(ins.mnemonic), [s.mnemonic for s in TABLE], n=3)
        hint = f"did you mean {' or '.join(close)}?" if close else "isa/README.md lists the instructions"
        raise _illegal(f"unknown mnemonic {ins.mnemonic!r}", ins, index, hint=hint)
    return spec


def _check_value(spec: InstrSpec, op: OperandSpec, value: Any, ins: Instruction, index: int | None,
                 domains: bool) -> None:
    """Kind and field range of one operand; with ``domains`` also its spaces, dtypes, choices."""
    where = f"{spec.mnemonic} operand {op.name}"
    if op.kind == "tile":
        if value is None and op.optional:
            return
        if not isinstance(value, Tile):
            raise _illegal(f"{where} must be a tile, got {value!r}", ins, index, operand=op.name,
                           hint="write a tile as space[core]:offset:dtype[rows,cols]")
        if not isinstance(value.space, Space):
            raise _illegal(f"{where} has space {value.space!r}, not an isa.table.Space", ins, index,
                           operand=op.name)
        if value.space is Space.HBM and value.core != 0:
            raise _illegal(f"{where} is an HBM tile with core {value.core}; HBM is chip-global (core 0)",
                           ins, index, operand=op.name)
        fields = (("core", value.core, _U32_MAX), ("offset", value.offset, _U64_MAX),
                  ("rows", value.rows, _U32_MAX), ("cols", value.cols, _U32_MAX),
                  ("stride", value.stride, _U64_MAX))
        for field, v, top in fields:
            if type(v) is int and 0 <= v <= top:  # the common case, without the ABC check
                continue
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not 0 <= v <= top:
                raise _illegal(f"{where}: tile {field} {v!r} must be an integer in [0, {top}]", ins, index,
                               operand=op.name)
        if not domains:
            return
        if value.space not in op.spaces:
            allowed = ", ".join(s.value for s in op.spaces)
            raise _illegal(f"{where} is in {value.space.value}, but {spec.mnemonic} takes it from {allowed}",
                           ins, index, operand=op.name, addresses=(value.region(),),
                           hint=f"move the tile to {allowed}")
        if op.dtypes and value.dtype not in op.dtypes:
            raise _illegal(f"{where} has dtype {value.dtype}, not one of {', '.join(op.dtypes)}", ins, index,
                           operand=op.name, addresses=(value.region(),))
    elif op.kind in ("imm", "sem"):
        if type(value) is not int and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
            raise _illegal(f"{where} must be an integer, got {value!r}", ins, index, operand=op.name)
        lo, hi = _I64 if op.kind == "imm" else (0, _U32_MAX)
        if not lo <= value <= hi:
            what = "a signed 64-bit integer" if op.kind == "imm" else f"a semaphore id in [0, {_U32_MAX}]"
            raise _illegal(f"{where}={value} must be {what}", ins, index, operand=op.name)
    elif op.kind == "fimm":
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise _illegal(f"{where} must be a number, got {value!r}", ins, index, operand=op.name)
    elif op.kind == "enum":
        if not isinstance(value, str):
            raise _illegal(f"{where} must be one of {', '.join(op.choices)} (a string), got {value!r}",
                           ins, index, operand=op.name)
        if value not in op.choices:
            close = difflib.get_close_matches(value, op.choices, n=1)
            raise _illegal(f"{where}={value!r} is not one of {', '.join(op.choices)}", ins, index,
                           operand=op.name, hint=f"did you mean {close[0]}?" if close else None)
    elif op.kind == "label":
        problem = label_problem(value)
        if problem is not None:
            raise _illegal(f"{where} {problem}", ins, index, operand=op.name,
                           hint=f"a label is 1 to {LABEL_MAX_CHARS} printable characters, e.g. "
                                '"rowmax after exp"')
    else:  # pragma: no cover - a table row with a new operand kind needs checker support
        raise ValueError(f"{spec.mnemonic} operand {op.name} has unknown kind {op.kind!r}")


def label_problem(value: Any) -> str | None:
    """None when ``value`` is a valid ``label`` operand (a probe's name), else what is wrong.

    Valid: a str of 1 to ``LABEL_MAX_CHARS`` characters, all printable (``str.isprintable``: no
    control characters, line breaks or unpaired surrogates, so it prints on one line and encodes
    as UTF-8), without whitespace at either end.
    """
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value:
        return "is empty"
    if len(value) > LABEL_MAX_CHARS:
        return f"has {len(value):,} characters (at most {LABEL_MAX_CHARS})"
    if not value.isprintable():
        bad = next(ch for ch in value if not ch.isprintable())
        return f"{value[:24]!r} holds the unprintable character {bad!r}"
    if value != value.strip():
        return f"{value!r} has whitespace at an end"
    return None


def operand_values(ins: Instruction, *, index: int | None = None, domains: bool = True
                   ) -> tuple[InstrSpec, dict[str, Any]]:
    """The row and every operand's value (defaults filled in), after checking names and kinds.

    Args:
        ins: the instruction.
        index: its index in the Program, for messages.
        domains: also check tile spaces and dtypes and enum choices (the encoder checks only what
            the binary format needs: names, kinds, field widths, choices).

    Raises:
        IllegalInstruction: unknown mnemonic; missing, unknown, repeated or mistyped operand.
    """
    spec = _lookup(ins, index)
    given: dict[str, Any] = {}
    for item in ins.args:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise _illegal(f"{spec.mnemonic}: operand entry {item!r} is not a (name, value) pair", ins, index)
        name, value = item
        if name in given:
            raise _illegal(f"{spec.mnemonic} operand {name} is given twice", ins, index, operand=name)
        given[name] = value
    names = [op.name for op in spec.operands]
    for name in given:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            raise _illegal(f"{spec.mnemonic} has no operand {name!r}", ins, index,
                           hint=f"did you mean {close[0]}?" if close else f"its operands: {', '.join(names)}")
    values: dict[str, Any] = {}
    for op in spec.operands:
        if op.name in given:
            value = given[op.name]
        elif op.optional:
            value = op.default
        else:
            raise _illegal(f"{spec.mnemonic} is missing operand {op.name}", ins, index, operand=op.name,
                           hint=f"{spec.mnemonic} takes {_signature(spec)}")
        if value is None and op.optional:  # None spells "omitted" for every optional operand
            value = op.default
        _check_value(spec, op, value, ins, index, domains or op.kind == "enum")
        values[op.name] = value
    return spec, values


def _signature(spec: InstrSpec) -> str:
    return ", ".join(op.name if not op.optional else f"[{op.name}=]" for op in spec.operands)


def canonical(ins: Instruction) -> Instruction:
    """``ins`` with every operand present, in table order (defaults filled in, absent tiles None).

    This is the form the assembler and the decoder produce, so ``decode(encode(ins)) ==
    canonical(ins)`` for any encodable instruction (and ``== ins`` when ``ins`` is canonical).
    """
    _, values = operand_values(ins, domains=False)
    return Instruction(ins.mnemonic, ins.engine, tuple(values.items()), ins.source)


def check_instruction(ins: Instruction, *, index: int | None = None) -> None:
    """Raise if ``ins`` breaks the instruction table.

    Checks, in order: the mnemonic exists; the engine is well formed and its unit runs this row
    ("any" rows run anywhere); every operand is present (or optional), known, of the right kind,
    in an allowed space with an allowed dtype, and enum values are among the choices; every rule
    of the row holds.

    Args:
        ins: the instruction.
        index: its index in the Program, quoted in the message.

    Raises:
        IllegalInstruction: with the index, engine, source and a hint. Operand errors also carry
            ``.operand`` (the operand's name), which the assembler uses to point at the column.
    """
    spec = _lookup(ins, index)
    bad_engine = check_engine(ins.engine)
    if bad_engine:
        raise _illegal(bad_engine, ins, index,
                       hint="engines are c<core>.dma<q>, c<core>.mxu, c<core>.vpu or link")
    if spec.unit != "any" and ins.engine.unit != spec.unit:
        raise _illegal(f"{spec.mnemonic} runs on a {spec.unit} engine, not on {ins.engine}", ins, index,
                       hint=f"issue it to {_engine_hint(spec.unit, ins.engine.core)}")
    _, values = operand_values(ins, index=index)
    env = dict(values)
    env["core"] = ins.engine.core
    for rule in spec.rules:
        problem = check_rule(spec, rule, env)
        if problem is not None:
            raise _illegal(f"{spec.mnemonic}: {problem}", ins, index,
                           hint=f"see the {spec.mnemonic} section of isa/README.md")


def check_legality(program: Program) -> None:
    """Check every instruction of ``program`` (see :func:`check_instruction`) and its engines.

    Only the ISA's rules, instruction by instruction: ``jalapeno_emu.emu.check_program`` runs
    this, then proves bounds, capacity, deadlock freedom and the absence of races.

    Raises:
        IllegalInstruction: the first illegal instruction, with its index in the Program.
    """
    for index, ins in enumerate(program.instructions):
        if not isinstance(ins, Instruction):
            raise IllegalInstruction(f"program entry {ins!r} is not an Instruction", index=index)
        check_instruction(ins, index=index)


def check_program(program: Program) -> None:
    """Deprecated: :func:`check_legality` (its old name, which ``jalapeno_emu.emu.check_program``,
    the full checker, also has).

    Warns:
        DeprecationWarning: naming both functions.
    """
    import warnings

    warnings.warn("jalapeno_emu.isa.check_program is deprecated: it checks only the ISA's legality "
                  "rules; call jalapeno_emu.isa.check_legality for that, or jalapeno_emu.emu."
                  "check_program(program, spec) for the full checker (bounds, capacity, deadlocks, "
                  "races, uninitialised reads)", DeprecationWarning, stacklevel=2)
    check_legality(program)
