"""Progress reports from the emulator's long passes: the safety checks and the functional run.

Stage: emulator. ``check_program`` and ``run_functional`` take ``progress``, a callable given
(instructions done, total) about every 1% of the way (``report_interval``), first with 0 and last
with total; a full-size kernel has hundreds of thousands of instructions and the passes take
minutes, so a caller can show how far they are.

Code that calls those passes through a library function that does not take ``progress``
(``kernels.run_kernel`` builds, checks, times and runs a kernel in one call) sets one for every
pass run inside a ``with reporting_progress(fn):`` block instead; ``fn`` gets the pass's name
(``"check"`` or ``"functional"``) before the two counts. A ``progress`` passed explicitly wins.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["ProgressFn", "StageProgressFn", "report_interval", "reporting_progress", "resolve_progress"]

ProgressFn = Callable[[int, int], None]
"""Called with (instructions done, total instructions)."""

StageProgressFn = Callable[[str, int, int], None]
"""Called with (pass name, instructions done, total instructions)."""

# A ContextVar rather than a module global: threads (and asyncio tasks) each see their own.
_AMBIENT: ContextVar[StageProgressFn | None] = ContextVar("jalapeno_emu_progress", default=None)

REPORTS_PER_PASS = 100
"""About how many times a pass reports (every 1%): often enough for a smooth bar, rarely enough
that reporting costs nothing next to the instructions."""


@contextmanager
def reporting_progress(fn: StageProgressFn) -> Iterator[None]:
    """Within the block, passes given no ``progress`` report to ``fn(pass name, done, total)``."""
    token = _AMBIENT.set(fn)
    try:
        yield
    finally:
        _AMBIENT.reset(token)


def resolve_progress(progress: ProgressFn | None, stage: str) -> ProgressFn | None:
    """``progress`` if given, else the enclosing ``reporting_progress`` callback bound to
    ``stage``, else None (nothing to report to)."""
    if progress is not None:
        return progress
    ambient = _AMBIENT.get()
    return None if ambient is None else functools.partial(ambient, stage)


def report_interval(total: int) -> int:
    """Instructions between two reports for a pass of ``total`` instructions (at least 1)."""
    return max(1, total // REPORTS_PER_PASS)
