"""The emulator: Programs, the functional pass, the timing pass and their results.

Stage: emulator, after the ISA and the chip spec. Public names are re-exported here, one per line.
"""

from jalapeno_emu.emu.check import check_program as check_program
from jalapeno_emu.emu.compile_cache import disable_compile_cache as disable_compile_cache
from jalapeno_emu.emu.compile_cache import enable_compile_cache as enable_compile_cache
from jalapeno_emu.emu.functional import FunctionalResult as FunctionalResult
from jalapeno_emu.emu.functional import run_functional as run_functional
from jalapeno_emu.emu.hbm_map import bytes_per_pseudo_channel as bytes_per_pseudo_channel
from jalapeno_emu.emu.schedule import sequential_order as sequential_order
from jalapeno_emu.emu.timeline import Timeline as Timeline
from jalapeno_emu.emu.timing import run_timing as run_timing
from jalapeno_emu.isa.program import Engine as Engine
from jalapeno_emu.isa.program import Instruction as Instruction
from jalapeno_emu.isa.program import Program as Program
from jalapeno_emu.isa.program import Tile as Tile

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
