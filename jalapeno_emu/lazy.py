"""JAX loaded when first used, so that timing-only work starts without it.

Importing JAX costs about 1.5 s per process. The kernels, the model planner and the rack import
modules whose pure-JAX references and input generators need JAX, but timing a program (``model``,
``layer``, ``serve``, ``sweep`` and each of their worker processes) never calls them. Those
modules bind ``jax``, ``jnp`` and ``lax`` to a ``LazyModule`` and wrap their module-level
``jax.jit`` in ``lazy_jit``; the first attribute read or call imports JAX as usual.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["LazyModule", "lazy_jit"]


class LazyModule:
    """Stands for the module ``name``; the first attribute read imports it.

    Example: ``jnp = LazyModule("jax.numpy")`` at the top of a module, then ``jnp.zeros(3)`` in a
    function, exactly as with ``import jax.numpy as jnp``.
    """

    __slots__ = ("_module", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        state = "loaded" if self._module is not None else "not loaded yet"
        return f"<LazyModule {self._name!r} ({state})>"


def lazy_jit(fn: Callable[..., Any], **jit_kwargs: Any) -> Callable[..., Any]:
    """``jax.jit(fn, **jit_kwargs)``, made on the first call instead of at import."""
    jitted: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not jitted:
            import jax

            jitted.append(jax.jit(fn, **jit_kwargs))
        return jitted[0](*args, **kwargs)

    return call
