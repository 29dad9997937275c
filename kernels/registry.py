"""The kernel registry: every kernel family module registers its KernelDefs here."""

from __future__ import annotations

import difflib
import importlib

from jalapeno_emu.errors import InvalidArgumentError

from .base import KernelDef

__all__ = ["all_kernels", "get_kernel", "register"]

_REGISTRY: dict[str, KernelDef] = {}
# Kernel family modules, imported on first use so that importing one kernel stays cheap.
_FAMILIES = ("norm", "gemm", "attention", "mla", "moe", "cache")


def register(kdef: KernelDef) -> KernelDef:
    """Add a kernel (module import time). Names are unique."""
    if kdef.name in _REGISTRY and _REGISTRY[kdef.name] is not kdef:
        raise ValueError(f"kernel {kdef.name!r} registered twice")
    _REGISTRY[kdef.name] = kdef
    return kdef


def _load_all() -> None:
    for fam in _FAMILIES:
        try:
            importlib.import_module(f"jalapeno_emu.kernels.{fam}")
        except ModuleNotFoundError as exc:  # a family not written yet
            if exc.name != f"jalapeno_emu.kernels.{fam}":
                raise


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
