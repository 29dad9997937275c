"""jalapeno-emu: a functional, cycle-approximate emulator of the Jalapeño inference accelerator.

Pipeline (docs/layout.md walks it): ``mx`` numerics -> ``isa`` -> chip spec -> emulator ->
``kernels`` -> model -> rack -> serving -> CLI. This release holds the numerics layer.
"""

from jalapeno_emu import mx as mx
from jalapeno_emu.errors import EmuError as EmuError

__version__ = "0.1.0"

__all__ = ["EmuError", "__version__", "mx"]
