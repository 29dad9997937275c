"""What every fuzz test shares: budgets, the "success or a project error" oracle, a hard time limit."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from hypothesis import settings

from jalapeno_emu.errors import EmuError
from tests.deadline import DeadlineExceeded, deadline

__all__ = ["Hang", "call", "fuzz_settings", "time_limit"]

# Examples per test are multiplied by this under the "deep" profile (tests/fuzz/conftest.py).
_SCALE = {"ci": 1, "deep": 10}.get(os.environ.get("JALAPENO_FUZZ_PROFILE", "ci"), 1)


def fuzz_settings(max_examples: int, deadline_s: float) -> settings:
    """The settings of one fuzz test: its example budget (scaled by the profile) and a deadline.

    The deadline is generous (a loaded two-core CI machine is slow); what it catches is an input
    that makes the code under test take orders of magnitude longer, which is what a size that
    should have been refused does. ``time_limit`` stops a true hang that never returns.
    """
    return settings(max_examples=max_examples * _SCALE, deadline=timedelta(seconds=deadline_s))


Hang = DeadlineExceeded
"""An example ran past its hard time limit: an input the code should have refused runs on."""


def time_limit(seconds: float, what: str) -> contextlib.AbstractContextManager[None]:
    """Raise :class:`Hang` naming ``what`` if the block runs longer than ``seconds``.

    Hypothesis's deadline is only checked once an example returns, so an endless loop would stall
    the suite; the shared SIGALRM deadline (``tests/deadline.py``) interrupts it.
    """
    return deadline(seconds, what)


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, or the ``EmuError`` it raised (returned, not raised).

    The fuzz oracle: a public entry point either succeeds or raises one of the project's errors;
    any other exception propagates, so Hypothesis reports and shrinks the input that caused it.
    An ``EmuError`` must also print: its message is what a user reads.
    """
    try:
        return fn(*args, **kwargs)
    except EmuError as exc:
        assert str(exc), f"{type(exc).__name__} with an empty message"
        return exc
