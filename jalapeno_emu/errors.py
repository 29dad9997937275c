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
