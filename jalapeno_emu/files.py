"""Files written whole or not at all.

Stage: shared by every stage that writes output (traces, sweeps, binaries). A temporary file in
the target's directory is filled and then renamed onto the target: a rename is atomic within one
filesystem, so a reader sees the old file or the whole new one, and a failure leaves the target
as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "atomic_write_json", "cache_root"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write`` on a temporary binary file beside ``path``, then rename it onto ``path``.

    Raises:
        OSError: the directory is not writable, or writing failed (the target is untouched).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike[str], doc: Any) -> None:
    """``doc`` as JSON at ``path``, written whole or not at all."""
    atomic_write(path, lambda f: f.write(json.dumps(doc).encode("utf-8")))


def cache_root() -> Path:
    """The directory jalapeno-emu keeps its caches under (kernel timings, compiled functions):
    ``$JALAPENO_EMU_CACHE_DIR``, else ``~/.cache/jalapeno-emu``."""
    root = os.environ.get("JALAPENO_EMU_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "jalapeno-emu"
