"""The project's one exception hierarchy.

Every error the library raises on bad input derives from :class:`EmuError`, so callers (and the
CLI) can catch one type. The argument-checking errors also derive from the matching built-in
(``ValueError``/``TypeError``) so generic code that expects those keeps working.
"""

from __future__ import annotations

__all__ = ["ConfigError", "EmuError", "InvalidArgumentError", "InvalidTypeError"]


class EmuError(Exception):
    """Base class of every error jalapeno-emu raises on purpose.

    Args:
        message: one readable sentence saying what was wrong.
        hint: optional advice on what to do instead.
    """

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message} (hint: {hint})")


class InvalidArgumentError(EmuError, ValueError):
    """An argument has the right type but a value that is not allowed; the message names it."""


class InvalidTypeError(EmuError, TypeError):
    """An argument has a type (or dtype) that is not allowed; the message names it."""


class ConfigError(EmuError, ValueError):
    """A configuration (preset, override, config file) is malformed or inconsistent."""


class ProgramError(EmuError):
    """An illegal program, found by the checker or during a pass.

    Args:
        message: what is wrong.
        index: instruction index in the Program (None when not tied to one instruction).
        engine: the engine queue ("c0.dma1"), when known.
        addresses: the memory ranges involved, as readable strings ("sram[c0]:0x100..0x200").
        source: where the instruction was built ("gemm.py:42") or assembled ("k.jasm:7").
        hint: what to do instead.
    """

    def __init__(
        self,
        message: str,
        *,
        index: int | None = None,
        engine: str | None = None,
        addresses: tuple[str, ...] = (),
        source: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.index = index
        self.engine = engine
        self.addresses = tuple(addresses)
        self.source = source
        where = []
        if index is not None:
            where.append(f"instruction #{index}")
        if engine:
            where.append(f"on {engine}")
        if source:
            where.append(f"({source})")
        text = f"{' '.join(where)}: {message}" if where else message
        if addresses:
            text += f" [{', '.join(addresses)}]"
        super().__init__(text, hint=hint)


class IllegalInstruction(ProgramError, ValueError):
    """An instruction whose operands break the ISA's legality rules (dtype, shape, space...)."""


class OutOfBounds(ProgramError, IndexError):
    """A tile reaches outside its allocation or its memory."""


class CapacityExceeded(ProgramError):
    """An allocation does not fit the memory it asks for (HBM, SRAM, accumulators)."""


class UninitializedRead(ProgramError):
    """An instruction reads bytes that nothing has written."""


class Race(ProgramError):
    """Two engines touch overlapping memory, one of them writing, with no ordering between them."""


class Deadlock(ProgramError):
    """Some engines wait for something that can never happen; the message says who waits on whom."""


class AssemblyError(EmuError, ValueError):
    """Malformed assembly text or binary, with the line and column (or byte offset) at fault."""

    def __init__(self, message: str, *, line: int | None = None, column: int | None = None,
                 source: str = "<asm>", hint: str | None = None) -> None:
        self.line, self.column, self.source = line, column, source
        loc = source if line is None else f"{source}:{line}" + ("" if column is None else f":{column}")
        super().__init__(f"{loc}: {message}", hint=hint)
