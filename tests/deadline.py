"""A deadline for tests of inputs that used to run without end: the test fails instead of hanging."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class DeadlineExceeded(AssertionError):
    """The block ran past its deadline (raised inside it by SIGALRM)."""


@contextlib.contextmanager
def deadline(seconds: float, what: str | None = None) -> Iterator[None]:
    """Raise :class:`DeadlineExceeded` inside the block if it runs longer than ``seconds``
    (naming ``what`` ran on, when given).

    SIGALRM interrupts pure-Python loops (the builders, the simulator) between bytecodes; outside
    the main thread, where signals cannot be delivered, the block simply runs without a deadline.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum: int, _frame: object) -> None:
        if what is None:
            raise DeadlineExceeded(f"still running after {seconds} s")
        raise DeadlineExceeded(f"{what} ran for more than {seconds:g} s: an input that should be "
                               "refused runs on")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
