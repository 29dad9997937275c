"""OCP Microscaling (MX v1.0) numerics, bit-exact: formats, quantise, pack, matmul, error stats.

Stage: numerics, the bottom of the pipeline; the matrix unit, the kernels and the numerics
reports all call into this package. Public names are re-exported here.

The formats load with the package; everything that computes (and so imports JAX, about 1.5 s)
loads on first use, so that the timing pass and the kernels' planners, which only need the
formats' sizes, start without JAX.
"""

import sys
from importlib import import_module
from types import ModuleType
from typing import Any

from jalapeno_emu.mx.formats import FORMATS as FORMATS
from jalapeno_emu.mx.formats import ElementFormat as ElementFormat
from jalapeno_emu.mx.formats import element_format as element_format

# name -> the module that defines it, imported when the name is first read
_LAZY = {
    "MXArray": "array",
    "block_sum_is_exact_in_f32": "matmul",
    "matmul": "matmul",
    "matmul_accumulate": "matmul",
    "from_gpt_oss": "pack",
    "pack_fp4": "pack",
    "unpack_fp4": "pack",
    "ROUNDINGS": "quantize",
    "dequantize": "quantize",
    "quantize": "quantize",
    "SCALE_MODES": "scale",
    "ErrorStats": "stats",
    "error_stats": "stats",
}

__all__ = [
    "FORMATS",
    "ROUNDINGS",
    "SCALE_MODES",
    "ElementFormat",
    "ErrorStats",
    "MXArray",
    "block_sum_is_exact_in_f32",
    "dequantize",
    "element_format",
    "error_stats",
    "from_gpt_oss",
    "matmul",
    "matmul_accumulate",
    "pack_fp4",
    "quantize",
    "unpack_fp4",
]


class _Package(ModuleType):
    """The import system binds a submodule to its package's attribute when it first loads it;
    ``matmul`` and ``quantize`` are both submodules and the functions they define, and here the
    names mean the functions (as they did when this package imported them eagerly)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, ModuleType) and _LAZY.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jalapeno_emu.mx' has no attribute {name!r}")
    value = getattr(import_module(f"jalapeno_emu.mx.{module}"), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
