"""Fused step and layer timings kept on disk between processes.

Stage: model, beside ``timing.py``. Timing a fused decode step builds the whole step's Program
(gpt-oss-120b at batch 64: about 10 s on 2 cores), and every ``model`` or ``layer`` command, and
every ``demo``, is a new process that would build it again. This cache keeps the result (a
:class:`ModelTiming` or :class:`LayerTiming` without its Timelines, which only traces read) in
one file per question under ``cache_root()`` (``$JALAPENO_EMU_CACHE_DIR``, default
``~/.cache/jalapeno-emu``), in a directory named by the chip spec's and the code's fingerprints
(``jalapeno_emu.fingerprint``): editing any module that decides a Program or its timing starts
an empty directory, so a cached figure is always what this code would compute.

A file holds the question it answers (the model config, step, layer and fusion, as text) beside
the answer, and a file that cannot be read or answers another question is a miss. Files are
written whole or not at all (``files.atomic_write``); a cache that cannot be written costs the
next process a rebuild, nothing else. Off by default in the library, on in the CLI
(``--no-cache`` turns it off).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.files import atomic_write, cache_root
from jalapeno_emu.fingerprint import code_fingerprint, spec_fingerprint

if TYPE_CHECKING:
    from jalapeno_emu.chip import ChipSpec

__all__ = ["cache_directory", "cached_timing", "is_cached"]

T = TypeVar("T")


def cache_directory(spec: ChipSpec, root: str | os.PathLike[str] | None = None) -> Path:
    """Where timings of ``spec`` computed by this code live (under ``root``, default
    ``cache_root()``)."""
    base = Path(root) if root is not None else cache_root()
    return base / f"step-timings-{spec_fingerprint(spec)}-{code_fingerprint()}"


def _path(question: tuple, spec: ChipSpec, disk_cache: bool | str | os.PathLike[str]) -> tuple[str, Path]:
    key = repr(question)
    directory = cache_directory(spec, None if disk_cache is True else disk_cache)
    return key, directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pkl"


def _read(key: str, path: Path) -> Any:
    """The answer stored at ``path`` for ``key``, or ``_MISS``."""
    try:
        with open(path, "rb") as f:
            stored_key, answer = pickle.load(f)
        if stored_key == key:
            return answer
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, TypeError, ValueError):
        pass  # absent, half-written by an older version, or from code that no longer unpickles
    return _MISS


_MISS = object()


def is_cached(question: tuple, spec: ChipSpec, disk_cache: bool | str | os.PathLike[str] = True) -> bool:
    """Whether :func:`cached_timing` would answer ``question`` from disk (reads the file)."""
    return bool(disk_cache) and _read(*_path(question, spec, disk_cache)) is not _MISS


def cached_timing(question: tuple, spec: ChipSpec, compute: Callable[[], T],
                  disk_cache: bool | str | os.PathLike[str]) -> T:
    """``compute()``, or its answer to ``question`` from an earlier process.

    Args:
        question: what is timed, as values whose ``repr`` names them completely (the model
            config, the step, the layer, the fusion).
        spec: the chip the timing is for.
        compute: times it (returns a ModelTiming or LayerTiming).
        disk_cache: False computes without the cache; True uses ``cache_root()``; a path another
            root directory.

    Returns:
        The computed result (with Timelines) on a miss; the cached one (without) on a hit.
    """
    if not disk_cache:
        return compute()
    key, path = _path(question, spec, disk_cache)
    answer = _read(key, path)
    if answer is not _MISS:
        return answer
    result = compute()
    payload = pickle.dumps((key, _without_timelines(result)), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(payload))
    except (OSError, InvalidArgumentError):
        pass  # read-only or full disk, or not a regular file there: the next process times it again
    return result


def _without_timelines(result: T) -> T:
    """``result`` with every LayerTiming's Timelines dropped (only traces read them; a fused
    step's run to hundreds of MB)."""
    from .timing import LayerTiming, ModelTiming

    if isinstance(result, LayerTiming):
        return dataclasses.replace(result, timelines=())
    if isinstance(result, ModelTiming):
        return dataclasses.replace(
            result, head=_without_timelines(result.head), tail=_without_timelines(result.tail),
            groups=tuple((idx, _without_timelines(lt)) for idx, lt in result.groups))
    return result
