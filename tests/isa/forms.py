"""Instruction forms built generically from the table's operand specs, for tests that must cover
every row (a row added to ``isa/table.py`` is covered without editing any test).

- :func:`encodable_forms`: representative, not necessarily legal, instructions of one row: every
  engine kind it may run on, optional operands absent and present, every enum choice, strided
  tiles, every allowed dtype, extreme immediates. The encoder only needs structure.
- :func:`legal_form`: one legal instance found by a small backtracking search over candidate
  values, checking each rule as soon as all the names it reads are bound.
- :func:`legal_forms`: the legal instance plus the variants of it that are still legal.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

from jalapeno_emu.errors import IllegalInstruction
from jalapeno_emu.isa.legality import check_instruction, check_rule
from jalapeno_emu.isa.program import Engine, Instruction, Tile
from jalapeno_emu.isa.table import DTYPES, InstrSpec, OperandSpec, Space

_SHAPES = ((32, 64), (64, 32), (32, 32), (32, 2), (2, 32), (32, 1), (1, 64), (8, 8), (8, 1), (8, 4))
_ENGINES = {"dma": (Engine(0, "dma", 1),), "mxu": (Engine(0, "mxu"),), "vpu": (Engine(0, "vpu"),),
            "link": (Engine(-1, "link"),),
            "any": (Engine(0, "dma", 3), Engine(1, "mxu"), Engine(0, "vpu"), Engine(-1, "link"))}


def engines_for(spec: InstrSpec) -> tuple[Engine, ...]:
    """Engines that may issue ``spec`` (one per kind)."""
    return _ENGINES[spec.unit]


def _tile(space: Space, dtype: str, rows: int, cols: int, *, offset: int = 0x100, core: int = 0,
          stride: int = -1) -> Tile:
    return Tile(space, 0 if space is Space.HBM else core, offset, dtype, rows, cols, stride)


def _fits(dtype: str, cols: int) -> bool:
    return (cols * DTYPES[dtype].bits) % 8 == 0


def _tile_candidates(op: OperandSpec) -> list[Tile | None]:
    out: list[Tile | None] = [None] if op.optional else []
    for space in op.spaces:
        for dtype in op.dtypes or ("f32", "bf16"):
            out += [_tile(space, dtype, r, c) for r, c in _SHAPES if _fits(dtype, c)]
    return out


def _candidates(op: OperandSpec) -> list[Any]:
    if op.kind == "tile":
        return _tile_candidates(op)
    if op.kind == "imm":
        return [op.default] if op.optional else [1, 2, 0]
    if op.kind == "sem":
        return [1, 0]
    if op.kind == "fimm":
        return [-1.5, 2.0]
    if op.kind == "enum":
        return list(op.choices)
    if op.kind == "label":
        return ["rowmax", "after exp, row 0"]
    raise AssertionError(f"no test values for operand kind {op.kind!r}; add them to tests/isa/forms.py")


def _names(rule: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(rule, mode="eval")) if isinstance(n, ast.Name)}


def legal_form(spec: InstrSpec, engine: Engine | None = None) -> Instruction:
    """A legal instance of ``spec`` (raises AssertionError when the candidates cannot satisfy it)."""
    engine = engine or engines_for(spec)[0]
    ops = spec.operands
    bound: list[set[str]] = [{"core"} | {op.name for op in ops[:k + 1]} for k in range(len(ops))]
    # The rules to check once operand k is bound: those whose names just became all bound.
    due = [[r for r in spec.rules if _names(r) <= bound[k] and not (k and _names(r) <= bound[k - 1])]
           for k in range(len(ops))]
    cands = [_candidates(op) for op in ops]
    env: dict[str, Any] = {"core": engine.core}

    def search(k: int) -> bool:
        if k == len(ops):
            return True
        for value in cands[k]:
            env[ops[k].name] = value
            if all(check_rule(spec, r, env) is None for r in due[k]) and search(k + 1):
                return True
        del env[ops[k].name]
        return False

    assert search(0), f"no legal {spec.mnemonic} from the candidate values; extend tests/isa/forms.py"
    args = tuple((op.name, env[op.name]) for op in ops)
    ins = Instruction(spec.mnemonic, engine, args, f"{spec.mnemonic}:1")
    check_instruction(ins)
    return ins


def _replace(ins: Instruction, name: str, value: Any) -> Instruction:
    return dataclasses.replace(ins, args=tuple((k, value if k == name else v) for k, v in ins.args))


def _variants(spec: InstrSpec, base: Instruction) -> list[Instruction]:
    out = [dataclasses.replace(base, engine=e) for e in engines_for(spec)]
    for op in spec.operands:
        value = base.arg(op.name)
        if op.kind == "enum":
            out += [_replace(base, op.name, c) for c in op.choices]
        elif op.kind == "imm":
            out += [_replace(base, op.name, v) for v in (-(2**63), 2**63 - 1, -5, 0x7F)]
        elif op.kind == "sem":
            out += [_replace(base, op.name, v) for v in (0, 2**32 - 1)]
        elif op.kind == "fimm":
            out += [_replace(base, op.name, v) for v in (float("inf"), -0.0, 1e-300, -7.25, 3)]
        elif op.kind == "label":  # quotes, commas, brackets, comment characters, non-ASCII, longest
            out += [_replace(base, op.name, v) for v in ('say "hi"', "a,b[1]", "x; y # z", "Jalapeño",
                                                         "é" * 64, "a\\b")]
        elif op.kind == "tile":
            if op.optional:
                out.append(_replace(base, op.name, None))
            t = value if value is not None else _tile_candidates(op)[-1]
            out.append(_replace(base, op.name, dataclasses.replace(t, stride=t.row_bytes + 24)))
            out.append(_replace(base, op.name, dataclasses.replace(t, rows=1, stride=4096, offset=2**40)))
            if t.space is not Space.HBM:
                out.append(_replace(base, op.name, dataclasses.replace(t, core=7)))
            for dtype in op.dtypes or tuple(DTYPES):
                if _fits(dtype, t.cols):
                    out.append(_replace(base, op.name, dataclasses.replace(t, dtype=dtype, stride=-1)))
    return out


def encodable_forms(spec: InstrSpec) -> list[Instruction]:
    """Representative instances of ``spec`` for the binary round trip (legal or not)."""
    base = legal_form(spec)
    return [base, *_variants(spec, base)]


def legal_forms(spec: InstrSpec) -> list[Instruction]:
    """The legal instance of ``spec`` and every variant of it that is still legal."""
    out = []
    for ins in encodable_forms(spec):
        try:
            check_instruction(ins)
        except IllegalInstruction:
            continue
        out.append(ins)
    return out
