"""The program representation, re-exported from its home in the ISA layer (``jalapeno_emu.isa.program``).

Kept so that scripts written against ``jalapeno_emu.emu.program`` keep working; new code imports
``jalapeno_emu.isa.program``.
"""

from jalapeno_emu.isa.program import Allocation, Engine, HbmInit, Instruction, Program, Tile, parse_engine

__all__ = ["Allocation", "Engine", "HbmInit", "Instruction", "Program", "Tile", "parse_engine"]
