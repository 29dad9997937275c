"""The instruction set of the emulated die (installed as ``jalapeno_emu.isa``).

Stage: ISA, right after numerics. It holds the instruction table (the single source of truth
for mnemonics, operands, encodings, legality and timing parameters), the program representation,
the encoder, assembler, disassembler and builder. Its matrix-unit instruction computes exactly
``jalapeno_emu.mx.matmul``.
Exported: the table (``TABLE``, ``by_mnemonic``), the legality checker (``check_legality``;
``check_program`` is its deprecated old name), the binary encoding, the assembler/disassembler and
the generated reference (``isa/README.md``).

The program representation (``Instruction``, ``Loop``, ``Program``, ``Tile``: ``program.py``) lives here,
below the emulator, which reads it; the ISA never imports the emulator. The modules that handle
programs load on first use, so that importing the table stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .table import TABLE, by_mnemonic

if TYPE_CHECKING:  # the names below, for type checkers and IDEs; at run time see _LAZY
    from .asm import assemble, disassemble
    from .builder import KernelBuilder, MXTensor, Semaphore, unrolled_loops
    from .encoding import decode, decode_program, encode, encode_program
    from .legality import check_instruction, check_legality, check_program
    from .program import Instruction, Loop, Program, Tile
    from .reference import reference_markdown

__all__ = [
    "TABLE",
    "Instruction",
    "KernelBuilder",
    "Loop",
    "MXTensor",
    "Program",
    "Semaphore",
    "Tile",
    "assemble",
    "by_mnemonic",
    "check_instruction",
    "check_legality",
    "check_program",
    "decode",
    "decode_program",
    "disassemble",
    "encode",
    "encode_program",
    "reference_markdown",
    "unrolled_loops",
]

# Name -> submodule, imported on first attribute access (PEP 562).
_LAZY = {
    "assemble": "asm",
    "disassemble": "asm",
    "decode": "encoding",
    "decode_program": "encoding",
    "encode": "encoding",
    "encode_program": "encoding",
    "check_instruction": "legality",
    "check_legality": "legality",
    "check_program": "legality",  # deprecated: check_legality (it warns when called)
    "reference_markdown": "reference",
    "KernelBuilder": "builder",
    "unrolled_loops": "builder",
    "Instruction": "program",
    "Loop": "program",
    "Program": "program",
    "Tile": "program",
    "MXTensor": "builder",
    "Semaphore": "builder",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
