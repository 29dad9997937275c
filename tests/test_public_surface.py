"""The package's entry points resolve, and the kernel registry finds every family by itself."""

import subprocess
import sys

import jalapeno_emu
from jalapeno_emu.kernels import all_kernels


def test_every_exported_name_resolves() -> None:
    for name in jalapeno_emu.__all__:
        assert getattr(jalapeno_emu, name) is not None, name


def test_importing_the_package_loads_no_emulator_or_kernels() -> None:
    code = ("import sys, jalapeno_emu\n"
            "layers = ('jalapeno_emu.emu', 'jalapeno_emu.kernels')\n"
            "print(sorted(m for m in sys.modules if m.startswith(layers)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_registry_finds_every_family_without_a_list() -> None:
    names = {k.name for k in all_kernels()}
    # one kernel of each family module: norm, gemm, attention, mla, moe, cache
    assert {"rmsnorm", "gemm", "attention-decode", "mla-decode", "moe", "kv-append"} <= names
