"""The emulator: Programs, the functional pass, the timing pass and their results.

Stage: emulator, after the ISA and the chip spec. Public names are re-exported here; each loads
its module on first use, so the timing pass (and ``chip``/``asm`` commands) never import JAX,
which only the functional pass and the compilation cache need (2-3 s of a command's start-up).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; at run time see _LAZY
    from jalapeno_emu.emu.check import check_program
    from jalapeno_emu.emu.compile_cache import disable_compile_cache, enable_compile_cache
    from jalapeno_emu.emu.functional import FunctionalResult, run_functional
    from jalapeno_emu.emu.hbm_map import bytes_per_pseudo_channel
    from jalapeno_emu.emu.schedule import sequential_order
    from jalapeno_emu.emu.timeline import Timeline
    from jalapeno_emu.emu.timing import run_timing
    from jalapeno_emu.isa.program import Engine, Instruction, Program, Tile

_LAZY = {
    "check_program": "jalapeno_emu.emu.check",
    "disable_compile_cache": "jalapeno_emu.emu.compile_cache",
    "enable_compile_cache": "jalapeno_emu.emu.compile_cache",
    "FunctionalResult": "jalapeno_emu.emu.functional",
    "run_functional": "jalapeno_emu.emu.functional",
    "bytes_per_pseudo_channel": "jalapeno_emu.emu.hbm_map",
    "sequential_order": "jalapeno_emu.emu.schedule",
    "Timeline": "jalapeno_emu.emu.timeline",
    "run_timing": "jalapeno_emu.emu.timing",
    "Engine": "jalapeno_emu.isa.program",
    "Instruction": "jalapeno_emu.isa.program",
    "Program": "jalapeno_emu.isa.program",
    "Tile": "jalapeno_emu.isa.program",
}

__all__ = [
    "Engine",
    "FunctionalResult",
    "Instruction",
    "Program",
    "Tile",
    "Timeline",
    "bytes_per_pseudo_channel",
    "check_program",
    "disable_compile_cache",
    "enable_compile_cache",
    "run_functional",
    "run_timing",
    "sequential_order",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
