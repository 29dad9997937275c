"""Fingerprints that name what a cached result was computed from: the code and the chip spec.

Stage: shared by the disk caches (kernel launch timings in ``rack.launch_timer``, step and layer
timings in ``model.timing_cache``). A cache file is named by both, so editing any module that
decides a Program or its timing, or any field of the spec, starts a new file: a cached figure is
always what this code would compute for that spec.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jalapeno_emu.chip import ChipSpec

__all__ = ["SOURCE_PACKAGES", "TIMING_FREE_FIELDS", "code_fingerprint", "spec_fingerprint"]

SOURCE_PACKAGES = ("kernels", "isa", "emu", "chip", "mx", "model")
"""The packages whose source decides a Program or its timing (model: the fused parts' wiring)."""


@functools.cache
def code_fingerprint() -> str:
    """sha256 (16 hex digits) of the source of :data:`SOURCE_PACKAGES` (read once a process:
    the code a process runs does not change under it)."""
    h = hashlib.sha256()
    for pkg in SOURCE_PACKAGES:
        mod = importlib.import_module(f"jalapeno_emu.{pkg}")
        base = Path(mod.__file__).parent
        for path in sorted(base.rglob("*")):
            if path.suffix in (".py", ".toml") and path.is_file():
                h.update(str(path.relative_to(base)).encode())
                h.update(path.read_bytes())
        h.update(pkg.encode())
    return h.hexdigest()[:16]


TIMING_FREE_FIELDS = ("software.stack",)
"""Spec fields no device time depends on: the serving stack's host costs are charged by the
serving simulator after the kernels' and steps' times, so ``--stack`` re-times nothing."""


def spec_fingerprint(spec: ChipSpec) -> str:
    """sha256 (16 hex digits) of every field of ``spec`` that decides a device time (its JSON
    form, less :data:`TIMING_FREE_FIELDS`)."""
    fields = spec.to_dict()
    for dotted in TIMING_FREE_FIELDS:
        block, name = dotted.split(".")
        fields[block] = {k: v for k, v in fields.get(block, {}).items() if k != name}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
