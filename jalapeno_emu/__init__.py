"""jalapeno-emu: a functional, cycle-approximate emulator of the Jalapeño inference accelerator.

Pipeline (docs/layout.md walks it): ``mx`` numerics -> ``isa`` -> chip spec -> emulator ->
``kernels`` -> model -> rack -> serving -> CLI. Every layer is here; the names below are the
entry points most scripts start from (each loads its layer on first use, so ``import
jalapeno_emu`` stays cheap):

- ``mx``: OCP MX numerics (``quantize``, ``dequantize``, ``matmul``);
- ``load_preset``: a chip spec (``jalapeno-v1``, ``tiny``, GPU presets, or a TOML path);
- ``KernelBuilder``: write a Program; ``check_program``, ``run_functional``, ``run_timing``: the
  emulator's checker, functional pass and timing pass;
- ``get_kernel``, ``run_kernel``: the kernel library;
- ``load_model_config``, ``time_model``: models on one die;
- ``predict``: a served workload on a rack (mapping searched).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from jalapeno_emu.errors import EmuError as EmuError

if TYPE_CHECKING:  # for type checkers and IDEs; at run time see _LAZY
    from jalapeno_emu import mx
    from jalapeno_emu.chip import load_preset
    from jalapeno_emu.emu import check_program, run_functional, run_timing
    from jalapeno_emu.isa.builder import KernelBuilder
    from jalapeno_emu.kernels import get_kernel, run_kernel
    from jalapeno_emu.model import load_model_config
    from jalapeno_emu.model.timing import time_model
    from jalapeno_emu.rack.deployment import predict

__version__ = "0.1.0"

_LAZY = {
    "mx": "jalapeno_emu",
    "load_preset": "jalapeno_emu.chip",
    "KernelBuilder": "jalapeno_emu.isa.builder",
    "check_program": "jalapeno_emu.emu",
    "run_functional": "jalapeno_emu.emu",
    "run_timing": "jalapeno_emu.emu",
    "get_kernel": "jalapeno_emu.kernels",
    "run_kernel": "jalapeno_emu.kernels",
    "load_model_config": "jalapeno_emu.model",
    "time_model": "jalapeno_emu.model.timing",
    "predict": "jalapeno_emu.rack.deployment",
}

__all__ = [
    "EmuError",
    "KernelBuilder",
    "__version__",
    "check_program",
    "get_kernel",
    "load_model_config",
    "load_preset",
    "mx",
    "predict",
    "run_functional",
    "run_kernel",
    "run_timing",
    "time_model",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "mx":  # a subpackage: importing it sets the attribute
        value = importlib.import_module("jalapeno_emu.mx")
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value
