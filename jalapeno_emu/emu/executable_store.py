"""The functional pass's compiled functions kept on disk whole, so a later process neither traces
nor lowers them.

Stage: emulator, beside ``compile_cache.py``. JAX's persistent cache saves XLA's compile, but it is
keyed by the lowered program, so every process still traces and lowers each function before it
can look one up: in the demo's tiny model, about 300 instruction signatures at 30-40 ms each on
two cores, most of a warm run's time. The functional pass knows a complete key before tracing (an
instruction signature fixes every shape and operand, ``functional._signature``), so it keeps the
finished executable (``jax.experimental.serialize_executable``) under that key, and a later process
loads it in a few milliseconds instead.

A file's name is a sha256 of the signature and of everything else the executable depends on: the
code (``fingerprint.code_fingerprint``: any edit of the emulator, ISA or MX code starts new files),
the versions of jax and jaxlib, the backend, the host CPU (XLA's CPU code is compiled for the
machine's instruction set, and a cache directory may be shared between machines) and JAX's
precision settings. On whenever JAX's persistent cache is (the same switches turn both off:
``JALAPENO_EMU_COMPILE_CACHE=0``, ``jalapeno-emu --no-compile-cache``, ``disable_compile_cache``),
in ``executables`` inside JAX's cache directory (so wherever that is shared, between the test
workers for instance, so are these); ``JALAPENO_EMU_EXECUTABLE_STORE=0`` turns this store
off alone (to measure what it saves). A file is written whole (a temporary file, then a rename) or
not at all; one that cannot be read, loaded or run is compiled anew and rewritten. Storing never
makes a run fail.

Only an executable XLA compiled in this process can be stored: one that JAX's persistent cache
served serialises into a file that cannot run (XLA's CPU backend, jax 0.10: "Function ... not
found" when called). So each function is compiled under a module name no compile has used (the
name is part of JAX's cache keys; two keys can lower to the same program, a DMA load and a store
of the same shapes), and JAX's persistent cache keeps nothing of these compiles: the store holds
them. A cold run therefore compiles each function once, as before; one whose file is lost is
compiled again, never taken from JAX's cache.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import pickle
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jalapeno_emu.files import atomic_write

__all__ = ["STORE_SUBDIR", "Stored", "store_dir", "stored"]

STORE_SUBDIR = "executables"
_FORMAT = 1  # of the stored files: (serialized executable, in tree, out tree), pickled
_OFF = {"0", "off", "false", "no"}
_compiles = itertools.count()


def store_dir() -> Path | None:
    """Where executables are kept now: ``executables`` in the directory of JAX's persistent cache
    while that is on in this process (JAX's cache only touches its own ``*-cache`` files there),
    None while it is off."""
    from .compile_cache import compile_cache_dir

    where = compile_cache_dir()
    return where / STORE_SUBDIR if where is not None else None


@functools.cache
def _host() -> str:
    """The CPU this process compiles for: its model and instruction-set flags where Linux says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    except OSError:
        lines = []
    seen = sorted(set(lines))
    return "|".join([platform.machine(), platform.processor(), *seen])


@functools.cache
def _environment() -> str:
    import jax
    import jaxlib

    from jalapeno_emu.fingerprint import code_fingerprint

    client = jax.devices()[0].client
    return "\n".join([code_fingerprint(), jax.__version__, jaxlib.__version__, client.platform,
                      client.platform_version, str(jax.config.jax_enable_x64),
                      str(jax.config.jax_default_matmul_precision), _host()])


def _file_for(directory: Path, key: Any) -> Path:
    digest = hashlib.sha256(f"{_FORMAT}\n{_environment()}\n{key!r}".encode()).hexdigest()
    return directory / f"{digest[:32]}.xla"


def _load(path: Path) -> Callable | None:
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        return deserialize_and_load(payload, in_tree, out_tree)
    except FileNotFoundError:
        return None
    except Exception:  # a truncated, foreign or stale file: compile it anew
        return None


def _save(path: Path, compiled: Any) -> bool:
    from jax.experimental.serialize_executable import serialize

    try:
        blob = pickle.dumps(serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(blob))
    except Exception:  # a full disk, a backend that cannot serialise: run on
        return False
    return True


@contextlib.contextmanager
def _jax_cache_not_written() -> Iterator[None]:
    """JAX's persistent cache keeps nothing compiled inside (what it would keep is this store's)."""
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


class Stored:
    """A function compiled through the store: called like ``jax.jit(fn)``.

    The first call loads the executable from its file, or traces, lowers and compiles ``fn`` for
    the arguments it was given and writes the file; later calls run that executable directly.
    Every call must pass arguments of the same shapes and dtypes as the first: the key promises it.

    Attributes:
        path: the executable's file.
        loaded: True when the executable came from its file, False when it was compiled here, None
            before the first call.
    """

    __slots__ = ("_call", "_donate", "_fn", "loaded", "path")

    def __init__(self, fn: Callable, path: Path, donate_argnums: int | tuple[int, ...]) -> None:
        self._fn, self.path, self._donate = fn, path, donate_argnums
        self._call: Callable | None = None
        self.loaded: bool | None = None

    def __call__(self, *args: Any) -> Any:
        call = self._call
        if call is None:
            return self._first(args)
        return call(*args)

    def _compile(self, args: tuple) -> Any:
        import jax

        # A module name no compile has used (the name is part of JAX's cache keys), so that the
        # executable is XLA's own, not one a JAX cache serves: those serialise into files that
        # cannot run (XLA's CPU backend, jax 0.10: "Function ... not found" when called).
        name = f"stored_{self.path.stem[:16]}_{os.getpid()}_{next(_compiles)}_{time.time_ns()}"
        self._fn.__name__ = self._fn.__qualname__ = name
        with _jax_cache_not_written():
            return jax.jit(self._fn, donate_argnums=self._donate).lower(*args).compile()

    def _first(self, args: tuple) -> Any:
        exe = _load(self.path)
        if exe is not None:
            # The first run is on copies: a donated argument is gone once a call starts, even one
            # that fails, and a file that loads may still not run (one written from an executable
            # JAX's cache served, for instance); then the arguments are still there to compile with.
            import jax
            import numpy as np

            try:
                out = exe(*jax.tree.map(lambda a: np.array(a, copy=True), args))
            except Exception:  # it does not run here, whatever the reason: compile it
                exe = None
            else:
                self._call, self.loaded = exe, True
                return out
        exe = self._compile(args)
        _save(self.path, exe)
        self._call, self.loaded = exe, False
        return exe(*args)


def stored(fn: Callable, key: Any, *, donate_argnums: int | tuple[int, ...] = ()) -> Callable:
    """``jax.jit(fn, donate_argnums=...)``, its executable kept in the store under ``key`` (a value
    whose ``repr`` names everything the traced function depends on besides the code and the
    environment); plain ``jax.jit`` while the store is off (see the module docstring)."""
    directory = store_dir()
    if directory is None or os.environ.get("JALAPENO_EMU_EXECUTABLE_STORE", "1").strip().lower() in _OFF:
        import jax

        return jax.jit(fn, donate_argnums=donate_argnums)
    return Stored(fn, _file_for(directory, key), donate_argnums)
