"""The CLI starts without JAX: ``--help``, ``chip``, ``asm`` and ``disasm`` took 3-4 s of start-up
importing it (and ml_dtypes' extension through ``mx``) for nothing; commands that compute load it
when they run."""

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
                         check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_the_command_line_and_the_timing_pass_import_no_jax():
    loaded = _modules_after("import jalapeno_emu, jalapeno_emu.cli.main, jalapeno_emu.emu.timing, "
                            "jalapeno_emu.emu.check, jalapeno_emu.isa.asm, jalapeno_emu.chip")
    assert "jax" not in loaded and "jalapeno_emu.mx" not in loaded


def test_the_lazy_names_still_resolve():
    loaded = _modules_after("import jalapeno_emu as je, jalapeno_emu.emu as emu\n"
                            "assert je.mx.quantize.__module__ == 'jalapeno_emu.mx.quantize'\n"
                            "assert emu.run_functional.__name__ == 'run_functional'\n"
                            "assert 'Timeline' in dir(emu)")
    assert "jax" in loaded
