"""JAX's persistent compilation cache for the functional pass: on by default, in the user cache.

Stage: emulator, beside ``functional.py``. The functional pass compiles one XLA function per
instruction signature (a tiny model's decode step on jalapeno-v1 has about 2,000 of them). XLA's
own compile of each is most of a first run's time and does not change between runs, so the pass
turns on JAX's persistent cache (https://docs.jax.dev/en/latest/persistent_compilation_cache.html)
the first time it runs: a second process reuses the executables instead of compiling them again
(tiny-kimi's prefill and two decode steps on the tiny preset: 104 s cold, 29 s warm). JAX's cache
still traces and lowers every function to find it; the per-signature functions of the pass skip
that too, from ``executable_store.py``'s files, which are on whenever this cache is.

Where: ``jax`` under ``$JALAPENO_EMU_CACHE_DIR`` (default ``~/.cache/jalapeno-emu``, where the
rack's kernel timings are cached too). Off: ``JALAPENO_EMU_COMPILE_CACHE=0`` (or ``off``, ``false``,
``no``), ``jalapeno-emu --no-compile-cache``, or :func:`disable_compile_cache`. A cache the user
configured in JAX themselves (``jax_compilation_cache_dir``) is left as it is. A directory that
cannot be created leaves the cache off: caching never makes a run fail.
"""

from __future__ import annotations

import os
from pathlib import Path

from jalapeno_emu.files import cache_root

__all__ = ["compile_cache_dir", "default_cache_dir", "disable_compile_cache", "enable_compile_cache",
           "ensure_default_compile_cache", "switched_on", "wanted_by_environment"]

_OFF = {"0", "off", "false", "no"}
_state = {"decided": False}


def default_cache_dir() -> Path:
    """Where the cache goes unless told otherwise: ``jax`` under ``files.cache_root()``."""
    return cache_root() / "jax"


def switched_on(variable: str) -> bool:
    """An on/off environment switch: on unless ``variable`` says 0, off, false or no."""
    return os.environ.get(variable, "1").strip().lower() not in _OFF


def wanted_by_environment() -> bool:
    """False when ``JALAPENO_EMU_COMPILE_CACHE`` turns the cache off (0, off, false, no)."""
    return switched_on("JALAPENO_EMU_COMPILE_CACHE")


def compile_cache_dir() -> Path | None:
    """The directory JAX caches compiled functions in now, or None when the cache is off."""
    import jax  # here, not at the top: importing this module must not load JAX (CLI start-up)

    current = jax.config.jax_compilation_cache_dir
    return Path(current) if current else None


def enable_compile_cache(path: str | os.PathLike[str] | None = None) -> Path | None:
    """Turn the persistent cache on in ``path`` (default: :func:`default_cache_dir`).

    Every compiled function is cached, however quickly it compiled (JAX's default keeps only
    those over a second; the functional pass's take tens of milliseconds each, thousands of
    times). Returns the directory, or None when it cannot be created (the cache stays off).
    """
    where = Path(path).expanduser() if path is not None else default_cache_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    import jax
    from jax.experimental.compilation_cache import compilation_cache as _jax_cache

    jax.config.update("jax_compilation_cache_dir", str(where))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX decides once, at a process's first compile, whether it uses the cache: anything
    # compiled before this call (weights quantised, a reference run) would leave it unused.
    _jax_cache.reset_cache()
    _state["decided"] = True
    return where


def disable_compile_cache() -> None:
    """Turn the persistent cache off for this process (compiled functions stay in memory)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as _jax_cache

    jax.config.update("jax_compilation_cache_dir", None)
    _jax_cache.reset_cache()
    _state["decided"] = True


def ensure_default_compile_cache() -> Path | None:
    """What the functional pass calls before it runs: the first time, turn the cache on in the
    default directory unless the environment turns it off or JAX already has a cache
    configured; later calls change nothing. Returns the cache directory in use, or None."""
    if not _state["decided"]:
        _state["decided"] = True
        if wanted_by_environment() and compile_cache_dir() is None:
            enable_compile_cache()
    return compile_cache_dir()
