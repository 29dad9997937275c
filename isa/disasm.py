"""Disassembly: a Program as the assembly text ``isa.asm.assemble`` reads back into an equal Program.

Stage: ISA. The syntax is documented in ``isa/asm.py`` (and the generated ``isa/README.md``);
this module writes it: directives first, then one line per instruction (loops as ``.loop`` /
``.endloop`` blocks with their ``OPERAND +=STEP`` steps), each with its source as a comment.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from jalapeno_emu.isa.program import Instruction, Loop, Program, Tile

from .legality import operand_values
from .table import OperandSpec, Space

__all__ = ["NAME_RE", "disassemble", "format_instruction", "format_tile"]

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
"""A name written bare in assembly (kernel, allocation, semaphore, label); others are quoted."""

def _name(text: str) -> str:
    # ensure_ascii: a raw U+2028 or U+0085 in a name would split the line when read back.
    return text if NAME_RE.fullmatch(text) else json.dumps(text)


def _where(space: Space, core: int) -> str:
    return "hbm" if space is Space.HBM else f"{space.value}[{core}]"


def format_tile(tile: Tile) -> str:
    """A tile in assembly syntax; ``/STRIDE`` whenever the stride is not the packed row size.

    (``str(Tile)`` leaves the stride out of single-row tiles, which would not round-trip.)
    """
    text = f"{_where(tile.space, tile.core)}:{tile.offset:#x}:{tile.dtype}[{tile.rows},{tile.cols}]"
    return text if tile.stride == tile.row_bytes else f"{text}/{tile.stride}"


def _value(op: OperandSpec, value: Any, sem_names: Mapping[int, str]) -> str:
    if op.kind == "tile":
        return format_tile(value)
    if op.kind == "fimm":
        return repr(float(value))
    if op.kind == "sem":
        return sem_names.get(value, str(int(value)))
    if op.kind == "label":
        return _name(value)
    return str(value) if op.kind == "enum" else str(int(value))


def format_instruction(ins: Instruction, *, sem_names: Mapping[int, str] | None = None,
                       width: int = 0, steps: Mapping[str, int] | None = None) -> str:
    """One instruction as an assembly line (no comment), e.g. ``c0.mxu: sem.signal 3``.

    Required operands are positional; optional ones are ``name=value`` and left out when equal
    to their default (absent tiles are left out).

    Args:
        ins: the instruction (need not be canonical).
        sem_names: semaphore ids to print by name (only names that assemble back unambiguously).
        width: pad ``ENGINE:`` to this many characters, to line mnemonics up.
        steps: a loop body instruction's operand steps, written ``OPERAND +=STEP`` (a stepped
            semaphore is written by id: the name is the first iteration's only).

    Raises:
        IllegalInstruction: the instruction's operands are not of the kinds its row expects.
    """
    spec, values = operand_values(ins, domains=False)
    sem_names = sem_names or {}
    parts = []
    steps = steps or {}
    for op in spec.operands:
        value = values[op.name]
        step = steps.get(op.name)
        tail = f" +={step}" if step else ""
        if not op.optional:
            parts.append(_value(op, value, {} if step else sem_names) + tail)
        elif value is not None and (value != op.default or step):
            parts.append(f"{op.name}={_value(op, value, {} if step else sem_names)}{tail}")
    head = f"{ins.engine}:".ljust(width)
    return f"{head} {spec.mnemonic}" + (f" {', '.join(parts)}" if parts else "")


def disassemble(program: Program) -> str:
    """The Program as assembly text that :func:`assemble` turns back into an equal Program.

    Directives for the name, preset, allocations, semaphore names and inits come first, then one
    line per instruction, with its ``source`` as a comment when it has one. Builder-made programs
    disassemble too. (Instruction ``source`` strings and ``Program.meta`` do not round-trip.)
    """
    n_loops = len(program.loops)
    loops = f" in {len(program.items)} items, {n_loops} of them loops" if n_loops else ""
    lines = [f"; {_name(program.name)}: {program.n_instructions} instructions{loops} "
             "(jalapeno-emu disassembly)",
             f".kernel {_name(program.name)}", f".preset {_name(program.preset)}"]
    lines += [f".alloc {_where(a.space, a.core)} {_name(a.name)} {a.offset:#x} {a.nbytes}"
              for a in program.allocations]
    lines += [f".sem {sem_id} {_name(name)}" for sem_id, name in program.semaphores]
    for init in program.inits:
        seed = f" {init.seed}" if init.seed or init.kind == "normal" else ""
        lines.append(f".init {_name(init.name)} {init.kind} {init.dtype}{seed}")
    # Print a semaphore by name only when the name is bare and names exactly one id.
    counts: dict[str, int] = {}
    for _, name in program.semaphores:
        counts[name] = counts.get(name, 0) + 1
    sem_names = {i: n for i, n in program.semaphores if counts[n] == 1 and NAME_RE.fullmatch(n)}
    width = max((len(str(item.engine)) + 1 for item in program.items), default=0)

    def line(ins: Instruction, steps: Mapping[str, int] | None = None) -> str:
        text = format_instruction(ins, sem_names=sem_names, width=width, steps=steps)
        one_line = ins.source and ins.source.splitlines() == [ins.source]
        return f"{text}  ; {ins.source}" if one_line else text

    for item in program.items:
        if type(item) is Loop:
            lines.append(f".loop {item.count}")
            lines += [line(ins, dict(steps)) for ins, steps in zip(item.body, item.steps, strict=True)]
            lines.append(".endloop")
        else:
            lines.append(line(item))
    return "\n".join(lines) + "\n"

