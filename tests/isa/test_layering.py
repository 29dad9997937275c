"""The ISA sits below the emulator: importing every ISA module loads nothing of ``jalapeno_emu.emu``."""

import subprocess
import sys


def test_the_isa_modules_import_nothing_of_the_emulator() -> None:
    code = (
        "import sys\n"
        "import jalapeno_emu.isa.asm, jalapeno_emu.isa.builder, jalapeno_emu.isa.encoding\n"
        "import jalapeno_emu.isa.legality, jalapeno_emu.isa.program, jalapeno_emu.isa.reference\n"
        "print(sorted(m for m in sys.modules if m.startswith('jalapeno_emu.emu')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_old_program_module_still_names_the_same_classes() -> None:
    from jalapeno_emu.emu import program as old
    from jalapeno_emu.isa import program as new

    assert old.Program is new.Program and old.Instruction is new.Instruction and old.Tile is new.Tile
