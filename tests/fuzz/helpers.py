"""What every fuzz test shares: budgets, the "success or a project error" oracle, a hard time limit."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from hypothesis import settings

from jalapeno_emu.errors import EmuError

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


class Hang(AssertionError):
    """An example ran past its hard time limit: an input the code should have refused runs on."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`Hang` naming ``what`` if the block runs longer than ``seconds``.

    Hypothesis's deadline is only checked once an example returns, so an endless loop would stall
    the suite; SIGALRM interrupts it. Only in the main thread (signals are delivered there); a
    worker thread simply runs without the alarm.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _alarm(signum: int, frame: Any) -> None:
        raise Hang(f"{what} ran for more than {seconds:g} s: an input that should be refused runs on")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


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
