"""Kernel library for the emulated die (installed as ``jalapeno_emu.kernels``).

Stage: kernels, after the emulator. One module per kernel family, each with its pure-JAX
reference. Nothing is exported yet: kernels land once the ISA builder exists (issue 4).
"""

__all__: list[str] = []
