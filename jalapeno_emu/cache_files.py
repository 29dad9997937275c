"""What jalapeno-emu keeps in its cache directory, and taking out what no run will read again.

Stage: shared (the ``cache`` command). Everything lives under :func:`jalapeno_emu.files.cache_root`
(``$JALAPENO_EMU_CACHE_DIR``, else ``~/.cache/jalapeno-emu``), in four parts:

- ``kernel timings``: ``timings-<spec>-<code>.jsonl``, the rack's launch figures
  (:mod:`jalapeno_emu.rack.launch_timer`);
- ``step timings``: ``step-timings-<spec>-<code>/``, fused layer and step figures
  (:mod:`jalapeno_emu.model.timing_cache`);
- ``stored executables``: ``jax/executables/<digest>.key`` and ``.xla``, the functional pass's
  compiled functions (:mod:`jalapeno_emu.emu.executable_store`);
- ``JAX compile cache``: the rest of ``jax/``, JAX's own persistent cache.

Every edit of the code that decides a Program or its timing (``fingerprint.code_fingerprint``)
starts new timing files and new executable keys; the old ones stay and are never read again, so
the directory only grows (433 MB on a development machine after a few weeks). What is *stale*:

- a timing file or directory named by another code fingerprint than this code's: this code never
  reads it (a checkout of that older code would, and would rebuild it);
- an executable key written by other code (the store writes the code fingerprint into each key)
  or not used for ``older_than_days`` (the store marks a key used when it loads or writes it);
  an executable no remaining key names, at once when only keys of other code named it, else
  once it is as old;
- a JAX cache entry not written for ``older_than_days``.

:func:`prune` removes the stale files, :func:`clear` every file of the four parts (and nothing
else: the directory may hold other things when ``$JALAPENO_EMU_CACHE_DIR`` points somewhere
shared). Both only cost speed: whatever a later run needs is computed and written again.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from jalapeno_emu.files import cache_root

__all__ = ["CachePart", "clear", "prune", "survey"]

_DAY_S = 86400.0


@dataclass(frozen=True)
class CachePart:
    """One part of the cache directory.

    Attributes:
        name: what it holds ("kernel timings", "step timings", "stored executables",
            "JAX compile cache").
        path: where (a directory; the timing parts: the cache root).
        files: files it holds; bytes: their size.
        stale_files, stale_bytes: those no run of this code reads again (see the module docstring).
    """

    name: str
    path: Path
    files: int
    bytes: int
    stale_files: int
    stale_bytes: int


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # removed meanwhile by another process
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile: nothing to prune
        return float("inf")


def _tree_files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []


def _timing_parts(root: Path, code: str) -> dict[str, tuple[list[Path], list[Path]]]:
    """Per timing part, (every file, the stale files): by the code fingerprint in each name."""
    out: dict[str, tuple[list[Path], list[Path]]] = {"kernel timings": ([], []), "step timings": ([], [])}
    if not root.is_dir():
        return out
    for entry in root.iterdir():
        if entry.name.startswith("timings-") and entry.name.endswith(".jsonl") and entry.is_file():
            part, files, fingerprint = "kernel timings", [entry], entry.name[:-len(".jsonl")].split("-")[-1]
        elif entry.name.startswith("step-timings-") and entry.is_dir():
            part, files, fingerprint = "step timings", _tree_files(entry), entry.name.split("-")[-1]
        else:
            continue
        out[part][0].extend(files)
        if fingerprint != code:
            out[part][1].extend(files)
    return out


def _executables(store: Path, code: str, cutoff: float) -> tuple[list[Path], list[Path]]:
    """(every file, the stale files) of the executable store: keys written by other code (their
    second line) or last used before ``cutoff``, then the executables no other key names (those
    of other code at once: a key of this code would name them; the rest once written before
    ``cutoff``, as a process of this code may be about to name one it has just written)."""
    files = _tree_files(store)
    stale, named, orphaned_by_code = [], set(), set()
    for path in files:
        if path.suffix != ".key":
            continue
        try:
            lines = path.read_text(encoding="ascii").split()
        except (OSError, UnicodeDecodeError):  # unreadable: the store rewrites it when used
            stale.append(path)
            continue
        other_code = len(lines) > 1 and lines[1] != code
        if other_code or _mtime(path) < cutoff:
            stale.append(path)
            if other_code and lines:
                orphaned_by_code.add(lines[0])
        elif lines:
            named.add(lines[0])
    stale += [p for p in files if p.suffix == ".xla" and p.name not in named
              and (p.name in orphaned_by_code or _mtime(p) < cutoff)]
    return files, stale


def _jax_cache(jax_dir: Path, cutoff: float) -> tuple[list[Path], list[Path]]:
    files = [p for p in _tree_files(jax_dir) if "executables" not in p.relative_to(jax_dir).parts[:1]]
    return files, [p for p in files if _mtime(p) < cutoff]


def _base(root: str | os.PathLike[str] | None) -> Path:
    return Path(root).expanduser() if root is not None else cache_root()


def _parts(root: Path, older_than_days: float) -> list[tuple[str, Path, list[Path], list[Path]]]:
    from jalapeno_emu.fingerprint import code_fingerprint

    if older_than_days < 0:
        from jalapeno_emu.errors import InvalidArgumentError

        raise InvalidArgumentError(f"older_than_days={older_than_days} must be >= 0")
    cutoff = time.time() - older_than_days * _DAY_S
    code = code_fingerprint()
    timing = _timing_parts(root, code)
    jax_dir = root / "jax"
    store = jax_dir / "executables"
    return [("kernel timings", root, *timing["kernel timings"]),
            ("step timings", root, *timing["step timings"]),
            ("stored executables", store, *_executables(store, code, cutoff)),
            ("JAX compile cache", jax_dir, *_jax_cache(jax_dir, cutoff))]


def survey(root: str | os.PathLike[str] | None = None, *, older_than_days: float = 30.0) -> list[CachePart]:
    """The four parts of the cache directory ``root`` (default :func:`cache_root`), with what of
    each is stale (see the module docstring; ``older_than_days`` for the age-based parts).

    Raises:
        InvalidArgumentError: ``older_than_days`` is negative.
    """
    base = _base(root)
    return [CachePart(name, path, len(files), sum(map(_size, files)), len(stale), sum(map(_size, stale)))
            for name, path, files, stale in _parts(base, older_than_days)]


def prune(root: str | os.PathLike[str] | None = None, *, older_than_days: float = 30.0) -> tuple[int, int]:
    """Remove the stale files of ``root`` (default :func:`cache_root`); empty step-timing
    directories go too. Returns (files, bytes) removed.

    Raises:
        InvalidArgumentError: ``older_than_days`` is negative.
    """
    base = _base(root)
    removed, freed = 0, 0
    for _, _, _, stale in _parts(base, older_than_days):
        for path in stale:
            size = _size(path)
            try:
                path.unlink()
            except FileNotFoundError:  # another process pruned it first
                continue
            removed, freed = removed + 1, freed + size
    for entry in base.glob("step-timings-*"):
        if entry.is_dir() and not any(entry.iterdir()):
            entry.rmdir()
    return removed, freed


def clear(root: str | os.PathLike[str] | None = None) -> tuple[int, int]:
    """Remove every file of the four parts of ``root`` (default :func:`cache_root`), and nothing
    else there. Returns (files, bytes) removed."""
    base = _base(root)
    timing = _timing_parts(base, code="")  # every timing file (whose code is stale does not matter)
    kernel_files = timing["kernel timings"][0]
    every = kernel_files + timing["step timings"][0] + _tree_files(base / "jax")
    files, freed = len(every), sum(map(_size, every))
    for path in kernel_files:
        path.unlink(missing_ok=True)
    for entry in base.glob("step-timings-*"):
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    shutil.rmtree(base / "jax", ignore_errors=True)
    return files, freed
