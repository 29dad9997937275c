"""The kernel registry: every kernel family module registers its KernelDefs here (each module of
the package is imported on first use; a module that defines no kernel registers nothing)."""

from __future__ import annotations

import difflib
import importlib
import pkgutil

from jalapeno_emu.errors import InvalidArgumentError

from .base import KernelDef

__all__ = ["all_kernels", "get_kernel", "register"]

_REGISTRY: dict[str, KernelDef] = {}
_loaded = False


def register(kdef: KernelDef) -> KernelDef:
    """Add a kernel (module import time). Names are unique."""
    if kdef.name in _REGISTRY and _REGISTRY[kdef.name] is not kdef:
        raise ValueError(f"kernel {kdef.name!r} registered twice")
    _REGISTRY[kdef.name] = kdef
    return kdef


def _load_all() -> None:
    """Import every module of the package once, so each family registers its kernels: no list to
    keep by hand, and a family that fails to import fails loudly instead of going missing.
    Imported on first use, so that importing one kernel stays cheap."""
    global _loaded
    if _loaded:
        return
    package = __name__.rpartition(".")[0]
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f"{package}.{info.name}")
    _loaded = True


def all_kernels() -> list[KernelDef]:
    """Every registered kernel, sorted by name."""
    _load_all()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def get_kernel(name: str) -> KernelDef:
    """The kernel called ``name``; InvalidArgumentError with close matches otherwise."""
    _load_all()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise InvalidArgumentError(
            f"no kernel named {name!r}{hint} (known: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name]
