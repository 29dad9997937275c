"""Generates ``isa/README.md``, the ISA reference, from the instruction table.

Run ``python -m jalapeno_emu.isa.reference > isa/README.md``; a test fails when the file and the
table drift apart. The assembly syntax and the binary layout are taken from the docstrings of
``isa/asm.py`` and ``isa/encoding.py``, so each is written once.
"""

from __future__ import annotations

from . import asm, encoding
from .legality import ENGINE_UNITS
from .table import DTYPES, TABLE, InstrSpec, OperandSpec, Space

__all__ = ["reference_markdown"]

_REGENERATE = "python -m jalapeno_emu.isa.reference > isa/README.md"
_KIND_TEXT = {"tile": "tile", "imm": "int (i64)", "fimm": "float (f64, used as f32)", "enum": "enum",
              "sem": "semaphore id (u32)", "label": "label (str)"}
_UNIT_TEXT = {"dma": "`c<core>.dma<queue>`", "mxu": "`c<core>.mxu`", "vpu": "`c<core>.vpu`", "link": "`link`",
              "any": "any engine"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _after(doc: str, marker: str) -> str:
    """The part of a module docstring after ``marker`` (a heading line), dedented as written."""
    return doc.split(marker, 1)[1].strip("\n")


def _operand_row(op: OperandSpec) -> str:
    if op.kind == "tile":
        spaces = ", ".join(s.value for s in op.spaces)
        allowed = ", ".join(op.dtypes) if op.dtypes else "any"
    elif op.kind == "enum":
        spaces, allowed = "", ", ".join(f"`{c}`" for c in op.choices)
    else:
        spaces, allowed = "", ""
    optional = "required"
    if op.optional:
        optional = "absent" if op.kind == "tile" else f"`{op.default}`"
    return (f"| `{op.name}` | {_KIND_TEXT[op.kind]} | {spaces} | {allowed} | {optional} | "
            f"{'yes' if op.writes else ''} | {_cell(op.doc)} |")


def _section(spec: InstrSpec) -> list[str]:
    lines = [
        f"### `{spec.mnemonic}`",
        "",
        f"- opcode: `{spec.opcode:#04x}`",
        f"- engine: {_UNIT_TEXT[spec.unit]}",
        f"- timing class: `{spec.timing}`",
        f"- syntax: `ENGINE: {spec.mnemonic} "
        + ", ".join(op.name if not op.optional else f"[{op.name}=...]" for op in spec.operands) + "`",
        "",
        "| operand | kind | spaces | dtypes / choices | optional (default) | writes | meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_operand_row(op) for op in spec.operands]
    lines += ["", spec.doc, ""]
    if spec.rules:
        lines += ["Legality rules (besides the operand table):", ""]
        lines += [f"- `{rule}`" for rule in spec.rules]
        lines.append("")
    return lines


def reference_markdown() -> str:
    """The ISA reference as Markdown, generated from ``TABLE`` (the content of ``isa/README.md``)."""
    lines = [
        "# Jalapeño ISA reference",
        "",
        f"<!-- generated from isa/table.py; do not edit. Regenerate with `{_REGENERATE}` -->",
        "",
        "Every instruction form is a row of `isa/table.py`. The legality checker, the binary encoder,",
        "the assembler and this page all read those rows, so what the emulator accepts is exactly",
        "what is written here.",
        "",
        "## Overview",
        "",
        "- Engines are in-order queues: per core `c<core>.dma<queue>` (DMA queues), `c<core>.mxu`",
        "  (matrix unit), `c<core>.vpu` (vector unit); per chip `link` (scale-up port).",
        "  Engine units: " + ", ".join(f"`{u}`" for u in ENGINE_UNITS) + "; instructions of unit `any`",
        "  run on every engine.",
        "- A tile is a 2-D strided view of memory, `space[core]:offset:dtype[rows,cols]/stride`, the",
        "  stride being the bytes from one row to the next (default: packed rows).",
        "- Spaces: " + ", ".join(f"`{s.value}`" for s in Space) + ". `hbm` is chip-global and byte",
        "  addressed; `sram` (scratchpad) and `acc` (FP32 accumulators) are per core.",
        "- Semaphores are chip-global counters that only grow: `sem.signal` adds, `sem.wait` blocks",
        "  until a count is reached.",
        "- Legality rules are Python expressions over the operands: a tile exposes `rows`, `cols`,",
        "  `shape`, `dtype`, `nbytes`, `row_bytes`, `core`, `offset`, `stride`; an absent optional",
        "  tile is `None`; `core` alone is the issuing engine's core.",
        "",
        "## Ordering model",
        "",
        "What may happen before what, in every schedule; the timing pass implements it and the",
        "checker (`jalapeno_emu.emu.check_program`) proves programs against it.",
        "",
        "- **In order per engine.** Each engine runs its instructions in the order they were issued.",
        "  Matrix and vector units finish one instruction before starting the next. A DMA queue",
        "  *issues* in order but keeps up to `dma.max_outstanding_per_queue` transfers in flight,",
        "  so two transfers of one queue may complete in either order.",
        "- **`sem.signal` lands late, never early.** It adds its count once every earlier instruction",
        "  of its engine has completed (for a DMA queue: every earlier transfer has landed). A DMA",
        "  queue does not stop at a signal: it keeps issuing the transfers after it. So a signal",
        "  orders what came before it on its engine against whoever waits for it; it orders nothing",
        "  on its own queue.",
        "- **`sem.wait` blocks its engine** until the semaphore's count reaches the value. Counts only",
        "  grow, so a wait never consumes. A wait happens after exactly those signals that *every*",
        "  schedule must have executed to reach its value: if several engines signal the same",
        "  semaphore, a signal counts only beyond what all the others could contribute, and signals",
        "  that can only come after the wait (the waiting engine's own later signals, or any ordered",
        "  after the wait through other semaphores) cannot contribute. Give each producer its own",
        "  semaphore, or wait for the total, and the ordering is the obvious one.",
        "- **`barrier`** releases every participant once the last of `count` has arrived: everything",
        "  before it on any participant happens before everything after it on all of them.",
        "- **`link.recv`** happens after its matching `link.send` (same peer and tag, in order).",
        "- **A race** is two accesses to overlapping bytes, at least one a write, neither ordered",
        "  before the other by the rules above. Reading scratchpad or accumulator bytes that no",
        "  ordered write has written is an uninitialised read. Both are errors, reported with the",
        "  two instructions, the buffer and the source lines.",
        "",
        "### Dtypes",
        "",
        "| dtype | bits | code | MX element format | storage |",
        "|---|---|---|---|---|",
    ]
    for d in DTYPES.values():
        lines.append(f"| `{d.name}` | {d.bits} | {d.code} | {d.mx_fmt or ''} | {d.numpy or 'MX codes'} |")
    lines += ["", "FP4 codes are packed two per byte, low nibble first.", ""]
    lines += ["### Instructions", "", "| mnemonic | opcode | engine | timing |", "|---|---|---|---|"]
    lines += [f"| [`{s.mnemonic}`](#{s.mnemonic.replace('.', '')}) | `{s.opcode:#04x}` | "
              f"{_UNIT_TEXT[s.unit]} | {s.timing} |" for s in TABLE]
    lines += ["", "## Assembly syntax", "", "From `isa/asm.py`.", "",
              _after(asm.__doc__ or "", "------\n"), ""]
    lines += ["## Binary format", "", "From `isa/encoding.py`.", "",
              _after(encoding.__doc__ or "", "------\n"), ""]
    lines += ["## Instructions", ""]
    for spec in TABLE:
        lines += _section(spec)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.stdout.write(reference_markdown())
