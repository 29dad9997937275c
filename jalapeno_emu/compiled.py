"""Hot loops compiled with numba, their machine code cached on disk.

Stage: shared by the timing pass's event loop (:mod:`jalapeno_emu.emu.timing_core`) and the rack's
grid interpolation (:mod:`jalapeno_emu.rack.grid`). numba is imported by the caller's module or
on first use; importing this module does not load it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["njit_cached"]


def njit_cached(fn: Callable[..., Any]) -> Any:
    """``numba.njit(cache=True)(fn)``, or plain ``njit`` (compiled anew in each process) where
    numba finds no writable cache directory (``NUMBA_CACHE_DIR``, the package directory, then the
    user cache directory): compiling costs seconds once, loading from the cache a fraction of a
    second per process."""
    from numba import njit

    try:
        return njit(cache=True)(fn)
    except RuntimeError as e:  # numba: "cannot cache function ...: no locator available"
        if "no locator available" not in str(e):
            raise
        return njit(fn)
