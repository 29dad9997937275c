"""Kernel library for the emulated die (installed as ``jalapeno_emu.kernels``).

Stage: kernels, on top of the ISA builder and the emulator. One module per kernel family
(``norm``, ``gemm``, ``embedding``, ``attention``, ``mla_decode``, ``mla_prefill``, ``moe``, ``cache`` and
``mla_append``; the registry finds them), each kernel registered as a ``KernelDef``
with shape keys, a Program builder, input generation and a pure-JAX reference; ``run_kernel``
checks, times and (optionally) verifies one.
"""

from .base import KernelBuild as KernelBuild
from .base import KernelDef as KernelDef
from .base import ShapeKey as ShapeKey
from .base import Tolerance as Tolerance
from .registry import all_kernels as all_kernels
from .registry import get_kernel as get_kernel
from .registry import register as register
from .runner import KernelReport as KernelReport
from .runner import run_kernel as run_kernel

__all__ = [
    "KernelBuild",
    "KernelDef",
    "KernelReport",
    "ShapeKey",
    "Tolerance",
    "all_kernels",
    "get_kernel",
    "register",
    "run_kernel",
]
